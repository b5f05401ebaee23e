"""The ZeroMQ peers against a raw ROUTER socket standing in for a server: malformed replies
fail their caller at once, infinite timeouts have no timer, and a request given up on is
withdrawn with a ``Cancel`` on the same connection."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import msgspec
import pytest
import torch
import zmq

import tqueue
from tqueue.errors import ControllerUnavailableError, ProtocolError, StorageUnitUnavailableError
from tqueue.transport import _liveness, _sockets, _zmq, _zmq_server
from tqueue.wire import Kind
from tqueue.wire import _messages as _wire

WAIT = 10.0  # seconds a test waits for something that must happen


class Stand:
    """A ROUTER socket that plays a server by hand, from the test's thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self) -> tuple[bytes, _wire.Message]:
        if not self.sock.poll(int(WAIT * 1000)):
            raise TimeoutError(f"no request within {WAIT} s")
        ident, *frames = self.sock.recv_multipart()
        return ident, _wire.decode(frames)[0]

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def stand():
    s = Stand()
    yield s
    s.close()


def malformed_meta(rid: int) -> list[bytes]:
    """A Meta reply whose rid can be read but whose body does not validate."""
    return [bytes([Kind.META]), msgspec.msgpack.encode({"rid": rid, "meta": 5})]


def get_meta() -> _wire.GetMeta:
    return _wire.GetMeta(partition="p", fields=["x"], batch_size=1, task="t")


def test_a_malformed_reply_fails_its_request_at_once(stand):
    async def main():
        peer = _zmq.Peer(stand.address, name="controller", unavailable=ControllerUnavailableError)
        try:
            pending = asyncio.ensure_future(peer.request(get_meta(), expect=_wire.MetaReply, timeout=600))
            ident, msg = await asyncio.to_thread(stand.recv)
            stand.send(ident, malformed_meta(msg.rid))
            with pytest.raises(ProtocolError, match=r"controller at tcp://\S+ sent a malformed reply: bad MetaReply header"):
                await asyncio.wait_for(pending, WAIT)
        finally:
            await peer.close()

    asyncio.run(main())


def test_a_malformed_reply_fails_a_blocking_request_at_once(stand):
    def serve():
        ident, msg = stand.recv()
        stand.send(ident, malformed_meta(msg.rid))

    thread = threading.Thread(target=serve)
    thread.start()
    peer = _zmq.BlockingPeer(stand.address, name="controller", unavailable=ControllerUnavailableError)
    try:
        with pytest.raises(ProtocolError, match=r"controller at tcp://\S+ sent a malformed reply: bad MetaReply header"):
            peer.request(get_meta(), expect=_wire.MetaReply, timeout=30)
    finally:
        thread.join(WAIT)
        peer.close()


def test_an_infinite_timeout_outlasts_the_peer_default_and_a_cancel_withdraws(stand):
    """``math.inf`` sets no timer (the peer's own timeout is short here); cancelling the
    task sends ``Cancel(of=rid)`` on the same connection, and the server answers nothing."""

    async def main():
        peer = _zmq.Peer(stand.address, name="controller", timeout=0.2)
        try:
            waiting = asyncio.ensure_future(peer.request(get_meta(), expect=_wire.MetaReply, timeout=math.inf))
            _, msg = await asyncio.to_thread(stand.recv)
            with pytest.raises(asyncio.TimeoutError):  # well past the peer's 0.2 s
                await asyncio.wait_for(asyncio.shield(waiting), 1.0)
            waiting.cancel()
            _, cancel = await asyncio.to_thread(stand.recv)
            assert isinstance(cancel, _wire.Cancel) and cancel.of == msg.rid
        finally:
            await peer.close()

    asyncio.run(main())


def test_a_request_that_times_out_is_withdrawn(stand):
    async def main():
        peer = _zmq.Peer(stand.address, name="controller", unavailable=ControllerUnavailableError)
        try:
            with pytest.raises(ControllerUnavailableError, match=r"did not answer GetMeta within 0.1 s"):
                await peer.request(get_meta(), expect=_wire.MetaReply, timeout=0.1)
            _, msg = await asyncio.to_thread(stand.recv)
            _, cancel = await asyncio.to_thread(stand.recv)
            assert isinstance(cancel, _wire.Cancel) and cancel.of == msg.rid
        finally:
            await peer.close()

    asyncio.run(main())


def test_a_blocking_request_that_times_out_is_withdrawn(stand):
    peer = _zmq.BlockingPeer(stand.address, name="controller", unavailable=ControllerUnavailableError)
    try:
        with pytest.raises(ControllerUnavailableError, match=r"did not answer GetMeta within 0.1 s"):
            peer.request(get_meta(), expect=_wire.MetaReply, timeout=0.1)
        _, msg = stand.recv()
        _, cancel = stand.recv()
        assert isinstance(cancel, _wire.Cancel) and cancel.of == msg.rid
    finally:
        peer.close()


def test_a_closed_socket_under_a_send_is_unavailable(stand):
    async def main():
        peer = _zmq.Peer(stand.address, name="controller", unavailable=ControllerUnavailableError)
        peer._socket.sock.close(0)  # the socket goes away beneath the peer
        with pytest.raises(ControllerUnavailableError, match=r"request to controller at tcp://\S+: ZMQError") as info:
            await peer.request(get_meta(), expect=_wire.MetaReply, timeout=1)
        assert isinstance(info.value.__cause__, zmq.ZMQError)
        await peer.close()

    asyncio.run(main())


def test_a_server_busy_with_a_big_request_is_not_taken_for_gone_before_its_transit(stand, monkeypatch):
    """A server cannot answer pings queued behind a big request (ZeroMQ hands a message over
    whole, and a unit copies a put into fresh pages): the peer counts its silence from the end
    of the request's transit (its bytes at ``TRANSIT_RATE``), so a unit busy with a big put for
    longer than the liveness window is not taken for gone. One that never answers still is,
    after the transit and the window. (On a GPU host a 4 GiB put over TCP was failed as "not
    heard from for 3.4 s" and placed again.)"""
    # 48 MiB at a rate of 25 MB/s: a transit of 2 s that a loopback moving 25 MB/s or more
    # (85 MB/s with four test processes on two cores) keeps to; at TRANSIT_RATE itself, how
    # long the server's copy takes on a loaded machine is what the test measured
    monkeypatch.setattr(_liveness, "TRANSIT_RATE", 25e6)
    big = bytearray(48 << 20)
    transit = len(big) / _liveness.TRANSIT_RATE
    interval = 0.2  # a window of 0.6 s

    async def main():
        peer = _zmq.Peer(stand.address, name="storage unit", unavailable=StorageUnitUnavailableError, timeout=600)
        peer.heartbeat(interval)
        try:
            asked = time.monotonic()
            pending = asyncio.ensure_future(peer.request(get_meta(), [big], expect=_wire.Ok))
            ident, msg = await asyncio.to_thread(stand.recv)
            silent = 1.25 * _liveness.window(interval)
            assert silent < transit  # silent past a window, inside the transit
            # counted from the request, not from its arrival: on a loaded machine the 192 MB take
            # part of the transit to arrive, and the peer's allowance began when it sent them
            left = asked + silent - time.monotonic()
            if left > 0:
                with pytest.raises(asyncio.TimeoutError):  # silent for longer than the window, still waiting
                    await asyncio.wait_for(asyncio.shield(pending), left)
            assert not pending.done() and time.monotonic() - asked >= silent
            stand.send(ident, _wire.encode(_wire.Ok(rid=msg.rid)))
            reply, _ = await asyncio.wait_for(pending, WAIT)
            assert isinstance(reply, _wire.Ok)

            sent = time.monotonic()
            with pytest.raises(StorageUnitUnavailableError, match=r"storage unit at tcp://\S+ has not been heard from"):
                await asyncio.wait_for(peer.request(get_meta(), [big], expect=_wire.Ok), WAIT)
            assert time.monotonic() - sent >= transit
        finally:
            await peer.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_get_meta_with_an_infinite_timeout_waits_past_the_request_timeout(cluster, client, partition, kind):
    """``timeout=math.inf`` waits as long as the controller lives, whatever
    ``request_timeout`` says; it returns when a put lands."""
    config = tqueue.ClientConfig(request_timeout=2.0)  # its handshake must not time out under load
    got: list[object] = []
    done = threading.Event()

    def consume() -> None:
        try:
            if kind == "sync":
                with tqueue.Client(cluster.address, config=config) as c:
                    got.append(c.get_meta(partition, ["x"], 1, task="t", timeout=math.inf))
            else:

                async def main():
                    async with tqueue.AsyncClient(cluster.address, config=config) as c:
                        return await c.get_meta(partition, ["x"], 1, task="t", timeout=math.inf)

                got.append(asyncio.run(main()))
        except BaseException as exc:  # reported below
            got.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        assert not done.wait(3.0), got  # past request_timeout, still waiting
        client.put(partition, {"x": torch.arange(1)})
        assert done.wait(30), "get_meta did not return after the put"
    finally:
        thread.join(30)
    assert isinstance(got[0], _wire.BatchMeta) and got[0].indexes == [0], got


def test_a_decode_failure_beyond_the_codec_costs_one_reply_only(stand, monkeypatch):
    """A decode that fails with something other than the codec's own errors (here a
    RecursionError, as a frame nested too deep gives) fails the request it answers with
    ProtocolError; the reply queued behind it in the same wake-up still reaches its caller."""
    real = _zmq.decode
    calls = []

    def decode(frames, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return real(frames, **kw)

    monkeypatch.setattr(_zmq, "decode", decode)

    async def main():
        peer = _zmq.Peer(stand.address, name="controller", unavailable=ControllerUnavailableError)
        try:
            first = asyncio.ensure_future(peer.request(get_meta(), expect=_wire.Ok, timeout=30))
            second = asyncio.ensure_future(peer.request(get_meta(), expect=_wire.Ok, timeout=30))
            (ident, a), (_, b) = await asyncio.to_thread(lambda: (stand.recv(), stand.recv()))
            stand.send(ident, _wire.encode(_wire.Ok(rid=a.rid)))
            stand.send(ident, _wire.encode(_wire.Ok(rid=b.rid)))
            with pytest.raises(ProtocolError, match=r"malformed reply: reply from controller at \S+: RecursionError"):
                await asyncio.wait_for(first, WAIT)
            assert isinstance((await asyncio.wait_for(second, WAIT))[0], _wire.Ok)
        finally:
            await peer.close()

    asyncio.run(main())


def test_a_process_may_hold_more_sockets_than_zeromqs_default():
    """ZeroMQ's context holds 1023 sockets by default (about 250 clients a process); tqueue's
    holds as many as the process may open files, up to MAX_SOCKETS."""
    import resource

    from tqueue.transport._sockets import MAX_SOCKETS, context, max_sockets

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 1200 + 100:
        pytest.skip(f"the open-file limit here is {soft}")
    assert context().get(zmq.MAX_SOCKETS) == max_sockets() == min(soft, MAX_SOCKETS)
    socks = []
    try:
        for _ in range(1200):
            socks.append(context().socket(zmq.DEALER))
    finally:
        for s in socks:
            s.close(linger=0)


def test_replies_made_in_a_drain_leave_at_its_end_in_order_and_a_failed_one_is_reported():
    """What handlers send while a socket is drained waits in its outbox and leaves, in order,
    when the drain ends: the handler's call returns at once, even for a peer that is not
    there, whose failure reaches the server's ``on_undelivered`` after the handler is done."""
    events: list[str] = []

    async def main():
        server = _zmq_server.Server("tcp://127.0.0.1:0", name="stand-in", max_header=1 << 20)
        undelivered: list[tuple[bytes, str]] = []

        def undelivered_to(ident, msg):
            undelivered.append((ident, type(msg).__name__))
            events.append("undelivered")

        server.on_undelivered = undelivered_to

        def handler(ident, msg, bufs):
            for k in range(3):  # three answers to the caller, then one to a peer that is not there
                server.reply(ident, msg.rid + 100 * k, _wire.Ok())
            server.reply(b"\x00nobody", 7, _wire.Ok())
            events.append("handler done")

        server.route(_wire.GetMeta, handler)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.address)
        try:
            dealer.send_multipart(_wire.encode(get_meta()))  # rid 0

            def three():
                got = []
                for _ in range(3):
                    assert dealer.poll(int(WAIT * 1000)), "no reply"
                    got.append(_wire.decode(dealer.recv_multipart())[0].rid)
                return got

            assert await asyncio.to_thread(three) == [0, 100, 200]
            assert events == ["handler done", "undelivered"]
            assert undelivered == [(b"\x00nobody", "Ok")]
            assert server.queues.unreachable == 1  # counted as a peer that is gone (EHOSTUNREACH)
        finally:
            dealer.close(0)
            ctx.term()
            await server.close()

    asyncio.run(main())


def test_a_ping_is_answered_as_it_arrives_before_the_requests_taken_in_with_it_are_handled():
    """The outbox holds what handlers send, but not the pongs of a take-in: they leave before
    the requests taken in with them are handled, so a backlog never delays a sign of life by
    a turn. inproc: a send is in the server's pipe when it returns, so the request and the
    ping queued while the loop is busy are taken in together."""
    started, gate = threading.Event(), threading.Event()
    seen: list[str] = []

    async def main():
        server = _zmq_server.Server("inproc://tqueue-test-pong", name="stand-in", max_header=1 << 20)
        dealer = _sockets.context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect("inproc://tqueue-test-pong")

        def handler(ident, msg, bufs):
            if msg.rid == 1:  # the loop is busy while the test queues a request and a ping
                started.set()
                assert gate.wait(WAIT)
                return _wire.Ok()
            # the second request: the ping taken in with it must have been answered already
            while dealer.poll(2000):
                reply = _wire.decode(dealer.recv_multipart())[0]
                seen.append(type(reply).__name__)
                if isinstance(reply, _wire.Pong):
                    break
            return _wire.Ok()

        server.route(_wire.GetMeta, handler)
        try:
            first = get_meta()
            first.rid = 1
            dealer.send_multipart(_wire.encode(first))

            def queue_behind():
                assert started.wait(WAIT)
                second = get_meta()
                second.rid = 2
                dealer.send_multipart(_wire.encode(second))
                dealer.send_multipart(_wire.encode(_wire.Ping()))
                gate.set()

            await asyncio.to_thread(queue_behind)
            reply = await asyncio.to_thread(lambda: dealer.poll(int(WAIT * 1000)) and _wire.decode(dealer.recv_multipart())[0])
            assert isinstance(reply, _wire.Ok) and reply.rid == 2
            assert seen == ["Ok", "Pong"]  # the first request's answer, then the pong
        finally:
            dealer.close(0)
            await server.close()

    asyncio.run(main())
