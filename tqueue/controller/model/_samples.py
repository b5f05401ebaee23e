"""A partition's samples, free of IO: what is known of each sample, in numpy arrays, and
what each task has done with them (:class:`TaskState`, below: the serving scans).

Per-sample state is kept in numpy arrays so a scan for ready samples is vectorised and a
partition of a million samples costs tens of megabytes, not a dict entry per sample.
A sample's fields are a bitmask: bit 63 says its first put is committed, bit 62 that it is
excluded (aborted, failed, cleared, moved away) and is never served again, bit 61 that it is
partial (an unfinished rollout: stored, not served until completed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...wire import FieldSpec, GroupId

COMMITTED = np.uint64(1 << 63)
EXCLUDED = np.uint64(1 << 62)
PARTIAL = np.uint64(1 << 61)
HIDDEN = EXCLUDED | PARTIAL
# per-sample arrays start empty (shared) and double as samples come: an empty partition costs little
_EMPTY: dict[type, Any] = {dtype: np.zeros(0, dtype=dtype) for dtype in (np.uint64, np.int16, np.int64)}
NO_VERSION = -1
#: a rollout segment: (version, first_token), and the rows of the fields its update spliced
Segment = tuple[int, int] | tuple[int, int, tuple[tuple[str, int], ...]]


def grow(arr: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    """``arr``, or a copy at least twice as long, holding ``size`` items (the rest ``fill``)."""
    if size <= len(arr):
        return arr
    cap = max(size, 2 * len(arr))
    out = np.full(cap, fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


@dataclasses.dataclass
class Moved:
    """Samples in transit between partitions (see ``Partition.take_out``)."""

    fields: dict[str, FieldSpec]
    has: dict[str, np.ndarray]
    partial: np.ndarray
    units: np.ndarray
    second_units: np.ndarray  # the unit of each one's second copy (-1: none)
    version: np.ndarray
    version_max: np.ndarray
    revision: np.ndarray
    segments: list[list[Segment] | None]
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
            second_units=self.second_units[sel],
            version=self.version[sel],
            version_max=self.version_max[sel],
            revision=self.revision[sel],
            segments=[self.segments[i] for i in picked],
            groups=None if self.groups is None else [self.groups[i] for i in picked],
            lengths={name: arr[sel] for name, arr in self.lengths.items()},
            indexes=self.indexes[sel],
        )


_NO_GROUPS: Any = ()  # read-only: a Groups that has none


class Groups:
    """Members of each group, by explicit id; completion order; failures."""

    __slots__ = ("ordinal", "ids", "members", "committed", "failed", "aborted", "complete", "order")

    def __init__(self) -> None:
        # shared and empty until the first group comes (most partitions never have one): an
        # empty partition costs the controller little
        self.ordinal: dict[GroupId, int] = _NO_GROUPS
        self.ids: list[GroupId] = _NO_GROUPS
        self.members: list[list[int]] = _NO_GROUPS
        self.committed: list[int] = _NO_GROUPS
        self.failed: list[int] = _NO_GROUPS  # members that will never come
        self.aborted: list[bool] = _NO_GROUPS
        self.complete: list[bool] = _NO_GROUPS
        self.order: list[int] = _NO_GROUPS  # complete groups, in the order they completed

    def of(self, gid: GroupId) -> int:
        if self.ordinal is _NO_GROUPS:
            self.ordinal = {}
            self.ids, self.members, self.committed, self.failed = [], [], [], []
            self.aborted, self.complete, self.order = [], [], []
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

    def commit(self, indexes: np.ndarray, of: np.ndarray, size: int) -> tuple[np.ndarray, list[int]]:
        """Samples ``indexes`` (of groups ``of``, -1: none) finished: the late members of
        aborted groups among them, and the groups they complete (not aborted)."""
        late: list[np.ndarray] = []
        done: list[int] = []
        if not self.ids:  # no sample of the partition belongs to a group
            return indexes[:0], done
        for g in np.unique(of).tolist():
            if g < 0:
                continue
            self.committed[g] += int(np.count_nonzero(of == g))
            if self.aborted[g]:
                late.append(indexes[of == g])
            was = self.complete[g]
            self.check(g, size)
            if self.complete[g] and not was and not self.aborted[g]:
                done.append(g)
        return (np.concatenate(late) if late else indexes[:0]), done

    def check(self, g: int, size: int) -> None:
        if size and not self.complete[g] and self.committed[g] + self.failed[g] >= size:
            self.complete[g] = True
            self.order.append(g)



class Samples:
    """Each sample's fields (a bitmask), unit, versions, committed updates, rollout segments
    and group. ``n`` samples are allocated; the arrays may be longer (they double as they grow)."""

    __slots__ = ("n", "mask", "unit", "second_unit", "version", "version_max", "revision", "segments", "group", "groups", "has_groups")

    def __init__(self) -> None:
        self.n = 0
        self.mask = _EMPTY[np.uint64]  # shared until the first sample: each grows into its own
        self.unit = _EMPTY[np.int16]
        self.second_unit = _EMPTY[np.int16]  # the unit of the second copy (-1: none; partitions of copies=2)
        self.version = _EMPTY[np.int64]  # oldest segment's
        self.version_max = _EMPTY[np.int64]
        self.revision = _EMPTY[np.int64]  # committed updates
        self.segments: dict[int, list[Segment]] = {}  # samples of several segments
        self.group = _EMPTY[np.int64]
        self.groups = Groups()
        self.has_groups = False

    def allocate(self, count: int, groups: Sequence[GroupId] | None, versions: Sequence[int] | None) -> int:
        """Room for ``count`` more samples; the index of the first."""
        start = self.n
        # every array grows before ``n`` moves: a failed allocation leaves the samples as they were
        for attr, fill in (
            ("mask", 0), ("unit", -1), ("second_unit", -1), ("version", NO_VERSION), ("version_max", NO_VERSION),
            ("revision", 0), ("group", -1),
        ):
            setattr(self, attr, grow(getattr(self, attr), start + count, fill))
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
        return start

    def check_indexes(self, indexes: np.ndarray, partition: str) -> None:
        if len(indexes) and (indexes.min() < 0 or indexes.max() >= self.n):
            bad = int(indexes[(indexes < 0) | (indexes >= self.n)][0])
            raise InvalidArgumentError(f"sample {bad} does not exist in partition {partition!r}")
        if len(indexes) and not np.all(self.mask[indexes] & COMMITTED):
            bad = int(indexes[(self.mask[indexes] & COMMITTED) == 0][0])
            raise InvalidArgumentError(
                f"sample {bad} of partition {partition!r} is not committed yet"
            )
        if len(np.unique(indexes)) != len(indexes):
            raise InvalidArgumentError(f"partition {partition!r}: a sample is listed twice")


    def add_segment(
        self, indexes: np.ndarray, version: int, first_token: int, splice: dict[str, np.ndarray] | None = None
    ) -> None:
        """A resumed rollout: tokens from ``first_token`` on come from ``version``; rows of
        each field of ``splice`` from its row (per sample) on."""
        for k, i in enumerate(indexes.tolist()):
            segs = self.segments.get(i)
            if segs is None:
                segs = self.segments[i] = [(int(self.version[i]), 0)] if self.version[i] != NO_VERSION else []
            if splice:
                segs.append((version, first_token, tuple((name, int(rows[k])) for name, rows in splice.items())))
            else:
                segs.append((version, first_token))
        old = self.version[indexes]
        self.version[indexes] = np.where(old == NO_VERSION, version, np.minimum(old, version))
        self.version_max[indexes] = np.maximum(self.version_max[indexes], version)

    def splices_of(self, indexes: np.ndarray) -> dict[str, list[list[int]]] | None:
        """Per field a segment spliced, per sample: the first row of the field each segment
        computed (the first segment row 0, one that spliced another field or none: -1)."""
        held = [self.segments.get(i) for i in indexes.tolist()]
        names = {name for segs in held if segs for seg in segs if len(seg) > 2 for name, _ in seg[2]}
        if not names:
            return None
        out: dict[str, list[list[int]]] = {}
        for name in sorted(names):
            rows = out[name] = []
            for i, segs in zip(indexes.tolist(), held):
                if segs is None:
                    rows.append([0] if self.version[i] != NO_VERSION else [])
                    continue
                rows.append([dict(seg[2]).get(name, -1) if len(seg) > 2 else (0 if j == 0 else -1)
                             for j, seg in enumerate(segs)])
        return out

    def segments_of(self, indexes: np.ndarray) -> list[list[list[int]]] | None:
        if not self.segments or not any(i in self.segments for i in indexes.tolist()):
            return None
        out = []
        for i in indexes.tolist():
            segs = self.segments.get(i)
            if segs is None:
                v = int(self.version[i])
                segs = [(v, 0)] if v != NO_VERSION else []
            out.append([[seg[0], seg[1]] for seg in segs])
        return out

    def finishing(self, indexes: np.ndarray) -> int:
        """How many of these samples a completion would finish (partial, not excluded)."""
        mask = self.mask[indexes]
        return int(np.count_nonzero(((mask & PARTIAL) != 0) & ((mask & EXCLUDED) == 0)))


    def groups_of(self, indexes: np.ndarray) -> list[GroupId] | None:
        if not self.has_groups:
            return None
        ids = self.groups.ids
        return [ids[g] if g >= 0 else None for g in self.group[indexes].tolist()]

    def with_groups(self, indexes: np.ndarray) -> np.ndarray:
        """``indexes`` and every other member of their groups, sorted, less the excluded."""
        members = [self.groups.members[g] for g in np.unique(self.group[indexes]).tolist() if g >= 0]
        out = np.unique(np.concatenate([indexes, *(np.asarray(m, dtype=np.int64) for m in members)]))
        return out[(self.mask[out] & EXCLUDED) == 0]

    def on_unit(self, unit_id: int) -> np.ndarray:
        """The committed samples stored on a unit, not excluded yet."""
        n = self.n
        return np.flatnonzero((self.unit[:n] == unit_id) & ((self.mask[:n] & (COMMITTED | EXCLUDED)) == COMMITTED))

    def unexclude(self, indexes: np.ndarray) -> int:
        """Serve again those of these committed samples that were excluded; how many."""
        back = indexes[(self.mask[indexes] & (EXCLUDED | COMMITTED)) == (EXCLUDED | COMMITTED)]
        self.mask[back] &= ~EXCLUDED
        return len(back)

    def pack(
        self, indexes: np.ndarray, uid: int, specs: dict[str, FieldSpec], bits: dict[str, np.uint64],
        lengths: dict[str, np.ndarray],
    ) -> Moved:
        """These samples as they leave partition ``uid`` (whose fields are ``specs``)."""
        return Moved(
            fields=dict(specs),
            has={name: (self.mask[indexes] & bit) != 0 for name, bit in bits.items()},
            partial=(self.mask[indexes] & PARTIAL) != 0,
            units=self.unit[indexes].copy(),
            second_units=self.second_unit[indexes].copy(),
            version=self.version[indexes].copy(),
            version_max=self.version_max[indexes].copy(),
            revision=self.revision[indexes].copy(),
            segments=[self.segments.get(i) for i in indexes.tolist()],
            groups=self.groups_of(indexes),
            lengths={name: arr[indexes].copy() for name, arr in lengths.items()},
            indexes=indexes.copy(),
            uid=uid,
        )

    def land(self, idx: np.ndarray, moved: Moved, bits: dict[str, np.uint64]) -> None:
        """Samples moved in at ``idx`` (reserved by ``allocate``): their fields (``bits``
        here), units, versions and segments."""
        mask = np.full(len(idx), COMMITTED, dtype=np.uint64)
        for name, has in moved.has.items():
            if has.any():
                mask |= np.where(has, bits[name], np.uint64(0)).astype(np.uint64)
        mask |= np.where(moved.partial, PARTIAL, np.uint64(0)).astype(np.uint64)
        self.mask[idx] = mask
        self.unit[idx] = moved.units
        self.second_unit[idx] = moved.second_units
        self.version[idx] = moved.version
        self.version_max[idx] = moved.version_max
        self.revision[idx] = moved.revision
        for i, segs in zip(idx.tolist(), moved.segments):
            if segs is not None:
                self.segments[i] = list(segs)


# --- serving ----------------------------------------------------------------------------
# Serving, free of IO: what one task has done with each sample of a partition, and the scans
# that find what it may take next (samples in index order, or whole groups in completion order).

# per task, per sample
AVAILABLE, LEASED, CONSUMED, REFUSED = 0, 1, 2, 3
SCAN_CHUNK = 1 << 16


def count_ready(samples: Samples, task: TaskState | None, mask: np.uint64) -> int:
    """How many samples have the fields of ``mask``, are not hidden, and (with a ``task``)
    are available to it."""
    n = samples.n
    if n == 0:
        return 0
    ok = (samples.mask[:n] & (mask | HIDDEN)) == mask
    if task is not None:
        ok &= task.state[:n] == AVAILABLE
    return int(ok.sum())


class TaskState:
    """What one task has done with each sample of a partition's ``samples``."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        cap = len(samples.mask)
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
        self.state = grow(self.state, cap)
        self.lease = grow(self.lease, cap)

    def _ok(self, mask: np.uint64, a: int, b: int, min_version: int | None) -> np.ndarray:
        s = self.samples
        ok = (s.mask[a:b] & (mask | HIDDEN)) == mask
        ok &= self.state[a:b] == AVAILABLE
        if min_version is not None:
            stale = ok & (s.version[a:b] < min_version) & (s.version[a:b] != NO_VERSION)
            if stale.any():
                self.state[a:b][stale] = REFUSED
                self.refused += int(stale.sum())
                ok &= ~stale
        return ok

    def all_ready(self, mask: np.uint64, min_version: int | None = None) -> np.ndarray:
        """Every sample ``find_ready`` could return, in index order."""
        n = self.samples.n
        if self.lo >= n:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._ok(mask, self.lo, n, min_version)) + self.lo

    def find_ready(
        self, mask: np.uint64, count: int, min_version: int | None = None, lease_id: int = 0,
    ) -> np.ndarray | None:
        """The first ``count`` samples that have every field in ``mask``, that are not
        excluded, and that this task has neither leased nor consumed, in index order; None if
        there are fewer. Samples older than ``min_version`` are refused (and counted). With
        ``lease_id``, they are leased under it (``take``).

        Scans from the task's low-water mark in windows that start small (a few times
        ``count``) and double, so the usual case touches little more than it returns."""
        n = self.samples.n
        found: list[np.ndarray] = []
        need = count
        start = self.lo
        window = max(4 * count, 1024)
        while start < n and need > 0:
            end = min(n, start + window)
            hit = np.flatnonzero(self._ok(mask, start, end, min_version))[:need]
            if len(hit):
                found.append(hit + start)
                need -= len(hit)
            start = end
            window = min(2 * window, SCAN_CHUNK)
        if need > 0:
            return None
        out = np.concatenate(found) if len(found) > 1 else found[0]
        if lease_id:
            self.take(out, lease_id)
        return out

    def find_groups(self, mask: np.uint64, count: int, min_version: int | None = None) -> np.ndarray | None:
        """Live members of the first ``count`` complete groups whose every live member has
        the fields and is available to this task, in completion order; None if fewer are
        ready. A group with a member older than ``min_version`` is refused whole."""
        s = self.samples
        chosen: list[np.ndarray] = []
        order = s.groups.order
        i = self.group_lo
        prefix = True  # groups before group_lo are all taken by this task
        while i < len(order) and len(chosen) < count:
            g = order[i]
            i += 1
            members = np.asarray(s.groups.members[g], dtype=np.int64)
            live = members[(s.mask[members] & EXCLUDED) == 0]
            if s.groups.aborted[g] or not len(live) or not np.any(self.state[live] == AVAILABLE):
                if prefix:
                    self.group_lo = i
                continue
            prefix = False
            if np.any(self.state[live] != AVAILABLE):
                continue
            if min_version is not None:
                versions = s.version[live]
                if np.any((versions < min_version) & (versions != NO_VERSION)):
                    self.state[live] = REFUSED
                    self.refused += len(live)
                    continue
            if np.all((s.mask[live] & (mask | HIDDEN)) == mask):
                chosen.append(live)
        if len(chosen) < count:
            return None
        return np.concatenate(chosen)

    def take(self, indexes: np.ndarray, lease_id: int) -> None:
        """Lease these samples under ``lease_id``."""
        self.state[indexes] = LEASED
        self.lease[indexes] = lease_id
        self.leased += len(indexes)
        self._advance()

    def ack(self, indexes: np.ndarray, lease_id: int) -> int:
        """Mark leased samples consumed; samples not held by ``lease_id`` are left alone."""
        held = self.state[indexes] == LEASED
        if lease_id:
            held &= self.lease[indexes] == lease_id
        mine = indexes[held]
        if len(mine) > 1 and not (mine[1:] > mine[:-1]).all():  # a sample named twice counts once
            mine = np.unique(mine)
        self.state[mine] = CONSUMED
        self.leased -= len(mine)
        self.consumed += len(mine)
        return len(mine)

    def expire(self, indexes: np.ndarray, lease_id: int) -> int:
        """Samples still held by ``lease_id`` become available again."""
        held = indexes[(self.state[indexes] == LEASED) & (self.lease[indexes] == lease_id)]
        self.state[held] = AVAILABLE
        self.lease[held] = 0
        self.leased -= len(held)
        self.expired += len(held)
        if len(held):
            self.lo = min(self.lo, int(held.min()))
            self.group_lo = 0  # cheap to rescan: complete groups only
        return len(held)

    def release(self, indexes: np.ndarray) -> None:
        """Samples excluded while this task held them: no longer held (the excluded bit keeps
        them out)."""
        held = indexes[self.state[indexes] == LEASED]
        self.leased -= len(held)
        self.state[held] = AVAILABLE

    def _advance(self) -> None:
        n = self.samples.n
        window = 1024
        while self.lo < n:
            end = min(n, self.lo + window)
            free = np.flatnonzero(self.state[self.lo : end] == AVAILABLE)
            if len(free):
                self.lo += int(free[0])
                return
            self.lo = end
            window = min(2 * window, SCAN_CHUNK)
