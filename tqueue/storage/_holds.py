"""A storage unit's arena ranges in use by clients: those allocated to writers (until their
``Store`` arrives) and those held by readers (until they ``Release`` them), each with the
timer that lapses it and the client session that owns it (freed at once when it ends)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

from ..config import StorageConfig
from ..errors import ProtocolError
from ..transport._arena import Arena, Region
from ..wire import Store

log = logging.getLogger(__name__)


class Holds:
    """Allocations and holds of ``arena``'s regions. ``decref``: drop the reference an
    allocation or a hold keeps on a region. ``name``: the unit's, for the log."""

    def __init__(self, config: StorageConfig, arena: Arena | None, decref: Callable[[Region], None], name: Callable[[], str]) -> None:
        self.config = config
        self.arena = arena
        self._decref = decref
        self._name = name
        self._loop = asyncio.get_running_loop()
        # offset: (region, its timer, the session it is allocated to, the allocation's token)
        self.allocs: dict[int, tuple[Region, asyncio.TimerHandle, bytes, int]] = {}
        self.kept: set[int] = set()  # offsets of allocations a writer keeps for several Stores
        self.holds: dict[int, tuple[list[Region], asyncio.TimerHandle, bytes]] = {}

    def alloc(self, nbytes: int, session: bytes) -> Region | None:
        """A region for a writer's ``Store``; None: no arena, or no room in it."""
        if self.arena is None or nbytes <= 0:
            return None
        region = self.arena.alloc(nbytes)
        if region is None:
            return None
        # a writer that never stores gives the range back after the request timeout
        timer = self._loop.call_later(self.config.alloc_timeout, self.expire_alloc, region.offset)
        # a token tells this allocation from a later one at the same offset (a release of a
        # kept region that lapsed meanwhile must not end the next writer's)
        self.allocs[region.offset] = (region, timer, session, secrets.randbits(62) + 1)
        return region

    def take_alloc(self, offset: int, session: bytes, keep: bool = False) -> Region:
        """The region allocated to ``session`` at ``offset``, for a ``Store`` into it, with a
        reference of the Store's own. Without ``keep`` the allocation ends (its reference
        passes to the Store); with it, the writer keeps the region for later Stores (a lease),
        and its allocation lasts ``alloc_timeout`` from now."""
        entry = self.allocs.get(offset)
        if entry is None or entry[2] != session:
            raise ProtocolError(f"arena region {offset} was not allocated to this writer (or has expired)")
        region, timer, _, token = entry
        timer.cancel()
        if not keep:
            del self.allocs[offset]
            self.kept.discard(offset)
            return region
        timer = self._loop.call_later(self.config.alloc_timeout, self.expire_alloc, offset, "lapsed unused")
        self.allocs[offset] = (region, timer, session, token)
        self.kept.add(offset)
        assert self.arena is not None
        self.arena.incref(region)
        return region

    def release_allocs(self, regions: list[list[int]], session: bytes) -> None:
        """The writer no longer puts into these regions it kept (``[offset, token]`` each):
        their allocations end (the samples stored in them keep their references). Another
        session's regions, and allocations that lapsed meanwhile, are left alone."""
        for ref in regions:
            if len(ref) != 2:
                raise ProtocolError(f"a released arena region is [offset, token], got {ref}")
            entry = self.allocs.get(ref[0])
            if entry is not None and entry[2] == session and entry[3] == ref[1]:
                del self.allocs[ref[0]]
                self.kept.discard(ref[0])
                entry[1].cancel()
                self._decref(entry[0])

    def expire_alloc(self, offset: int, why: str = "was allocated but never stored") -> None:
        """The allocation at ``offset`` lapses. A region a writer kept for its puts lapses
        as expected once it stops putting (or closes): said at DEBUG only."""
        entry = self.allocs.pop(offset, None)
        if entry is not None:
            entry[1].cancel()
            if offset in self.kept:
                self.kept.discard(offset)
                log.debug("%s: arena region %d, kept by a writer for its puts, %s", self._name(), offset, why)
            else:
                log.warning("%s: arena region %d %s", self._name(), offset, why)
            self._decref(entry[0])

    def frames(self, msg: Store, raw: list[Any], region: Region | None) -> tuple[list[Any], list[int]]:
        """A ``Store``'s frames in block order, raw ones and ranges of its allocated ``region``
        interleaved; where each lies in the arena (-1: a raw frame)."""
        if msg.shm is None:
            if region is not None:
                raise ProtocolError("a Store with an arena region lists no arena ranges")
            return raw, [-1] * len(raw)
        if region is None or self.arena is None:
            raise ProtocolError("arena ranges in a Store without an allocated region")
        frames: list[Any] = []
        where: list[int] = []
        it = iter(raw)
        for ref in msg.shm:
            if not ref:
                frame = next(it, None)
                if frame is None:
                    raise ProtocolError("the Store lists more raw frames than arrived")
                frames.append(frame)
                where.append(-1)
                continue
            if len(ref) != 2:
                raise ProtocolError(f"an arena range is [offset, length], got {ref}")
            off, length = ref
            if length < 0 or off < region.offset or off + length > region.end:
                raise ProtocolError(
                    f"arena range [{off}, {off + length}) lies outside the allocated region "
                    f"[{region.offset}, {region.end})"
                )
            frames.append(self.arena.view[off : off + length])
            where.append(off)
        if next(it, None) is not None:
            raise ProtocolError("raw frames beyond what the Store lists")
        return frames, where

    def hold(self, regions: list[Region], session: bytes) -> int:
        """Keep ``regions`` for a reader until it releases them or ``hold_timeout``; the hold's id."""
        hold = secrets.randbits(63) | 1  # not guessable (and released by its session only)
        timer = self._loop.call_later(self.config.hold_timeout, self.end_hold, hold)
        self.holds[hold] = (regions, timer, session)
        return hold

    def release(self, holds: list[int], session: bytes) -> None:
        """End holds; only the session that got a hold may end it (another reader's batch
        must not change under it). Holds that are not the caller's are left alone."""
        for hold in holds:
            entry = self.holds.get(hold)
            if entry is not None and entry[2] == session:
                self.end_hold(hold)

    def end_hold(self, hold: int) -> None:
        entry = self.holds.pop(hold, None)
        if entry is None:
            return
        entry[1].cancel()
        for region in entry[0]:
            self._decref(region)

    def session_gone(self, session: bytes) -> None:
        """A client session ended: its arena ranges and holds go back now."""
        allocs = [offset for offset, entry in self.allocs.items() if entry[2] == session]
        for offset in allocs:
            self.expire_alloc(offset, "was allocated by a client that is gone")
        holds = [hold for hold, entry in self.holds.items() if entry[2] == session]
        for hold in holds:
            self.end_hold(hold)
        if allocs or holds:
            log.info("%s: a client session ended; %d arena allocations and %d holds freed",
                     self._name(), len(allocs), len(holds))
