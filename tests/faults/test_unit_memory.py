"""Every byte a unit holds is counted and bounded, with real unit processes: arena pages a
reader held go back to the OS once their partition is cleared and the hold released, in either
order (``retain_bytes=0``); a bulk reader that stops or trickles is cut off within
``bulk_stall_timeout + N / bulk_min_rate``, its bytes shown in ``status()`` (``held_bytes``)
until then, and the unit's memory comes back after; replies left unread on several connections
stay under ``max_queued_bytes_total``, the fetches past it refused with ``UnavailableError``.

Memory is read from /proc: the unit's resident size (``VmRSS``, which counts the arena pages
the unit has mapped) and the arena's own pages (the blocks of its memory file).
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

import tqueue
from tqueue.transport import _bulk
from tqueue.wire import _messages as _wire

from ._proc import memfds, peak_rss, reset_peak, rss, until
from .conftest import bulk_address_of

MiB = 1 << 20
INTERVAL = 0.5  # the cluster's heartbeat: status() shows a unit's counts this fresh
ARENA_BYTES = 96 * MiB
SLACK = 16 * MiB  # what a unit may keep beyond its baseline once everything is freed


def arena_pages(pid: int) -> int:
    """Bytes of the unit's arena backed by memory (its memory file's blocks), whoever maps them."""
    for path in memfds(pid, "/memfd:tqueue-arena"):
        return os.stat(path).st_blocks * 512
    raise AssertionError(f"unit {pid} has no arena")


def lean_cluster(**storage: object) -> tqueue.LocalCluster:
    """One unit of its own that gives freed memory back at once."""
    return tqueue.LocalCluster(
        num_storage_units=1, storage={"retain_bytes": 0, **storage}, controller={"heartbeat_interval": INTERVAL}
    )


async def reported(client: tqueue.AsyncClient, condition: Callable[[Any], bool], what: str) -> None:
    """Wait until the unit's line in ``status()`` satisfies ``condition``. It is as of the
    unit's last heartbeat, and no call waits for one: polled, a fifth of an interval apart."""
    deadline = time.monotonic() + 10 * INTERVAL + 5
    while not condition((await client.status()).units[0]):
        assert time.monotonic() < deadline, f"status() never showed {what}"
        await asyncio.sleep(INTERVAL / 5)


# --- arena pages held by a reader ----------------------------------------------------


async def release(client: tqueue.AsyncClient, batch: dict) -> None:
    """Drop the last views of ``batch`` and have the unit acknowledge their hold's release."""
    batch.clear()
    conns = client._conns
    # The hold is queued for release when the views are collected, which happens once the
    # client's loop lets go of the fetch's futures: a few loop turns (not time), bounded.
    for _ in range(1000):
        gc.collect()
        if conns._releases:
            break
        await asyncio.sleep(0)
    assert conns._releases, "the views' hold was never queued for release"
    await conns.flush_releases()  # answered once the unit has ended the hold


@pytest.mark.parametrize("order", [pytest.param("clear-then-release", id="clear-then-release"),
                                   pytest.param("release-then-clear", id="release-then-clear")])
def test_arena_pages_a_reader_held_go_back_to_the_os_in_either_order(order):
    # no lease: the writer's lease would keep its range (and pages) in use until it lapses
    shm = tqueue.ClientConfig(shm=True, shm_min_bytes=0, arena_lease_bytes=0)
    sockets = tqueue.ClientConfig(shm=False, bulk=False)

    async def main(cluster: tqueue.LocalCluster) -> None:
        pid = cluster.pids[1]
        async with tqueue.AsyncClient(cluster.address, config=shm) as c, \
                tqueue.AsyncClient(cluster.address, config=sockets) as far:
            base, base_pages = rss(pid), arena_pages(pid)
            await c.put("previous-step", {"x": torch.ones(4, MiB // 4)})
            await c.put("step", {"x": torch.full((4, ARENA_BYTES // 16), 3.0)})
            # a reader over the socket: the unit sends from its arena, mapping its pages
            got = await far.get_data("step", ["x"], 4, task="far", timeout=30)
            assert bool((got["x"] == 3.0).all())
            del got
            mapped = rss(pid) - base
            held = dict(await c.get_data("step", ["x"], 4, task="near", timeout=30))  # zero-copy views
            await c.clear("previous-step")  # a trainer clears the step before while it reads this one
            if order == "clear-then-release":
                await c.clear("step")
                await reported(c, lambda u: u.nbytes == 0 and u.arena_used >= ARENA_BYTES, "the held pages in use")
                assert bool((held["x"] == 3.0).all())  # the reader's bytes are intact meanwhile
                await release(c, held)
            else:
                await release(c, held)
                await c.clear("step")
            await reported(c, lambda u: u.arena_used == 0, "no arena bytes in use")
            after, pages = rss(pid) - base, arena_pages(pid)
            print(f"{order}: unit RSS +{mapped / MiB:.1f} MiB with the arena mapped, +{after / MiB:.1f} MiB "
                  f"after; arena pages {base_pages / MiB:.1f} -> {pages / MiB:.1f} MiB")
            assert mapped >= ARENA_BYTES - SLACK  # the measure sees the pages
            # before: the pages stayed (+95 MiB of RSS, 96 MiB of arena pages)
            assert pages <= base_pages + SLACK and after <= SLACK, (after / MiB, pages / MiB)

    with lean_cluster() as cluster:
        asyncio.run(main(cluster))


# --- a bulk reader that stops, or trickles ----------------------------------------------

STALL = 3.0  # StorageConfig.bulk_stall_timeout in these tests
RATE = 16 * MiB  # StorageConfig.bulk_min_rate
STREAM_BYTES = 64 * MiB
BOUND = STALL + STREAM_BYTES / RATE  # the reply's time: 7 s


def trickle(sock: socket.socket, stop: threading.Event, got: list[int], ended: threading.Event) -> None:
    """Read 4 KiB about every 20 ms (~200 KiB/s, far below RATE) until the unit hangs up.
    The pause is the trickle itself, not a wait for something to happen."""
    try:
        while not stop.wait(0.02):
            chunk = sock.recv(4096)
            if not chunk:
                break
            got[0] += len(chunk)
    except OSError:
        pass  # reset by the unit: cut off as well
    finally:
        ended.set()


def drain(sock: socket.socket, got: list[int]) -> None:
    """Read what is left on the stream until the unit's hang-up (EOF or a reset)."""
    sock.settimeout(30)
    try:
        while chunk := sock.recv(1 << 20):
            got[0] += len(chunk)
    except ConnectionResetError:
        pass


@pytest.mark.parametrize("reader", [pytest.param("stops", id="stops"), pytest.param("trickles", id="trickles", marks=pytest.mark.slow)])
def test_a_bulk_reader_that_stops_or_trickles_is_cut_off_and_counted_until_then(reader, raw):
    with lean_cluster(bulk_stall_timeout=STALL, bulk_min_rate=RATE) as cluster, \
            cluster.client(config=tqueue.ClientConfig(shm=False)) as client:
        pid = cluster.pids[1]
        client.put("warm-up", {"x": torch.ones(4, MiB // 4)})
        client.clear("warm-up")
        base = rss(pid)
        meta = client.put("step", {"x": torch.full((4, STREAM_BYTES // 16), 5.0)})
        stored = rss(pid) - base
        stream = _bulk.BulkStream(bulk_address_of(cluster), 10)
        stream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        got, ended, stop = [0], threading.Event(), threading.Event()
        try:
            fetch = _wire.Fetch(rid=1, partition="step", partition_uid=meta.partition_uid, indexes=list(meta.indexes),
                                fields=["x"], bulk=stream.token)
            reply = raw(cluster.unit_addresses[0]).ask(_wire.encode(fetch), timeout=30)
            t0 = time.monotonic()  # the unit is sending from here on
            assert isinstance(reply, _wire.Fetched) and reply.bulk == STREAM_BYTES, reply
            if reader == "trickles":
                threading.Thread(target=trickle, args=(stream.sock, stop, got, ended), daemon=True).start()
            client.clear("step")
            # cleared, yet held for the reader: status() says so (as of the unit's heartbeat,
            # which no call waits for: polled)
            seen = []

            def shown() -> bool:
                unit = client.status().units[0]
                seen.append((time.monotonic() - t0, unit.nbytes, unit.held_bytes))
                return unit.nbytes == 0 and unit.held_bytes >= STREAM_BYTES

            until(shown, STALL, "the reader's bytes in held_bytes", every=INTERVAL / 5)
            held_rss = rss(pid) - base
            until(lambda: client.status().units[0].held_bytes == 0, BOUND + 10 * INTERVAL, "the reader cut off",
                  every=INTERVAL / 5)
            cut = time.monotonic() - t0
            # the unit gives the memory back once it let go of the reply: no event says when
            until(lambda: rss(pid) - base <= SLACK, 10, f"unit RSS back within {SLACK >> 20} MiB of {base >> 20} MiB")
            after = rss(pid) - base
            if reader == "trickles":
                assert ended.wait(30), "the unit never hung up on the trickling reader"
            else:
                drain(stream.sock, got)
        finally:
            stop.set()
            stream.close()
        print(f"bulk reader that {reader}: unit RSS +{stored / MiB:.1f} MiB stored, +{held_rss / MiB:.1f} MiB held "
              f"after clear (status: nbytes 0, held_bytes {STREAM_BYTES >> 20} MiB), cut off after {cut:.1f} s "
              f"(bound {BOUND:.0f} s) having read {got[0] / MiB:.1f} MiB, RSS +{after / MiB:.1f} MiB after")
        # before: held indefinitely (64 MiB after 150 s) while status() said 0 bytes
        assert held_rss >= STREAM_BYTES - SLACK
        assert cut <= BOUND + 4 * INTERVAL + 2, seen  # 2 s for two busy cores
        assert reader == "trickles" or cut >= STALL, seen  # a stopped reader gets its stall_timeout
        assert got[0] < STREAM_BYTES


# --- replies left unread on several connections ------------------------------------------

PER_PEER = 64 * MiB  # StorageConfig.max_queued_bytes in this test
TOTAL = 96 * MiB  # StorageConfig.max_queued_bytes_total: less than three peers' worth
PEERS = 3
FETCHES = 100  # per connection, about 4 MB each: 1.2 GB asked for in all
ROW = 4000


def test_replies_unread_on_several_connections_stay_under_the_total_bound(partition):
    storage = {"max_queued_bytes": PER_PEER, "max_queued_bytes_total": TOTAL}
    with tqueue.LocalCluster(num_storage_units=1, storage=storage, controller={"heartbeat_interval": INTERVAL}) as cluster, \
            cluster.client(config=tqueue.ClientConfig(shm=False, bulk=False)) as c:
        pid = cluster.pids[1]
        # 64 puts of 16 rows: a fetch of all of them joins 64 runs into ~4 MB of new frames
        rows = torch.arange(1024 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1024, ROW)
        metas = [c.put(partition, {"x": rows[i : i + 16]}) for i in range(0, 1024, 16)]
        indexes = [i for m in metas for i in m.indexes]
        fetch = _wire.Fetch(rid=0, partition=partition, partition_uid=metas[0].partition_uid, indexes=indexes, fields=["x"])
        ctx = zmq.Context()
        peers = []
        try:
            for _ in range(PEERS):
                peer = ctx.socket(zmq.DEALER)
                peer.setsockopt(zmq.RCVHWM, 1)
                peer.setsockopt(zmq.RCVBUF, 64 << 10)
                peer.setsockopt(zmq.LINGER, 0)
                peer.connect(cluster.unit_addresses[0])
                peers.append(peer)
            reset_peak(pid)
            before = rss(pid)
            ping = _wire.encode(_wire.Ping())

            def alive() -> None:
                """Each peer is live and not reading (as a client that heartbeats): a silent one's
                session would end after 1.5 s and its queued replies with it."""
                for peer in peers:
                    peer.send_multipart(ping)

            for rid in range(1, FETCHES + 1):
                fetch.rid = rid
                for peer in peers:
                    peer.send_multipart(_wire.encode(fetch))
            alive()
            # a correct client is served meanwhile, bytes intact
            got = c.get_data(c.get_meta(partition, ["x"], 1024, task="t", timeout=30))["x"]
            assert torch.equal(got.sum(0), rows.sum(0))
            # what the unit holds for them shows in status() (as of its heartbeat: polled)
            until(lambda: alive() or c.status().units[0].held_bytes > PER_PEER, 10, "unread replies in held_bytes",
                  every=INTERVAL / 5)
            held = c.status().units[0].held_bytes
            served, refused, by_total = [0] * PEERS, [0] * PEERS, 0
            answered = [0] * PEERS
            while min(answered) < FETCHES:
                alive()
                for i, peer in enumerate(peers):
                    if answered[i] == FETCHES:
                        continue
                    assert peer.poll(60_000), "a fetch got no answer"
                    reply, frames = _wire.decode(peer.recv_multipart())
                    if isinstance(reply, _wire.Pong):
                        continue
                    answered[i] += 1
                    if isinstance(reply, _wire.Fetched):
                        served[i] += 1
                        assert sum(len(f) for f in frames) == 1024 * ROW
                        continue
                    assert isinstance(reply, _wire.Error) and reply.code == "unavailable", reply
                    assert re.search(r"(to this connection are unread.*StorageConfig\.max_queued_bytes\)"
                                     r"|to all connections are unread.*StorageConfig\.max_queued_bytes_total\))", reply.message)
                    by_total += "max_queued_bytes_total" in reply.message
                    refused[i] += 1
            grew = peak_rss(pid) - before
            print(f"{PEERS} connections x {FETCHES} unread fetches: unit peak RSS +{grew / MiB:.1f} MiB "
                  f"(total bound {TOTAL >> 20} MiB), held_bytes {held / MiB:.1f} MiB; served {served}, "
                  f"refused {refused} ({by_total} by the total bound)")
            assert all(served) and all(refused) and by_total > 0
            assert held <= TOTAL + 8 * MiB  # one reply past the bound at most (the first always goes)
            # before: +200 MiB here (each connection up to its own bound); 51 -> 1,240 MiB at 1 GiB
            assert grew < TOTAL + 32 * MiB, grew / MiB
        finally:
            for peer in peers:
                peer.close()
            ctx.term()
        until(lambda: c.status().units[0].held_bytes == 0, 10, "no reply held once read", every=INTERVAL / 5)
