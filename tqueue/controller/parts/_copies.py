"""Copies of samples (partitions of two copies): a put's second copy and its commits
(:class:`Copies`), the reads of a dead unit's samples served from their copies
(:class:`Failover`), and copying again (:class:`Copier`).

Copying again: samples of a partition of two copies held by one unit (a unit's death, a put
no second unit had room for, a restored checkpoint) are copied again, in the background, a
bounded batch at a time.

A batch is up to :data:`BATCH` samples of one partition, on one holder unit, with the same
fields. The controller notes their revisions and fields, reads them from the holder
(``Fetch``, no arena, no bulk stream) and stores them on another live unit (another host
first) under a grant of their indexes; that unit commits as it does for any write, and the
commit records the copy for the samples still as they were read: their revision did not move
(no update committed in between) and no update of them is in flight (one granted while they
were held once writes the holder alone, so the copy would lack it: a reader of the copy after
the holder's death found "no field 'reward' on this unit"), and their holder still lives.

A sample whose copy failed (a unit gone in between) or was not recorded is tried again after
a backoff of its own, from :data:`RETRY_FIRST` doubling to :data:`RETRY_MAX`, woken by a
timer of the controller's loop; a target whose store failed is passed over for as long while
another unit can take the copy. Without a unit to copy to, nothing is tried: a registration
wakes the copier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError, PartitionClearedError, TQueueError
from ...wire import Commit, Committed, Fetch, Fetched, Grant, Locate, Located, Store, Stored, UnitInfo
from ..model._partition import GrantRecord, Partition
from ..model._state import ControllerState, Unit

log = logging.getLogger(__name__)

BATCH = 64  # samples copied per round trip: a bound on the bytes the controller relays at once
RETRY_FIRST = 0.05  # seconds before a sample whose copy failed is tried again; doubled at each failure
RETRY_MAX = 5.0  # the longest wait between two tries of one sample


class _Backoff:
    """The retries of one partition's samples: failed tries and when the next may start."""

    __slots__ = ("tries", "after")

    def __init__(self) -> None:
        self.tries = np.zeros(0, dtype=np.int16)
        self.after = np.zeros(0, dtype=np.float64)

    def due(self, idx: np.ndarray, now: float) -> np.ndarray:
        inside = idx < len(self.after)
        ok = np.ones(len(idx), dtype=bool)
        ok[inside] = self.after[idx[inside]] <= now
        return idx[ok]

    def fail(self, idx: np.ndarray, now: float) -> float:
        """Count a failed try of ``idx``; the delay before the first of them is due again."""
        if len(idx) and int(idx.max()) >= len(self.after):
            size = max(int(idx.max()) + 1, 2 * len(self.after))
            self.tries = np.concatenate([self.tries, np.zeros(size - len(self.tries), dtype=np.int16)])
            self.after = np.concatenate([self.after, np.zeros(size - len(self.after), dtype=np.float64)])
        self.tries[idx] = np.minimum(self.tries[idx] + 1, 32)
        delay = np.minimum(RETRY_MAX, RETRY_FIRST * 2.0 ** (self.tries[idx].astype(np.float64) - 1))
        self.after[idx] = now + delay
        return float(delay.min()) if len(idx) else 0.0

    def forget(self, idx: np.ndarray) -> None:
        """``idx`` were copied: a later loss of their copy starts from the first delay."""
        idx = idx[idx < len(self.after)]
        self.tries[idx] = 0
        self.after[idx] = 0.0

    def pending(self, held: np.ndarray, now: float) -> float | None:
        """The earliest time one of ``held`` (held once still) is due, if any waits."""
        held = held[held < len(self.after)]
        later = self.after[held]
        later = later[later > now]
        return float(later.min()) if len(later) else None


class Copier:
    """The controller's copier: samples held once are copied again, over ``state``."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state
        self._running = False
        self._again = False  # woken while running: look for work again before stopping
        self._backoff: dict[int, _Backoff] = {}  # partition uid -> retries of its samples
        self._avoid: dict[int, float] = {}  # unit id -> loop time until which it is not a target (a store failed)
        self._timer: asyncio.TimerHandle | None = None  # wakes the copier when the next retry is due

    def wake(self) -> None:
        """Copy what is held once (and due), unless that is under way already."""
        if self.state.tasks.closed:
            return
        if self._running:
            self._again = True
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._running = True
        self.state.tasks.start(self._run(), "copy samples held once")

    def _fire(self) -> None:
        self._timer = None
        self.wake()

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                tried = 0
                for part, idx, holder_id in self._plan():
                    job = self._recheck(part, idx, holder_id)
                    if job is not None:
                        tried += 1
                        await self._attempt(part, *job)
                if not tried and not self._again:
                    return
        finally:
            self._running = False
            self._arm()

    def _two_copies(self, part: Partition) -> bool:
        if (part.options.copies or self.state.config.copies) < 2:
            return False
        part.twice = True  # a cluster's default of two copies: its samples are meant to be held twice
        return True

    def _plan(self) -> list[tuple[Partition, np.ndarray, int]]:
        """Batches of samples held once and due, each on a live holder that has a unit to
        copy to: (partition, indexes, holder's unit id)."""
        now = self.state.loop.time()
        jobs = []
        for part in list(self.state.partitions.values()):
            if not self._two_copies(part):
                continue
            held = part.held_once()
            backoff = self._backoff.get(part.uid)
            if backoff is not None:
                held = backoff.due(held, now)
            s = part.samples
            for holder_id in np.unique(s.unit[held]).tolist():
                holder = self.state.units.get(holder_id)
                if holder is None or not holder.alive or self._target(holder) is None:
                    continue
                on = held[s.unit[held] == holder_id]
                masks = s.mask[on]
                for mask in np.unique(masks):
                    same = on[masks == mask]
                    jobs += [(part, same[k : k + BATCH], holder_id) for k in range(0, len(same), BATCH)]
        return jobs

    def _recheck(self, part: Partition, idx: np.ndarray, holder_id: int) -> tuple[np.ndarray, Unit, Unit] | None:
        """What of a planned batch is still to copy now (an earlier copy of the round may have
        taken time): its samples still held once on that holder, with the same fields."""
        if self.state.partitions.by_uid.get(part.uid) is not part:
            return None
        holder = self.state.units.get(holder_id)
        if holder is None or not holder.alive:
            return None
        s = part.samples
        idx = np.intersect1d(idx, part.held_once(), assume_unique=True)
        idx = idx[s.unit[idx] == holder_id]
        if not len(idx):
            return None
        idx = idx[s.mask[idx] == s.mask[idx[0]]]
        target = self._target(holder)
        return (idx, holder, target) if target is not None else None

    def _target(self, holder: Unit) -> Unit | None:
        """A unit to copy ``holder``'s samples to: live, not being probed, not known gone (its
        address refuses connections), not one whose store just failed where another can take
        it; another host first, then the least loaded."""
        now = self.state.loop.time()
        peers = self.state.units.peers
        others = [
            u for u in self.state.units.values()
            if u.alive and not u.suspect and u is not holder
            and (peer := peers.get(u.info.unit_id)) is not None and not peer.refusing
        ]
        others = [u for u in others if self._avoid.get(u.info.unit_id, 0.0) <= now] or others
        apart = [u for u in others if u.info.host != holder.info.host]
        pool = apart or others
        return min(pool, key=lambda u: (u.load, u.info.unit_id)) if pool else None

    async def _attempt(self, part: Partition, idx: np.ndarray, holder: Unit, target: Unit) -> None:
        """One try of a batch; what it did not copy is tried again after its backoff."""
        failure: Exception | None = None
        try:
            await self._copy(part, idx, holder, target)
        except Exception as exc:  # a unit gone in between, say: retried after the backoff
            failure = exc
        now = self.state.loop.time()
        backoff = self._backoff.setdefault(part.uid, _Backoff())
        left = np.intersect1d(idx, part.held_once(), assume_unique=True)
        backoff.forget(np.setdiff1d(idx, left, assume_unique=True))
        if not len(left):
            return
        delay = backoff.fail(left, now)
        if failure is not None:
            self._avoid[target.info.unit_id] = now + delay
            log.warning("partition %r: copying %d samples from unit %d to unit %d failed (%s); tried again in %.2f s",
                        part.name, len(idx), holder.info.unit_id, target.info.unit_id, failure, delay)
        else:
            log.info("partition %r: %d of %d samples copied to unit %d were updated meanwhile; copied again in %.2f s",
                     part.name, len(left), len(idx), target.info.unit_id, delay)

    def _arm(self) -> None:
        """A timer for the next retry due, if a sample held once waits for one."""
        if self.state.tasks.closed:
            return
        now = self.state.loop.time()
        first: float | None = None
        for uid, backoff in list(self._backoff.items()):
            part = self.state.partitions.by_uid.get(uid)
            held = part.held_once() if part is not None else np.zeros(0, dtype=np.int64)
            if not len(held):
                del self._backoff[uid]  # freed, or nothing held once: nothing to retry
                continue
            due = backoff.pending(held, now)
            if due is not None and (first is None or due < first):
                first = due
        if first is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.state.loop.call_at(first, self._fire)
        elif self._again:
            self.wake()

    async def _copy(self, part: Partition, idx: np.ndarray, holder: Unit, target: Unit) -> None:
        s = part.samples
        # what is read is what the mask says now: its revision is taken here, before the read,
        # so an update that commits after this point leaves the copy unrecorded
        fields = [name for name, bit in part.schema.bits.items() if s.mask[idx[0]] & bit]
        revision = s.revision[idx].copy()
        source = self.state.units.peers.get(holder.info.unit_id)
        sink = self.state.units.peers.get(target.info.unit_id)
        if source is None or sink is None:
            raise RuntimeError("a unit is not connected")
        timeout = self.state.config.unit_timeout
        fetched, frames = await source.request(
            Fetch(partition=part.name, partition_uid=part.uid, indexes=idx.tolist(), fields=fields),
            expect=Fetched, timeout=timeout,
        )
        grant_id = next(self.state.grants.ids)
        self.state.grants[grant_id] = GrantRecord(
            grant_id, part.uid, target.info.unit_id, 0, len(idx), idx, frozenset(fields), copy_of=revision,
        )
        try:
            await sink.request(
                Store(grant_id=grant_id, partition=part.name, partition_uid=part.uid, start=0, count=len(idx),
                      blocks=fetched.blocks, indexes=idx.tolist(), timeout=timeout),
                frames, expect=Stored, timeout=timeout,
            )
        finally:
            self.state.grants.pop(grant_id, None)  # committed (see ``copied``), or given up on


def record_copy(
    part: Partition, grant: GrantRecord, unit_id: int, alive: set[int], updating: np.ndarray | None = None
) -> int:
    """The commit of a grant that copies samples again: record the new copy of each sample it holds that
    is as it was read (its revision did not move, and it is not in ``updating``: the indexes
    of updates in flight, which write its first copy alone), still live, and whose first copy
    still lives; how many."""
    assert grant.copy_of is not None and grant.indexes is not None
    s = part.samples
    idx = grant.indexes
    ok = (s.revision[idx] == grant.copy_of) & (s.second_unit[idx] < 0) & np.isin(s.unit[idx], list(alive))
    ok &= s.unit[idx] != unit_id
    ok &= np.isin(idx, part.held_once(), assume_unique=True)
    if updating is not None and len(updating):
        ok &= ~np.isin(idx, updating)
    s.second_unit[idx[ok]] = unit_id
    return int(ok.sum())


class Copies:
    """The second copies of the writes to a partition of two copies: where a put's goes, a first
    commit of two, and the commit of a copy made again."""

    def __init__(self, state: ControllerState, copy_again: Callable[[], None]) -> None:
        self.state = state
        self._copy_again = copy_again  # the copier (its own loop goes from one batch to the next)

    def place(self, msg: Grant, first: Unit) -> Unit | None:
        """A second unit for a put to a partition of two copies: on another host where one has
        room, else another unit; None where no other live unit has room (the put is stored
        once, and said so: its samples count among the partition's single copies)."""
        others = [u for u in self.state.units.values()
                  if u.alive and not u.suspect and u is not first and u.fits(msg.nbytes)]
        if not others:
            log.warning("partition %r: no second live unit with room, a put of %d samples is stored once",
                        msg.partition, msg.count)
            return None
        apart = [u for u in others if u.info.host != first.info.host]
        pool = apart or others
        return min(pool, key=lambda u: (u.load, u.info.unit_id))

    def of_update(self, part: Partition, indexes: np.ndarray) -> tuple[UnitInfo | None, list[UnitInfo]] | None:
        """The units an update of ``indexes`` in a partition of two copies writes: those of the
        copies now, which may differ from where the writer located them (a death promoted a
        copy, a copy was made); None where the samples are not all on the same two (the writer
        locates them again). (None, []): the unit is the one the writer located."""
        if not len(indexes) or indexes.min() < 0 or indexes.max() >= part.n:
            return None, []
        pairs = set(zip(part.samples.unit[indexes].tolist(), part.samples.second_unit[indexes].tolist()))
        if len(pairs) != 1:
            return None
        first, second = pairs.pop()
        units = self.state.units
        return (units[first].info if first in units else None), ([units[second].info] if second in units else [])

    def committed(self, part: Partition, grant: GrantRecord) -> None:
        """A write to a partition of two copies committed on every unit it was granted: a put's
        second copy recorded, or a put that no second unit had room for held once and copied
        when one has."""
        if grant.second_unit >= 0:  # both copies are stored: the samples are ready, each on two units
            part.samples.second_unit[grant.start : grant.start + grant.count] = grant.second_unit
        elif grant.indexes is None:
            part.single += grant.count
            self.state.loop.call_soon(self._copy_again)

    def copied(self, grant: GrantRecord, msg: Commit) -> Committed:
        """A copy made again is stored: recorded where still wanted."""
        del self.state.grants[msg.grant_id]
        part = self.state.partitions.by_uid.get(grant.partition_uid)
        if part is None:
            raise PartitionClearedError(f"the partition of grant {msg.grant_id} was cleared before its copy was stored")
        alive = {u.info.unit_id for u in self.state.units.values() if u.alive}
        n = record_copy(part, grant, msg.unit_id, alive, self._updating(part.uid))
        log.info("partition %r: %d samples held once have a second copy on unit %d", part.name, n, msg.unit_id)
        unit = self.state.units.get(msg.unit_id)
        if unit is not None:
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        return Committed(sealed=part.sealed)

    def _updating(self, uid: int) -> np.ndarray:
        """The samples of partition ``uid`` that an update granted and not yet committed writes."""
        pending = [g.indexes for g in self.state.grants.values()
                   if g.partition_uid == uid and g.indexes is not None and g.copy_of is None]
        return np.concatenate(pending) if pending else np.zeros(0, dtype=np.int64)

    def first(self, grant: GrantRecord, msg: Commit) -> Committed:
        """One unit of a put of two copies holds its copy; the samples are ready once the other
        does too (a reader never sees a sample held once that was meant to be held twice)."""
        grant.waiting.discard(msg.unit_id)
        part = self.state.partitions.by_uid.get(grant.partition_uid)
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


class Failover:
    """A unit's death, for the readers of partitions of two copies: its samples with a copy on a
    live unit are served from that copy (:meth:`promote`, before the losses are counted), and a
    reader whose fetch from a failing unit asks ``Locate`` with ``moved_from`` waits for that
    unit's verdict: answered once it is declared dead (:meth:`unit_gone`), or at its timeout
    with where the samples still are. ``Locate`` also places rows allocated ahead of their data
    at their first write (``place``: as a put's grant is placed)."""

    def __init__(self, state: ControllerState, *, place: Callable[[Grant], Unit]) -> None:
        self.state = state
        self._parked: dict[int, list[tuple[bytes, Locate, asyncio.TimerHandle]]] = {}  # unit id -> Locates waiting
        self._place = place

    def promote(self, unit_id: int) -> None:
        """Unit ``unit_id`` died: samples with a copy on a live unit are served from it."""
        alive = {u.info.unit_id for u in self.state.units.values() if u.alive}
        for part in list(self.state.partitions.values()):
            kept = part.promote(unit_id, alive)
            if kept:
                log.warning("partition %r: %d samples of storage unit %d are served from their copies now", part.name,
                            kept, unit_id)

    def locate(self, ident: bytes, msg: Locate, bufs: list[Any]) -> Located | None:
        located = self._located(msg)
        unit = self.state.units.get(msg.moved_from)
        if (located.two_copies and unit is not None and unit.alive and msg.moved_from in located.units
                and msg.timeout > 0):
            self.state.parked.check(f"a read's wait for the copies of unit {msg.moved_from}")
            timer = self.state.loop.call_later(msg.timeout, self._expire, msg.moved_from, ident, msg)
            self._parked.setdefault(msg.moved_from, []).append((ident, msg, timer))
            return None  # answered once the unit is declared dead (unit_gone), or at the timeout
        return located

    def unit_gone(self, unit_id: int) -> None:
        """A unit was declared dead and its samples promoted: answer the reads waiting on it."""
        for ident, msg, timer in self._parked.pop(unit_id, []):
            timer.cancel()
            self._answer(ident, msg)

    def _expire(self, unit_id: int, ident: bytes, msg: Locate) -> None:
        waiting = self._parked.get(unit_id, [])
        self._parked[unit_id] = [w for w in waiting if w[1] is not msg]
        self._answer(ident, msg)  # where the samples are still: the reader gives up on its copies

    def _answer(self, ident: bytes, msg: Locate) -> None:
        try:
            self.state.server.reply(ident, msg.rid, self._located(msg))
        except TQueueError as exc:  # the partition went meanwhile: the error is the answer
            self.state.server.reply_error(ident, msg.rid, exc)

    def _located(self, msg: Locate) -> Located:
        part = self.state.partitions.live(msg.partition, msg.partition_uid)
        idx = np.asarray(msg.indexes, dtype=np.int64)
        part.samples.check_indexes(idx, part.name)
        units = part.samples.unit[idx]
        unplaced = idx[units < 0]
        if len(unplaced):
            unit = self._place(Grant(partition=part.name, count=len(unplaced), blocks=[], host=msg.host))
            part.samples.unit[unplaced] = unit.info.unit_id
        units = part.samples.unit[idx].tolist()
        dead = {u.info.unit_id for u in self.state.units.values() if not u.alive}
        copies = part.options.copies or self.state.config.copies
        return Located(units=units, gone=[u in dead for u in units], two_copies=copies > 1,
                       second_units=part.samples.second_unit[idx].tolist())


def copies_of(part: Partition, indexes: np.ndarray) -> set[int]:
    """The units an update of ``indexes`` of a partition of two copies must reach (both copies,
    one pair for all of them; the client groups by pair after a ``Locate``); empty otherwise."""
    seconds = part.samples.second_unit[indexes]
    if not len(indexes) or (seconds < 0).all():
        return set()
    pairs = set(zip(part.samples.unit[indexes].tolist(), seconds.tolist()))
    if len(pairs) != 1:
        raise InvalidArgumentError(
            f"partition {part.name!r}: an update of samples held by different pairs of units {sorted(pairs)[:4]}; "
            "write each pair's samples apart (the client does, after asking where they are)"
        )
    return {u for u in pairs.pop() if u >= 0}
