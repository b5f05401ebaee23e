"""The streaming loader: a DataLoader with worker processes over several steps gets every
sample exactly once; a reader SIGKILLed holding a batch loses nothing; a client used after a
fork raises ForkedClientError, and one made in the child works."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

import tqueue
from tqueue.bridges.loader import StepStream, loader


def produce(address: str, names: list[str], per_step: int) -> list[int]:
    values = []
    with tqueue.Client(address) as c:
        for k, name in enumerate(names):
            xs = [k * 1000 + i for i in range(per_step)]
            c.create_partition(name, tasks=["train"])
            c.put(name, {"x": torch.tensor(xs), "ids": [torch.full((i % 7 + 1,), i) for i in range(per_step)]})
            c.seal(name)
            values += xs
    return values


def test_two_workers_over_three_steps_get_every_sample_exactly_once(cluster, partition):
    names = [f"{partition}-{k}" for k in range(3)]
    values = produce(cluster.address, names, 23)  # not a multiple of the batch: a short last batch
    stream = StepStream(cluster.address, names, ["x", "ids"], 5, lease_timeout=120)
    seen, workers = [], set()
    for batch in loader(stream, num_workers=2, timeout=120):
        assert len(batch["x"]) == len(batch["ids"]) and 0 < len(batch["x"]) <= 5
        for x, ids in zip(batch["x"].tolist(), batch["ids"]):
            assert ids.tolist() == [x % 1000] * (x % 1000 % 7 + 1)  # fields of one sample together
        seen += batch["x"].tolist()
        workers.add(batch["_meta"].partition)
    assert sorted(seen) == values and len(seen) == len(set(seen))
    with tqueue.Client(cluster.address) as c:  # consumed and acked: the sealed steps freed themselves
        assert not [p.name for p in c.status().partitions if p.name.startswith(partition)]


def _take_one_and_wait(address: str, name: str, out) -> None:
    stream = StepStream(address, [name], ["x"], 4, lease_timeout=2.0)
    batch = next(iter(stream))
    out.send(batch["x"].tolist())
    out.recv()  # blocks until killed


def test_a_reader_killed_holding_a_batch_loses_nothing(cluster, partition):
    values = produce(cluster.address, [partition], 12)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_take_one_and_wait, args=(cluster.address, partition, theirs))
    proc.start()
    try:
        assert mine.poll(60)
        taken = mine.recv()
        assert len(taken) == 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        # the survivor gets everything: the dead reader's batch once its lease expires
        seen = [x for batch in StepStream(cluster.address, [partition], ["x"], 4, lease_timeout=60) for x in batch["x"].tolist()]
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert sorted(seen) == values and set(taken) <= set(seen)


def _use_after_fork(client: tqueue.Client, address: str, name: str, out) -> None:
    try:
        client.status()
        out.send("no error")
    except tqueue.ForkedClientError as exc:
        out.send(str(exc))
    with tqueue.Client(address) as fresh:  # a client made in the child works
        fresh.put(name, {"x": torch.tensor([7])})
    out.send("put")


def test_a_client_used_after_fork_raises_and_one_made_in_the_child_works(cluster, partition):
    with tqueue.Client(cluster.address) as client:
        client.status()
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_use_after_fork, args=(client, cluster.address, partition, theirs))
        proc.start()
        assert mine.poll(60)
        message = mine.recv()
        assert mine.poll(60) and mine.recv() == "put"
        proc.join(30)
        assert proc.exitcode == 0
        assert f"this client was made in process {os.getpid()} and used in process {proc.pid}, forked from it" in message
        assert client.get_data(partition, ["x"], 1, task="t", timeout=10)["x"].tolist() == [7]
