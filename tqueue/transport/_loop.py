"""A ZeroMQ socket driven by the running asyncio loop: how a peer or a server receives (the
loop's reader on ZeroMQ's edge-triggered descriptor), and how a server takes in what has
arrived before handling it, so that a backlog delays answers and not signs of life."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ._boundary import Boundary
from ._sockets import NOBLOCK, POLLIN, context, events, recv_frames, send_frames, tune

log = logging.getLogger(__name__)

DRAIN_BATCH = 256  # messages one socket handles before the loop's other work gets a turn
MAX_INBOX = 1_024  # messages a server takes in ahead of handling them (then ZeroMQ holds them,
MAX_INBOX_BYTES = 8 << 20  # and pushes back on their senders); and bytes
TURN_SECONDS = 0.02  # a server handles its inbox this long a turn, then takes in (and answers pings) again


class LoopSocket:
    """A ZeroMQ socket driven by the running asyncio loop.

    ZeroMQ's descriptor is edge-triggered and only says "look at EVENTS": on each wake-up
    every queued message is received and handed to ``on_message``; after each send the
    events are checked again, since a send can consume the edge of a message that arrived.
    Sends never block: high-water marks are unbounded, or (a server's) sends are
    ``NOBLOCK`` and a full queue fails the send. ``on_message`` handles its own
    failures; one that escapes it anyway is logged and costs that message only, since the
    messages queued behind it would otherwise wait for the next edge.

    With ``on_arrival`` (a server), each wake-up first takes in everything that has arrived
    (up to ``MAX_INBOX`` messages and ``MAX_INBOX_BYTES`` held) and shows each message to ``on_arrival`` (with its sender's identity), which may answer it
    at once (a ``Ping``) and returns whether it did; the rest are handled each connection's
    in order and the connections in turn, at most ``DRAIN_BATCH`` a turn and for
    ``TURN_SECONDS`` (a handler that takes longer ends its turn); the connections in
    ``first`` (a controller's storage units, whose commits finish many clients' puts) have
    everything they sent handled at the start of each turn. A backlog of requests then delays their answers, not the signs of
    life: every arrival counts for its sender's session when it arrives, and pings are
    answered within one turn of the loop, however long the queue behind them.

    What handlers send while the socket is being drained waits in an outbox, in order, and
    leaves at the end of the drain, back to back. Each send that ZeroMQ has to hand to its
    I/O thread wakes that thread (a system call) when it is asleep; spread between handlers,
    every reply woke it, and a burst wakes it about once (controller CPU a request: -10 to
    -15%). A send of the outbox that fails is reported to the ``on_error`` given with it. The
    pongs ``on_arrival`` made leave as soon as everything is taken in, before any handling.
    """

    def __init__(
        self,
        kind: int,
        on_message: Callable[[list[zmq.Frame]], None],
        *,
        sending: Boundary,
        on_arrival: Callable[[bytes, list[zmq.Frame]], bool] | None = None,
    ) -> None:
        self.sock = context().socket(kind)
        tune(self.sock)
        self._on_message = on_message
        self._on_arrival = on_arrival
        # with on_arrival: messages taken in, not yet handled, per connection, and whose turn is next
        self._queues: dict[bytes, collections.deque[list[zmq.Frame]]] = {}
        self._turns: collections.deque[bytes] = collections.deque()
        self._held = 0
        self._held_bytes = 0
        self.first: set[bytes] = set()  # connections whose messages go before the others' (a controller's units)
        self._sending = sending
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        self._scheduled = False
        self._draining = False  # handlers run from _drain: a send need not look for arrivals
        # sends made while draining, sent at its end: (frames, flags, copy, on_error)
        self._outbox: list[tuple[Sequence[Any], int, bool, Callable[[BaseException], None] | None]] = []
        self.closed = False

    def send(
        self,
        frames: Sequence[Any],
        *,
        copy: bool,
        flags: int = 0,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Queue ``frames``; a ZeroMQ failure (the socket closed under the call, or with
        ``NOBLOCK`` a peer's full or vanished queue) is raised as the ``sending`` boundary's
        error, ``from`` ZeroMQ's. While the socket is being drained (a handler answering)
        the frames wait in the outbox until the drain ends; a failure then goes to
        ``on_error`` (logged without one)."""
        if self._draining:
            self._outbox.append((frames, flags, copy, on_error))
            return
        with self._sending:
            try:
                send_frames(self.sock, frames, flags, copy)
            finally:
                # a send, even one that fails (a vanished peer), may take the edge of a
                # message that arrived: without this check it would wait for the next one
                self._check()

    def _check(self) -> None:
        if not self._scheduled and events(self.sock) & POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        self._draining = True
        try:
            if self._on_arrival is not None:
                self._take_in()
                return
            for _ in range(DRAIN_BATCH):
                frames = self._recv()
                if frames is None:
                    return
                self._handle(frames)
        finally:
            self._draining = False
            if self._outbox:
                self._flush()
        # more may wait: take them after the loop's other work (timers, other sockets), so
        # that a flood on one socket cannot starve heartbeats on another
        if not self.closed and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _flush(self) -> None:
        """Send the outbox, in order; then look for arrivals (a send may take their edge)."""
        outbox, self._outbox = self._outbox, []
        for frames, flags, copy, on_error in outbox:
            if self.closed:
                return  # as a send to a closed socket: nobody is left to answer
            try:
                with self._sending:
                    send_frames(self.sock, frames, flags, copy)
            except Exception as exc:  # each failure goes to its sender's handler
                if on_error is None:
                    log.warning("%s: a send failed: %s", self._sending.what, exc)
                    continue
                try:
                    on_error(exc)
                except Exception:  # as in _handle: a bug costs this message, not the loop
                    log.exception("%s: handling a failed send failed", self._sending.what)
        self._check()

    def _recv(self) -> list[zmq.Frame] | None:
        """The next message that has arrived, or None (none has, or the socket is closed)."""
        if self.closed:
            return None
        try:
            return recv_frames(self.sock, NOBLOCK)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:  # a receive loop has no caller to raise to
            if not self.closed:
                log.warning("%s: receive failed: %s", self._sending.what, exc)
            return None

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            self._on_message(frames)
        except Exception:  # a bug in a handler: it costs this message, not the loop
            log.exception("%s: a message could not be handled", self._sending.what)

    def _take_in(self) -> None:
        """Receive everything that has arrived (answering what ``on_arrival`` answers), then
        handle a turn's worth of the inbox: each connection's messages in order, the
        connections in turn (as ZeroMQ itself serves them), so that one that sends a flood
        delays the others by no more than one message each time round."""
        assert self._on_arrival is not None
        queues, turns = self._queues, self._turns
        while self._held < MAX_INBOX and self._held_bytes < MAX_INBOX_BYTES:
            frames = self._recv()
            if frames is None:
                break
            ident = frames[0].bytes
            try:
                if self._on_arrival(ident, frames):
                    continue
            except Exception:  # as in _handle: a bug costs this message, not the loop
                log.exception("%s: a message could not be handled", self._sending.what)
                continue
            queue = queues.get(ident)
            if queue is None:
                queue = queues[ident] = collections.deque()
                turns.append(ident)
            queue.append(frames)
            self._held += 1
            self._held_bytes += sum(len(f) for f in frames)
        if self._outbox:  # the pings answered as they arrived leave now, before the handling
            self._flush()
        until = time.monotonic() + TURN_SECONDS
        for ident in [i for i in self.first if i in queues]:  # they carry the work of many (commits)
            turns.remove(ident)
            while ident in queues and not self.closed:
                self._handle(self._pop(ident))
        for _ in range(DRAIN_BATCH):
            if self.closed or not turns or time.monotonic() > until:
                break
            ident = turns.popleft()
            frames = self._pop(ident)
            if ident in queues:
                turns.append(ident)
            self._handle(frames)
        if self.closed or self._scheduled:
            return
        if turns:  # the rest after the loop's other work (timers, other sockets)
            self._scheduled = True
            self._loop.call_soon(self._drain)
        else:
            self._check()  # a send in a handler may have taken the edge of a new arrival

    def _pop(self, ident: bytes) -> list[zmq.Frame]:
        """The next message taken in from connection ``ident`` (its queue goes once empty)."""
        queue = self._queues[ident]
        frames = queue.popleft()
        if not queue:
            del self._queues[ident]
        self._held -= 1
        self._held_bytes -= sum(len(f) for f in frames)
        return frames

    def drain(self) -> None:
        """Handle what has arrived now (before judging a peer silent, say): with
        ``on_arrival``, everything that has arrived is taken in (and counts as a sign of
        life), and a turn's worth of it handled."""
        self._drain()

    def close(self, linger: int = 0) -> None:
        """Close; ``linger`` ms: how long ZeroMQ's own thread may still deliver what was
        queued last (a ``Bye``). Closing never waits for it."""
        if self.closed:
            return
        self.closed = True
        try:
            self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
        except (RuntimeError, ValueError, zmq.ZMQError):
            pass  # the loop is already closed
        self.sock.close(linger=linger)
