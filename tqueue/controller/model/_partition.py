"""A partition's metadata, free of IO (the records of units and grants in flight are in
:mod:`._records`). A :class:`Partition` composes what it holds: its :class:`~._schema.Schema`
(fields, bits, lengths), its :class:`~._samples.Samples` (per-sample arrays, groups) and a
:class:`~._serving.TaskState` per task that reads it (leases, acks and the scans for ready
samples); it keeps the counts and the lifetime (seal, target, free) that tie them together.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from ...errors import InvalidArgumentError
from ...wire import FieldSpec, Grant, GroupId
from ._keyindex import KeyIndex
from ._records import GrantRecord
from ._samples import COMMITTED, EXCLUDED, PARTIAL, Groups, Moved, Samples
from ._schema import Schema
from ._serving import AVAILABLE, LEASED, TaskState, count_ready

FAILURE_POLICIES = ("drop_group", "mask_member")
NO_STEP = -1
_STEP_NAME = re.compile(r"(?:^|[/._:-])step[-_]?(\d{1,18})$")


def step_in(name: str) -> int:
    """The training step a partition's name carries (``train/step-17``, ``step_3``), else
    NO_STEP: the step whose batch the trainer reads at that version (see ``Options.step``)."""
    found = _STEP_NAME.search(name)
    return int(found.group(1)) if found else NO_STEP


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
    of each put, on as many units (1 or 2; 0: ``ControllerConfig.copies``).
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


DEFAULT_OPTIONS = Options()

class Partition:
    """``max_samples`` and ``max_tasks`` bound what requests may make it allocate: a put
    past them is refused before anything changes (see ``ControllerConfig``). Slotted, and its
    per-sample arrays start empty: 100,000 empty partitions cost the controller under 200 MB."""

    __slots__ = (
        "name", "uid", "options", "step", "max_samples", "max_tasks", "schema", "samples", "tasks", "unit_bytes",
        "committed", "excluded", "lost", "reasons", "in_flight", "sealed", "complete", "promised", "groups_done",
        "keys", "twice", "corrupt",
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
        self.samples.check_indexes(indexes, self.name)
        self.schema.record(added, msg.blocks, msg.count, indexes, self.n)
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
        cap = len(self.samples.mask)
        start = self.samples.allocate(count, groups, versions)
        if len(self.samples.mask) != cap:  # the samples' arrays grew: each task's grow with them
            for task in self.tasks.values():
                task.ensure(len(self.samples.mask))
        self.in_flight += 1
        return start

    def commit(self, grant: GrantRecord, unit_id: int) -> None:
        bits = COMMITTED
        for name in grant.fields:
            bits |= self.schema.bits[name]
        if grant.indexes is not None:
            idx = grant.indexes
            self.samples.mask[idx] |= bits
            self.samples.revision[idx] += 1
            if grant.segment is not None:
                self.samples.add_segment(idx, *grant.segment)
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
        """Before :meth:`lose`: samples with a copy on a live unit are served from it."""
        promoted, gone = self.samples.promote(unit_id, alive)
        if promoted or gone:  # held once now (``single``), until copied again
            self.twice = True
        return promoted

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

    def count_ready(self, task: TaskState | None, mask: np.uint64) -> int:
        return count_ready(self.samples, task, mask)

    # --- lifetime -------------------------------------------------------------------

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

