"""Keys and tags (tqueue/client/_key_calls.py, tqueue/controller/parts/_user_keys.py) on a real cluster."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tqueue

from ..servers import LoopCluster


def _values(client: tqueue.Client, partition: str, n: int) -> tqueue.BatchMeta:
    return client.put(partition, {"x": torch.arange(float(n))})


def test_tag_only_keys_get_their_samples_later(client: tqueue.Client, partition: str) -> None:
    client.tag_keys(partition, ["a", "b"], [{"status": "running"}, {"status": "running"}])
    assert client.list_keys(partition) == {partition: {"a": {"status": "running"}, "b": {"status": "running"}}}
    meta = _values(client, partition, 2)
    client.bind_keys(meta, ["b", "c"])
    found = client.lookup_keys(partition, ["c", "a", "missing", "b"])
    assert found.indexes == [meta.indexes[1], -1, -1, meta.indexes[0]]
    assert found.tags == [{}, {"status": "running"}, None, {"status": "running"}]  # b kept its tags
    assert found.meta is not None and found.meta.indexes == [meta.indexes[1], meta.indexes[0]]
    assert client.get_data(found.meta)["x"].tolist() == [1.0, 0.0]


def test_lookups_neither_lease_nor_consume(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 3)
    client.bind_keys(meta, ["k0", "k1", "k2"])
    found = client.lookup_keys(partition, ["k2", "k0"], fields=["x"])
    for _ in range(2):
        assert client.get_data(found.meta)["x"].tolist() == [2.0, 0.0]
    leased = client.get_meta(partition, ["x"], 3, task="train", timeout=10)
    assert sorted(leased.indexes) == sorted(meta.indexes)
    assert client.keys_of(partition, sorted(leased.indexes)).keys == ["k0", "k1", "k2"]


def test_tags_replace_and_keys_of(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 2)
    client.bind_keys(meta, ["a", "b"], tags=[{"n": 1}, {"n": 2}])
    client.set_tags(meta.select([1]), [{"n": 3, "done": True}])
    client.tag_keys(partition, ["a"], [{"m": [1, 2]}])
    got = client.keys_of(partition, meta.indexes)
    assert got.keys == ["a", "b"] and got.tags == [{"m": [1, 2]}, {"n": 3, "done": True}]
    unnamed = _values(client, partition, 1)
    assert client.keys_of(partition, unnamed.indexes).keys == [None]


def test_a_key_names_one_sample(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 2)
    client.bind_keys(meta.select([0]), ["a"])
    with pytest.raises(tqueue.InvalidArgumentError, match=f"key 'a' of partition '{partition}' already names sample"):
        client.bind_keys(meta.select([1]), ["a"])
    with pytest.raises(tqueue.InvalidArgumentError, match=r"sample \d+ of partition .* is named 'a' already"):
        client.bind_keys(meta.select([0]), ["z"])
    with pytest.raises(tqueue.InvalidArgumentError, match="the same key twice"):
        client.bind_keys(meta, ["b", "b"])
    with pytest.raises(tqueue.InvalidArgumentError, match="2 keys for 1 samples"):
        client.bind_keys(meta.select([1]), ["b", "c"])
    with pytest.raises(tqueue.InvalidArgumentError, match="keys are str, got int"):
        client.tag_keys(partition, [1], [{}])  # type: ignore[list-item]
    with pytest.raises(tqueue.InvalidArgumentError, match="one dict per key"):
        client.tag_keys(partition, ["q"], [])


def test_drop_keys_frees_their_samples(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 3)
    client.bind_keys(meta, ["a", "b", "c"])
    client.drop_keys(partition, ["a", "c", "unknown"])
    client.drop_keys(partition, ["a"])  # again: harmless
    client.drop_keys("no-such-partition", ["a"])
    assert client.list_keys(partition) == {partition: {"b": {}}}
    left = client.get_meta(partition, ["x"], 1, task="t", timeout=10)
    assert left.indexes == [meta.indexes[1]]
    with pytest.raises(tqueue.WaitTimeoutError):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0)


def test_cleared_samples_and_partitions_take_their_keys(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 2)
    client.bind_keys(meta, ["a", "b"])
    client.clear(meta.select([0]))
    found = client.lookup_keys(partition, ["a", "b"])
    assert found.indexes == [-1, meta.indexes[1]]
    client.clear(partition)
    assert partition not in client.list_keys()
    _values(client, partition, 1)  # a new partition of that name starts without keys
    assert client.list_keys(partition) == {}
    assert client.lookup_keys(partition, ["b"]).indexes == [-1]


def test_bounds_of_a_request() -> None:
    with LoopCluster(num_storage_units=1, controller={"max_samples_per_request": 3}) as cluster, tqueue.Client(
        cluster.address
    ) as client:
        with pytest.raises(tqueue.InvalidArgumentError, match="4 keys in one request, more than max_samples_per_request=3"):
            client.tag_keys("p", list("abcd"), [{}] * 4)
        with pytest.raises(tqueue.InvalidArgumentError, match="a key of 5000 characters"):
            client.tag_keys("p", ["k" * 5000], [{}])
        with pytest.raises(tqueue.InvalidArgumentError, match="4 samples in one request, more than max_samples_per_request=3"):
            client.keys_of("p", [0, 1, 2, 3])
        with pytest.raises(tqueue.InvalidArgumentError, match="4 keys in one request"):
            client.lookup_keys("p", list("abcd"))


@pytest.fixture
def async_client(cluster: tqueue.LocalCluster) -> Iterator[str]:
    yield cluster.address


def test_async_twin(async_client: str, partition: str) -> None:
    async def run() -> dict[str, dict[str, dict[str, object]]]:
        async with tqueue.AsyncClient(async_client) as client:
            meta = await client.put(partition, {"x": torch.zeros(1)})
            await client.bind_keys(meta, ["only"], tags=[{"ok": True}])
            return await client.list_keys(partition)

    assert asyncio.run(run()) == {partition: {"only": {"ok": True}}}


def test_keys_and_tags_survive_a_checkpoint(tmp_path: Path) -> None:
    with LoopCluster(num_storage_units=1) as cluster, tqueue.Client(cluster.address) as client:
        meta = _values(client, "kv", 2)
        client.bind_keys(meta, ["a", "b"], tags=[{"n": 1, "raw": b"\x00\xff"}, {"n": 2}])
        client.tag_keys("kv", ["later"], [{"status": "pending"}])
        client.save_checkpoint(tmp_path)
    with LoopCluster(num_storage_units=2) as cluster, tqueue.Client(cluster.address) as client:
        client.load_checkpoint(tmp_path)
        assert client.list_keys() == {
            "kv": {"a": {"n": 1, "raw": b"\x00\xff"}, "b": {"n": 2}, "later": {"status": "pending"}}
        }
        found = client.lookup_keys("kv", ["b", "a"])
        assert found.indexes == [meta.indexes[1], meta.indexes[0]]
        assert client.get_data(found.meta)["x"].tolist() == [1.0, 0.0]


def test_select_reads_live_samples_without_a_lease(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 4)
    taken = client.get_meta(partition, ["x"], 2, task="train", timeout=10)
    client.ack(taken)
    client.clear(meta.select([3]))
    every = client.select(partition, ["x"])
    assert every is not None and every.indexes == meta.indexes[:3] and every.lease == 0
    assert client.get_data(client.select(partition, ["x"], limit=2))["x"].tolist() == [0.0, 1.0]
    assert client.select(partition, ["x", "never-written"]).indexes == []
    assert client.select("no-such-partition", ["x"]) is None
    # nothing was consumed: the task still has the other two, another task all three
    assert len(client.get_meta(partition, ["x"], 1, task="train", timeout=10)) == 1
    assert len(client.get_meta(partition, ["x"], 3, task="other", timeout=10)) == 3
    with pytest.raises(tqueue.InvalidArgumentError, match="limit must be >= 0"):
        client.select(partition, ["x"], limit=-1)
    assert client.select(partition, ["x"], consumed_by="train").indexes == sorted(taken.indexes)
    assert client.select(partition, ["x"], consumed_by="nobody").indexes == []


def test_reset_consumption_lets_a_task_read_again(client: tqueue.Client, partition: str) -> None:
    meta = _values(client, partition, 3)
    first = client.get_meta(partition, ["x"], 2, task="train", timeout=10)
    client.ack(first)
    held = client.get_meta(partition, ["x"], 1, task="train", timeout=10)  # leased, not acked
    other = client.get_meta(partition, ["x"], 3, task="eval", timeout=10)
    client.ack(other)
    client.reset_consumption(partition, "train")
    again = client.get_meta(partition, ["x"], 2, task="train", timeout=10)
    assert sorted(again.indexes) == sorted(first.indexes)
    with pytest.raises(tqueue.WaitTimeoutError):  # the leased one stays leased; eval was not reset
        client.get_meta(partition, ["x"], 1, task="train", timeout=0)
    with pytest.raises(tqueue.WaitTimeoutError):
        client.get_meta(partition, ["x"], 1, task="eval", timeout=0)
    client.ack(held)
    client.ack(again)
    client.reset_consumption(partition)  # every task
    status = next(p for p in client.status().partitions if p.name == partition)
    assert {t: s.consumed for t, s in status.tasks.items()} == {"train": 0, "eval": 0}
    assert len(client.get_meta(partition, ["x"], 3, task="eval", timeout=10)) == len(meta)
    client.reset_consumption("no-such-partition")


def test_reset_consumption_wakes_a_parked_reader(cluster: tqueue.LocalCluster, partition: str) -> None:
    from tests.faults._proc import until

    with tqueue.Client(cluster.address) as client, tqueue.Client(cluster.address) as reader:
        meta = _values(client, partition, 2)
        client.ack(client.get_meta(partition, ["x"], 2, task="t", timeout=10))
        got: dict[str, tqueue.BatchMeta] = {}
        thread = threading.Thread(target=lambda: got.update(meta=reader.get_meta(partition, ["x"], 2, task="t", timeout=30)))
        thread.start()
        until(lambda: any(w.task == "t" for w in client.status().waiting), 10, "the read parked")
        client.reset_consumption(partition, "t")
        thread.join(30)
        assert sorted(got["meta"].indexes) == sorted(meta.indexes)


def test_select_cuts_at_its_limit_at_the_controller(cluster: tqueue.LocalCluster, client: tqueue.Client, partition: str, raw: Any) -> None:
    """A select of a few samples of a big partition gets a reply of that few: the controller
    cuts, not the client (a force_fetch of 2 must not carry the meta of every sample)."""
    from tqueue import wire

    client.put(partition, {"x": torch.arange(1000.0).reshape(1000, 1)})
    peer = raw(cluster.address)
    peer.send(wire.encode(wire.Select(rid=1, partition=partition, fields=["x"], limit=2)))
    reply, _ = peer.recv(timeout=10)
    assert isinstance(reply, wire.MetaReply) and reply.meta.indexes == [0, 1]
    peer.send(wire.encode(wire.Select(rid=2, partition=partition, fields=["x"])))
    assert len(peer.recv(timeout=10)[0].meta.indexes) == 1000  # -1, the default: all
