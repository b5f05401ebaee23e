"""The public API as a user writes it: mypy checks this file (tests/typing/test_mypy.py);
it is never run. Each ``assert_type`` holds what a call returns."""

from __future__ import annotations

import math
from typing import Any, assert_type

import torch

import tqueue
from tqueue.wire import CheckpointReply, KeysFound, StatusReply, VersionReply


def producer(client: tqueue.Client) -> None:
    client.create_partition("train/step-0", tasks=["actor_train"], grouping=tqueue.Grouping(4),
                            over_sampling=tqueue.OverSampling(groups=8, recycle_to="train/step-1"))
    meta = client.put("train/step-0", {"input_ids": [torch.arange(5)] * 4}, groups="prompt-0", version=0)
    assert_type(meta.indexes, list[int])
    client.keys.bind(meta, ["a", "b", "c", "d"], tags=[{"n": i} for i in range(4)])
    client.seal("train/step-0")


def consumer(client: tqueue.Client, rank: int, size: int) -> None:
    meta = client.get_meta(
        "train/step-0",
        ["input_ids"],
        8,
        task="actor_train",
        timeout=math.inf,
        data_parallel=tqueue.DataParallel(rank, size),
        micro_batches=tqueue.MicroBatches(max_tokens=4096, multiple_of=2),
    )
    read: tqueue.Meta = meta  # the struct is a Meta as it is
    assert_type(read.micro_batch_indices, list[list[int]] | None)
    batch = client.get_data(meta, jagged="padded")
    assert_type(batch, tqueue.Batch)
    one_call = client.get_data("train/step-0", ["input_ids"], 8, task="ref", data_parallel=tqueue.DataParallel(0, 1))
    assert_type(one_call, tqueue.Batch)
    client.renew(meta, lease_timeout=60)
    client.ack(meta)


def namespaces(client: tqueue.Client) -> None:
    found = client.keys.lookup("p", ["a"])
    assert_type(found, KeysFound)
    assert_type(client.keys.all(), dict[str, dict[str, dict[str, Any]]])
    assert_type(client.samples.select("p", ["x"], limit=3), tqueue.Meta | None)
    assert_type(client.samples.stats("p", "reward"), tqueue.FieldStats)
    assert_type(client.rollouts.wait_version(3, timeout=0), VersionReply)
    refused = client.rollouts.complete(found.meta, {"response_ids": [torch.arange(3)]}, version=1, first_token=0) if found.meta else []
    assert_type(refused, list[int])
    client.rollouts.set_staleness(1, batch_size=64)
    assert_type(client.checkpoints.save("/tmp/ckpt", metadata={"step": 3}), CheckpointReply)
    assert_type(client.status(), StatusReply)


async def asynchronous(address: str) -> None:
    async with tqueue.AsyncClient(address) as client:
        meta = await client.put("p", [{"x": 1}, {"x": 2}])
        await client.keys.bind(meta, ["a", "b"])
        assert_type(await client.samples.allocate("p", 2), tqueue.Meta)
        assert_type(await client.rollouts.wait_version(), VersionReply)
        assert_type(await client.checkpoints.load("/tmp/ckpt"), Any)


def config() -> tqueue.ClientConfig:
    plain = tqueue.ClientConfig(shm=False)
    assert_type(plain.timeouts, tqueue.Timeouts)
    return plain.replace(timeouts=tqueue.Timeouts(get=5.0, lease=60.0), bulk=False)
