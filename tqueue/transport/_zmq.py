"""ZeroMQ plumbing shared by every component: one context, a request/reply peer, a server loop.

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
import inspect
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import zmq

from ..errors import PermissionDeniedError, ProtocolError, TQueueError, UnavailableError, from_code
from ..wire import Bye, Cancel, Error, Kind, Message, Notice, Ping, Pong, decode, encode, error_reply, salvage_rid
from . import _auth
from ._auth import Curve
from ._boundary import DECODE_ERRORS, Boundary, io_errors
from ._connect import ConnectWatch, endpoint
from ._liveness import HEARTBEAT_INTERVAL, Sessions, session_of, transit, window
from ._loop import LoopSocket
from ._metrics import Latency
from ._queues import MAX_QUEUED_BYTES, MAX_QUEUED_BYTES_TOTAL, SendQueues
from ._sockets import NOBLOCK, bind, context, recv_frames, send_frames, tune

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


_CANCEL_KIND = bytes([Kind.CANCEL])
_PING = encode(Ping())
RECONNECT_GRACE = 0.3  # seconds a request to a server whose reconnects were refused waits for one that succeeds
VERDICT_GRACE = 1.0  # seconds a request that found no connection waits for the handshake's verdict (a refusal names its cause)
_monitors = itertools.count()  # names of blocking peers' monitor sockets
BYE_LINGER_MS = 500  # a closing peer's Bye may still leave this long after the close
_BYE = encode(Bye())
MAX_FRAMES = 1 << 16  # frames per request a server accepts by default
MAX_QUEUED_REPLIES = 10_000  # replies a server queues for one peer (its send high-water mark)
MAX_IN_FLIGHT = 1_024  # requests of one peer whose handlers wait at once (on another server)
_PING_KIND = bytes([Kind.PING])
MAX_QUEUED_REQUESTS = 1_000  # requests of one peer a server holds unread (its receive high-water mark)
STALL_GRACE = 1.0  # seconds a peer holding replies of a cleared partition may take none of their bytes
MAX_CONNECTIONS = 1 << 16  # connections whose descriptor a server remembers (to cut one off); then the oldest go


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


Handler = Callable[[bytes, Any, list[Any]], Any]


class Server:
    """A ROUTER socket and the dispatch of its requests to typed handlers.

    A handler gets ``(identity, message, buffers)`` and returns a reply message, a
    ``(reply, buffers)`` pair, ``None`` (it will answer later with :meth:`reply`), or an
    awaitable of one of those. Whatever it raises becomes an error reply; serving goes on.

    A ``Cancel`` is never answered: it goes to its handler where one is routed (whatever that
    returns or raises is dropped) and is dropped otherwise. ``Ping`` and ``Bye`` are the
    server's own: every message is a sign of life of its sender's session, and
    :attr:`sessions` says when a session ended (see :mod:`._liveness`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        name: str,
        max_header: int,
        max_frames: int = MAX_FRAMES,
        max_frame_bytes: int = -1,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        max_queued_bytes_total: int = MAX_QUEUED_BYTES_TOTAL,
        max_queued_replies: int = MAX_QUEUED_REPLIES,
        heartbeat: float = HEARTBEAT_INTERVAL,
        curve: Curve | None = None,
        advertise: str = "",
    ) -> None:
        self.queues = SendQueues(name, max_queued_bytes, max_queued_bytes_total)
        self.sessions = Sessions(heartbeat, name=name, drain=self.drain)
        self.latency = Latency()  # per message kind, for the metrics endpoint
        self.name = name
        self.max_header = max_header
        self.max_frames = max_frames
        self._decoding = Boundary(f"{name}: malformed request", DECODE_ERRORS)
        self._socket = LoopSocket(
            zmq.ROUTER,
            self._on_request,
            sending=Boundary(f"{name}: reply", io_errors(UnavailableError)),
            on_arrival=self._on_arrival,
        )
        # ZeroMQ drops the connection of a peer whose frame exceeds this before it is received
        self._socket.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        # a reply to a peer that is gone, or whose queue is full, fails the send (counted,
        # logged) instead of vanishing; the queue of one peer that does not read is bounded
        self._socket.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.sock.setsockopt(zmq.SNDHWM, max_queued_replies)
        # a peer that sends faster than it is served is read no further (TCP pushes back on
        # it) once this many of its requests wait: what it sent is held at most this often
        self._socket.sock.setsockopt(zmq.RCVHWM, MAX_QUEUED_REQUESTS)
        self.curve = curve
        if curve is not None:
            curve.serve(self._socket.sock)
        self.address = bind(self._socket.sock, endpoint, advertise)
        self._bound = self._socket.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # the descriptor each connection's last message came from: ZeroMQ lets go of what it
        # queued for a peer only once its connection closes, so a stalled one is cut off there
        self._fds: dict[bytes, int] = {}
        self._cuttable = self._bound.startswith(("tcp://", "ipc://"))  # connections with a descriptor
        self.sessions.on_gone(self._session_gone)
        self._handlers: dict[type, Handler] = {}
        self._roles: dict[type, str] = {}
        # the principal (see _auth) of the message being handled; "" with auth off
        self.principal = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._in_flight: dict[bytes, int] = {}  # requests of each peer whose handler waits
        # told of each reply that could not be sent, to take back what it gave (a lease, a grant)
        self.on_undelivered: Callable[[bytes, Message], None] | None = None
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def name(self) -> str:
        return self.queues.name

    @name.setter
    def name(self, name: str) -> None:  # a unit is named once it has registered
        self.queues.name = name

    def route(self, msg_type: type[Message], handler: Handler, *, role: str = "") -> None:
        """Send messages of ``msg_type`` to ``handler``; with auth on and a ``role``, only
        from peers of that principal (others get PermissionDeniedError)."""
        self._handlers[msg_type] = handler
        if role:
            self._roles[msg_type] = role

    def drain(self) -> None:
        """Handle every request that has arrived, now (before judging who is silent)."""
        if not self._socket.closed:
            self._socket.drain()

    def reply(self, ident: bytes, rid: int, msg: Message, buffers: Sequence[Any] = (), tag: int = 0) -> None:
        """Send a reply; one that cannot be sent (the socket closed) is logged: the handler
        that answers has no caller to tell, and the requester times out. ``tag``: what its
        buffers belong to (a partition uid), for :meth:`free_stalled`."""
        if self._socket.closed:
            return
        msg.rid = rid
        if buffers:
            refusal = self.queues.admit(ident, buffers)
            if refusal is not None:
                msg, buffers = error_reply(rid, refusal), ()
            else:
                buffers = self.queues.track(ident, buffers, tag)
        frames = [ident, *encode(msg, buffers)]
        try:
            # sent now, or (answering from a drain) at the drain's end, failing to _not_sent
            self._socket.send(frames, copy=not buffers, flags=NOBLOCK, on_error=functools.partial(self._not_sent, ident, msg))
        except UnavailableError as exc:
            self._not_sent(ident, msg, exc)

    def _not_sent(self, ident: bytes, msg: Message, exc: BaseException) -> None:
        """A reply that could not be sent (its peer vanished, or its queue is full)."""
        if not isinstance(exc, UnavailableError):
            raise exc
        self.queues.undelivered(ident, exc)
        if self.on_undelivered is not None:
            try:
                self.on_undelivered(ident, msg)
            except Exception:  # the reply is lost either way; the server goes on
                log.exception("%s: taking back an undelivered %s failed", self.name, type(msg).__name__)

    def free_stalled(self, tag: int, grace: float = STALL_GRACE) -> None:
        """The bytes of ``tag`` (a partition just cleared) must go: a peer that still has
        replies of it queued and takes none of their bytes for ``grace`` seconds is cut off
        (its connection closed: ZeroMQ then drops what it queued for it, and the peer's
        requests in flight fail at once; it reconnects by itself); one that takes some is
        looked at again after another ``grace``."""
        held = self.queues.holding(tag)
        if held:
            asyncio.get_running_loop().call_later(grace, self._stalled, tag, held, grace)

    def _stalled(self, tag: int, before: dict[bytes, int], grace: float) -> None:
        if self._socket.closed:
            return
        again = {}
        for ident, sent in self.queues.holding(tag).items():
            if ident in before and sent == before[ident]:
                self.cut_off(ident, f"it took none of its replies of a cleared partition for {grace:g} s")
            else:
                again[ident] = sent
        if again:
            asyncio.get_running_loop().call_later(grace, self._stalled, tag, again, grace)

    def _session_gone(self, session: bytes) -> None:
        """A session that ended (silent, or said Bye): what is queued for its connections goes."""
        for ident in [i for i in self._fds if session_of(i) == session]:
            if self.queues.queued(ident):
                self.cut_off(ident, "its session is gone")
            self._fds.pop(ident, None)

    def cut_off(self, ident: bytes, why: str) -> bool:
        """Close connection ``ident`` from this side (False: its descriptor is unknown, or no
        longer one of this server's connections)."""
        fd = self._fds.get(ident, -1)
        if fd < 0:
            return False
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False  # closed since
        with sock:
            try:
                if not _accepted_by(sock, self._bound):
                    return False  # the number was reused for another descriptor
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
        self.queues.log_once(ident, "was cut off, %d reply bytes queued for it freed: %s", self.queues.queued(ident), why)
        return True

    def reply_error(self, ident: bytes, rid: int, exc: BaseException) -> None:
        if not isinstance(exc, TQueueError):
            log.error("%s failed on a request", self.name, exc_info=exc)
        self.reply(ident, rid, error_reply(rid, exc))

    async def serve(self) -> None:
        """Requests are served from the loop as they arrive; this waits until ``close``."""
        await self._stopped

    def serve_first(self, ident: bytes, first: bool = True) -> None:
        """Handle what connection ``ident`` sends before the other connections' messages, at
        the start of each turn (``first=False``: in turn again)."""
        if first:
            self._socket.first.add(ident)
        else:
            self._socket.first.discard(ident)

    def _on_arrival(self, ident: bytes, frames: list[zmq.Frame]) -> bool:
        """Every message counts for its sender's session as it arrives (then, not when it is
        handled); a ``Ping`` is answered at once (True: nothing more to do), ahead of the
        requests queued before it."""
        self.sessions.seen(ident)
        if self._cuttable:
            fds = self._fds
            if ident not in fds and len(fds) >= MAX_CONNECTIONS:
                del fds[next(iter(fds))]
            fds[ident] = frames[0].get(zmq.SRCFD)
        if len(frames) == 3 and frames[1].bytes == _PING_KIND:
            self._on_request(frames)
            return True
        return False

    def _on_request(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        body = frames[1:]
        if self.curve is not None and body:
            self.principal = str(body[0].get("User-Id") or "")
        try:
            if len(body) > self.max_frames:
                raise ProtocolError(f"a message of {len(body)} frames; at most {self.max_frames} are accepted")
            with self._decoding:
                msg, buffers = decode(body, max_header=self.max_header)
        except TQueueError as exc:
            # the sender gets its error; the log gets one line per peer, not one per frame
            self.queues.malformed += 1
            self.queues.log_once(ident, "sent a malformed request (%d so far): %s", self.queues.malformed, exc)
            if bytes(body[0].buffer if body else b"") != _CANCEL_KIND:
                self.reply_error(ident, salvage_rid(body) or tail_rid(body), exc)
            return
        if isinstance(msg, Ping):
            self.reply(ident, msg.rid, Pong())
            return
        if isinstance(msg, Bye):
            self.sessions.bye(ident)
            return
        handler = self._handlers.get(type(msg))
        if isinstance(msg, Cancel):
            self._cancel(handler, ident, msg)
            return
        try:
            if handler is None:
                raise ProtocolError(f"{self.name} does not handle {type(msg).__name__} messages")
            role = self._roles.get(type(msg))
            if role and self.curve is not None and self.principal != role:
                raise PermissionDeniedError(
                    f"{self.name}: {type(msg).__name__} is for the {role} key only; this peer is "
                    f"{self.principal or 'unknown'}"
                )
            if self._in_flight.get(ident, 0) >= MAX_IN_FLIGHT:
                raise UnavailableError(
                    f"{self.name}: {MAX_IN_FLIGHT} requests of this connection are still in progress; "
                    "wait for their answers"
                )
            started = time.perf_counter()
            result = handler(ident, msg, buffers)
        except Exception as exc:  # every failure becomes a typed reply; serving goes on
            self.reply_error(ident, msg.rid, exc)
            return
        kind = type(msg).__name__
        if inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(self._finish(ident, msg.rid, result, kind, started))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self._in_flight[ident] = self._in_flight.get(ident, 0) + 1
        else:
            self.latency.observe(kind, time.perf_counter() - started)
            self._send_result(ident, msg.rid, result)

    def _cancel(self, handler: Handler | None, ident: bytes, msg: Cancel) -> None:
        """A requester gave up on request ``msg.of``: withdraw it, and answer nothing."""
        if handler is None:
            return
        try:
            handler(ident, msg, [])
        except Exception:  # nobody to answer: a failed withdrawal is the server's to report
            log.exception("%s: withdrawing request %d failed", self.name, msg.of)

    async def _finish(self, ident: bytes, rid: int, pending: Awaitable[Any], kind: str, started: float) -> None:
        try:
            result = await pending
        except Exception as exc:  # as in _on_request: a typed reply, never a dead server
            self.reply_error(ident, rid, exc)
            return
        finally:
            left = self._in_flight.pop(ident, 1) - 1
            if left:
                self._in_flight[ident] = left
        self.latency.observe(kind, time.perf_counter() - started)
        self._send_result(ident, rid, result)

    def _send_result(self, ident: bytes, rid: int, result: Any) -> None:
        if result is None:
            return
        if isinstance(result, tuple):  # (reply, buffers) or (reply, buffers, tag)
            self.reply(ident, rid, *result)
        else:
            self.reply(ident, rid, result)

    async def close(self) -> None:
        self.sessions.close()
        for task in list(self._tasks):
            task.cancel()
        self._socket.close()
        if self.curve is not None:
            self.curve = None
            _auth.release()
        if not self._stopped.done():
            self._stopped.set_result(None)


def _accepted_by(sock: socket.socket, bound: str) -> bool:
    """Whether ``sock`` is a connection accepted at endpoint ``bound`` (``tcp://host:port``,
    ``ipc://path``)."""
    if sock.type != socket.SOCK_STREAM:
        return False
    here = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return bound == f"ipc://{here}"
    return isinstance(here, tuple) and bound.rpartition(":")[2] == str(here[1])


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """A request whose send failed after its call returned (it was sent from a drain)."""
    if not fut.done():
        fut.set_exception(exc)

