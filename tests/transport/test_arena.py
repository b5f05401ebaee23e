"""The same-host path: payload through the unit's shared-memory arena, zero-copy reads
that stay valid while held, and ranges reused only after their holds are released."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from typing import Any

import numpy as np
import pytest
import torch

import tqueue
from tqueue.transport import _arena
from tqueue.transport._arena import POPULATE_MIN_BYTES, Arena, ArenaMap

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


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_writer_maps_a_range_in_one_call_before_it_fills_it():
    """``ArenaMap.populate`` maps a range's pages into the writer (MADV_POPULATE_WRITE) so that
    the fill does not fault them in one by one: the writer's RSS grows by the range with no
    byte written yet, the bytes written after are the arena's (the unit's side sees them), and
    a range under ``POPULATE_MIN_BYTES`` is left to fault."""
    arena = Arena(64 << 20)
    try:
        writer = ArenaMap(arena.path)
        before = rss()
        writer.populate(4096, 16 << 20)
        grew = rss() - before
        assert 16 << 20 <= grew < (16 << 20) + (2 << 20), grew
        small = rss()
        writer.populate(32 << 20, POPULATE_MIN_BYTES - 1)
        assert rss() - small < POPULATE_MIN_BYTES
        data = np.arange(1 << 20, dtype=np.uint8)
        writer.fill(4096, [data])
        assert bytes(arena.view[4096 : 4096 + data.nbytes]) == data.tobytes()
    finally:
        arena.close()  # the writer's map goes with the test's frame


def test_a_kernel_without_populate_is_asked_once_and_the_fill_still_lands(monkeypatch, caplog):
    """Before Linux 5.14 madvise refuses MADV_POPULATE_WRITE (EINVAL): the map stops asking,
    says so at DEBUG, and fills as before."""
    monkeypatch.setattr(_arena, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    arena = Arena(8 << 20)
    try:
        writer = ArenaMap(arena.path)
        calls: list[tuple[int, ...]] = []
        with caplog.at_level(logging.DEBUG, logger="tqueue.transport._arena"):
            writer.mm = _Counting(writer.mm, calls)
            writer.populate(0, 1 << 20)
            writer.populate(0, 1 << 20)
        assert len(calls) == 1 and "no MADV_POPULATE_WRITE here" in caplog.text
        data = np.full(1 << 20, 7, dtype=np.uint8)
        writer.fill(0, [data])
        assert bytes(arena.view[: data.nbytes]) == data.tobytes()
    finally:
        arena.close()


class _Counting:
    """An mmap whose madvise calls are counted."""

    def __init__(self, mm: Any, calls: list[tuple[int, ...]]) -> None:
        self._mm, self._calls = mm, calls

    def madvise(self, *args: int) -> None:
        self._calls.append(args)
        self._mm.madvise(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mm, name)
