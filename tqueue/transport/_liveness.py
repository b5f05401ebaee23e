"""Liveness: heartbeats between peers and servers, after the ZeroMQ Guide's Paranoid Pirate.

Every message counts as a sign of life, in both directions. A peer that has heard nothing
from its server for :data:`HEARTBEAT_INTERVAL` sends a ``Ping`` (answered with ``Pong``);
one that has heard nothing for ``HEARTBEAT_LIVENESS`` intervals fails every request it has
pending at once, instead of at each request's own timeout. A server remembers when it last
heard from each *session* and, once a session has been silent for as long, or said ``Bye``,
tells whoever registered with :meth:`Sessions.on_gone`, so that what the session held
(parked calls, grants, arena holds) is freed at once.

A session is one client: all its connections (the event loop's and one per calling thread)
share a random ZeroMQ routing id prefix made by :func:`routing_id`. A connection that set
no routing id (ZeroMQ then makes one starting with a zero byte) is a session of its own.

The controller sets the interval for the whole cluster: units learn it when they register,
clients in the controller's ``HelloReply``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..config import HEARTBEAT_INTERVAL

log = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_INTERVAL", "HEARTBEAT_LIVENESS", "TRANSIT_RATE", "UNIT_LIVENESS", "Session", "Sessions"]

HEARTBEAT_LIVENESS = 3  # silent intervals after which a peer or a session counts as gone
# A storage unit counts as dead after more silent intervals than a client does: its death
# makes its samples lost for good, a client's only frees what it held.
UNIT_LIVENESS = 5

# The slowest rate, in bytes a second, at which a request's bytes are taken to cross to the
# server and be handled there (a unit copies a put into fresh pages at 1.4 GB/s on a GPU host
# and ZeroMQ hands over a message only once it is whole). A server cannot answer a ping queued
# behind such a request, so a peer does not count the first ``transit(n)`` s after sending n
# bytes as silence: a 4 GiB put over TCP once failed as "not heard from for 3.4 s".
TRANSIT_RATE = 200e6

SESSION_BYTES = 12
_SUFFIX_BYTES = 2
_IDENT_BYTES = SESSION_BYTES + _SUFFIX_BYTES


def new_session() -> bytes:
    """A random session id; never starts with a zero byte (ZeroMQ reserves those)."""
    raw = os.urandom(SESSION_BYTES)
    return bytes([raw[0] | 1]) + raw[1:]


class Session:
    """One client's session id and the routing ids of its connections."""

    def __init__(self) -> None:
        self.id = new_session()
        self._numbers = itertools.count()

    def routing_id(self) -> bytes:
        """A routing id for one more connection of this session (unique per server)."""
        return routing_id(self.id, next(self._numbers))


def routing_id(session: bytes, number: int) -> bytes:
    return session + (number % (1 << (8 * _SUFFIX_BYTES))).to_bytes(_SUFFIX_BYTES, "big")


def session_of(ident: bytes) -> bytes:
    """The session a connection's routing id belongs to."""
    if len(ident) == _IDENT_BYTES and ident[0]:
        return ident[:SESSION_BYTES]
    return ident


def window(interval: float, liveness: int = HEARTBEAT_LIVENESS) -> float:
    """Seconds of silence after which a peer counts as gone."""
    return interval * liveness


def transit(buffers: Sequence[Any]) -> float:
    """Seconds a request carrying ``buffers`` may keep its server from answering."""
    return sum(memoryview(b).nbytes for b in buffers) / TRANSIT_RATE


class Sessions:
    """When a server last heard from each session, swept by one timer per interval.

    ``seen`` is called for every message received, so it is a dict write and nothing more.
    A session silent for ``window(interval)``, or one that said ``Bye``, is forgotten and
    the callbacks of :meth:`on_gone` run with its id (and may free what it held).
    """

    def __init__(self, interval: float, *, name: str, drain: Callable[[], None] = lambda: None) -> None:
        self.interval = interval
        self.name = name
        self._drain = drain  # handle what has arrived before judging silence
        self._last: dict[bytes, float] = {}
        self.last_heard = 0.0  # during the on_gone callbacks: when the ending session was last heard
        self._gone: list[Callable[[bytes], None]] = []
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        if interval > 0:
            self._timer = self._loop.call_later(interval, self._sweep)

    def __len__(self) -> int:
        return len(self._last)

    def set_interval(self, interval: float) -> None:
        """A server that learns the cluster's interval late (a unit, at registration)."""
        self.interval = interval
        if self._timer is None and interval > 0:
            self._timer = self._loop.call_later(interval, self._sweep)

    def on_gone(self, callback: Callable[[bytes], None]) -> None:
        self._gone.append(callback)

    def seen(self, ident: bytes) -> None:
        self._last[session_of(ident)] = self._loop.time()

    def heard(self, session: bytes) -> float:
        """When a message of ``session`` last arrived (loop time; 0.0: none, or it ended)."""
        return self._last.get(session, 0.0)

    def bye(self, ident: bytes) -> None:
        session = session_of(ident)
        if self._last.pop(session, None) is not None:
            self._end(session, "closed", self._loop.time())

    def _sweep(self) -> None:
        self._drain()
        now = self._loop.time()
        limit = now - window(self.interval)
        gone = [s for s, t in self._last.items() if t < limit]
        for session in gone:
            last = self._last.pop(session)
            self._end(session, f"silent for more than {window(self.interval):.1f} s", last)
        self._timer = self._loop.call_later(self.interval, self._sweep)

    def _end(self, session: bytes, why: str, last: float) -> None:
        log.debug("%s: session %s ended (%s)", self.name, session.hex(), why)
        self.last_heard = last
        for callback in self._gone:
            try:
                callback(session)
            except Exception:  # one part failing to free must not keep the others from it
                log.exception("%s: freeing what session %s held failed", self.name, session.hex())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
