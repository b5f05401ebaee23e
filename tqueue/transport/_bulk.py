"""Bulk streams: payload over plain TCP streams beside the ZeroMQ sockets.

ZeroMQ hands every received frame over in a buffer it allocated, so a consumer that gets
a field in 1 MiB frames must copy each one into the batch tensor (about 35 ms for 136 MB
here: as long as half the fetch itself). Over a plain stream socket the receiver chooses
where the bytes land: ``recv_into`` the rows of the batch tensor they belong to, leaving no
assembly copy.

The control stays on ZeroMQ. A client opens streams to a unit (more when it moves bytes to or
from one unit concurrently, or over parallel lanes), says which token each is, and waits for
the unit's ``K``. A ``Fetch`` names a token; the unit answers on ZeroMQ with the blocks (the
sizes of every frame) and ``bulk`` = the bytes that follow, then writes the frames on that
stream in order. A ``Store`` names lanes ``[token, frames]``; the client writes the frames on
them while the unit reads. A stream carries one operation at a time; whoever gives up on one
mid-way closes the stream, so bytes are never read out of step.

Each stream has a writer thread on the unit (sends release the GIL); reads, on both sides,
run in worker threads with ``MSG_WAITALL``: one system call per destination. One more thread
watches every stream for its peer hanging up, so that a closed or killed client's streams
(socket and thread) are reclaimed at once; the streams a unit holds are capped in all and
per peer address, and one beyond a cap is refused at its hello with the reason. A peer that
stops reading (or writing), or trickles, is cut off at its :class:`Pace`; until then the
bytes queued for it are counted (:attr:`BulkServer.held_bytes`): they keep their payload in
memory even after its partition was cleared.

Some frames pass through a per-thread scratch buffer of about a MiB, so that their bytes stay
in the core's cache: a :class:`Produced` frame is written into it as it is sent, a
:class:`Consumed` one read out of it as it arrives (packed integer fields, narrowed on the way
out and widened on the way in: tqueue/wire/_pack.py). These two protocols are all the streams
know of such frames. A produced frame that cannot be produced as promised raises
:class:`FrameRefused`; the stream is closed then, and its writer sends the data another way.

Socket failures become tqueue errors through :class:`~tqueue.transport._boundary.Boundary`:
a client's stream that breaks raises :class:`StorageUnitUnavailableError` naming the unit and
the operation, a unit's stream that breaks under a put :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from .. import _threads
from ..errors import ProtocolError, StorageUnitUnavailableError, UnavailableError
from ._boundary import Boundary, ErrorMap, io_errors

log = logging.getLogger(__name__)
T = TypeVar("T")

_HELLO = struct.Struct("<4sQ")  # magic, token
_MAGIC = b"TQB1"
_OK = b"K"
_IOV = 512  # buffers per sendmsg (Linux allows 1024)
HELLO_TIMEOUT = 10.0  # seconds a new stream may take to say its token before it is dropped
STALL = 30.0  # seconds a unit's transfer may move no byte before it is cut off (StorageConfig.bulk_stall_timeout)
MIN_RATE = 1 << 20  # bytes a second a unit's transfer must average (StorageConfig.bulk_min_rate)
MIN_BYTES = 256 << 10  # smaller replies go inline on ZeroMQ: a second socket would not pay
LOOPBACK_SNDBUF = 256 << 10
IO_THREADS = 32
MAX_STREAMS = 512  # streams a unit holds at once by default (StorageConfig.bulk_streams)
MAX_STREAMS_PER_PEER = 128  # from one peer address (StorageConfig.bulk_streams_per_peer)
MAX_QUEUED = 1 << 30  # bytes a stream may queue behind the reply it sends (StorageConfig.max_queued_bytes)
_REASON = 200  # bytes of a refusal's reason
_CLIENT_IO = io_errors(StorageUnitUnavailableError)
_UNIT_IO: ErrorMap = {OSError: ProtocolError}  # a writer that breaks off its put: the put is refused


class Produced(Protocol):
    """A frame produced into a scratch buffer as it is sent: ``nbytes`` go on the stream,
    ``cost`` is what sending them costs in bytes sent as they are (lanes are balanced by it),
    and ``produce(scratch)`` writes the frame into ``scratch`` (``nbytes`` long), false where
    it cannot (then :class:`FrameRefused` is raised and the stream closed)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def cost(self) -> int: ...

    def produce(self, scratch: np.ndarray) -> bool: ...


class Consumed(Protocol):
    """A frame consumed from a scratch buffer as it arrives: ``nbytes`` come off the stream
    into ``scratch``, then ``consume(scratch)`` takes them where they belong."""

    @property
    def nbytes(self) -> int: ...

    def consume(self, scratch: np.ndarray) -> None: ...


class FrameRefused(Exception):
    """A :class:`Produced` frame could not be produced (a value of a field narrowed on the
    way does not fit the narrow type). The stream was closed, as its reader is left mid-write;
    the writer sends the data again another way."""


def run_blocking(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run a blocking stream operation in this process's bulk I/O threads.

    Not asyncio's default executor (a handful of threads): a read that waits for its writer
    must never queue behind reads whose writers wait in turn, so there are threads enough for
    every stream that can be busy at once."""
    return asyncio.get_running_loop().run_in_executor(_threads.pool("bulk-io", IO_THREADS), fn, *args)


def _stream_opts(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _writer_opts(sock: socket.socket) -> None:
    """On loopback, a small send buffer keeps the bytes in flight within the CPU caches:
    the reader copies them out while they are still there (3.4 against 2.9 GB/s measured
    here). Between hosts the kernel's autotuning stays, as the window must cover the link."""
    _stream_opts(sock)
    try:
        peer = ipaddress.ip_address(sock.getpeername()[0])
    except (OSError, ValueError):
        return
    if peer.is_loopback:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOOPBACK_SNDBUF)


class Pace:
    """The time a unit gives one transfer of ``nbytes`` on a stream: it is cut off
    (:class:`TimeoutError`) once no byte has moved for ``stall`` seconds, and once
    ``stall + nbytes / min_rate`` seconds have passed since it began, so a peer that trickles
    holds it no longer than one that stopped. ``stall`` or ``min_rate`` 0: no such bound."""

    def __init__(self, nbytes: int, stall: float, min_rate: int) -> None:
        now = time.monotonic()
        self.nbytes = nbytes
        self.stall = stall if stall > 0 else math.inf
        self.began = self.moved = now
        self.deadline = now + (stall if stall > 0 else 0.0) + nbytes / min_rate if min_rate > 0 else math.inf
        self.done = 0  # bytes moved
        self._timeout = -1.0  # the socket's timeouts as last set

    def next_call(self, sock: socket.socket) -> None:
        """Bound the next send or receive on ``sock``; TimeoutError once time is up."""
        now = time.monotonic()
        left = min(self.deadline - now, self.moved + self.stall - now)
        if left <= 0:
            why = f"no byte for {self.stall:g} s" if self.moved + self.stall <= now else "past its deadline"
            raise TimeoutError(
                f"{self.done} of {self.nbytes} bytes moved in {now - self.began:.1f} s, {why} "
                "(StorageConfig.bulk_stall_timeout, bulk_min_rate)"
            )
        # A call that times out after moving some bytes returns them, and the stall is timed
        # from its return: calls of a quarter of the stall keep that within 25% of the bound.
        timeout = min(left, self.stall / 4)
        if timeout != self._timeout:  # most calls: a quarter of the stall, set once
            _kernel_timeouts(sock, timeout)
            self._timeout = timeout

    def moved_bytes(self, n: int) -> None:
        if n > 0:
            self.done += n
            self.moved = time.monotonic()


class BulkServer:
    """A unit's listening stream socket, its accepted streams and their writer threads;
    UnavailableError where it cannot listen on ``host``.

    Every stream is reclaimed as soon as its peer goes: one thread watches all of them for
    a hang-up (epoll ``EPOLLRDHUP``: the peer closed or died, even with bytes unread), and
    the stream's writer thread then closes it. At most ``max_streams`` streams (greeting
    or open) exist at once, ``max_per_peer`` from one peer address; one beyond either is
    refused at its hello with ``R`` and the reason (the client sends over ZeroMQ instead).

    A stream sends one reply after the other; one that would queue more than ``max_queued``
    bytes behind the reply under way is refused (:meth:`send` is false: its caller answers
    another way). Every transfer, either way, runs at a :class:`Pace` of ``stall`` and
    ``min_rate``; one cut off closes its stream. ``on_sent`` is called (from a writer thread)
    each time a queued send has let go of its buffers, sent or not.
    """

    def __init__(
        self,
        host: str,
        *,
        name: str = "storage unit",
        max_streams: int = MAX_STREAMS,
        max_per_peer: int = MAX_STREAMS_PER_PEER,
        max_queued: int = MAX_QUEUED,
        stall: float = STALL,
        min_rate: int = MIN_RATE,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.max_streams = max_streams
        self.max_per_peer = max_per_peer
        self.max_queued = max_queued
        self.stall = stall
        self.min_rate = min_rate
        self._on_sent = on_sent
        self._held = 0  # bytes of sends queued or under way (see held_bytes)
        with Boundary(f"{name}: cannot listen for bulk streams on {host}", io_errors(UnavailableError)):
            self._listener = socket.create_server((host, 0), backlog=64)
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        self._streams: dict[int, _Writer] = {}
        self._peers: dict[str, int] = {}  # streams greeting or open, by peer address
        self._lock = threading.Lock()
        self._closed = False
        self._watch = _HangupWatch()
        self._accepting = threading.Thread(target=self._accept, name="tqueue-bulk-accept", daemon=True)
        self._accepting.start()

    @property
    def open_streams(self) -> int:
        with self._lock:
            return sum(self._peers.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of sends queued or under way: their buffers stay in memory until their
        reader has taken them or is cut off, even where their partition was cleared."""
        with self._lock:
            return self._held

    def send(self, token: int, frames: Sequence[Any]) -> bool:
        """Queue ``frames`` for the stream of ``token``; False if there is no such stream, or
        it has more than ``max_queued`` bytes to send before them (nothing is queued then)."""
        with self._lock:
            writer = self._streams.get(token)
        if writer is None:
            return False
        return writer.queue([memoryview(f).cast("B") for f in frames], self.max_queued)

    def read(self, token: int, targets: Sequence[memoryview]) -> None:
        """Fill ``targets`` in order from the stream of ``token`` (a writer's put), at this
        server's :class:`Pace`; blocking, for a worker thread. A stream that fails, is cut off
        or is unknown is closed; raises ProtocolError."""
        with self._lock:
            writer = self._streams.get(token)
        if writer is None or writer.dead:
            raise ProtocolError(f"no bulk stream with token {token} (closed, or never opened)")
        pace = Pace(sum(t.nbytes for t in targets), self.stall, self.min_rate)
        with writer.reading:
            read_into(writer.sock, targets, 0.0, pace=pace)

    def _account(self, nbytes: int) -> None:
        """Count bytes of sends queued (+) or let go of (-); from any thread."""
        with self._lock:
            self._held += nbytes
        if nbytes < 0 and self._on_sent is not None:
            self._on_sent()

    def drop(self, token: int) -> None:
        """Close a stream whose bytes are out of step (a put that was refused unread)."""
        with self._lock:
            writer = self._streams.get(token)
        if writer is not None:
            writer.stop()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            writers, self._streams = list(self._streams.values()), {}
        for w in writers:
            w.stop()
        self._accepting.join(timeout=5)
        self._watch.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            refused = self._admit(addr[0])
            if refused:
                _refuse(sock, refused)
                log.info("%s: refused a bulk stream from %s: %s", self.name, addr[0], refused)
                continue
            threading.Thread(
                target=self._handshake, args=(sock, addr[0]), name="tqueue-bulk-hello", daemon=True
            ).start()

    def _admit(self, peer: str) -> str:
        """Count a new stream from ``peer``; the reason it is refused, or ``""``."""
        with self._lock:
            if sum(self._peers.values()) >= self.max_streams:
                return f"{self.max_streams} bulk streams are open (StorageConfig.bulk_streams)"
            if self._peers.get(peer, 0) >= self.max_per_peer:
                return f"{self.max_per_peer} bulk streams from {peer} are open (StorageConfig.bulk_streams_per_peer)"
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return ""

    def _release(self, peer: str) -> None:
        with self._lock:
            left = self._peers.get(peer, 0) - 1
            if left > 0:
                self._peers[peer] = left
            else:
                self._peers.pop(peer, None)

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            with Boundary(f"{self.name}: bulk stream hello", _UNIT_IO):
                self._greet(sock, peer)
        except ProtocolError as exc:  # an accept thread has no caller: the peer sees the close
            log.info("%s: refused a bulk stream: %s", self.name, exc)
            sock.close()
            self._release(peer)

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """Read the hello, register the stream under its token and answer ``K``."""
        sock.settimeout(HELLO_TIMEOUT)
        hello = sock.recv(_HELLO.size, socket.MSG_WAITALL)
        if len(hello) != _HELLO.size or hello[:4] != _MAGIC:
            raise ProtocolError(f"not a tqueue bulk stream hello: {hello[:16]!r}")
        (_, token) = _HELLO.unpack(hello)
        sock.settimeout(None)  # each transfer sets its own timeouts (its Pace)
        _writer_opts(sock)
        writer = _Writer(sock, token, peer, self)
        with self._lock:
            if self._closed or token in self._streams:
                raise ProtocolError(f"bulk stream token {token} is already in use")
            self._streams[token] = writer
        try:
            sock.sendall(_OK)
        except OSError:
            with self._lock:
                del self._streams[token]
            raise
        self._watch.add(writer)
        writer.start()

    def _forget(self, writer: _Writer) -> None:
        """A writer's last act, before it closes its socket."""
        self._watch.remove(writer)
        with self._lock:
            if self._streams.get(writer.token) is writer:
                del self._streams[writer.token]
        self._release(writer.peer)


def _refuse(sock: socket.socket, reason: str) -> None:
    """Answer a hello that will not be served: ``R`` and the reason, then close (never
    blocks: a peer that does not read loses the reason, not the unit its accept thread)."""
    try:
        sock.send(b"R" + reason.encode()[:_REASON], socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()


class _HangupWatch:
    """One thread that notices, for every open stream, its peer hanging up (closed, reset
    or killed) and stops that stream's writer, which then closes it: a stream never
    outlives its peer, whether or not it is in use. ``EPOLLRDHUP`` only: bytes arriving
    (a put) never wake it."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._writers: dict[int, _Writer] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tqueue-bulk-watch", daemon=True)
        self._thread.start()

    def add(self, writer: _Writer) -> None:
        with self._lock:
            self._writers[writer.fd] = writer
            self._epoll.register(writer.fd, select.EPOLLRDHUP)

    def remove(self, writer: _Writer) -> None:
        with self._lock:
            if self._writers.get(writer.fd) is writer:
                del self._writers[writer.fd]
                try:
                    self._epoll.unregister(writer.fd)
                except (OSError, ValueError):
                    pass  # the epoll is closed

    def _run(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except (OSError, ValueError):
                return  # closed
            for fd, _ in events:
                if fd == self._wake:
                    return
                with self._lock:
                    writer = self._writers.pop(fd, None)
                    if writer is not None:
                        self._epoll.unregister(fd)  # level-triggered: once is enough
                if writer is not None:
                    log.debug("bulk stream %d: its peer hung up", writer.token)
                    writer.hangup()

    def close(self) -> None:
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=5)
        with self._lock:
            self._epoll.close()
        os.close(self._wake)


class _Writer:
    """One stream's writer thread: sends queued frame lists in order, each at the server's
    :class:`Pace`; closes the stream. The bytes queued are counted on the server from when a
    list is queued until the thread has let go of it."""

    def __init__(self, sock: socket.socket, token: int, peer: str, server: BulkServer) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.token = token
        self.peer = peer
        self.jobs: queue.SimpleQueue[tuple[list[memoryview], int] | None] = queue.SimpleQueue()  # (buffers, bytes)
        self.dead = False
        self._server = server
        self._sending = 0  # bytes of the list being sent
        self._pending = 0  # bytes of the lists queued or being sent
        self._lock = threading.Lock()  # queue() against the drain when the thread ends
        self.reading = Boundary(f"bulk stream {token} broke while a put was read", _UNIT_IO, on_error=self.stop)
        self._thread = threading.Thread(target=self._run, name="tqueue-bulk-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def queue(self, job: list[memoryview], limit: int) -> bool:
        """Queue a send; False if the stream is closing or has sends under way that ``job``
        would take past ``limit`` bytes (nothing was queued then)."""
        nbytes = sum(v.nbytes for v in job)
        with self._lock:
            if self.dead or (self._pending and self._pending + nbytes > limit):
                return False
            self._pending += nbytes
            self._server._account(nbytes)
            self.jobs.put((job, nbytes))
        return True

    def hangup(self) -> None:
        """The peer is gone: end the thread, which closes the stream (a blocked send or
        read fails on its own, the peer having reset or closed)."""
        with self._lock:
            self.dead = True
        self.jobs.put(None)

    def stop(self) -> None:
        self.hangup()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _run(self) -> None:
        server = self._server
        try:
            while (nbytes := self._send_next()) >= 0:
                with self._lock:
                    self._pending -= nbytes
                server._account(-nbytes)  # its buffers are let go of: say so
        except TimeoutError as exc:
            log.warning("%s: bulk stream %d from %s: its reader is cut off: %s", server.name, self.token, self.peer, exc)
        except OSError as exc:
            log.info("bulk stream %d closed by its reader: %s", self.token, exc)
        finally:
            with self._lock:
                self.dead = True
                self._pending = 0
            server._forget(self)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # a read of a put under way ends now
            except OSError:
                pass
            self.sock.close()
            # what failed to go, and what was queued behind it, is let go of and uncounted
            # (a send cut short sliced its buffers: the count queued is what comes off)
            left, self._sending = self._sending, 0
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    left += job[1]
                del job
            if left:
                server._account(-left)

    def _send_next(self) -> int:
        """Send the next queued list and return its bytes (-1: the stream ends). Its buffers
        are let go of when this returns or raises."""
        job = self.jobs.get()
        if job is None:
            return -1
        bufs, self._sending = job
        del job
        send_all(self.sock, bufs, pace=Pace(self._sending, self._server.stall, self._server.min_rate))
        nbytes, self._sending = self._sending, 0
        return nbytes


def send_all(sock: socket.socket, bufs: list[memoryview], *, pace: Pace | None = None) -> None:
    """Write every buffer, gathering up to ``_IOV`` per system call; with ``pace``, each call
    bounded by it (TimeoutError once its time is up)."""
    i = 0
    while i < len(bufs):
        batch = bufs[i : i + _IOV]
        if pace is not None:
            pace.next_call(sock)
            try:
                sent = sock.sendmsg(batch)
            except BlockingIOError:  # the call's timeout, nothing sent: the pace decides
                continue
            pace.moved_bytes(sent)
        else:
            sent = sock.sendmsg(batch)
        total = sum(b.nbytes for b in batch)
        if sent == total:
            i += len(batch)
            continue
        # a partial send: skip what went, retry the rest of the batch
        for b in batch:
            if sent >= b.nbytes:
                sent -= b.nbytes
                i += 1
                continue
            bufs[i] = b[sent:]
            break


_scratch = threading.local()


def send_frames(sock: socket.socket, frames: Sequence[Any]) -> None:
    """Write every frame: buffers as they are, gathered; each :class:`Produced` frame
    produced into this thread's scratch buffer (small enough to stay in the core's cache) and
    sent from it. The kernel has copied the bytes when ``sendmsg`` returns, so the scratch is
    free again. :class:`FrameRefused` where a frame cannot be produced."""
    run: list[memoryview] = []
    for f in frames:
        produce = getattr(f, "produce", None)  # the one lookup a plain buffer costs
        if produce is None:
            run.append(memoryview(f).cast("B"))
            continue
        if run:
            send_all(sock, run)
            run = []
        out = _scratch_of(f.nbytes)
        if not produce(out):
            raise FrameRefused(f"a frame of {f.nbytes} bytes could not be produced for the stream")
        send_all(sock, [memoryview(out)])
    if run:
        send_all(sock, run)


def _scratch_of(nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's scratch buffer (a frame: about a MiB, fits a core's cache)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def stall_limit(sock: socket.socket, timeout: float) -> None:
    """Fail a send or receive that makes no progress for ``timeout`` seconds.

    Kernel timeouts (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``) on a blocking socket, not Python's
    ``settimeout``: that one makes the socket non-blocking underneath, so ``MSG_WAITALL`` no
    longer waits and a large receive turns into one poll and one call per few hundred KiB."""
    sock.settimeout(None)
    _kernel_timeouts(sock, timeout)


def _kernel_timeouts(sock: socket.socket, timeout: float) -> None:
    sec = timeout if 0 < timeout < 1e9 else 0.0  # 0: no limit (an infinite timeout)
    sec = max(sec, 1e-3) if sec else 0.0  # a few microseconds must not read as none
    tv = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def read_into(
    sock: socket.socket, targets: Sequence[memoryview | Consumed], timeout: float, *, pace: Pace | None = None
) -> None:
    """Fill every target in order from ``sock``; OSError if it closes or stalls ``timeout``
    (with ``pace``: TimeoutError once its time is up instead). A :class:`Consumed` target is
    received into this thread's scratch buffer and consumed from there."""
    if pace is None:
        stall_limit(sock, timeout)
    for t in targets:
        consume = getattr(t, "consume", None)  # the one lookup a plain target costs
        if consume is None:
            _recv_exactly(sock, t, pace)  # type: ignore[arg-type]
        else:
            buf = _scratch_of(t.nbytes)
            _recv_exactly(sock, memoryview(buf), pace)
            consume(buf)


def _recv_exactly(sock: socket.socket, t: memoryview, pace: Pace | None) -> None:
    got, n = 0, t.nbytes
    while got < n:
        if pace is not None:
            pace.next_call(sock)
        try:
            r = sock.recv_into(t[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # the call's timeout, nothing received
            if pace is None:
                raise
            continue  # the pace decides
        if r == 0:
            raise OSError("the peer closed the stream")
        if pace is not None:
            pace.moved_bytes(r)
        got += r


class BulkStream:
    """A client's stream to one unit. Blocking; used from worker threads."""

    def __init__(self, address: str, timeout: float) -> None:
        host, _, port = address.rpartition(":")
        self.token = int.from_bytes(os.urandom(8), "little") | 1
        self.address = address
        self._reading = Boundary(f"bulk stream from {address} broke mid-fetch", _CLIENT_IO, on_error=self.close)
        self._writing = Boundary(f"bulk stream to {address} broke mid-put", _CLIENT_IO, on_error=self.close)
        with Boundary(f"cannot open a bulk stream to {address}", _CLIENT_IO, on_error=self.close):
            self.sock = sock = socket.create_connection((host, int(port)), timeout=timeout)
            _stream_opts(sock)
            sock.sendall(_HELLO.pack(_MAGIC, self.token))
            answer = sock.recv(1, socket.MSG_WAITALL)
            if answer == b"R":
                reason = sock.recv(_REASON).decode(errors="replace")
                raise ConnectionError(f"the unit refused the stream: {reason}")
            if answer != _OK:
                raise ConnectionError("the unit closed the stream during the hello")

    def read(self, targets: Sequence[memoryview | Consumed], timeout: float) -> None:
        """Fill every target in order; StorageUnitUnavailableError if the unit stops sending
        (the stream is closed then: bytes may be left unread)."""
        with self._reading:
            read_into(self.sock, targets, timeout)

    def write(self, frames: Sequence[Any], timeout: float) -> None:
        """Send ``frames`` back to back (a put's lane); StorageUnitUnavailableError if the unit
        stops reading. :class:`Produced` frames are produced on the way; where one cannot be,
        the stream is closed (its reader is left mid-write) and :class:`FrameRefused` raised."""
        with self._writing:
            stall_limit(self.sock, timeout)
            send_frames(self.sock, frames)

    def close(self) -> None:
        sock = getattr(self, "sock", None)  # None: the connect failed
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
