"""A partition's metadata, free of IO, and the records of the writes to it in flight
(:class:`GrantRecord`; the storage units' records are in :mod:`._state`). A :class:`Partition` composes what it holds: its :class:`Schema` (fields,
bits, lengths: below, in this module), its :class:`~._samples.Samples` (per-sample arrays,
groups) and a :class:`~._samples.TaskState` per task that reads it (leases, acks and the
scans for ready samples); it keeps the counts and the lifetime (seal, target, free) that tie
them together. A put and a read enter this module for all of it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
from collections.abc import Iterable, Sequence

import numpy as np

from ...errors import InvalidArgumentError, SchemaError, UnknownFieldError
from ...wire import FieldBlock, FieldSpec, Grant, GroupId
from ._keyindex import KeyIndex
from ._samples import AVAILABLE, COMMITTED, EXCLUDED, LEASED, PARTIAL, Groups, Moved, Samples, TaskState, count_ready, grow

FAILURE_POLICIES = ("drop_group", "mask_member")
FIRST_READY, WHOLE_GROUPS = "first_ready", "groups"  # batch policies (planning/_batch_policies.py)

log = logging.getLogger(__name__)
NO_STEP = -1
_STEP_NAME = re.compile(r"(?:^|[/._:-])step[-_]?(\d{1,18})$")


def step_in(name: str) -> int:
    """The training step a partition's name carries (``train/step-17``, ``step_3``), else
    NO_STEP: the step whose batch the trainer reads at that version (see ``Options.step``)."""
    found = _STEP_NAME.search(name)
    return int(found.group(1)) if found else NO_STEP


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
    splice: dict[str, np.ndarray] | None = None  # an update's spliced fields: per sample, the first row it computes
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


@dataclasses.dataclass(frozen=True)
class Options:
    """How a partition behaves; fixed when it is created.

    ``fields``: the only fields it accepts (None: any). ``tasks``: the tasks that must
    consume every sample before the partition frees itself (None: those that asked).
    ``group_size``: samples per group (GRPO ``n``), needed to release whole groups.
    ``on_member_failure``: ``drop_group`` aborts a group when a member fails;
    ``mask_member`` releases the group without it. ``auto_free``: once sealed (no more
    samples will come), free the partition when every task has consumed every sample.
    ``target`` / ``target_groups``: over-sampling; the partition seals itself once this many
    samples (or whole groups) are complete, and aborts the surplus. ``recycle_to``: puts that
    arrive after the seal go to that partition as partial samples instead of being discarded.
    ``prefetch``: a consumer short of samples here may take ready ones from that partition.
    ``step``: the trainer's version at which it reads this partition, for the staleness
    bound (NO_STEP: taken from a name ending in ``step-N``, else none). ``copies``: copies
    of each put, on as many units (1 or 2; 0: ``ControllerConfig.copies``). ``dedup``: fields
    shared by content, each value stored once per unit and sent once per put and per read
    (tqueue/wire/_shared.py).
    """

    fields: frozenset[str] | None = None
    tasks: frozenset[str] | None = None
    group_size: int = 0
    on_member_failure: str = "drop_group"
    auto_free: bool = True
    target: int = 0
    target_groups: int = 0
    recycle_to: str = ""
    prefetch: str = ""
    step: int = NO_STEP
    copies: int = 0
    dedup: frozenset[str] = frozenset()


DEFAULT_OPTIONS = Options()

class Partition:
    """``max_samples`` and ``max_tasks`` bound what requests may make it allocate: a put
    past them is refused before anything changes (see ``ControllerConfig``). Slotted, and its
    per-sample arrays start empty: 100,000 empty partitions cost the controller under 200 MB."""

    __slots__ = (
        "name", "uid", "options", "step", "max_samples", "max_tasks", "schema", "samples", "tasks", "unit_bytes",
        "committed", "excluded", "lost", "reasons", "in_flight", "sealed", "complete", "promised", "groups_done",
        "keys", "twice", "corrupt", "default_policy",
    )

    def __init__(
        self, name: str, uid: int, options: Options | None = None, *, max_samples: int = 1 << 40, max_tasks: int = 1 << 20
    ) -> None:
        self.name = name
        self.uid = uid
        self.options = options or DEFAULT_OPTIONS
        self.step = self.options.step if self.options.step != NO_STEP else step_in(name)
        self.max_samples = max_samples
        self.max_tasks = max_tasks
        self.schema = Schema(name, self.options.fields)
        self.samples = Samples()
        self.tasks: dict[str, TaskState] = {}
        self.unit_bytes: dict[int, int] = {}
        self.committed = 0
        self.excluded = 0
        self.lost = 0  # samples whose storage unit died (excluded, reason "lost")
        self.twice = self.options.copies > 1  # its samples are meant to be held by two units (see ``single``)
        self.corrupt = 0  # copies dropped because a reader found their bytes changed (CRC-32C)
        self.reasons: collections.Counter[str] = collections.Counter()
        self.in_flight = 0  # grants not yet committed
        self.sealed = False  # no more samples will be put
        self.complete = 0  # committed, finished and not excluded
        self.promised = 0  # target places held by puts granted but not yet committed
        self.groups_done = 0  # complete groups counted toward target_groups
        self.keys: KeyIndex | None = None  # user keys and sample tags, made on first use (parts/_user_keys.py)
        # The batch policy of a read that names none: whole groups where the partition has a
        # group size, else index order. (Without a group size nothing tells when a group is
        # whole: the first put with groups there says so, once.)
        self.default_policy = WHOLE_GROUPS if self.options.group_size else FIRST_READY

    @property
    def n(self) -> int:
        return self.samples.n

    def held_once(self) -> np.ndarray:
        """Samples meant to be held by two units that one unit alone holds now (after a
        unit's death, a put no second unit had room for, a restore): committed, stored, not
        excluded (lost, aborted, failed, cleared, moved away), without a second copy."""
        if not self.twice:
            return np.zeros(0, dtype=np.int64)
        n, s = self.n, self.samples
        live = (s.mask[:n] & (COMMITTED | EXCLUDED)) == COMMITTED
        return np.flatnonzero(live & (s.second_unit[:n] < 0) & (s.unit[:n] >= 0))

    @property
    def single(self) -> int:
        """How many samples are held once now (:meth:`held_once`), as ``status()`` reports."""
        return len(self.held_once())

    @single.setter
    def single(self, value: int) -> None:
        # Writers that leave samples held once (a put no second unit had room for, a restored
        # checkpoint) add them here; the count is the samples' own, so what this records is
        # that the partition's samples are meant to be held twice (a cluster's default).
        if value > 0:
            self.twice = True

    @property
    def specs(self) -> dict[str, FieldSpec]:
        return self.schema.specs

    @property
    def groups(self) -> Groups:
        return self.samples.groups

    # --- writes ---------------------------------------------------------------------

    def check_put(self, msg: Grant) -> dict[str, FieldSpec] | None:
        """Refuse a put past ``max_samples`` or against the schema (nothing is changed);
        return the specs it would add, or None where it comes late (the partition is sealed,
        or, for complete samples, every place of its target is taken), unchecked."""
        target = self.options.target
        if self.sealed or (not msg.partial and target and self.complete + self.promised >= target):
            return None
        self.check_room(msg.count)
        return self.schema.check_blocks(msg.blocks, msg.count)

    def put(self, msg: Grant) -> tuple[int, int] | None:
        """``check_put`` then ``admit_put``: where its samples start and how many are kept;
        None where the put comes late (nothing is changed)."""
        added = self.check_put(msg)
        return None if added is None else self.admit_put(msg, added)

    def callers_within(self, msg: Grant) -> int:
        """A put of several callers (``Grant.callers``) that would cross the target before
        its last caller: the samples of the callers up to the one that crosses (the writer
        puts them, then the others apart, which come late). 0: grant it as it is."""
        target = self.options.target
        if msg.callers is None or msg.partial or not target or self.sealed:
            return 0
        room = target - self.complete - self.promised
        if room <= 0:
            return 0  # late as a whole
        upto = np.cumsum(msg.callers)
        take = int(upto[np.searchsorted(upto, room)]) if room < msg.count else msg.count
        return take if take < msg.count else 0

    def check_room(self, count: int) -> None:
        """Refuse ``count`` more samples past ``max_samples`` (nothing is changed)."""
        if count < 0 or self.n + count > self.max_samples:
            raise InvalidArgumentError(
                f"partition {self.name!r} holds {self.n} samples; count={count} more would pass "
                f"max_partition_samples={self.max_samples}"
            )

    def admit_put(self, msg: Grant, added: dict[str, FieldSpec]) -> tuple[int, int]:
        """Record a granted put (checked by ``check_put``): its fields, samples and lengths.
        Return where its samples start and how many of them are kept (see ``promise``)."""
        start = self.allocate(msg.count, msg.groups, msg.versions)
        self.schema.record(added, msg.blocks, msg.count, slice(start, start + msg.count), self.n)
        return start, msg.count if msg.partial else self.promise(msg.count)

    def admit_update(self, msg: Grant, indexes: np.ndarray) -> int | None:
        """Check and record an update of committed samples: its fields and lengths. Return the
        target places a completion takes, or None where the target has no room for all of
        them (nothing is granted: the samples stay partial)."""
        added = self.schema.check_blocks(msg.blocks, msg.count)
        appended = frozenset(msg.append or ())
        self.schema.check_appends(appended, msg.blocks, self.options.dedup)
        self.samples.check_indexes(indexes, self.name)
        self.schema.record(added, msg.blocks, msg.count, indexes, self.n, appended)
        if not (msg.complete and self.options.target):
            return 0
        # completing partial rollouts takes places of the target, as a put does: all of
        # them, or none (the samples stay partial; the caller may postpone them)
        finishing = self.samples.finishing(indexes)
        kept = self.promise(finishing) if not self.sealed else 0
        if kept < finishing:
            self.promised -= kept
            self.reasons["completion refused: target reached"] += finishing
            return None
        return kept

    def allocate(self, count: int, groups: Sequence[GroupId] | None, versions: Sequence[int] | None) -> int:
        cap, grouped = len(self.samples.mask), self.samples.has_groups
        start = self.samples.allocate(count, groups, versions)
        if groups is not None and not grouped and not self.options.group_size and not self.options.target:
            log.warning(
                "partition %r holds samples put with groups but has no group_size: a read that names no policy "
                "takes them in index order, and may split groups (create_partition(..., grouping=Grouping(n)) keeps them whole)",
                self.name,
            )
        if len(self.samples.mask) != cap:  # the samples' arrays grew: each task's grow with them
            for task in self.tasks.values():
                task.ensure(len(self.samples.mask))
        self.in_flight += 1
        return start

    def commit(self, grant: GrantRecord, unit_id: int) -> None:
        """Record a grant's samples as stored on ``unit_id``; the grant ends (its timer stops)."""
        grant.stop_timer()
        bits = COMMITTED
        for name in grant.fields:
            bits |= self.schema.bits[name]
        if grant.indexes is not None:
            idx = grant.indexes
            self.samples.mask[idx] |= bits
            self.samples.revision[idx] += 1
            if grant.segment is not None:
                self.samples.add_segment(idx, *grant.segment, splice=grant.splice)
            if grant.complete:
                finished = idx[(self.samples.mask[idx] & PARTIAL) != 0]
                self.samples.mask[finished] &= ~PARTIAL
                self.promised -= grant.kept
                self._count_complete(finished)
            return
        sl = slice(grant.start, grant.start + grant.count)
        if grant.partial:
            bits |= PARTIAL
        self.samples.mask[sl] |= bits
        self.samples.unit[sl] = unit_id
        self.committed += grant.count
        self.in_flight -= 1
        if not grant.partial:
            self.promised -= grant.kept
            if grant.kept < grant.count:  # the producer was told at its grant which are kept
                self.exclude(np.arange(grant.start + grant.kept, grant.start + grant.count), "over target")
            self._count_complete(np.arange(grant.start, grant.start + grant.kept))

    def promise(self, count: int) -> int:
        """How many of a put's ``count`` samples are kept: all without a target, else those
        that fit in what completed samples and earlier grants left of it (held until the put
        commits or is forgotten)."""
        target = self.options.target
        if not target:
            return count
        kept = max(0, min(count, target - self.complete - self.promised))
        self.promised += kept
        return kept

    def _count_complete(self, indexes: np.ndarray, toward_target: bool = True) -> None:
        """Finished samples: count them toward their groups and the partition's target."""
        live = indexes[(self.samples.mask[indexes] & EXCLUDED) == 0]
        target = self.options.target if toward_target else 0
        if target and self.complete + len(live) > target:
            over = live[target - self.complete :] if self.complete < target else live
            self.exclude(over, "over target")
            live = live[: max(0, target - self.complete)]
        self.complete += len(live)
        late, done = self.samples.groups.commit(indexes, self.samples.group[indexes], self.options.group_size)
        if len(late):  # late members of an aborted group
            self.exclude(late, "group aborted")
        for g in done if toward_target else ():
            self._count_group(g)
        if target and self.complete >= target:
            self.sealed = True

    def _count_group(self, g: int) -> None:
        target = self.options.target_groups
        if not target:
            return
        if self.groups_done >= target:
            self.abort_group(g, "over target")
            return
        self.groups_done += 1
        if self.groups_done >= target:
            self.sealed = True

    def forget(self, grant: GrantRecord) -> None:
        """A grant that will never commit (its write failed)."""
        if grant.indexes is not None:
            self.promised -= grant.kept
            return
        self.in_flight -= 1
        if not grant.partial:
            self.promised -= grant.kept
        self.samples.mask[grant.start : grant.start + grant.count] |= EXCLUDED

    def exclude(self, indexes: np.ndarray, reason: str) -> int:
        """Never serve these samples again; count them under ``reason``."""
        fresh = indexes[(self.samples.mask[indexes] & (EXCLUDED | COMMITTED)) == COMMITTED]
        self.samples.mask[indexes] |= EXCLUDED
        self.excluded += len(fresh)
        self.reasons[reason] += len(fresh)
        for task in self.tasks.values():
            task.release(fresh)
        return len(fresh)

    def take_out(self, indexes: np.ndarray, reason: str) -> Moved:
        """Everything the controller knows of these samples, which leave (excluded here)."""
        schema = self.schema
        moved = self.samples.pack(indexes, self.uid, schema.specs, schema.bits, schema.lengths)
        self.exclude(indexes, reason)
        return moved

    def restore(self, indexes: np.ndarray, reason: str) -> None:
        """Undo ``take_out`` for samples whose move failed: their data never left."""
        back = self.samples.unexclude(indexes)
        self.excluded -= back
        self.reasons[reason] -= back
        if self.reasons[reason] <= 0:
            del self.reasons[reason]

    def reserve_in(self, moved: Moved) -> np.ndarray:
        """Indexes here for samples on their way in (invisible until ``land``)."""
        self.schema.add(self.schema.check_moved(moved))
        count = len(moved.units)
        start = self.allocate(count, moved.groups, None)
        return np.arange(start, start + count)

    def land(self, idx: np.ndarray, moved: Moved) -> None:
        """The samples' data is keyed here now: make them visible (partial ones stay hidden)."""
        self.samples.land(idx, moved, self.schema.bits)
        self.schema.land_lengths(idx, moved.lengths, self.n)
        self.committed += len(idx)
        self.in_flight -= 1
        self._count_complete(idx[~moved.partial], toward_target=False)

    def drained(self) -> bool:
        """Sealed, and nothing is on its way in: what is ready now is all there will be."""
        return self.sealed and not self.in_flight

    def fail_members(self, gid: GroupId, count: int, reason: str) -> None:
        g = self.samples.groups.of(gid)
        self.samples.has_groups = True
        self.samples.groups.failed[g] += count
        if self.options.on_member_failure == "drop_group":
            self.abort_group(g, f"member failed: {reason}")
        self.samples.groups.check(g, self.options.group_size)

    def fail_samples(self, indexes: np.ndarray, reason: str) -> None:
        self.exclude(indexes, f"failed: {reason}")
        self._abort_groups_of(indexes, f"member failed: {reason}")

    def promote(self, unit_id: int, alive: set[int]) -> int:
        """Before :meth:`lose`, a unit died: samples it held whose copy is on a live unit are
        served from that copy now, and copies it held are gone; all of them are held once
        (``single``) until copied again. Returns how many were promoted."""
        n = self.n
        unit, second = self.samples.unit[:n], self.samples.second_unit[:n]
        promoted = np.flatnonzero((unit == unit_id) & (second >= 0) & np.isin(second, list(alive)))
        unit[promoted] = second[promoted]
        second[promoted] = -1
        gone = np.flatnonzero(second == unit_id)
        second[gone] = -1
        if len(promoted) or len(gone):
            self.twice = True
        return len(promoted)

    def lose(self, unit_id: int, keep: np.ndarray | None = None) -> int:
        """The samples stored on a dead unit: excluded for good (reason ``lost``), counted
        per task that had not consumed them, and their groups treated as with failed
        members (``drop_group`` aborts them, ``mask_member`` serves them without). Leases
        on them end: their holders' reads fail, their acks count nothing."""
        idx = self.samples.on_unit(unit_id)
        if keep is not None and len(keep):
            idx = np.setdiff1d(idx, keep, assume_unique=True)
        return self.lose_samples(idx, "lost")

    def lose_samples(self, idx: np.ndarray, reason: str) -> int:
        """Samples whose bytes are gone (their unit died, or their only copy failed its
        checksum): excluded for good under ``reason``, lost for every task that had not
        consumed them, their groups treated as with failed members."""
        if not len(idx):
            return 0
        for task in self.tasks.values():
            state = task.state[idx]
            task.lost += int(((state == AVAILABLE) | (state == LEASED)).sum())
        self.lost += self.exclude(idx, reason)
        self._abort_groups_of(idx, "member lost")
        return len(idx)

    def _abort_groups_of(self, indexes: np.ndarray, reason: str) -> None:
        if self.options.on_member_failure == "drop_group":
            for g in np.unique(self.samples.group[indexes]).tolist():
                if g >= 0:
                    self.abort_group(g, reason)

    def abort_group(self, g: int, reason: str) -> None:
        if self.samples.groups.aborted[g]:
            return
        self.samples.groups.aborted[g] = True
        members = np.asarray(self.samples.groups.members[g], dtype=np.int64)
        if len(members):
            self.exclude(members, reason)

    # --- serving --------------------------------------------------------------------

    def task(self, name: str) -> TaskState:
        state = self.tasks.get(name)
        if state is None:
            if len(self.tasks) >= self.max_tasks:
                raise InvalidArgumentError(
                    f"partition {self.name!r} is read by {len(self.tasks)} tasks; task {name[:100]!r} "
                    f"would pass max_tasks_per_partition={self.max_tasks}"
                )
            state = self.tasks[name] = TaskState(self.samples)
            state.lost = self.lost  # what died before this task's first read, it never consumed
        return state

    def reading(self, fields: Iterable[str], task: str) -> tuple[np.uint64, list[str], TaskState | None]:
        """For a read of ``fields`` by ``task`` (one call): the fields' mask, those never
        written yet, and the task's state (None while some are missing)."""
        mask, missing = self.schema.field_mask(fields)
        return mask, missing, None if missing else self.task(task)

    def count_ready(self, task: TaskState | None, mask: np.uint64) -> int:
        return count_ready(self.samples, task, mask)

    # --- lifetime -------------------------------------------------------------------

    def ack(self, name: str, given: list[int], lease: int) -> tuple[TaskState, int, bool]:
        """Task ``name`` acknowledges the samples ``given`` under ``lease``: its state, how many
        it took, and whether the partition is now :meth:`finished`."""
        task = self.tasks.get(name)
        if task is None:
            raise InvalidArgumentError(f"task {name!r} has no samples of partition {self.name!r} to acknowledge")
        indexes = np.asarray(given, dtype=np.int64)
        if len(indexes) and not 0 <= lowest(given, indexes) <= highest(given, indexes) < self.samples.n:
            raise InvalidArgumentError(f"partition {self.name!r} has no sample {given}")
        return task, task.ack(indexes, lease), self.finished()

    def finished(self) -> bool:
        """Sealed, and every task that must read the partition consumed every live sample."""
        if not self.options.auto_free or not self.sealed or self.in_flight:
            return False
        names = self.options.tasks if self.options.tasks is not None else self.tasks.keys()
        if not names:
            return False
        live = self.committed - self.excluded
        for name in names:
            task = self.tasks.get(name)
            if task is None or task.consumed + task.refused < live:
                return False
        return True

    @property
    def nbytes(self) -> int:
        return sum(self.unit_bytes.values())


# --- the schema -------------------------------------------------------------------------
# A partition's schema, free of IO: its fields' specs and bits, the fields it declares, and
# the length of each sample of its jagged tensor fields (for balancing by tokens).
#
# A jagged tensor field's spec says whether its shapes have varied so far: its ``shape`` is the
# one shape every sample granted so far has, or ``()`` once two differ (or none was seen). That
# is one way only: a field whose shapes varied stays so, whatever is removed later.

MAX_FIELDS = 61


class Schema:
    """The fields of partition ``name``: each one's logical spec and bit in a sample's mask.
    ``declared``: the only fields it accepts (None: any)."""

    __slots__ = ("name", "declared", "specs", "bits", "lengths")

    def __init__(self, name: str, declared: frozenset[str] | None) -> None:
        self.name = name
        self.declared = declared
        self.specs: dict[str, FieldSpec] = {}
        self.bits: dict[str, np.uint64] = {}
        self.lengths: dict[str, np.ndarray] = {}  # jagged tensor fields: size of dim 0

    def check_blocks(self, blocks: Sequence[FieldBlock], count: int) -> dict[str, FieldSpec]:
        """Validate a write's fields against the partition; return the specs it would add."""
        added: dict[str, FieldSpec] = {}
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise SchemaError(f"partition {self.name!r}: a field is listed twice in {names}")
        for block in blocks:
            name = block.name
            if not isinstance(name, str) or not name:
                raise SchemaError(f"partition {self.name!r}: field names are non-empty strings")
            if self.declared is not None and name not in self.declared:
                raise UnknownFieldError(
                    f"field {name!r} is not declared for partition {self.name!r}; "
                    f"declared: {sorted(self.declared)}"
                )
            if block.spec.layout == "jagged" and block.spec.kind != "object":
                if block.shapes is None or len(block.shapes) != count * block.spec.ndim:
                    raise SchemaError(
                        f"field {name!r} of partition {self.name!r}: jagged field needs "
                        f"{count} per-sample shapes of {block.spec.ndim} dims"
                    )
            old = self.specs.get(name)
            if old is None:
                added[name] = _logical(block, count)
            else:
                _check_compatible(self.name, name, old, block)
        if len(self.specs) + len(added) > MAX_FIELDS:
            raise SchemaError(
                f"partition {self.name!r} would have {len(self.specs) + len(added)} fields; "
                f"at most {MAX_FIELDS} are supported"
            )
        return added

    def check_appends(self, appended: frozenset[str], blocks: Sequence[FieldBlock], shared: frozenset[str]) -> None:
        """An update's appended fields: jagged tensor fields the partition has, of the write,
        and not shared by content."""
        names = {b.name for b in blocks}
        for name in appended:
            spec = self.specs.get(name)
            if name not in names:
                raise SchemaError(f"partition {self.name!r}: field {name!r} is to be appended but the write has no values of it")
            if spec is None or spec.kind == "object" or spec.layout != "jagged" or spec.ndim == 0:
                raise SchemaError(
                    f"field {name!r} of partition {self.name!r}: only jagged tensor fields the partition holds "
                    "grow by appends (their rows along dim 0)"
                )
            if name in shared:
                raise SchemaError(f"field {name!r} of partition {self.name!r} is shared by content: it is written whole")

    def record(self, added: dict[str, FieldSpec], blocks: Sequence[FieldBlock], count: int,
               where: slice | np.ndarray, n: int, appended: frozenset[str] = frozenset()) -> None:
        """Record a write ``check_blocks`` passed: the fields it adds, the shapes it gives,
        the lengths of its samples at ``where`` (of ``n``; grown by those of ``appended``)."""
        self.add(added)
        self.note_shapes(blocks, count)
        self.record_lengths(blocks, where, n, appended)

    def add(self, specs: dict[str, FieldSpec]) -> None:
        """Add new fields' specs; a jagged field already here whose one shape differs from
        the new spec's is marked varied."""
        for name, spec in specs.items():
            old = self.specs.get(name)
            if old is not None:
                if old.layout == "jagged" and old.shape and tuple(spec.shape) != tuple(old.shape):
                    self.specs[name] = _varied(old)
                continue
            self.specs[name] = spec
            self.bits[name] = np.uint64(1 << len(self.bits))

    def note_shapes(self, blocks: Sequence[FieldBlock], count: int) -> None:
        """Mark varied the jagged fields this write gives a shape other than their one shape."""
        for block in blocks:
            old = self.specs.get(block.name)
            if old is None or old.layout != "jagged" or not old.shape:
                continue
            if _one_shape(block, count) != tuple(old.shape):
                self.specs[block.name] = _varied(old)

    def record_lengths(
        self, blocks: Sequence[FieldBlock], where: slice | np.ndarray, n: int, appended: frozenset[str] = frozenset(),
    ) -> None:
        """Remember dim 0 of each sample of jagged tensor fields (for token balancing); an
        appended field's grows by the rows appended."""
        for block in blocks:
            spec = self.specs.get(block.name)
            if spec is None or spec.kind == "object" or spec.layout != "jagged" or spec.ndim == 0:
                continue
            arr = self.lengths.get(block.name)
            arr = grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), n)
            if block.spec.layout == "dense":
                rows: int | np.ndarray = block.spec.shape[0] if block.spec.shape else 1
            else:
                rows = np.asarray(block.shapes, dtype=np.int64).reshape(-1, block.spec.ndim)[:, 0]
            if block.name in appended:
                arr[where] += rows
            else:
                arr[where] = rows
            self.lengths[block.name] = arr

    def field_mask(self, fields: Iterable[str]) -> tuple[np.uint64, list[str]]:
        """Bitmask of ``fields`` plus the committed bit, and the fields never written yet."""
        mask = COMMITTED
        missing = []
        for name in fields:
            bit = self.bits.get(name)
            if bit is None:
                if self.declared is not None and name not in self.declared:
                    raise UnknownFieldError(
                        f"field {name!r} is not declared for partition {self.name!r}; "
                        f"declared: {sorted(self.declared)}"
                    )
                missing.append(name)
            else:
                mask |= bit
        return mask, missing

    def check_moved(self, moved: Moved) -> dict[str, FieldSpec]:
        """The specs samples moving in would add; refused if they disagree with these."""
        names = [n for n, has in moved.has.items() if has.any()]
        for name in names:
            old, new = self.specs.get(name), moved.fields[name]
            if old is not None and _varied(old) != _varied(new):
                raise SchemaError(
                    f"field {name!r} is {old} in partition {self.name!r} but {new} where the samples come from"
                )
        if self.declared is not None and set(names) - self.declared:
            raise UnknownFieldError(f"fields {sorted(set(names) - self.declared)} are not declared for partition {self.name!r}")
        return {n: moved.fields[n] for n in names}

    def land_lengths(self, idx: np.ndarray, lengths: dict[str, np.ndarray], n: int) -> None:
        for name, values in lengths.items():
            if name in self.specs:
                arr = self.lengths.get(name)
                arr = grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), n)
                arr[idx] = values
                self.lengths[name] = arr

    def balance_lengths(self, indexes: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        """Tokens per sample for balancing: the sum of dim 0 over the jagged fields asked
        (pad rows, index -1, weigh nothing)."""
        real = indexes >= 0
        safe = np.where(real, indexes, 0)
        total = np.zeros(len(indexes), dtype=np.int64)
        for name in fields:
            arr = self.lengths.get(name)
            if arr is not None:
                total += np.where(real, arr[safe], 0)
        if not total.any():
            total = real.astype(np.int64)
        return total


def _logical(block: FieldBlock, count: int) -> FieldSpec:
    spec = block.spec
    if spec.layout == "dense":
        return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="dense", shape=tuple(spec.shape))
    shape = () if spec.kind == "object" else (_one_shape(block, count) or ())
    return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", shape=shape, ndim=spec.ndim)


def _one_shape(block: FieldBlock, count: int) -> tuple[int, ...] | None:
    """The one shape every sample of a tensor block has, or None where they differ (or there
    are none, or they have no dimensions)."""
    spec = block.spec
    if spec.layout == "dense":
        return tuple(spec.shape) if spec.shape and count else None
    if not spec.ndim or not count or not block.shapes:
        return None
    shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, spec.ndim)
    if not (shapes == shapes[0]).all():
        return None
    return tuple(int(d) for d in shapes[0])


def _varied(spec: FieldSpec) -> FieldSpec:
    """A jagged spec with no one shape (a dense one as it is)."""
    if spec.layout != "jagged" or not spec.shape:
        return spec
    return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", ndim=spec.ndim)


def _check_compatible(partition: str, name: str, old: FieldSpec, block: FieldBlock) -> None:
    new = block.spec
    where = f"field {name!r} of partition {partition!r}"
    if new.kind != old.kind:
        raise SchemaError(f"{where} holds {old.kind} values; this write has {new.kind} values")
    if new.dtype != old.dtype:
        raise SchemaError(f"{where} has dtype {old.dtype}; this write has dtype {new.dtype}")
    if old.kind == "object":
        return
    if old.layout == "dense":
        if new.layout == "dense":
            if tuple(new.shape) != tuple(old.shape):
                raise SchemaError(
                    f"{where} has per-sample shape {tuple(old.shape)}; this write has "
                    f"{tuple(new.shape)}"
                )
            return
        shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, new.ndim)
        want = np.asarray(old.shape, dtype=np.int64)
        if new.ndim != len(old.shape):
            raise SchemaError(
                f"{where} has per-sample shape {tuple(old.shape)}; this write's samples have "
                f"{new.ndim} dimensions"
            )
        bad = np.flatnonzero(~np.all(shapes == want, axis=1))
        if len(bad):
            raise SchemaError(
                f"{where} has per-sample shape {tuple(old.shape)}; sample {int(bad[0])} of "
                f"this write has shape {tuple(int(d) for d in shapes[bad[0]])}"
            )
        return
    ndim = len(new.shape) if new.layout == "dense" else new.ndim
    if ndim != old.ndim:
        raise SchemaError(
            f"{where} has samples of {old.ndim} dimensions; this write's have {ndim}"
        )


SMALL = 64  # lists this short: Python's min and max (0.1 µs) before numpy's (3 µs each)


def lowest(values: list[int], array: np.ndarray) -> int:
    return min(values) if len(values) <= SMALL else int(array.min())


def highest(values: list[int], array: np.ndarray) -> int:
    return max(values) if len(values) <= SMALL else int(array.max())
