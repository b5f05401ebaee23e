"""The same-host path: payload through the unit's shared-memory arena, zero-copy reads
that stay valid while held, and ranges reused only after their holds are released."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch

import tqueue

SHM = tqueue.ClientConfig(shm=True, shm_min_bytes=0)


@pytest.fixture(scope="module")
def cluster():
    """One unit, so that every write competes for the same arena."""
    with tqueue.LocalCluster(num_storage_units=1) as c:
        yield c


def arena_offset(client: tqueue.AsyncClient, t: torch.Tensor) -> tuple[str, int]:
    """Which arena a tensor lives in, and where."""
    ptr = t.untyped_storage().data_ptr()
    for a in client._conns.arenas.values():
        if a is not None and a.array.ctypes.data <= ptr < a.array.ctypes.data + a.size:
            return a.path, ptr - a.array.ctypes.data
    raise AssertionError("tensor is not a view of an arena")


def test_views_stay_valid_while_held_and_ranges_are_reused_after(cluster, partition):
    async def main():
        # a range of each put's own (no lease), so that first fit shows where the freed one went
        async with tqueue.AsyncClient(cluster.address, config=dataclasses.replace(SHM, arena_lease_bytes=0)) as c:
            await c.put(partition, {"x": torch.full((64, 4096), 7, dtype=torch.int32)})
            batch = await c.get_data(partition, ["x"], 64, task="t", timeout=10)
            x = batch["x"]
            first = arena_offset(c, x)  # zero-copy: the tensor lives in the unit's arena
            assert c.stats.copied_bytes == 64 * 4096 * 4  # only the producer's copy in
            await c.clear(partition)
            again = f"{partition}-again"
            await c.put(again, {"x": torch.full((64, 4096), 9, dtype=torch.int32)})
            other = await c.get_data(again, ["x"], 64, task="t", timeout=10)
            assert arena_offset(c, other["x"]) != first  # still held: not reused
            assert bool((x == 7).all())
            del batch, x, other
            gc.collect()  # the last views die: their holds are queued for release
            await asyncio.sleep(0)  # one loop turn to queue them
            await c._conns.flush_releases()
            await c.clear(again)
            await c.put(partition, {"x": torch.full((64, 4096), 5, dtype=torch.int32)})
            third = await c.get_data(partition, ["x"], 64, task="t2", timeout=10)
            assert arena_offset(c, third["x"]) == first  # released, freed, first fit again
            assert bool((third["x"] == 5).all())

    asyncio.run(main())


def test_socket_consumer_of_same_host_data(cluster, partition):
    """A producer on the unit's host writes via the arena; a consumer elsewhere (here: with
    the arena turned off) gets the same bytes over the socket."""
    data = {"x": torch.randn(32, 8192), "s": [f"s{i}" for i in range(32)]}
    with tqueue.Client(cluster.address, config=SHM) as producer:
        producer.put(partition, data)
    with tqueue.Client(cluster.address, config=tqueue.ClientConfig(shm=False)) as consumer:
        batch = consumer.get_data(partition, ["x", "s"], 32, task="t", timeout=10)
        assert torch.equal(batch["x"], data["x"]) and batch["s"] == data["s"]
