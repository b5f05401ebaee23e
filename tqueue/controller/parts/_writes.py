"""The controller's write side: grants, placement, the memory budget and staleness admission.

A grant is answered at once, or parked (no polling) until memory frees or the trainer's
version admits more samples, or refused with a typed error that says what was asked, used and
allowed. Acts on the :class:`~tqueue.controller.model._state.ControllerState` it is given.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ...errors import (
    InvalidArgumentError,
    PartitionClearedError,
    SchemaError,
    StorageFullError,
    StorageUnitUnavailableError,
    TQueueError,
    WaitTimeoutError,
)
from ...transport._liveness import session_of
from ...wire import Commit, Commits, CommitsDone, Committed, Grant, Granted, Ok, Reserve, error_reply
from ..model._partition import NO_STEP, GrantRecord, Partition
from ..model._state import MAX_SERVED, ControllerState, ParkedWrite, Unit, Wait
from ._copies import Copies, copies_of
from ._cycles import Cycles

log = logging.getLogger(__name__)


class Writes:
    """Grants, commits, the memory budget and staleness admission, over ``state``."""

    def __init__(
        self,
        state: ControllerState,
        *,
        free: Callable[[Partition], None],
        wake: Callable[[str], None],
        sealed: Callable[[Partition], None],
        suspect: Callable[[int, str], None],
        copy_again: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        self.granted: collections.OrderedDict[tuple[bytes, int], int] = collections.OrderedDict()  # (ident, rid) -> grant
        self.committed: collections.OrderedDict[int, None] = collections.OrderedDict()  # lately committed grants
        self.placements = itertools.count()  # ties between units rotate by it
        self.copies = Copies(state, copy_again)  # the second copies of writes to partitions of two copies
        self._free = free  # free a partition if every task consumed it
        self._wake = wake  # serve the parked reads of a partition (after the reply: loop.call_soon)
        self._sealed = sealed  # announce a partition this commit sealed (after the wake)
        self._suspect = suspect  # (unit id, why): a client's store failed there; probe it
        self.cycles = Cycles(state)  # parked puts and reads that wait on each other

    def grant(self, ident: bytes, msg: Grant, bufs: list[Any]) -> Granted | None:
        if msg.count < 1:
            raise InvalidArgumentError(f"partition {msg.partition!r}: a write needs samples")
        if msg.groups is not None and len(msg.groups) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {len(msg.groups)} group ids for {msg.count} samples"
            )
        if msg.versions is not None and len(msg.versions) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {len(msg.versions)} versions for {msg.count} samples"
            )
        if msg.indexes is not None:
            updated = self._grant_update(msg)
            self._remember(ident, msg.rid, updated)
            return updated
        if msg.replaces:
            stored = self._replace(ident, msg)
            if stored is not None:
                return stored
        try:
            granted = self._grant_put(msg)
        except Wait as wait:
            self._park(ident, msg, wait)
            return None  # answered when it fits, or at its deadline
        self._remember(ident, msg.rid, granted)
        return granted

    def _remember(self, ident: bytes, rid: int, granted: Granted) -> None:
        """Which grant answered which request, for a cancel that crosses the reply, and
        which session owns it, to free it when that session ends."""
        record = self.state.grants.get(granted.grant_id)
        if record is not None:
            record.owner = session_of(ident)
        if granted.grant_id:
            self.granted[(ident, rid)] = granted.grant_id
            while len(self.granted) > MAX_SERVED:
                self.granted.popitem(last=False)

    def _replace(self, ident: bytes, msg: Grant) -> Granted | None:
        """A put whose store failed on its unit asks again: its old grant lapses, the unit is
        suspected (no placements until it answers a probe) and the put is placed anew. A
        grant committed before the failure reached its writer answers ``stored``."""
        record = self.state.grants.get(msg.replaces)
        if record is None:
            if msg.replaces in self.committed:
                return Granted(grant_id=msg.replaces, partition_uid=0, start=0, stored=True)
        elif record.owner != session_of(ident) or record.indexes is not None:
            raise InvalidArgumentError(f"grant {msg.replaces} is not a put of this client's to place again")
        else:
            self._lapse_grant(msg.replaces, f"could not be stored on storage unit {record.unit_id}")
        if msg.failed_unit >= 0:
            self._suspect(msg.failed_unit, f"a client could not store a put of partition {msg.partition!r} on it")
        return None

    def cancelled(self, ident: bytes, rid: int) -> None:
        """The caller of an answered put gave up on it before seeing its grant: it will
        never store, so the grant lapses now (its memory and target places are freed)."""
        grant_id = self.granted.pop((ident, rid), None)
        if grant_id is not None:
            self._lapse_grant(grant_id, "was cancelled by its caller")

    def _grant_put(self, msg: Grant, via: frozenset[str] = frozenset()) -> Granted:
        """``via``: the partitions a late put was recycled through to get here."""
        part = self.state.partitions.get(msg.partition)
        if part is None:
            if self.state.partitions.buried(msg.partition):
                log.info("a put of %d samples to partition %r, sealed and freed, is refused", msg.count, msg.partition)
                return Granted(grant_id=0, partition_uid=0, start=0, status="aborted", sealed=True, partition=msg.partition)
            # validate against a scratch partition: nothing is created for a refused put
            self.state.partitions.check_new(msg.partition)
            added = Partition(msg.partition, 0, max_samples=self.state.config.max_partition_samples).check_put(msg)
            assert added is not None  # a new partition is neither sealed nor has a target
            twice = self._twice(None)
            unit, admitted = self._room(msg)
            part = self.state.partitions.get_or_create(msg.partition)
            start, kept = part.admit_put(msg, added)
        else:
            # the partition is asked once, to check and record the put, once there is room
            # for it; a put that must wait for room is checked first (a bad one fails now, a
            # late one is answered now)
            take = part.callers_within(msg) if msg.callers is not None else 0
            if take:
                return Granted(grant_id=0, partition_uid=part.uid, start=0, partition=part.name, take=take)
            twice = self._twice(part)
            try:
                unit, admitted = self._room(msg)
            except Wait:
                if part.check_put(msg) is None:
                    return self._late_put(part, msg, via)
                raise
            try:
                placed = part.put(msg)
            except BaseException:
                self.state.trainer.admitted -= admitted  # not admitted after all
                raise
            if placed is None:
                self.state.trainer.admitted -= admitted
                return self._late_put(part, msg, via)
            start, kept = placed
        second = self.copies.place(msg, unit) if twice else None
        unit.reserved += msg.nbytes
        if second is not None:
            second.reserved += msg.nbytes
        grant_id = next(self.state.grants.ids)
        fields = frozenset(b.name for b in msg.blocks)
        self.state.grants[grant_id] = GrantRecord(
            grant_id, part.uid, unit.info.unit_id, start, msg.count, None, fields, msg.nbytes,
            partial=msg.partial, kept=kept, admitted=admitted,
            timer=self.state.loop.call_later(self.state.config.grant_timeout, self._lapse_grant, grant_id),
            second_unit=second.info.unit_id if second is not None else -1,
            waiting={unit.info.unit_id} | ({second.info.unit_id} if second is not None else set()),
        )
        return Granted(
            grant_id=grant_id, partition_uid=part.uid, start=start, unit=unit.info, schema=dict(part.schema.specs),
            partition=part.name, kept=-1 if kept == msg.count else kept,
            second_units=[second.info] if second is not None else [],
            dedup=sorted(part.options.dedup),
        )

    def _late_put(self, part: Partition, msg: Grant, via: frozenset[str]) -> Granted:
        """A put to a sealed partition, or one whose target earlier puts already hold:
        recycled as partial samples into the partition's ``recycle_to``, or refused
        (``aborted``, nothing is sent); the producer learns which from the reply. A chain of
        recycle partitions that comes back to one it passed ends there (refused)."""
        when = "after seal" if part.sealed else "over target"
        recycle = part.options.recycle_to
        if recycle and recycle != part.name and recycle not in via:
            redirected = msgspec.structs.replace(msg, partition=recycle, partial=True, callers=None)
            granted = self._grant_put(redirected, via | {part.name})
            if granted.status != "aborted":  # the recycle partition may refuse them too
                part.reasons[f"recycled {when}"] += msg.count
                return msgspec.structs.replace(granted, status="recycled", sealed=part.sealed)
        part.reasons[f"discarded {when}"] += msg.count
        return Granted(
            grant_id=0, partition_uid=part.uid, start=0, status="aborted", sealed=part.sealed, partition=part.name
        )

    def _grant_update(self, msg: Grant) -> Granted:
        part = self.state.partitions.live(msg.partition, msg.partition_uid)
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        if len(indexes) != msg.count:
            raise InvalidArgumentError("count and indexes disagree")
        splice = _splice_rows(msg, part.name, frozenset(b.name for b in msg.blocks))
        placed = self.copies.of_update(part, indexes) if self._twice(part) else (None, [])
        if placed is None:
            return Granted(grant_id=0, partition_uid=part.uid, start=0, status="moved", partition=part.name)
        unit, second_units = placed
        kept = part.admit_update(msg, indexes)
        if kept is None:
            return Granted(grant_id=0, partition_uid=part.uid, start=0, status="aborted", sealed=part.sealed,
                           partition=part.name)
        grant_id = next(self.state.grants.ids)
        fields = frozenset(b.name for b in msg.blocks)
        segment = (int(msg.segment[0]), int(msg.segment[1])) if msg.segment else None
        self.state.grants[grant_id] = GrantRecord(
            grant_id, part.uid, -1, 0, msg.count, indexes, fields, complete=msg.complete, segment=segment, kept=kept,
            splice=splice,
            waiting=copies_of(part, indexes),
            # as a put's: an update whose writer never stores gives back the target places it took
            timer=self.state.loop.call_later(self.state.config.grant_timeout, self._lapse_grant, grant_id),
        )
        return Granted(grant_id=grant_id, partition_uid=part.uid, start=0, schema=dict(part.specs), unit=unit,
                       second_units=second_units, dedup=sorted(part.options.dedup))

    def commit(self, ident: bytes, msg: Commit, bufs: list[Any]) -> Committed:
        grant = self.state.grants.get(msg.grant_id)
        if grant is None:
            raise InvalidArgumentError(f"grant {msg.grant_id} is unknown or already committed")
        if grant.indexes is None and msg.unit_id not in (grant.unit_id, grant.second_unit):  # its own units only
            raise InvalidArgumentError(
                f"grant {msg.grant_id} was placed on unit {grant.unit_id}; unit {msg.unit_id} cannot commit it"
            )
        if set(msg.fields) != grant.fields and grant.copy_of is None:
            # refused without consuming the grant: the unit's own store of it may still come
            raise InvalidArgumentError(
                f"grant {msg.grant_id} was for fields {sorted(grant.fields)}, "
                f"the unit stored {sorted(msg.fields)}"
            )
        if grant.copy_of is not None:
            return self.copies.copied(grant, msg)
        if grant.waiting - {msg.unit_id}:  # a put or update of two copies: one copy of two
            return self.copies.first(grant, msg)
        del self.state.grants[msg.grant_id]
        self.committed[msg.grant_id] = None
        while len(self.committed) > MAX_SERVED:
            self.committed.popitem(last=False)
        unit = self.state.units.get(msg.unit_id)
        if unit is not None and grant.indexes is None:
            unit.reserved -= grant.nbytes
        part = self.state.partitions.by_uid.get(grant.partition_uid)
        if part is None:
            grant.stop_timer()
            raise PartitionClearedError(
                f"the partition of grant {msg.grant_id} was cleared before its data was stored"
            )
        was_sealed = part.sealed
        part.commit(grant, grant.unit_id if grant.indexes is None else msg.unit_id)  # ends the grant: its timer too
        if self._twice(part):
            self.copies.committed(part, grant)
        if unit is not None:
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        # Waiters are served after this reply is sent: a failure while serving one of them
        # must not undo (or even delay) a commit the controller already recorded. A read that
        # parks after this commit finds its samples as it arrives: none parked, none to wake.
        if part.name in self.state.parked.reads.by_key:
            self.state.loop.call_soon(self._wake, part.name)
        if part.sealed and not was_sealed:
            self.state.loop.call_soon(self._sealed, part)
        return Committed(sealed=part.sealed)

    def commits(self, ident: bytes, msg: Commits, bufs: list[Any]) -> CommitsDone:
        """A unit's commits of one turn, each recorded as ``commit`` records it alone and in
        order: one that is refused is answered with its error and changes nothing, the
        others are recorded all the same."""
        sealed: list[bool] = []
        errors: list[tuple[int, str, str]] = []
        for i, entry in enumerate(msg.entries()):
            try:
                sealed.append(self.commit(ident, entry, bufs).sealed)
            except Exception as exc:  # as the server answers a lone Commit: typed, and logged if a bug
                if not isinstance(exc, TQueueError):
                    log.error("commit of grant %d failed", entry.grant_id, exc_info=exc)
                error = error_reply(0, exc)
                sealed.append(False)
                errors.append((i, error.code, error.message))
        return CommitsDone(sealed=sealed, errors=errors)

    def _twice(self, part: Partition | None) -> bool:
        """Whether ``part`` (None: the one a put makes) is a partition of two copies."""
        return ((part.options.copies if part is not None else 0) or self.state.config.copies) > 1

    def _room(self, msg: Grant) -> tuple[Unit, int]:
        """The unit a put goes to and the samples admission counts for it (Wait where the
        memory budget or staleness holds it back)."""
        unit = self.state.units.pick(msg, self.state.config.capacity_bytes, self.placements)
        return unit, self._admit(msg.count - min(msg.reserved, msg.count), msg.partition)

    def place(self, msg: Grant) -> Unit:
        """A unit for ``msg`` now, as its grant would pick it; StorageUnitUnavailableError
        where none can take it (no waiting: this is for samples that have their place)."""
        try:
            return self.state.units.pick(msg, self.state.config.capacity_bytes, self.placements)
        except Wait as wait:
            raise StorageUnitUnavailableError(f"partition {msg.partition!r}: no unit can take samples: {wait.reason}") from None

    def _admit(self, count: int, partition: str) -> int:
        """AReaL-style staleness admission: raise Wait if ``count`` more samples to
        ``partition`` would put producers more than ``max_staleness`` versions ahead of the
        trainer; return how many samples it counts in the running total.

        A partition with a step (``Options.step``, or a name ending in ``step-N``) is read by
        the trainer at version ``step``: puts to it are admitted while ``step <= version +
        max_staleness``, and samples of later steps never hold them back. A put to a partition
        without a step counts in a running total of ``(version + max_staleness + 1) *
        batch_size`` samples; one larger than that window is not refused: it waits until the
        trainer's version makes room for all of it. Either way a put to a partition that a
        consumer is parked on is admitted at once: the trainer needs it now, and holding it
        back could only deadlock the trainer."""
        if self.state.trainer.admission is None or count <= 0:
            return 0
        k, batch = self.state.trainer.admission
        version = self.state.trainer.version
        step = self.state.partitions.step_of(partition)
        awaited = partition in self.state.parked.reads
        if step != NO_STEP:
            if step <= version + k or awaited:
                return 0
            raise Wait(
                f"{count} samples for partition {partition!r} (step {step}) wait for the trainer: "
                f"producers may run {k} steps ahead of trainer version {version} (max_staleness {k}), "
                f"so step {step} is admitted at version {step - k}",
                full=False,
            )
        limit = (version + k + 1) * batch
        if self.state.trainer.admitted + count > limit and not awaited:
            raise Wait(
                f"{count} samples for partition {partition!r} wait for the trainer: "
                f"{self.state.trainer.admitted} samples admitted of {limit} allowed (trainer version "
                f"{version}, max_staleness {k}, batch_size {batch})",
                full=False,  # never "never": the limit grows with each version, so any put fits in time
            )
        self.state.trainer.admitted += count
        return count

    def needed(self, partition: str) -> None:
        """A consumer parked on ``partition``: puts to it that wait for the trainer's
        version are admitted now (see ``_admit``); those that wait for memory are watched."""
        if any(not p.full and getattr(p.req, "partition", None) == partition for p in self.state.parked.writes):
            self.state.loop.call_soon(self.retry_parked)  # after the parking request's handler
        self.cycles.watch(partition)

    def _park(self, ident: bytes, msg: Grant | Reserve, wait: Wait) -> None:
        if wait.never or msg.timeout <= 0:
            raise (StorageFullError if wait.full else WaitTimeoutError)(wait.reason)
        self.state.parked.check(f"a write to partition {msg.partition!r}" if isinstance(msg, Grant) else "a reserve")
        parked = ParkedWrite(ident, msg, wait.reason, wait.full)
        self.state.parked.writes.park(parked, msg.timeout, self._expire_parked)
        if isinstance(msg, Grant):
            self.cycles.watch(msg.partition)

    def _expire_parked(self, parked: ParkedWrite) -> None:
        what = "put" if isinstance(parked.req, Grant) else "reserve"
        err = (StorageFullError if parked.full else WaitTimeoutError)(
            f"{what} timed out after {parked.req.timeout} s: {parked.reason}"
        )
        self.state.server.reply_error(parked.ident, parked.req.rid, err)

    def retry_parked(self) -> None:
        for parked in list(self.state.parked.writes):
            try:
                if isinstance(parked.req, Grant):
                    reply: Any = self._grant_put(parked.req)
                else:
                    self._admit(parked.req.count, "(reserved)")
                    reply = Ok()
            except Wait as wait:
                parked.reason, parked.full = wait.reason, wait.full
                continue
            except Exception as exc:  # this write's failure is this write's answer alone
                reply = exc
            self.state.parked.writes.remove(parked)
            if isinstance(reply, Granted):
                self._remember(parked.ident, parked.req.rid, reply)
            self.state.parked.answer(parked.ident, parked.req.rid, reply)

    def reserve(self, ident: bytes, msg: Reserve, bufs: list[Any]) -> Ok | None:
        if msg.count < 1:
            raise InvalidArgumentError(f"reserve needs a count of at least 1, got {msg.count}")
        try:
            self._admit(msg.count, "(reserved)")
        except Wait as wait:
            self._park(ident, msg, wait)
            return None  # answered when it fits, or at its deadline
        return Ok()

    def _lapse_grant(self, grant_id: int, why: str = "was never committed") -> None:
        grant = self.state.grants.pop(grant_id, None)
        if grant is None:
            return  # committed (or its partition is gone)
        grant.stop_timer()
        if grant.indexes is None:
            log.warning("grant %d %s; its %d samples are dropped", grant_id, why, grant.count)
        else:
            log.warning("grant %d %s; its update of %d samples is dropped", grant_id, why, grant.count)
        # a put's units that had not stored it (an update reserved nothing)
        for unit_id in (grant.waiting or {grant.unit_id}) if grant.indexes is None else ():
            unit = self.state.units.get(unit_id)
            if unit is not None:
                unit.reserved -= grant.nbytes
        self.state.trainer.admitted -= grant.admitted  # its samples never came: the window is theirs again
        part = self.state.partitions.by_uid.get(grant.partition_uid)
        if part is not None:
            part.forget(grant)
            self._free(part)
            self.state.loop.call_soon(self._wake, part.name)  # its readers may learn a field will not come
        self.retry_parked()

    def lapse(self, grant_id: int, why: str) -> None:
        """Drop an uncommitted grant now (its memory, admission and target places return)."""
        self._lapse_grant(grant_id, why)

    def lapse_owned(self, session: bytes, why: str) -> int:
        """Lapse every uncommitted grant (a put's or an update's) of a client session that
        ended, and forget which of its requests got which grant."""
        for key in [k for k in self.granted if session_of(k[0]) == session]:
            del self.granted[key]
        owned = [g.grant_id for g in self.state.grants.values() if g.owner == session and g.copy_of is None]
        for grant_id in owned:
            self._lapse_grant(grant_id, why)
        return len(owned)

    def forget(self, part: Partition) -> None:
        """A partition is forgotten: so are its grants (their commits will find none)."""
        for grant_id in [g for g, r in self.state.grants.items() if r.partition_uid == part.uid]:
            grant = self.state.grants.pop(grant_id)
            grant.stop_timer()
            for unit_id in (grant.waiting or {grant.unit_id}) if grant.indexes is None else ():
                unit = self.state.units.get(unit_id)
                if unit is not None:
                    unit.reserved -= grant.nbytes  # its commit will find no grant to release it

    def lapse_on(self, unit_id: int, why: str) -> int:
        """Lapse every uncommitted grant placed on a unit that died: a put's, and an
        update's of samples that unit holds (their store can never come)."""
        placed = [g.grant_id for g in self.state.grants.values() if g.copy_of is None and self._on(g, unit_id)]
        for grant_id in placed:
            self._lapse_grant(grant_id, why)
        return len(placed)

    def _on(self, grant: GrantRecord, unit_id: int) -> bool:
        if grant.indexes is None:
            return unit_id in (grant.unit_id, grant.second_unit)
        if unit_id in grant.waiting:
            return True
        part = self.state.partitions.by_uid.get(grant.partition_uid)
        if part is None or not len(grant.indexes):
            return False
        return bool((part.samples.unit[grant.indexes] == unit_id).any())


def _splice_rows(msg: Grant, partition: str, fields: frozenset[str]) -> dict[str, np.ndarray] | None:
    """An update's splice rows, checked: per field it writes, one row >= 0 per sample, and a
    version segment for them to belong to."""
    if not msg.splice:
        return None
    if msg.segment is None:
        raise InvalidArgumentError(f"partition {partition!r}: splice rows come with a version segment (complete())")
    out = {}
    for name, rows in msg.splice.items():
        if name not in fields:
            raise SchemaError(f"partition {partition!r}: field {name!r} is spliced but the write has no values of it")
        arr = np.asarray(rows, dtype=np.int64)
        if len(arr) != msg.count or (arr < 0).any():
            raise InvalidArgumentError(
                f"field {name!r} of partition {partition!r}: splice rows are one row >= 0 per sample ({msg.count})"
            )
        out[name] = arr
    return out
