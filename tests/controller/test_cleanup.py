"""Cleanup: sealed partitions free themselves once every task consumed them; clear by name
or by meta; freed memory really returns to the OS."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tqueue
from tqueue.errors import PartitionClearedError, WaitTimeoutError


def names(client):
    return {p.name: p for p in client.status().partitions}


def consume(client, partition, task, n):
    meta = client.get_meta(partition, ["x"], n, task=task, timeout=5)
    client.ack(meta)
    return meta


def test_sealed_partition_frees_itself_when_every_declared_task_is_done(client, partition):
    client.create_partition(partition, tasks=["actor", "critic"])
    client.put(partition, {"x": torch.zeros(4, 1000)})
    consume(client, partition, "actor", 4)
    client.seal(partition)
    assert partition in names(client)  # the critic has not read them yet
    consume(client, partition, "critic", 2)
    assert partition in names(client)
    meta = consume(client, partition, "critic", 2)
    assert partition not in names(client)
    client.ack(meta)  # acking a freed partition is harmless


def test_unsealed_partitions_are_never_freed_under_a_late_task(client, partition):
    client.put(partition, {"x": torch.zeros(2, 10)})
    consume(client, partition, "actor", 2)
    assert partition in names(client)  # producers may still put; a later task may come
    consume(client, partition, "ref", 2)


def test_a_sealed_partition_takes_no_more_samples(client, partition):
    client.put(partition, {"x": torch.zeros(2, 10)})
    client.seal(partition)
    with pytest.raises(tqueue.PartitionSealedError, match=f"put of 1 sample.*to partition '{partition}' stored nothing"):
        client.put(partition, {"x": torch.zeros(1, 10)})
    late = client.put(partition, {"x": torch.zeros(1, 10)}, if_sealed="discard")  # the producer's choice: said so
    assert (late.status, late.sealed, late.indexes) == ("aborted", True, [])
    status = names(client)[partition]
    assert status.samples == 2 and status.reasons == {"discarded after seal": 2}


def test_clear_a_meta_frees_just_those_samples(client, partition):
    meta = client.put(partition, {"x": torch.zeros(4, 1000)})
    before = names(client)[partition].nbytes
    client.clear(meta.select([0, 1]))
    status = names(client)[partition]
    assert status.excluded == 2 and status.reasons == {"cleared": 2}
    got = client.get_meta(partition, ["x"], 2, task="t", timeout=5)
    assert got.indexes == [2, 3]
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0)
    assert status.nbytes == before  # the put's one piece is still half used
    client.clear(meta.select([2, 3]))
    assert names(client)[partition].nbytes == 0


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_unit_memory_returns_to_the_os_after_a_large_partition_is_freed(partition):
    storage = {"retain_bytes": 0, "shm_bytes": 0}  # return memory on every free; sockets only
    with tqueue.LocalCluster(num_storage_units=1, storage=storage) as cluster, cluster.client() as client:
        unit = cluster.pids[1]
        client.put("warm-up", {"x": torch.zeros(8, 1000)})
        client.clear("warm-up")
        base = rss(unit)
        client.put(partition, {"x": torch.ones(256, 1 << 18)})  # 256 MiB
        held = rss(unit)
        assert held - base > 250 << 20
        client.clear(partition)
        assert rss(unit) - base < 16 << 20


def test_clear_during_a_parked_get_and_ack_after_clear(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            meta = await c.put(partition, {"x": torch.zeros(2, 10)})
            leased = await c.get_meta(partition, ["x"], 2, task="t", timeout=5)
            waiting = asyncio.ensure_future(c.get_meta(partition, ["x"], 1, task="t", timeout=60))
            await asyncio.sleep(0)
            await c.clear(partition)
            with pytest.raises(PartitionClearedError):
                await asyncio.wait_for(waiting, 10)
            await c.ack(leased)  # harmless
            again = await c.put(partition, {"x": torch.zeros(1, 10)})
            assert again.partition_uid != meta.partition_uid and again.indexes == [0]

    asyncio.run(main())


def test_a_put_to_a_partition_that_sealed_and_freed_itself_is_refused(client, partition):
    client.create_partition(partition, target=2)
    client.put(partition, {"x": torch.zeros(2, 10)})
    consume(client, partition, "t", 2)
    assert partition not in names(client)  # sealed at its target, consumed: freed
    with pytest.raises(tqueue.PartitionSealedError, match=f"to partition '{partition}' stored nothing"):
        client.put(partition, {"x": torch.zeros(1, 10)})
    late = client.put(partition, {"x": torch.zeros(1, 10)}, if_sealed="discard")
    assert (late.status, late.sealed, late.indexes) == ("aborted", True, [])
    assert partition not in names(client)  # no new partition that nobody would free
    client.create_partition(partition)  # an explicit new start lifts the refusal
    again = client.put(partition, {"x": torch.zeros(1, 10)})
    assert (again.status, again.indexes) == ("ok", [0])
