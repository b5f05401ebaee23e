"""What a server has queued for each peer: its replies' zero-copy bytes counted until ZeroMQ
lets go of them, bounded per peer and in total, and the replies it could not deliver.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import zmq

from ..errors import UnavailableError

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 1 << 30  # reply bytes a server queues for one peer that does not read
MAX_QUEUED_BYTES_TOTAL = 4 << 30  # ... and for all its peers together


class SendQueues:
    """What a server has queued for each peer, and what it could not deliver.

    ZeroMQ keeps a reply's zero-copy buffers until the peer's connection has taken them, so
    a peer that stops reading would grow the server without bound. Bytes of buffers handed
    to ZeroMQ are counted per peer until ZeroMQ lets go of them (from its own thread); a
    reply with buffers that would take a peer past ``max_bytes``, or all peers together past
    ``max_total``, is answered with an :class:`UnavailableError` instead (the first one
    always goes: a single reply larger than a bound is served). Replies that ZeroMQ refuses
    (the peer is gone: ``ROUTER_MANDATORY``; its queue of ``max_queued_replies`` is full)
    are counted, and logged once per peer.
    """

    _LOGGED = 4096  # peers remembered as logged (then the set starts over)

    def __init__(self, name: str, max_bytes: int, max_total: int = MAX_QUEUED_BYTES_TOTAL) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.max_total = max_total
        self.refused = 0  # replies answered with an error: the peer, or all, had too much unread
        self.unreachable = 0  # replies to peers that are gone
        self.overflowed = 0  # replies dropped: the peer's queue of replies was full
        self.malformed = 0  # requests that could not be decoded
        self._queued: dict[bytes, int] = {}
        self._total = 0
        self._lock = threading.Lock()  # releases come from ZeroMQ's thread
        self._logged: set[tuple[bytes, str]] = set()

    def queued(self, ident: bytes) -> int:
        with self._lock:
            return self._queued.get(ident, 0)

    @property
    def total(self) -> int:
        """Bytes queued for all peers on this socket."""
        with self._lock:
            return self._total

    def admit(self, ident: bytes, buffers: Sequence[Any]) -> UnavailableError | None:
        """None if a reply of ``buffers`` may be queued for ``ident``; else the error sent."""
        size = sum(memoryview(b).nbytes for b in buffers)
        queued = self.queued(ident)
        if queued and queued + size > self.max_bytes:
            self.refused += 1
            self.log_once(ident, "does not read its replies: %d bytes queued, refusing more", queued)
            return UnavailableError(
                f"{self.name}: {queued} bytes of earlier replies to this connection are unread; a reply "
                f"of {size} more would pass the limit of {self.max_bytes} (StorageConfig.max_queued_bytes)"
            )
        total = self.total
        if not total or total + size <= self.max_total:
            return None
        self.refused += 1
        self.log_once(ident, "asked for a reply while replies to all peers hold %d bytes, refusing it", total)
        return UnavailableError(
            f"{self.name}: {total} bytes of replies to all connections are unread; a reply of {size} more "
            f"would pass the limit of {self.max_total} (StorageConfig.max_queued_bytes_total)"
        )

    def track(self, ident: bytes, buffers: Sequence[Any]) -> list[Any]:
        """``buffers`` as views whose release by ZeroMQ takes their bytes off the count."""
        out = []
        total = 0
        for b in buffers:
            view = memoryview(b)
            if view.nbytes >= zmq.COPY_THRESHOLD:  # smaller ones are copied at the send
                total += view.nbytes
                weakref.finalize(view, self._release, ident, view.nbytes)
            out.append(view)
        with self._lock:
            self._queued[ident] = self._queued.get(ident, 0) + total
            self._total += total
        return out

    def _release(self, ident: bytes, nbytes: int) -> None:
        with self._lock:
            self._total -= nbytes
            left = self._queued.get(ident, 0) - nbytes
            if left > 0:
                self._queued[ident] = left
            else:
                self._queued.pop(ident, None)

    def undelivered(self, ident: bytes, exc: UnavailableError) -> None:
        """A reply ZeroMQ refused: say so (the requester learns at its timeout)."""
        cause = exc.__cause__
        if isinstance(cause, zmq.Again):
            self.overflowed += 1
            self.log_once(ident, "has a full queue of unread replies; dropping replies to it (%d so far)", self.overflowed)
        elif isinstance(cause, zmq.ZMQError) and cause.errno == zmq.EHOSTUNREACH:
            self.unreachable += 1
            self.log_once(ident, "is gone; a reply to it was dropped (%d so far)", self.unreachable)
        else:
            log.warning("%s", exc)

    def log_once(self, ident: bytes, what: str, *args: Any) -> None:
        """A warning about a peer, the first time only (a peer's trouble can repeat at the
        rate it sends)."""
        key = (ident, what)
        if key in self._logged:
            return
        if len(self._logged) >= self._LOGGED:
            self._logged.clear()
        self._logged.add(key)
        log.warning("%s: peer %s " + what, self.name, ident.hex(), *args)
