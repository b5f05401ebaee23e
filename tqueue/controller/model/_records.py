"""Controller records of the cluster, free of IO: the storage units it knows, where a write
goes among them (:func:`pick`), and the grants it gave that are not committed yet (partition
state is in :mod:`._partition`)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Collection, Iterator

import numpy as np

from ...wire import Grant, UnitInfo


class Wait(Exception):
    """A write cannot be admitted yet; ``reason`` says why, ``full`` if for memory."""

    def __init__(self, reason: str, *, full: bool, never: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.full = full
        self.never = never  # waiting cannot help


@dataclasses.dataclass
class Unit:
    info: UnitInfo
    capacity: int = 0  # bytes the unit may hold; 0: no limit
    nbytes: int = 0  # stored, as the unit last reported
    reserved: int = 0  # granted to writes not yet committed
    name: str = ""  # its identity: registering again under it gives the same unit id
    alive: bool = True  # false once it missed its heartbeats: its samples are lost
    suspect: bool = False  # a client failed to store on it: no placements until a probe answers
    heard: float = 0.0  # loop time of its last heartbeat
    session: bytes = b""  # its connection's session at the controller (any message from it is a sign of life)
    ident: bytes = b""  # its connection at the controller, whose messages are handled first
    arena_used: int = 0  # as its last heartbeat said
    held_bytes: int = 0  # replies not yet taken by their readers, as its last heartbeat said
    metrics: str = ""  # its Prometheus endpoint

    @property
    def load(self) -> int:
        return self.nbytes + self.reserved

    def fits(self, nbytes: int) -> bool:
        return not self.capacity or self.load + nbytes <= self.capacity


@dataclasses.dataclass
class GrantRecord:
    grant_id: int
    partition_uid: int
    unit_id: int
    start: int
    count: int
    indexes: np.ndarray | None
    fields: frozenset[str]
    nbytes: int = 0
    partial: bool = False
    complete: bool = False
    segment: tuple[int, int] | None = None
    kept: int = 0  # a put's samples that count toward the target (the first ``kept``)
    admitted: int = 0  # staleness admission it took, given back if it never commits
    owner: bytes = b""  # the client session that asked for it (freed when that session ends)
    timer: asyncio.TimerHandle | None = None  # lapses the grant if it is never committed
    second_unit: int = -1  # a put of two copies: the unit of its second copy
    waiting: set[int] = dataclasses.field(default_factory=set)  # a put's units that have not committed yet
    copy_of: np.ndarray | None = None  # a copy made again: the samples' revisions when they were read

    def stop_timer(self) -> None:
        """The grant ended (committed, lapsed, cancelled, its partition gone)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def pick(known: Collection[Unit], msg: Grant, cap: int, placements: Iterator[int]) -> Unit:
    """Placement: a unit on the producer's host with room, the least loaded among those;
    Wait where none can take ``msg`` now (saying why, and whether it never will)."""
    units = [u for u in known if u.alive and not u.suspect]  # nothing new to a dead unit
    if not units:
        suspect = sum(u.alive and u.suspect for u in known)
        raise Wait(
            f"no live storage unit ({len(known)} registered: {suspect} being probed after a failed store, "
            f"{len(known) - suspect} dead)" if known
            else "no storage unit is registered with the controller yet",
            full=True,
        )
    need = msg.nbytes
    used = sum(u.load for u in units)
    if cap and used + need > cap:
        raise Wait(
            f"a write of {need} bytes to partition {msg.partition!r} needs memory: {used} "
            f"bytes used of {cap} allowed in the cluster",
            full=True,
            never=need > cap,
        )
    roomy = [u for u in units if u.fits(need)]
    if not roomy:
        largest = max((u.capacity or math.inf) for u in units)
        per_unit = ", ".join(f"unit {u.info.unit_id}: {u.load} of {u.capacity}" for u in units)
        raise Wait(
            f"a write of {need} bytes to partition {msg.partition!r} fits on no storage unit "
            f"({per_unit} bytes used of allowed)",
            full=True,
            never=need > largest,
        )
    local = [u for u in roomy if msg.host and u.info.host == msg.host]
    pool = local or roomy
    turn = next(placements)  # ties rotate so that equal units share the work
    return min(pool, key=lambda u: (u.load, (u.info.unit_id - turn) % len(pool)))
