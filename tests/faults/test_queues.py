"""ZeroMQ's silent drops made loud, and a bounded queue of replies per peer: a reader that
stops reading cannot grow a unit without bound."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

import tqueue
from tqueue.transport import _queues, _zmq_server
from tqueue.wire import _messages as _wire

from ._proc import peak_rss, reset_peak, rss, until

MiB = 1 << 20
BOUND = 32 * MiB
ROW = 4000
FETCHES = 100


@pytest.fixture(scope="module")
def small_queue() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=1, storage={"max_queued_bytes": BOUND}) as c:
        yield c


def reader_that_stalls(address: str) -> tuple[zmq.Context, zmq.Socket]:
    """A raw DEALER connected to ``address`` that takes as little as ZeroMQ lets it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 << 10)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def test_a_peer_that_stops_reading_is_bounded_and_told(small_queue, partition):
    pid = small_queue.pids[1]
    config = tqueue.ClientConfig(shm=False, bulk=False)
    with tqueue.Client(small_queue.address, config=config) as c:
        # 64 puts of 16 rows: a fetch of all of them joins 64 runs into ~4 MB of new frames
        rows = torch.arange(1024 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1024, ROW)
        metas = [c.put(partition, {"x": rows[i : i + 16]}) for i in range(0, 1024, 16)]
        indexes = [i for m in metas for i in m.indexes]
        uid = metas[0].partition_uid

        ctx, stalled = reader_that_stalls(small_queue.unit_addresses[0])
        try:
            reset_peak(pid)
            before = rss(pid)
            for rid in range(1, FETCHES + 1):
                fetch = _wire.Fetch(rid=rid, partition=partition, partition_uid=uid, indexes=indexes, fields=["x"])
                stalled.send_multipart(_wire.encode(fetch))
            # a correct client is served meanwhile, bytes intact
            got = c.get_data(c.get_meta(partition, ["x"], 1024, task="t", timeout=30))["x"]
            assert torch.equal(got.sum(0), rows.sum(0))  # every row came back, in some order
            # every request is answered: served, or refused with a typed error
            served = refused = 0
            for _ in range(FETCHES):
                assert stalled.poll(60_000), "a fetch got no answer"
                reply, frames = _wire.decode(stalled.recv_multipart())
                if isinstance(reply, _wire.Fetched):
                    served += 1
                    assert sum(len(f) for f in frames) == 1024 * ROW
                else:
                    assert isinstance(reply, _wire.Error) and reply.code == "unavailable", reply
                    assert re.search(r"bytes of earlier replies to this connection are unread", reply.message)
                    refused += 1
            assert served + refused == FETCHES and served >= 1 and refused >= 1
            grew = peak_rss(pid) - before
            # before: +400 MB (each queued fetch held its 4 MB of joined frames)
            print(f"unit peak RSS growth with {FETCHES} unread fetches: {grew / MiB:.1f} MiB ({served} served, {refused} refused)")
            assert grew < BOUND + 32 * MiB, grew / MiB
        finally:
            stalled.close()
            ctx.term()


def test_a_reply_to_a_vanished_peer_is_counted_and_logged_once(caplog):
    async def main() -> _queues.SendQueues:
        server = _zmq_server.Server("tcp://127.0.0.1:0", name="test server", max_header=1 << 20)
        parked: list[tuple[bytes, int]] = []
        both = asyncio.Event()

        def park(ident: bytes, msg: _wire.Hello, bufs: list) -> None:
            parked.append((ident, msg.rid))
            if len(parked) == 2:
                both.set()

        server.route(_wire.Hello, park)
        monitor = server._socket.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(server.address)
        for rid in (1, 2):
            peer.send_multipart(_wire.encode(_wire.Hello(rid=rid, protocol=_wire.PROTOCOL_VERSION)))
        await asyncio.wait_for(both.wait(), 30)
        peer.close()
        ctx.term()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, monitor.poll, 30_000), "the server never saw the peer go"
        for ident, rid in parked:
            server.reply(ident, rid, _wire.HelloReply(protocol=_wire.PROTOCOL_VERSION, server="test"))
        server._socket.sock.disable_monitor()
        monitor.close()
        await server.close()
        return server.queues

    with caplog.at_level(logging.WARNING, logger="tqueue.transport._zmq_server"):
        queues = asyncio.run(main())
    assert queues.unreachable == 2
    gone = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and re.search(r"test server: peer [0-9a-f]+ is gone", gone[0].getMessage())


# --- a stalled reader's bytes: bounded relative to capacity, freed within seconds -----------

CAPACITY = 512 * MiB  # per peer capacity / 32 = 16 MiB, in all capacity / 8 = 64 MiB
INTERVAL = 0.5  # the cluster's heartbeat: status() shows the unit's held_bytes this fresh


def stall(cluster: tqueue.LocalCluster, client: tqueue.Client, partition: str, fetches: int) -> tuple[zmq.Context, zmq.Socket]:
    """A raw socket that asks for ``fetches`` replies of about 4 MB and never reads them."""
    rows = torch.arange(1024 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1024, ROW)
    metas = [client.put(partition, {"x": rows[i : i + 16]}) for i in range(0, 1024, 16)]
    indexes = [i for m in metas for i in m.indexes]
    ctx, sock = reader_that_stalls(cluster.unit_addresses[0])
    for rid in range(1, fetches + 1):
        fetch = _wire.Fetch(rid=rid, partition=partition, partition_uid=metas[0].partition_uid, indexes=indexes, fields=["x"])
        sock.send_multipart(_wire.encode(fetch))
    return ctx, sock


def held(client: tqueue.Client) -> int:
    return client.status().units[0].held_bytes


@pytest.fixture
def capped() -> Iterator[tqueue.LocalCluster]:
    storage = {"capacity_bytes": CAPACITY, "retain_bytes": 0}
    with tqueue.LocalCluster(num_storage_units=1, storage=storage, controller={"heartbeat_interval": INTERVAL}) as c:
        yield c


def test_a_stalled_readers_replies_of_a_cleared_partition_are_freed_within_seconds(capped, partition):
    """The defaults follow the unit's capacity (16 MiB a peer at 512 MiB); the stalled reader
    keeps its session (it pings) but takes none of its replies: once their partition is
    cleared, the unit cuts it off and status() shows the bytes gone within seconds."""
    per_peer, total = tqueue.StorageConfig(controller="", capacity_bytes=CAPACITY).queued_bounds()
    assert (per_peer, total) == (16 * MiB, 64 * MiB)
    with capped.client(config=tqueue.ClientConfig(shm=False, bulk=False)) as c:
        ctx, sock = stall(capped, c, partition, 20)
        ping = _wire.encode(_wire.Ping())
        try:
            def shown(condition):
                sock.send_multipart(ping)  # a sign of life: the session stays, only reading stopped
                return condition(held(c))

            until(lambda: shown(lambda n: n > 0), 10, "the unread replies in held_bytes", every=INTERVAL / 5)
            most = held(c)
            assert most <= per_peer + 8 * MiB, most / MiB  # one reply past the bound at most
            c.clear(partition)
            cleared = time.monotonic()
            until(lambda: shown(lambda n: n == 0), 10, "the cleared partition's replies freed", every=INTERVAL / 5)
            took = time.monotonic() - cleared
            print(f"stalled reader: held {most / MiB:.1f} MiB (bound {per_peer >> 20} MiB a peer), freed {took:.2f} s after the clear")
            assert took < 5
        finally:
            sock.close()
            ctx.term()
        c.put(partition, {"x": torch.arange(4)})  # the unit serves on
        assert c.get_data(c.get_meta(partition, ["x"], 4, task="t", timeout=10))["x"].tolist() == [0, 1, 2, 3]


def test_a_stalled_reader_whose_session_ends_has_its_replies_freed(capped, partition):
    """A reader that stops reading and goes silent (no pings: its process hangs) is gone at
    the end of its liveness window; what the unit queued for it goes then, the partition alive."""
    with capped.client(config=tqueue.ClientConfig(shm=False, bulk=False)) as c:
        ctx, sock = stall(capped, c, partition, 20)
        try:
            until(lambda: held(c) > 0, 10, "the unread replies in held_bytes", every=INTERVAL / 5)
            seen = time.monotonic()
            until(lambda: held(c) == 0, 10, "the silent reader's replies freed", every=INTERVAL / 5)
            print(f"silent stalled reader: its replies freed {time.monotonic() - seen:.2f} s after status() showed them")
        finally:
            sock.close()
            ctx.term()
        assert c.get_data(c.get_meta(partition, ["x"], 1024, task="t", timeout=10))["x"].shape == (1024, ROW)
