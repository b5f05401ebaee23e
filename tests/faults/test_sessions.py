"""Ten thousand client sessions (connect, put, get, ack, close) leave every server's file
descriptors, threads and resident memory where they started, on every payload path: small
puts in ZeroMQ frames, same-host puts and reads through a unit's arena, and reads of a
client "on another host" over the units' bulk streams."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

import tqueue

from ._proc import fds, rss, threads, until

SESSIONS = int(os.environ.get("TQUEUE_TEST_SESSIONS", "10000"))
AT_ONCE = 8  # sessions open at the same time
WARM_UP = 300
SLACK = 2  # fds or threads of the last sessions may still be closing as we count
RSS_BOUND = 24 << 20  # allocator and ZeroMQ pools settling; a leak of 2.5 KB per session passes it
MiB = 1 << 20

CONFIGS = [
    tqueue.ClientConfig(),  # same host: puts over 1 MiB and their reads go through the arena
    tqueue.ClientConfig(shm=False),  # ZeroMQ frames
    tqueue.ClientConfig(shm=False, host="elsewhere"),  # reads over bulk streams
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=2) as c:
        yield c


async def session(address: str, n: int) -> None:
    config = CONFIGS[n % len(CONFIGS)]
    rows = 8 if n % len(CONFIGS) else 2048  # the arena path gets 2 MiB puts
    async with tqueue.AsyncClient(address, config=config) as client:
        part = f"s{n}"
        data = torch.full((4, rows * 16), float(n))
        meta = await client.put(part, {"x": data})
        got = await client.get_meta(part, ["x"], 4, task="t", timeout=60)
        batch = await client.get_data(got)
        assert torch.equal(batch["x"], data), n
        del batch  # arena views: the hold goes back with them
        await client.ack(got)
        await client.clear(part)
        assert meta.size == 4


async def sessions(address: str, first: int, count: int) -> None:
    queue = iter(range(first, first + count))

    async def worker() -> None:
        for n in queue:
            await session(address, n)

    await asyncio.gather(*(worker() for _ in range(AT_ONCE)))


def usage(pids: list[int]) -> list[tuple[int, int, int]]:
    return [(fds(p), threads(p), rss(p)) for p in pids]


@pytest.mark.soak
def test_ten_thousand_sessions_leave_fds_threads_and_rss_where_they_were(cluster):
    pids = cluster.pids  # controller, then the units
    asyncio.run(sessions(cluster.address, 0, WARM_UP))
    with cluster.client() as probe:
        until(lambda: not probe.status().partitions, 30, "the warm-up's partitions freed")
    before = usage(pids)
    t0 = time.monotonic()
    asyncio.run(sessions(cluster.address, WARM_UP, SESSIONS))
    took = time.monotonic() - t0
    with cluster.client() as probe:
        until(lambda: not probe.status().partitions, 30, "every partition freed")
        units = probe.status().units
    # ZeroMQ tears connections down on its own threads, a little after each close
    until(lambda: all(a[0] - b[0] <= SLACK for a, b in zip(usage(pids), before)), 30, "server fds back")
    after = usage(pids)
    report = ", ".join(
        f"{name} fds {b[0]}->{a[0]} threads {b[1]}->{a[1]} RSS {b[2] / MiB:.1f}->{a[2] / MiB:.1f} MiB"
        for name, b, a in zip(["controller", "unit 0", "unit 1"], before, after)
    )
    print(f"\n{SESSIONS} sessions in {took:.1f} s ({SESSIONS / took:.0f}/s): {report}")
    for b, a in zip(before, after):
        assert a[0] - b[0] <= SLACK and a[1] - b[1] <= SLACK, report
        assert a[2] - b[2] < RSS_BOUND, report
    assert all(u.alive and u.arena_used == 0 for u in units)
