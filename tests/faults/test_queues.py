"""ZeroMQ's silent drops made loud, and a bounded queue of replies per peer: a reader that
stops reading cannot grow a unit without bound."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator

import pytest
import torch
import zmq

import tqueue
from tqueue.transport import _zmq
from tqueue.wire import _messages as _wire

from ._proc import peak_rss, reset_peak, rss

MiB = 1 << 20
BOUND = 32 * MiB
ROW = 4000
FETCHES = 100


@pytest.fixture(scope="module")
def small_queue() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=1, storage={"max_queued_bytes": BOUND}) as c:
        yield c


def test_a_peer_that_stops_reading_is_bounded_and_told(small_queue, partition):
    pid = small_queue.pids[1]
    config = tqueue.ClientConfig(shm=False, bulk=False)
    with tqueue.Client(small_queue.address, config=config) as c:
        # 64 puts of 16 rows: a fetch of all of them joins 64 runs into ~4 MB of new frames
        rows = torch.arange(1024 * ROW, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1024, ROW)
        metas = [c.put(partition, {"x": rows[i : i + 16]}) for i in range(0, 1024, 16)]
        indexes = [i for m in metas for i in m.indexes]
        uid = metas[0].partition_uid

        ctx = zmq.Context()
        stalled = ctx.socket(zmq.DEALER)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 64 << 10)
        stalled.setsockopt(zmq.LINGER, 0)
        stalled.connect(small_queue.unit_addresses[0])
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
    async def main() -> _zmq.SendQueues:
        server = _zmq.Server("tcp://127.0.0.1:0", name="test server", max_header=1 << 20)
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

    with caplog.at_level(logging.WARNING, logger="tqueue.transport._zmq"):
        queues = asyncio.run(main())
    assert queues.unreachable == 2
    gone = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and re.search(r"test server: peer [0-9a-f]+ is gone", gone[0].getMessage())
