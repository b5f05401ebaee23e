"""Serving, free of IO: what one task has done with each sample of a partition, and the scans
that find what it may take next (samples in index order, or whole groups in completion order)."""

from __future__ import annotations

import numpy as np

from ._samples import EXCLUDED, HIDDEN, NO_VERSION, Samples, grow

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

    def find_ready(self, mask: np.uint64, count: int, min_version: int | None = None) -> np.ndarray | None:
        """The first ``count`` samples that have every field in ``mask``, that are not
        excluded, and that this task has neither leased nor consumed, in index order; None if
        there are fewer. Samples older than ``min_version`` are refused (and counted).

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
        return np.concatenate(found) if len(found) > 1 else found[0]

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
