"""Controller metadata, free of IO: partitions, their fields and samples, tasks, grants.

Per-sample state is kept in numpy arrays so a scan for ready samples is vectorised and a
partition of a million samples costs tens of megabytes, not a dict entry per sample.
A sample's fields are a bitmask; bit 63 says the sample's first put is committed.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from .._wire import FieldBlock, FieldSpec, GroupId, UnitInfo
from ..errors import InvalidArgumentError, SchemaError, UnknownFieldError

COMMITTED = np.uint64(1 << 63)
MAX_FIELDS = 63
SCAN_CHUNK = 1 << 16

# per task, per sample
AVAILABLE, LEASED, CONSUMED = 0, 1, 2


def _grow(arr: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    if size <= len(arr):
        return arr
    cap = max(size, 2 * len(arr))
    out = np.full(cap, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


@dataclasses.dataclass
class Unit:
    info: UnitInfo
    nbytes: int = 0  # stored, as the unit last reported
    reserved: int = 0  # granted to writes not yet committed

    @property
    def load(self) -> int:
        return self.nbytes + self.reserved


class TaskState:
    """What one task has done with each sample of a partition."""

    def __init__(self, cap: int) -> None:
        self.state = np.zeros(cap, dtype=np.uint8)
        self.lease = np.zeros(cap, dtype=np.int64)
        self.lo = 0  # every sample below lo is leased or consumed
        self.leased = 0
        self.consumed = 0

    def ensure(self, cap: int) -> None:
        self.state = _grow(self.state, cap)
        self.lease = _grow(self.lease, cap)


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


class Partition:
    def __init__(self, name: str, uid: int, declared: Sequence[str] | None = None) -> None:
        self.name = name
        self.uid = uid
        self.declared = frozenset(declared) if declared is not None else None
        self.specs: dict[str, FieldSpec] = {}
        self.bits: dict[str, np.uint64] = {}
        self.n = 0
        self.mask = np.zeros(1024, dtype=np.uint64)
        self.unit = np.full(1024, -1, dtype=np.int16)
        self.groups: list[GroupId] = []
        self.has_groups = False
        self.tasks: dict[str, TaskState] = {}
        self.unit_bytes: dict[int, int] = {}
        self.committed = 0

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

    def allocate(self, count: int, groups: Sequence[GroupId] | None) -> int:
        start = self.n
        self.n += count
        self.mask = _grow(self.mask, self.n)
        self.unit = _grow(self.unit, self.n, -1)
        for task in self.tasks.values():
            task.ensure(len(self.mask))
        if groups is None:
            self.groups.extend([None] * count)
        else:
            self.groups.extend(groups)
            self.has_groups = True
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
        if grant.indexes is None:
            sl = slice(grant.start, grant.start + grant.count)
            self.mask[sl] |= bits
            self.unit[sl] = unit_id
            self.committed += grant.count
        else:
            self.mask[grant.indexes] |= bits

    def task(self, name: str) -> TaskState:
        state = self.tasks.get(name)
        if state is None:
            state = self.tasks[name] = TaskState(len(self.mask))
        return state

    def find_ready(self, task: TaskState, mask: np.uint64, count: int) -> np.ndarray | None:
        """The first ``count`` samples that have every field in ``mask`` and that ``task``
        has neither leased nor consumed, in index order; None if there are fewer.

        Scans from the task's low-water mark in windows that start small (a few times
        ``count``) and double, so the usual case touches little more than it returns."""
        found: list[np.ndarray] = []
        need = count
        start = task.lo
        window = max(4 * count, 1024)
        while start < self.n and need > 0:
            end = min(self.n, start + window)
            ok = (self.mask[start:end] & mask) == mask
            ok &= task.state[start:end] == AVAILABLE
            hit = np.flatnonzero(ok)[:need]
            if len(hit):
                found.append(hit + start)
                need -= len(hit)
            start = end
            window = min(2 * window, SCAN_CHUNK)
        if need > 0:
            return None
        return np.concatenate(found) if len(found) > 1 else found[0]

    def count_ready(self, task: TaskState | None, mask: np.uint64) -> int:
        if self.n == 0:
            return 0
        ok = (self.mask[: self.n] & mask) == mask
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
        return [self.groups[i] for i in indexes.tolist()]

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
