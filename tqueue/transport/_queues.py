"""What a server has queued for each peer: its replies' zero-copy bytes counted until ZeroMQ
lets go of them, bounded per peer and in total, and the replies it could not deliver.

A reply may carry a tag (a storage unit's: the partition uid of a fetch), so that the server
can tell which peers still hold bytes of a partition that was cleared, and whether they take
any of them (``holding``, ``sent``): one that takes none is stalled, and is cut off (see
``Server.free_stalled``), which is the only way to make ZeroMQ let go of what it queued.
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

MAX_QUEUED_BYTES = 256 << 20  # reply bytes a server queues for one peer that does not read
MAX_QUEUED_BYTES_TOTAL = 1 << 30  # ... and for all its peers together (a unit's: see StorageConfig)


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
        self._sent: dict[bytes, int] = {}  # bytes ZeroMQ let go of, per peer with some queued
        self._tagged: dict[int, dict[bytes, int]] = {}  # tag -> peer -> its bytes queued
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

    def track(self, ident: bytes, buffers: Sequence[Any], tag: int = 0) -> list[Any]:
        """``buffers`` as views whose release by ZeroMQ takes their bytes off the count (and
        off ``tag``'s)."""
        out = []
        total = 0
        for b in buffers:
            view = memoryview(b)
            if view.nbytes >= zmq.COPY_THRESHOLD:  # smaller ones are copied at the send
                total += view.nbytes
                weakref.finalize(view, self._release, ident, view.nbytes, tag)
            out.append(view)
        if not total:
            return out
        with self._lock:
            self._queued[ident] = self._queued.get(ident, 0) + total
            self._total += total
            if tag:
                peers = self._tagged.setdefault(tag, {})
                peers[ident] = peers.get(ident, 0) + total
        return out

    def _release(self, ident: bytes, nbytes: int, tag: int = 0) -> None:
        with self._lock:
            self._total -= nbytes
            left = self._queued.get(ident, 0) - nbytes
            if left > 0:
                self._queued[ident] = left
                self._sent[ident] = self._sent.get(ident, 0) + nbytes
            else:
                self._queued.pop(ident, None)
                self._sent.pop(ident, None)
            peers = self._tagged.get(tag) if tag else None
            if peers is not None:
                mine = peers.get(ident, 0) - nbytes
                if mine > 0:
                    peers[ident] = mine
                else:
                    peers.pop(ident, None)
                    if not peers:
                        del self._tagged[tag]

    def holding(self, tag: int) -> dict[bytes, int]:
        """The peers with bytes of ``tag`` queued, each with what it has taken so far (``sent``)."""
        with self._lock:
            return {ident: self._sent.get(ident, 0) for ident in self._tagged.get(tag, ())}

    def sent(self, ident: bytes) -> int:
        """Bytes of ``ident``'s replies ZeroMQ has let go of since it last had none queued."""
        with self._lock:
            return self._sent.get(ident, 0)

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
