"""A ZeroMQ server loop: one ROUTER socket, each request dispatched to its handler and every
exception turned into a typed ``Error`` reply (the conventions are in :mod:`._zmq`, the peer's
side)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq

from ..errors import PermissionDeniedError, ProtocolError, TQueueError, UnavailableError
from ..wire import Bye, Cancel, Kind, Message, Ping, Pong, decode, encode, error_reply, salvage_rid
from . import _auth
from ._auth import Curve
from ._boundary import DECODE_ERRORS, Boundary, io_errors
from ._liveness import HEARTBEAT_INTERVAL, Sessions, session_of
from ._loop import LoopSocket
from ._metrics import Latency
from ._queues import MAX_QUEUED_BYTES, MAX_QUEUED_BYTES_TOTAL, SendQueues
from ._sockets import NOBLOCK, bind
from ._zmq import tail_rid

log = logging.getLogger(__name__)

Handler = Callable[[bytes, Any, list[Any]], Any]

_CANCEL_KIND = bytes([Kind.CANCEL])
MAX_FRAMES = 1 << 16  # frames per request a server accepts by default
MAX_QUEUED_REPLIES = 10_000  # replies a server queues for one peer (its send high-water mark)
MAX_IN_FLIGHT = 1_024  # requests of one peer whose handlers wait at once (on another server)
_PING_KIND = bytes([Kind.PING])
MAX_QUEUED_REQUESTS = 1_000  # requests of one peer a server holds unread (its receive high-water mark)
STALL_GRACE = 1.0  # seconds a peer holding replies of a cleared partition may take none of their bytes
MAX_CONNECTIONS = 1 << 16  # connections whose descriptor a server remembers (to cut one off); then the oldest go


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
