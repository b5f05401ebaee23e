"""ZeroMQ plumbing shared by every component: one context, a request/reply peer (the server loop
is `._zmq_server`).

IO here only moves frames. State lives in the components; errors that cross a socket are
translated here and nowhere else: a server turns every exception into a typed ``Error``
reply and goes on, a peer turns an ``Error`` reply back into the exception class, and
ZeroMQ and decode failures become tqueue errors through the boundaries of ``_boundary``.
A message that cannot be decoded costs that message only, never the receive loop.

A request's timeout is a number of seconds, ``math.inf`` (no timer: wait while the peer is
alive) or None (the peer's own request timeout): the one convention of every timeout in
tqueue, None meaning "the default of whoever is asked". A request given up on (its
timeout ran out, or its task was cancelled) is withdrawn with a ``Cancel`` on the same
connection, so the server does not keep a wait nobody will read; servers never answer one.

Sockets are plain (blocking-API) ZeroMQ sockets whose file descriptor is watched by the
asyncio loop; a readable event drains every queued message and dispatches it at once.
This costs far less per round trip than a future per receive (about 80 us against 310 us
for a small request and reply on two cores), and keeps asyncio for timers and the few
handlers that wait on another server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from ..errors import ProtocolError, TQueueError, UnavailableError, from_code
from ..wire import Bye, Cancel, Error, Message, Notice, Ping, decode, encode, salvage_rid
from ._auth import Curve
from ._boundary import DECODE_ERRORS, Boundary, io_errors
from ._connect import ConnectWatch, endpoint
from ._liveness import HEARTBEAT_INTERVAL, transit, window
from ._loop import LoopSocket
from ._sockets import NOBLOCK, context, recv_frames, send_frames, tune

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


_PING = encode(Ping())
RECONNECT_GRACE = 0.3  # seconds a request to a server whose reconnects were refused waits for one that succeeds
VERDICT_GRACE = 1.0  # seconds a request that found no connection waits for the handshake's verdict (a refusal names its cause)
_monitors = itertools.count()  # names of blocking peers' monitor sockets
BYE_LINGER_MS = 500  # a closing peer's Bye may still leave this long after the close
_BYE = encode(Bye())


def expected(reply: Message, expect: type[R], *, peer: str, request: Message) -> R:
    """``reply`` as ``expect``, or :class:`ProtocolError` naming what came instead (a check
    that holds under ``python -O``, unlike an ``assert``)."""
    if not isinstance(reply, expect):
        raise ProtocolError(
            f"{peer} answered {type(request).__name__} with {type(reply).__name__}, "
            f"expected {expect.__name__}"
        )
    return reply


_RID_KEY = b"\xa3rid"  # MessagePack's "rid": a header's last key (the base's field comes after the message's own)
_UINTS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def tail_rid(frames: Sequence[Any]) -> int:
    """The request id at the end of a header that cannot be decoded whole (too large for the
    server's ``max_header``, or nested too deep for the decoder), read from its last 13
    bytes: a reply the requester can match, at once, at no cost beyond the look (0: none)."""
    if len(frames) < 2:
        return 0
    view = memoryview(frames[1].buffer if isinstance(frames[1], zmq.Frame) else frames[1]).cast("B")
    tail = bytes(view[-13:])
    at = tail.rfind(_RID_KEY)
    if at < 0:
        return 0
    value = tail[at + len(_RID_KEY) :]
    if len(value) == 1 and value[0] < 0x80:  # a positive fixint
        return value[0]
    width = _UINTS.get(value[0], 0) if value else 0
    return int.from_bytes(value[1:], "big") if width and len(value) == 1 + width else 0


def _malformed(peer: str, exc: TQueueError) -> ProtocolError:
    return ProtocolError(f"{peer} sent a malformed reply: {exc}")


class Peer:
    """A DEALER connection to one server; many requests in flight, matched by id.

    Must be created and used inside a running event loop. ``routing_id`` names the
    connection to the server (see ``_liveness.Session``). After :meth:`heartbeat` the peer
    pings the server when it has been silent for an interval, and fails every pending
    request with its ``unavailable`` error once it has been silent for the liveness window
    (see :mod:`._liveness`), whatever each request's own timeout. With ``watch``, a first
    connection that fails (nothing listens, the handshake is refused) fails what is pending
    at once, as the error :class:`._connect.ConnectWatch` makes of it. With ``lasting``, a
    connection closed later fails what is in flight on it at once, and while reconnects are
    refused so does every new request. With ``restartable`` (a server that may restart at its
    address: the controller), a closed connection fails what is in flight (a restarted server
    never heard of it; a live one is told to withdraw it with a ``Cancel``), and new requests
    wait for the reconnect, within the heartbeat window. ``on_closed`` hears each such close
    (a server that restarted at its address may not be the one it was: its arena, say).
    """

    def __init__(
        self,
        address: str,
        *,
        name: str,
        unavailable: type[UnavailableError] = UnavailableError,
        timeout: float = 30.0,
        routing_id: bytes | None = None,
        curve: Curve | None = None,
        watch: bool = False,
        lasting: bool = False,
        restartable: bool = False,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.address = address = endpoint(address)
        self.name = name
        self.timeout = timeout
        self._unavailable = unavailable
        where = f"{name} at {address}"
        self._decoding = Boundary(f"reply from {where}", DECODE_ERRORS)
        self._socket = LoopSocket(
            zmq.DEALER, self._on_reply, sending=Boundary(f"request to {where}", io_errors(unavailable))
        )
        if routing_id is not None:
            self._socket.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve is not None:
            curve.connect(self._socket.sock)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[Message, list[Any]]]] = {}
        self._refused: TQueueError | None = None  # the watch's verdict on the first connection
        self._down: TQueueError | None = None  # (lasting) the server stopped answering; None once it does
        self._verdict = asyncio.Event()  # (lasting) cleared while a closed connection awaits its reconnect
        self._verdict.set()
        self._up = asyncio.Event()  # (lasting) set by each handshake, cleared when reconnects are refused
        self._restartable = restartable
        self._on_closed = on_closed  # (watched) each connection closed after it was up
        watched = lasting or restartable
        self._watch = None if not (watch or watched) else ConnectWatch(  # before the connect: every event counts
            self._socket.sock, name=name, address=address, keys=curve is not None,
            unavailable=unavailable, on_failure=self._refuse,
            on_lost=self._lost if watched else None, on_connected=self._connected if watched else None,
        )
        self._socket.sock.connect(address)
        self._loop = asyncio.get_running_loop()
        self._heard = self._loop.time()
        self._interval = 0.0
        self._ticker: asyncio.TimerHandle | None = None

    def heartbeat(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        """Ping after ``interval`` s of silence; fail what is pending after the window."""
        if interval <= 0 or self.closed:
            return
        first = not self._interval
        self._interval = interval
        if first:
            self._heard = self._loop.time()
            self._ticker = self._loop.call_later(interval, self._tick)

    @property
    def gone(self) -> bool:
        """Heartbeats are on and the server has been silent for the liveness window, or
        (lasting) its address refuses connections."""
        silent = bool(self._interval) and self._loop.time() - self._heard >= window(self._interval)
        return silent or self._down is not None

    @property
    def refusing(self) -> bool:
        """(lasting) The server's address refuses connections: its process is gone (silence
        alone, ``gone`` as well, may be a server stopped or slow)."""
        return self._down is not None

    def _tick(self) -> None:
        self._socket.drain()  # replies that arrived while the loop was busy count
        silent = self._loop.time() - self._heard
        if silent >= window(self._interval) and self._pending:
            self._fail_pending(self._unavailable(
                f"{self.name} at {self.address} has not been heard from for {silent:.1f} s "
                f"(heartbeat every {self._interval:g} s): it is gone or unreachable"
            ))
        elif silent >= self._interval:
            try:
                self._socket.send(_PING, copy=True, flags=NOBLOCK)
            except UnavailableError as exc:
                log.debug("%s", exc)
        if not self.closed:
            self._ticker = self._loop.call_later(self._interval, self._tick)

    def _fail_pending(self, exc: TQueueError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def _refuse(self, exc: TQueueError) -> None:
        self._refused = exc
        self._fail_pending(exc)

    def _lost(self, exc: TQueueError, gone: bool) -> None:
        if not gone and self._on_closed is not None:
            self._on_closed()
        if self._restartable:
            if not gone:
                lost = [rid for rid, fut in self._pending.items() if not fut.done()]
                self._fail_pending(exc)
                for rid in lost:  # queued for the reconnect: a server that lives withdraws them
                    self._withdraw(rid)
            return
        if gone:
            self._up.clear()
            self._down = exc
            self._verdict.set()
        else:  # closed: ZeroMQ reconnects at once, and the attempt says whether it lives
            self._verdict.clear()
        self._fail_pending(exc)

    def _connected(self) -> None:
        self._up.set()
        self._down = None
        self._verdict.set()

    async def settled(self, timeout: float) -> bool:
        """Whether the server is gone, once ZeroMQ has tried to reconnect after a closed
        connection (waiting up to ``timeout`` for that attempt): a request lost with its
        connection may be a server that restarted, or one that died."""
        if not self._verdict.is_set():
            try:
                await asyncio.wait_for(self._verdict.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.gone

    @property
    def closed(self) -> bool:
        return self._socket.closed

    async def request(
        self,
        msg: Message,
        buffers: Sequence[Any] = (),
        *,
        expect: type[R],
        timeout: float | None = None,
    ) -> tuple[R, list[Any]]:
        """Send ``msg`` with ``buffers`` (zero-copy) and wait for its reply, of type ``expect``.

        An ``Error`` reply is raised as its exception class, a reply of another type or one
        that cannot be decoded as :class:`ProtocolError`; no reply within ``timeout``
        (None: the peer's; ``math.inf``: none, the wait lasts while the peer
        is open) raises this peer's :class:`UnavailableError` subclass. A request that times
        out or whose task is cancelled is withdrawn with a ``Cancel``.
        """
        if self.closed:
            raise self._unavailable(f"connection to {self.name} at {self.address} is closed")
        if self._refused is not None:
            raise self._refused
        if self._down is not None:
            # a server restarted at its address is back within ZeroMQ's reconnect interval
            # (0.1 s) of listening; one that stays down fails the request after this grace
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up.wait(), RECONNECT_GRACE)
            if self._down is not None:
                raise self._down
        rid = next(self._ids)
        msg.rid = rid
        fut: asyncio.Future[tuple[Message, list[Any]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        limit = self.timeout if timeout is None else timeout
        try:
            # tiny messages are cheaper copied than wrapped as zero-copy frames; a socket with
            # no connection to queue on (one the server refused) fails at once, never blocks
            self._socket.send(encode(msg, buffers), copy=not buffers, flags=NOBLOCK, on_error=functools.partial(_fail, fut))
            if buffers and self._interval:  # the server hears nothing behind them until they are in
                self._heard = max(self._heard, self._loop.time() + transit(buffers))
            if limit == math.inf:
                reply, frames = await fut
            else:
                reply, frames = await asyncio.wait_for(fut, limit)
        except UnavailableError as exc:
            if not isinstance(exc.__cause__, zmq.Again):
                raise
            self._pending.pop(rid, None)
            fut.cancel()  # (a send that failed at once left it pending) nobody awaits it now
            if self._watch is not None:  # the handshake's verdict may be on its way
                await self._watch.judged(VERDICT_GRACE)
            if self._refused is not None:
                raise self._refused from None
            raise self._unavailable(
                f"{self.name} at {self.address} has no connection to take {type(msg).__name__}: it "
                "refused this client's handshake (CurveZMQ keys?) or cannot be reached"
            ) from None
        except asyncio.TimeoutError:
            self._withdraw(rid)
            raise self._unavailable(
                f"{self.name} at {self.address} did not answer {type(msg).__name__} "
                f"within {limit:.1f} s"
            ) from None
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():
                self._withdraw(rid)
            raise
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, Error):
            raise from_code(reply.code, reply.message)
        return expected(reply, expect, peer=self.name, request=msg), frames

    def _withdraw(self, rid: int) -> None:
        """Tell the server that nobody waits for request ``rid`` any more (no reply comes)."""
        if self.closed:
            return
        try:
            self._socket.send(encode(Cancel(of=rid)), copy=True, flags=NOBLOCK)
        except UnavailableError as exc:  # fire and forget: the caller already has its error
            log.debug("%s", exc)

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        self._heard = max(self._heard, self._loop.time())
        try:
            with self._decoding:
                msg, buffers = decode(frames)
        except ProtocolError as exc:
            # its caller learns now, not at its timeout, where the request id can be read
            fut = self._pending.get(salvage_rid(frames) or tail_rid(frames))
            if fut is not None and not fut.done():
                fut.set_exception(_malformed(f"{self.name} at {self.address}", exc))
            else:
                log.warning("dropping malformed reply from %s: %s", self.address, exc)
            return
        fut = self._pending.get(msg.rid)
        if isinstance(msg, Notice):  # word on a parked request, not its answer
            if fut is not None and not fut.done():
                log.warning("%s at %s: %s", self.name, self.address, msg.text)
            return
        if fut is not None and not fut.done():
            fut.set_result((msg, buffers))

    async def close(self, *, bye: bool = False) -> None:
        """Close the connection; ``bye``: first tell the server the session ends, so that
        what it holds for the session is freed now rather than after the liveness window."""
        if self.closed:
            return
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._watch is not None:
            self._watch.close()
        if bye:
            try:
                self._socket.send(_BYE, copy=True, flags=NOBLOCK)
            except UnavailableError as exc:
                log.debug("%s", exc)
        self._socket.close(linger=BYE_LINGER_MS if bye else 0)
        self._fail_pending(self._unavailable(f"connection to {self.name} closed"))


class BlockingPeer:
    """A DEALER connection to one server used from one thread, one request at a time.

    For a blocking client's small control calls: the caller's thread sends and waits on the
    socket itself, which saves the two thread hand-offs of going through an event loop
    (about 0.4 ms of a 0.8 ms ``get_meta`` on two cores). Not thread-safe: one per thread.
    ``restartable``: a connection closed while a request waits (the server died or
    restarted at its address) fails the request at once, as :class:`Peer` does.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str,
        unavailable: type[UnavailableError] = UnavailableError,
        routing_id: bytes | None = None,
        heartbeat: float = 0.0,
        curve: Curve | None = None,
        restartable: bool = False,
    ) -> None:
        self.address = address = endpoint(address)
        self.name = name
        self.heartbeat = heartbeat  # > 0: ping while waiting, give up after the window
        self._unavailable = unavailable
        where = f"{name} at {address}"
        self._io = Boundary(f"request to {where}", io_errors(unavailable))
        self._decoding = Boundary(f"reply from {where}", DECODE_ERRORS)
        self.sock = context().socket(zmq.DEALER)
        tune(self.sock)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve is not None:
            curve.connect(self.sock)
        self._mon: zmq.Socket | None = None
        if restartable:
            self._mon = self.sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED, f"inproc://tqueue-blocking-{os.getpid()}-{next(_monitors)}"
            )
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            self._poller.register(self._mon, zmq.POLLIN)
        self.sock.connect(address)
        self._ids = itertools.count(1)
        self.closed = False

    def _disconnected(self) -> bool:
        """Whether the connection closed since the last look (events read and forgotten)."""
        seen = False
        while self._mon is not None:
            try:
                self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seen = True  # the monitor hears only EVENT_DISCONNECTED
        return seen

    def request(self, msg: Message, *, expect: type[R], timeout: float) -> R:
        """Send ``msg`` and wait up to ``timeout`` seconds (``math.inf``: no limit) for its
        reply (replies to earlier requests that timed out are skipped); an ``Error`` reply is
        raised as its class, a malformed reply to this request as :class:`ProtocolError`. A
        request given up on before its answer came (a timeout, or any exception raised in the
        waiting thread: ``KeyboardInterrupt`` too) is withdrawn with a ``Cancel``, and the
        exception goes on. With a ``heartbeat``, the
        server is pinged after each interval of silence and the wait ends with the
        ``unavailable`` error once it has been silent for the liveness window."""
        if self.closed:
            raise self._unavailable(f"connection to {self.name} at {self.address} is closed")
        msg.rid = rid = next(self._ids)
        self._disconnected()  # a close before this request does not concern it
        try:
            # inside the try: a Ctrl-C just after the send (before the wait began) withdraws it
            # too (a Cancel of a request that never went is ignored by the server)
            with self._io:
                send_frames(self.sock, encode(msg), NOBLOCK)
            reply = self._wait(msg, rid, timeout)
        except BaseException:  # no answer: a timeout, a silent server, an interrupt (Ctrl-C)...
            self._withdraw(rid)
            raise
        if isinstance(reply, Error):
            raise from_code(reply.code, reply.message)
        return expected(reply, expect, peer=self.name, request=msg)

    def _withdraw(self, rid: int) -> None:
        """Tell the server that nobody waits for request ``rid`` any more (no reply comes)."""
        if self.closed:
            return
        try:
            with self._io:
                send_frames(self.sock, encode(Cancel(of=rid)), NOBLOCK)
        except UnavailableError as exc:  # fire and forget: the caller's own error goes on
            log.debug("%s", exc)

    def _wait(self, msg: Message, rid: int, timeout: float) -> Message:
        """The reply to request ``msg`` (id ``rid``), as it came."""
        with self._io:
            deadline = time.monotonic() + timeout
            heard = time.monotonic()
            while True:
                now = time.monotonic()
                left = deadline - now
                if self.heartbeat:
                    silent = now - heard
                    if silent >= window(self.heartbeat):
                        raise self._unavailable(
                            f"{self.name} at {self.address} has not been heard from for {silent:.1f} s "
                            f"(heartbeat every {self.heartbeat:g} s) while waiting for its answer to "
                            f"{type(msg).__name__}: it is gone or unreachable"
                        )
                    if silent >= self.heartbeat:
                        send_frames(self.sock, _PING, NOBLOCK)  # each poll lasts an interval at most
                    left = min(left, self.heartbeat)
                if now >= deadline:
                    raise self._unavailable(
                        f"{self.name} at {self.address} did not answer {type(msg).__name__} "
                        f"within {timeout:.1f} s"
                    )
                wait_ms = -1 if left == math.inf else max(1, int(left * 1000))
                if self._mon is not None:
                    ready = dict(self._poller.poll(wait_ms))
                    if self._mon in ready and self._disconnected():
                        raise self._unavailable(
                            f"{self.name} at {self.address} closed the connection (it died or restarted): "
                            f"the {type(msg).__name__} request in flight on it is lost"
                        )
                    if self.sock not in ready:
                        continue
                elif not self.sock.poll(wait_ms):
                    continue
                frames = recv_frames(self.sock)
                heard = time.monotonic()
                try:
                    with self._decoding:
                        reply, _ = decode(frames)
                except ProtocolError as exc:
                    if (salvage_rid(frames) or tail_rid(frames)) == rid:
                        raise _malformed(f"{self.name} at {self.address}", exc) from exc
                    log.warning("dropping malformed reply from %s: %s", self.address, exc)
                    continue
                if reply.rid != rid:
                    continue  # a Pong, or a late answer to a request that timed out
                if isinstance(reply, Notice):
                    log.warning("%s at %s, on %s: %s", self.name, self.address, type(msg).__name__, reply.text)
                    continue  # word on the wait, not its answer
                return reply

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._mon is not None:
                self.sock.disable_monitor()
                self._mon.close(linger=0)
            self.sock.close(linger=0)



def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """A request whose send failed after its call returned (it was sent from a drain)."""
    if not fut.done():
        fut.set_exception(exc)

