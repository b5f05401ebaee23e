"""Re-replication: samples of a replicated partition left with one copy by a unit's death are
copied again, in the background, a bounded batch at a time.

A batch is up to :data:`BATCH` samples of one partition, on one holder unit, with the same
fields. The controller reads them from the holder (``Fetch``, no arena, no bulk stream) and
stores them on another live unit (another host first) under a grant of their indexes; that
unit commits as it does for any write, and the commit records the copy, for the samples whose
revision did not move in between (an update meanwhile wrote the holder alone: those are copied
again next time) and whose unit still lives. A batch that fails (a unit gone in between) is
given up on for this round; the next unit death or commit of a copy starts another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ..errors import InvalidArgumentError, PartitionClearedError
from ..wire import Commit, Committed, Fetch, Fetched, Grant, Store, Stored
from ._partition import Partition
from ._records import GrantRecord, Unit
from ._samples import COMMITTED, EXCLUDED
from ._state import ControllerState

log = logging.getLogger(__name__)

BATCH = 64  # samples copied per round trip: a bound on the bytes the controller relays at once


class Replicas:
    """The controller's re-replication, over ``state``."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state
        self._running = False
        self._skip: set[tuple[int, int]] = set()  # (partition uid, first index) of batches that failed this round

    def wake(self) -> None:
        """Copy what is held once, unless that is under way already."""
        if not self._running and not self.state.tasks.closed:
            self._running = True
            self.state.tasks.start(self._run(), "copy samples held once")

    async def _run(self) -> None:
        try:
            while True:
                job = self._next()
                if job is None:
                    return
                part, idx, holder, target = job
                try:
                    await self._copy(part, idx, holder, target)
                except Exception as exc:  # a unit gone in between, say: the next death or commit retries
                    log.warning("partition %r: copying %d samples from unit %d to unit %d failed: %s",
                                part.name, len(idx), holder.info.unit_id, target.info.unit_id, exc)
                    self._skip.add((part.uid, int(idx[0])))
        finally:
            self._running = False
            self._skip.clear()

    def _next(self) -> tuple[Partition, np.ndarray, Unit, Unit] | None:
        units = self.state.units
        for part in list(self.state.partitions.values()):
            if not part.single or (part.options.replicas or self.state.config.replicas) < 2:
                continue
            s = part.samples
            n = s.n
            held = np.flatnonzero(((s.mask[:n] & (COMMITTED | EXCLUDED)) == COMMITTED) & (s.replica[:n] < 0) & (s.unit[:n] >= 0))
            for holder_id in np.unique(s.unit[held]).tolist():
                holder = units.get(holder_id)
                if holder is None or not holder.alive:
                    continue
                on = held[s.unit[held] == holder_id]
                masks = s.mask[on]
                same = on[masks == masks[0]][:BATCH]
                if (part.uid, int(same[0])) in self._skip:
                    continue
                target = self._target(holder)
                if target is not None:
                    return part, same, holder, target
        return None

    def _target(self, holder: Unit) -> Unit | None:
        others = [u for u in self.state.units.values() if u.alive and not u.suspect and u is not holder]
        apart = [u for u in others if u.info.host != holder.info.host]
        pool = apart or others
        return min(pool, key=lambda u: (u.load, u.info.unit_id)) if pool else None

    async def _copy(self, part: Partition, idx: np.ndarray, holder: Unit, target: Unit) -> None:
        s = part.samples
        fields = [name for name, bit in part.schema.bits.items() if s.mask[idx[0]] & bit]
        source = self.state.unit_peers.get(holder.info.unit_id)
        sink = self.state.unit_peers.get(target.info.unit_id)
        if source is None or sink is None:
            raise RuntimeError("a unit is not connected")
        timeout = self.state.config.unit_timeout
        fetched, frames = await source.request(
            Fetch(partition=part.name, partition_uid=part.uid, indexes=idx.tolist(), fields=fields),
            expect=Fetched, timeout=timeout,
        )
        grant_id = next(self.state.grant_ids)
        self.state.grants[grant_id] = GrantRecord(
            grant_id, part.uid, target.info.unit_id, 0, len(idx), idx, frozenset(fields),
            copy_of=s.revision[idx].copy(),
        )
        try:
            await sink.request(
                Store(grant_id=grant_id, partition=part.name, partition_uid=part.uid, start=0, count=len(idx),
                      blocks=fetched.blocks, indexes=idx.tolist(), timeout=timeout),
                frames, expect=Stored, timeout=timeout,
            )
        finally:
            self.state.grants.pop(grant_id, None)  # committed (see ``copied``), or given up on


def record_copy(part: Partition, grant: GrantRecord, unit_id: int, alive: set[int]) -> int:
    """The commit of a re-replication grant: record the new copy of each sample it holds whose
    revision is the one read and whose first copy still lives; how many."""
    assert grant.copy_of is not None and grant.indexes is not None
    s = part.samples
    idx = grant.indexes
    ok = (s.revision[idx] == grant.copy_of) & (s.replica[idx] < 0) & np.isin(s.unit[idx], list(alive))
    ok &= s.unit[idx] != unit_id
    s.replica[idx[ok]] = unit_id
    part.single = max(0, part.single - int(ok.sum()))
    return int(ok.sum())


class Copies:
    """The second copies of a replicated partition's writes: where a put's goes, a first
    commit of two, and the commit of a re-replication's copy."""

    def __init__(self, state: ControllerState, copy_again: Callable[[], None]) -> None:
        self.state = state
        self._copy_again = copy_again

    def place(self, msg: Grant, first: Unit) -> Unit | None:
        """A second unit for a replicated put: on another host where one has room, else
        another unit; None where no other live unit has room (the put is stored once, and
        said so: its samples count among the partition's single copies)."""
        others = [u for u in self.state.units.values()
                  if u.alive and not u.suspect and u is not first and u.fits(msg.nbytes)]
        if not others:
            log.warning("partition %r: no second live unit with room, a put of %d samples is stored once",
                        msg.partition, msg.count)
            return None
        apart = [u for u in others if u.info.host != first.info.host]
        pool = apart or others
        return min(pool, key=lambda u: (u.load, u.info.unit_id))

    def copied(self, grant: GrantRecord, msg: Commit) -> Committed:
        """A re-replication's copy is stored: recorded where still wanted (``_replicas``)."""
        del self.state.grants[msg.grant_id]
        part = self.state.by_uid.get(grant.partition_uid)
        if part is None:
            raise PartitionClearedError(f"the partition of grant {msg.grant_id} was cleared before its copy was stored")
        alive = {u.info.unit_id for u in self.state.units.values() if u.alive}
        n = record_copy(part, grant, msg.unit_id, alive)
        log.info("partition %r: %d samples held once have a second copy on unit %d", part.name, n, msg.unit_id)
        unit = self.state.units.get(msg.unit_id)
        if unit is not None:
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        self.state.loop.call_soon(self._copy_again)  # the next batch
        return Committed(sealed=part.sealed)

    def first(self, grant: GrantRecord, msg: Commit) -> Committed:
        """One unit of a replicated put holds its copy; the samples are ready once the other
        does too (a reader never sees a sample held once that was meant to be held twice)."""
        grant.waiting.discard(msg.unit_id)
        part = self.state.by_uid.get(grant.partition_uid)
        if part is None:
            raise PartitionClearedError(f"the partition of grant {msg.grant_id} was cleared before its data was stored")
        if set(msg.fields) != grant.fields:
            raise InvalidArgumentError(
                f"grant {msg.grant_id} was for fields {sorted(grant.fields)}, the unit stored {sorted(msg.fields)}"
            )
        unit = self.state.units.get(msg.unit_id)
        if unit is not None:
            if grant.indexes is None:
                unit.reserved -= grant.nbytes
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        return Committed(sealed=part.sealed)


def copies_of(part: Partition, indexes: np.ndarray) -> set[int]:
    """The units an update of ``indexes`` of a replicated partition must reach (both copies,
    one pair for all of them; the client groups by pair after a ``Locate``); empty otherwise."""
    replicas = part.samples.replica[indexes]
    if not len(indexes) or (replicas < 0).all():
        return set()
    pairs = set(zip(part.samples.unit[indexes].tolist(), replicas.tolist()))
    if len(pairs) != 1:
        raise InvalidArgumentError(
            f"partition {part.name!r}: an update of samples held by different pairs of units {sorted(pairs)[:4]}; "
            "write each pair's samples apart (the client does, after asking where they are)"
        )
    return {u for u in pairs.pop() if u >= 0}
