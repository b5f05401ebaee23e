"""Controller metadata, free of IO: partitions, their fields, samples, groups and tasks
(the records of units and grants in flight are in :mod:`._records`).

Per-sample state is kept in numpy arrays so a scan for ready samples is vectorised and a
partition of a million samples costs tens of megabytes, not a dict entry per sample.
A sample's fields are a bitmask: bit 63 says its first put is committed, bit 62 that it is
excluded (aborted, failed, cleared, moved away) and is never served again, bit 61 that it is
partial (an unfinished rollout: stored, not served until completed).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, SchemaError, UnknownFieldError
from ..wire import FieldBlock, FieldSpec, GroupId
from ._records import GrantRecord

COMMITTED = np.uint64(1 << 63)
EXCLUDED = np.uint64(1 << 62)
PARTIAL = np.uint64(1 << 61)
HIDDEN = EXCLUDED | PARTIAL
MAX_FIELDS = 61
SCAN_CHUNK = 1 << 16
# per-sample arrays start empty (shared) and double as samples come: an empty partition costs little
_EMPTY: dict[type, Any] = {dtype: np.zeros(0, dtype=dtype) for dtype in (np.uint64, np.int16, np.int64)}
NO_VERSION = -1

# per task, per sample
AVAILABLE, LEASED, CONSUMED, REFUSED = 0, 1, 2, 3

FAILURE_POLICIES = ("drop_group", "mask_member")
NO_STEP = -1
_STEP_NAME = re.compile(r"(?:^|[/._:-])step[-_]?(\d{1,18})$")


def step_in(name: str) -> int:
    """The training step a partition's name carries (``train/step-17``, ``step_3``), else
    NO_STEP: the step whose batch the trainer reads at that version (see ``Options.step``)."""
    found = _STEP_NAME.search(name)
    return int(found.group(1)) if found else NO_STEP


def _grow(arr: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    if size <= len(arr):
        return arr
    cap = max(size, 2 * len(arr))
    out = np.full(cap, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


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
    bound (NO_STEP: taken from a name ending in ``step-N``, else none).
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


DEFAULT_OPTIONS = Options()


class TaskState:
    """What one task has done with each sample of a partition."""

    def __init__(self, cap: int) -> None:
        self.state = np.zeros(cap, dtype=np.uint8)
        self.lease = np.zeros(cap, dtype=np.int64)
        self.lo = 0  # every sample below lo is leased, consumed or refused
        self.group_lo = 0  # every complete group before it is taken by this task
        self.leased = 0
        self.consumed = 0
        self.refused = 0
        self.expired = 0
        self.lost = 0  # samples not consumed by this task when their unit died

    def ensure(self, cap: int) -> None:
        self.state = _grow(self.state, cap)
        self.lease = _grow(self.lease, cap)


@dataclasses.dataclass
class Moved:
    """Samples in transit between partitions (see ``Partition.take_out``)."""

    fields: dict[str, FieldSpec]
    has: dict[str, np.ndarray]
    partial: np.ndarray
    units: np.ndarray
    version: np.ndarray
    version_max: np.ndarray
    revision: np.ndarray
    segments: list[list[tuple[int, int]] | None]
    groups: list[GroupId] | None
    lengths: dict[str, np.ndarray]
    indexes: np.ndarray  # where they were
    uid: int  # the partition they left

    def subset(self, sel: np.ndarray) -> Moved:
        """The samples where ``sel`` (a boolean mask) is true."""
        picked = np.flatnonzero(sel).tolist()
        return dataclasses.replace(
            self,
            has={name: has[sel] for name, has in self.has.items()},
            partial=self.partial[sel],
            units=self.units[sel],
            version=self.version[sel],
            version_max=self.version_max[sel],
            revision=self.revision[sel],
            segments=[self.segments[i] for i in picked],
            groups=None if self.groups is None else [self.groups[i] for i in picked],
            lengths={name: arr[sel] for name, arr in self.lengths.items()},
            indexes=self.indexes[sel],
        )


class Groups:
    """Members of each group, by explicit id; completion order; failures."""

    __slots__ = ("ordinal", "ids", "members", "committed", "failed", "aborted", "complete", "order")

    def __init__(self) -> None:
        self.ordinal: dict[GroupId, int] = {}
        self.ids: list[GroupId] = []
        self.members: list[list[int]] = []
        self.committed: list[int] = []
        self.failed: list[int] = []  # members that will never come
        self.aborted: list[bool] = []
        self.complete: list[bool] = []
        self.order: list[int] = []  # complete groups, in the order they completed

    def of(self, gid: GroupId) -> int:
        g = self.ordinal.get(gid)
        if g is None:
            g = self.ordinal[gid] = len(self.ids)
            self.ids.append(gid)
            self.members.append([])
            self.committed.append(0)
            self.failed.append(0)
            self.aborted.append(False)
            self.complete.append(False)
        return g

    def check(self, g: int, size: int) -> None:
        if size and not self.complete[g] and self.committed[g] + self.failed[g] >= size:
            self.complete[g] = True
            self.order.append(g)


class Partition:
    """``max_samples`` and ``max_tasks`` bound what requests may make it allocate: a put
    past them is refused before anything changes (see ``ControllerConfig``). Slotted, and its
    per-sample arrays start empty: 100,000 empty partitions cost the controller under 200 MB."""

    __slots__ = (
        "name",
        "uid",
        "options",
        "step",
        "max_samples",
        "max_tasks",
        "specs",
        "bits",
        "n",
        "mask",
        "unit",
        "version",
        "version_max",
        "revision",
        "segments",
        "group",
        "lengths",
        "groups",
        "has_groups",
        "tasks",
        "unit_bytes",
        "committed",
        "excluded",
        "lost",
        "reasons",
        "in_flight",
        "sealed",
        "complete",
        "promised",
        "groups_done",
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
        self.specs: dict[str, FieldSpec] = {}
        self.bits: dict[str, np.uint64] = {}
        self.n = 0
        self.mask = _EMPTY[np.uint64]  # shared until the first sample: each grows into its own
        self.unit = _EMPTY[np.int16]
        self.version = _EMPTY[np.int64]  # oldest segment's
        self.version_max = _EMPTY[np.int64]
        self.revision = _EMPTY[np.int64]  # committed updates
        self.segments: dict[int, list[tuple[int, int]]] = {}  # samples of several segments
        self.group = _EMPTY[np.int64]
        self.lengths: dict[str, np.ndarray] = {}  # jagged tensor fields: size of dim 0
        self.groups = Groups()
        self.has_groups = False
        self.tasks: dict[str, TaskState] = {}
        self.unit_bytes: dict[int, int] = {}
        self.committed = 0
        self.excluded = 0
        self.lost = 0  # samples whose storage unit died (excluded, reason "lost")
        self.reasons: collections.Counter[str] = collections.Counter()
        self.in_flight = 0  # grants not yet committed
        self.sealed = False  # no more samples will be put
        self.complete = 0  # committed, finished and not excluded
        self.promised = 0  # target places held by puts granted but not yet committed
        self.groups_done = 0  # complete groups counted toward target_groups

    @property
    def declared(self) -> frozenset[str] | None:
        return self.options.fields

    # --- schema ---------------------------------------------------------------------

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
                added[name] = _logical(block.spec)
            else:
                _check_compatible(self.name, name, old, block)
        if len(self.specs) + len(added) > MAX_FIELDS:
            raise SchemaError(
                f"partition {self.name!r} would have {len(self.specs) + len(added)} fields; "
                f"at most {MAX_FIELDS} are supported"
            )
        return added

    def add_specs(self, specs: dict[str, FieldSpec]) -> None:
        for name, spec in specs.items():
            if name in self.specs:
                continue
            self.specs[name] = spec
            self.bits[name] = np.uint64(1 << len(self.bits))

    def record_lengths(self, blocks: Sequence[FieldBlock], where: slice | np.ndarray) -> None:
        """Remember dim 0 of each sample of jagged tensor fields (for token balancing)."""
        for block in blocks:
            spec = self.specs.get(block.name)
            if spec is None or spec.kind == "object" or spec.layout != "jagged" or spec.ndim == 0:
                continue
            arr = self.lengths.get(block.name)
            arr = _grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), self.n)
            if block.spec.layout == "dense":
                arr[where] = block.spec.shape[0] if block.spec.shape else 1
            else:
                shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, block.spec.ndim)
                arr[where] = shapes[:, 0]
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

    # --- samples --------------------------------------------------------------------

    def check_room(self, count: int) -> None:
        """Refuse ``count`` more samples past ``max_samples`` (nothing is changed)."""
        if count < 0 or self.n + count > self.max_samples:
            raise InvalidArgumentError(
                f"partition {self.name!r} holds {self.n} samples; count={count} more would pass "
                f"max_partition_samples={self.max_samples}"
            )

    def allocate(self, count: int, groups: Sequence[GroupId] | None, versions: Sequence[int] | None) -> int:
        self.check_room(count)
        start = self.n
        # every array grows before ``n`` moves: a failed allocation leaves the partition as it was
        for attr, fill in (
            ("mask", 0), ("unit", -1), ("version", NO_VERSION), ("version_max", NO_VERSION),
            ("revision", 0), ("group", -1),
        ):
            setattr(self, attr, _grow(getattr(self, attr), start + count, fill))
        for task in self.tasks.values():
            task.ensure(len(self.mask))
        self.n += count
        if versions is not None:
            self.version[start : self.n] = versions
            self.version_max[start : self.n] = versions
        if groups is not None:
            self.has_groups = True
            for i, gid in enumerate(groups):
                if gid is None:
                    continue
                g = self.groups.of(gid)
                self.group[start + i] = g
                self.groups.members[g].append(start + i)
        self.in_flight += 1
        return start

    def check_indexes(self, indexes: np.ndarray) -> None:
        if len(indexes) and (indexes.min() < 0 or indexes.max() >= self.n):
            bad = int(indexes[(indexes < 0) | (indexes >= self.n)][0])
            raise InvalidArgumentError(f"sample {bad} does not exist in partition {self.name!r}")
        if len(indexes) and not np.all(self.mask[indexes] & COMMITTED):
            bad = int(indexes[(self.mask[indexes] & COMMITTED) == 0][0])
            raise InvalidArgumentError(
                f"sample {bad} of partition {self.name!r} is not committed yet"
            )
        if len(np.unique(indexes)) != len(indexes):
            raise InvalidArgumentError(f"partition {self.name!r}: a sample is listed twice")

    def commit(self, grant: GrantRecord, unit_id: int) -> None:
        bits = COMMITTED
        for name in grant.fields:
            bits |= self.bits[name]
        if grant.indexes is not None:
            idx = grant.indexes
            self.mask[idx] |= bits
            self.revision[idx] += 1
            if grant.segment is not None:
                self.add_segment(idx, *grant.segment)
            if grant.complete:
                finished = idx[(self.mask[idx] & PARTIAL) != 0]
                self.mask[finished] &= ~PARTIAL
                self.promised -= grant.kept
                self._count_complete(finished)
            return
        sl = slice(grant.start, grant.start + grant.count)
        if grant.partial:
            bits |= PARTIAL
        self.mask[sl] |= bits
        self.unit[sl] = unit_id
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

    def target_promised(self) -> bool:
        """Every place of the target is taken, by complete samples or puts in flight."""
        target = self.options.target
        return bool(target) and self.complete + self.promised >= target

    def _count_complete(self, indexes: np.ndarray, toward_target: bool = True) -> None:
        """Finished samples: count them toward their groups and the partition's target."""
        live = indexes[(self.mask[indexes] & EXCLUDED) == 0]
        target = self.options.target if toward_target else 0
        if target and self.complete + len(live) > target:
            over = live[target - self.complete :] if self.complete < target else live
            self.exclude(over, "over target")
            live = live[: max(0, target - self.complete)]
        self.complete += len(live)
        size = self.options.group_size
        members = self.group[indexes]
        for g in np.unique(members).tolist():
            if g < 0:
                continue
            self.groups.committed[g] += int(np.count_nonzero(members == g))
            if self.groups.aborted[g]:  # late members of an aborted group
                self.exclude(indexes[members == g], "group aborted")
            was = self.groups.complete[g]
            self.groups.check(g, size)
            if self.groups.complete[g] and not was and not self.groups.aborted[g] and toward_target:
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

    def add_segment(self, indexes: np.ndarray, version: int, first_token: int) -> None:
        """A resumed rollout: tokens from ``first_token`` on come from ``version``."""
        for i in indexes.tolist():
            segs = self.segments.get(i)
            if segs is None:
                segs = self.segments[i] = [(int(self.version[i]), 0)] if self.version[i] != NO_VERSION else []
            segs.append((version, first_token))
        old = self.version[indexes]
        self.version[indexes] = np.where(old == NO_VERSION, version, np.minimum(old, version))
        self.version_max[indexes] = np.maximum(self.version_max[indexes], version)

    def segments_of(self, indexes: np.ndarray) -> list[list[list[int]]] | None:
        if not self.segments or not any(i in self.segments for i in indexes.tolist()):
            return None
        out = []
        for i in indexes.tolist():
            segs = self.segments.get(i)
            if segs is None:
                v = int(self.version[i])
                segs = [(v, 0)] if v != NO_VERSION else []
            out.append([[v, t] for v, t in segs])
        return out

    def finishing(self, indexes: np.ndarray) -> int:
        """How many of these samples a completion would finish (partial, not excluded)."""
        mask = self.mask[indexes]
        return int(np.count_nonzero(((mask & PARTIAL) != 0) & ((mask & EXCLUDED) == 0)))

    def forget(self, grant: GrantRecord) -> None:
        """A grant that will never commit (its write failed)."""
        if grant.indexes is not None:
            self.promised -= grant.kept
            return
        self.in_flight -= 1
        if not grant.partial:
            self.promised -= grant.kept
        self.mask[grant.start : grant.start + grant.count] |= EXCLUDED

    def exclude(self, indexes: np.ndarray, reason: str) -> int:
        """Never serve these samples again; count them under ``reason``."""
        fresh = indexes[(self.mask[indexes] & (EXCLUDED | COMMITTED)) == COMMITTED]
        self.mask[indexes] |= EXCLUDED
        self.excluded += len(fresh)
        self.reasons[reason] += len(fresh)
        for task in self.tasks.values():
            held = fresh[task.state[fresh] == LEASED]
            task.leased -= len(held)
            task.state[held] = AVAILABLE  # excluded anyway: the bit keeps them out
        return len(fresh)

    def take_out(self, indexes: np.ndarray, reason: str) -> Moved:
        """Everything the controller knows of these samples, which leave (excluded here)."""
        moved = Moved(
            fields={name: spec for name, spec in self.specs.items()},
            has={name: (self.mask[indexes] & bit) != 0 for name, bit in self.bits.items()},
            partial=(self.mask[indexes] & PARTIAL) != 0,
            units=self.unit[indexes].copy(),
            version=self.version[indexes].copy(),
            version_max=self.version_max[indexes].copy(),
            revision=self.revision[indexes].copy(),
            segments=[self.segments.get(i) for i in indexes.tolist()],
            groups=self.groups_of(indexes),
            lengths={name: arr[indexes].copy() for name, arr in self.lengths.items()},
            indexes=indexes.copy(),
            uid=self.uid,
        )
        self.exclude(indexes, reason)
        return moved

    def restore(self, indexes: np.ndarray, reason: str) -> None:
        """Undo ``take_out`` for samples whose move failed: their data never left."""
        back = indexes[(self.mask[indexes] & (EXCLUDED | COMMITTED)) == (EXCLUDED | COMMITTED)]
        self.mask[back] &= ~EXCLUDED
        self.excluded -= len(back)
        self.reasons[reason] -= len(back)
        if self.reasons[reason] <= 0:
            del self.reasons[reason]

    def reserve_in(self, moved: Moved) -> np.ndarray:
        """Indexes here for samples on their way in (invisible until ``land``)."""
        names = [n for n, has in moved.has.items() if has.any()]
        for name in names:
            old, new = self.specs.get(name), moved.fields[name]
            if old is not None and old != new:
                raise SchemaError(
                    f"field {name!r} is {old} in partition {self.name!r} but {new} where the samples come from"
                )
        if self.declared is not None and set(names) - self.declared:
            raise UnknownFieldError(f"fields {sorted(set(names) - self.declared)} are not declared for partition {self.name!r}")
        self.add_specs({n: moved.fields[n] for n in names})
        count = len(moved.units)
        start = self.allocate(count, moved.groups, None)
        return np.arange(start, start + count)

    def land(self, idx: np.ndarray, moved: Moved) -> None:
        """The samples' data is keyed here now: make them visible (partial ones stay hidden)."""
        names = [n for n, has in moved.has.items() if has.any()]
        count = len(idx)
        bits = np.full(count, COMMITTED, dtype=np.uint64)
        for name in names:
            bits |= np.where(moved.has[name], self.bits[name], np.uint64(0)).astype(np.uint64)
        bits |= np.where(moved.partial, PARTIAL, np.uint64(0)).astype(np.uint64)
        self.mask[idx] = bits
        self.unit[idx] = moved.units
        self.version[idx] = moved.version
        self.version_max[idx] = moved.version_max
        self.revision[idx] = moved.revision
        for i, segs in zip(idx.tolist(), moved.segments):
            if segs is not None:
                self.segments[i] = list(segs)
        for name, values in moved.lengths.items():
            if name in self.specs:
                arr = self.lengths.get(name)
                arr = _grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), self.n)
                arr[idx] = values
                self.lengths[name] = arr
        self.committed += count
        self.in_flight -= 1
        self._count_complete(idx[~moved.partial], toward_target=False)

    def all_ready(self, task: TaskState, mask: np.uint64, min_version: int | None = None) -> np.ndarray:
        """Every sample ``find_ready`` could return, in index order."""
        if task.lo >= self.n:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._ok(task, mask, task.lo, self.n, min_version)) + task.lo

    def drained(self) -> bool:
        """Sealed, and nothing is on its way in: what is ready now is all there will be."""
        return self.sealed and not self.in_flight

    def fail_members(self, gid: GroupId, count: int, reason: str) -> None:
        g = self.groups.of(gid)
        self.has_groups = True
        self.groups.failed[g] += count
        if self.options.on_member_failure == "drop_group":
            self.abort_group(g, f"member failed: {reason}")
        self.groups.check(g, self.options.group_size)

    def fail_samples(self, indexes: np.ndarray, reason: str) -> None:
        self.exclude(indexes, f"failed: {reason}")
        if self.options.on_member_failure == "drop_group":
            for g in np.unique(self.group[indexes]).tolist():
                if g >= 0:
                    self.abort_group(g, f"member failed: {reason}")

    def lose(self, unit_id: int) -> int:
        """The samples stored on a dead unit: excluded for good (reason ``lost``), counted
        per task that had not consumed them, and their groups treated as with failed
        members (``drop_group`` aborts them, ``mask_member`` serves them without). Leases
        on them end: their holders' reads fail, their acks count nothing."""
        n = self.n
        idx = np.flatnonzero((self.unit[:n] == unit_id) & ((self.mask[:n] & (COMMITTED | EXCLUDED)) == COMMITTED))
        if not len(idx):
            return 0
        for task in self.tasks.values():
            state = task.state[idx]
            task.lost += int(((state == AVAILABLE) | (state == LEASED)).sum())
        self.lost += self.exclude(idx, "lost")
        if self.options.on_member_failure == "drop_group":
            for g in np.unique(self.group[idx]).tolist():
                if g >= 0:
                    self.abort_group(g, "member lost")
        return len(idx)

    def abort_group(self, g: int, reason: str) -> None:
        if self.groups.aborted[g]:
            return
        self.groups.aborted[g] = True
        members = np.asarray(self.groups.members[g], dtype=np.int64)
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
            state = self.tasks[name] = TaskState(len(self.mask))
        return state

    def _ok(self, task: TaskState, mask: np.uint64, a: int, b: int, min_version: int | None) -> np.ndarray:
        ok = (self.mask[a:b] & (mask | HIDDEN)) == mask
        ok &= task.state[a:b] == AVAILABLE
        if min_version is not None:
            stale = ok & (self.version[a:b] < min_version) & (self.version[a:b] != NO_VERSION)
            if stale.any():
                task.state[a:b][stale] = REFUSED
                task.refused += int(stale.sum())
                ok &= ~stale
        return ok

    def find_ready(self, task: TaskState, mask: np.uint64, count: int, min_version: int | None = None) -> np.ndarray | None:
        """The first ``count`` samples that have every field in ``mask``, that are not
        excluded, and that ``task`` has neither leased nor consumed, in index order; None if
        there are fewer. Samples older than ``min_version`` are refused (and counted).

        Scans from the task's low-water mark in windows that start small (a few times
        ``count``) and double, so the usual case touches little more than it returns."""
        found: list[np.ndarray] = []
        need = count
        start = task.lo
        window = max(4 * count, 1024)
        while start < self.n and need > 0:
            end = min(self.n, start + window)
            hit = np.flatnonzero(self._ok(task, mask, start, end, min_version))[:need]
            if len(hit):
                found.append(hit + start)
                need -= len(hit)
            start = end
            window = min(2 * window, SCAN_CHUNK)
        if need > 0:
            return None
        return np.concatenate(found) if len(found) > 1 else found[0]

    def find_groups(self, task: TaskState, mask: np.uint64, count: int, min_version: int | None = None) -> np.ndarray | None:
        """Live members of the first ``count`` complete groups whose every live member has
        the fields and is available to ``task``, in completion order; None if fewer are
        ready. A group with a member older than ``min_version`` is refused whole."""
        chosen: list[np.ndarray] = []
        order = self.groups.order
        i = task.group_lo
        prefix = True  # groups before group_lo are all taken by this task
        while i < len(order) and len(chosen) < count:
            g = order[i]
            i += 1
            members = np.asarray(self.groups.members[g], dtype=np.int64)
            live = members[(self.mask[members] & EXCLUDED) == 0]
            if self.groups.aborted[g] or not len(live) or not np.any(task.state[live] == AVAILABLE):
                if prefix:
                    task.group_lo = i
                continue
            prefix = False
            if np.any(task.state[live] != AVAILABLE):
                continue
            if min_version is not None:
                versions = self.version[live]
                if np.any((versions < min_version) & (versions != NO_VERSION)):
                    task.state[live] = REFUSED
                    task.refused += len(live)
                    continue
            if np.all((self.mask[live] & (mask | HIDDEN)) == mask):
                chosen.append(live)
        if len(chosen) < count:
            return None
        return np.concatenate(chosen)

    def count_ready(self, task: TaskState | None, mask: np.uint64) -> int:
        if self.n == 0:
            return 0
        ok = (self.mask[: self.n] & (mask | HIDDEN)) == mask
        if task is not None:
            ok &= task.state[: self.n] == AVAILABLE
        return int(ok.sum())

    def lease(self, task: TaskState, indexes: np.ndarray, lease_id: int) -> None:
        task.state[indexes] = LEASED
        task.lease[indexes] = lease_id
        task.leased += len(indexes)
        self._advance(task)

    def ack(self, task: TaskState, indexes: np.ndarray, lease_id: int) -> int:
        """Mark leased samples consumed; samples not held by ``lease_id`` are left alone."""
        held = task.state[indexes] == LEASED
        if lease_id:
            held &= task.lease[indexes] == lease_id
        mine = indexes[held]
        task.state[mine] = CONSUMED
        task.leased -= len(mine)
        task.consumed += len(mine)
        return len(mine)

    def expire(self, task: TaskState, indexes: np.ndarray, lease_id: int) -> int:
        """Samples still held by ``lease_id`` become available again."""
        held = indexes[(task.state[indexes] == LEASED) & (task.lease[indexes] == lease_id)]
        task.state[held] = AVAILABLE
        task.lease[held] = 0
        task.leased -= len(held)
        task.expired += len(held)
        if len(held):
            task.lo = min(task.lo, int(held.min()))
            task.group_lo = 0  # cheap to rescan: complete groups only
        return len(held)

    def _advance(self, task: TaskState) -> None:
        window = 1024
        while task.lo < self.n:
            end = min(self.n, task.lo + window)
            free = np.flatnonzero(task.state[task.lo : end] == AVAILABLE)
            if len(free):
                task.lo += int(free[0])
                return
            task.lo = end
            window = min(2 * window, SCAN_CHUNK)

    def groups_of(self, indexes: np.ndarray) -> list[GroupId] | None:
        if not self.has_groups:
            return None
        ids = self.groups.ids
        return [ids[g] if g >= 0 else None for g in self.group[indexes].tolist()]

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


def _logical(spec: FieldSpec) -> FieldSpec:
    if spec.layout == "dense":
        return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="dense", shape=tuple(spec.shape))
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
