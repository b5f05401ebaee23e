"""Copies whose bytes failed their checksum (``Corrupt``, from a reader): the copy is dropped
on its unit, the sample is served from its other copy where there is one (and copied again),
else it is lost for every task, as a sample of a dead unit is. Nothing else changes: a bad
copy is never served, and the samples it did not hold are untouched.

A reader's report is taken at its word: an admitted client may as well clear the samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ...wire import Corrupt, Located
from ..model._partition import Partition
from ..model._samples import COMMITTED, EXCLUDED
from ..model._state import ControllerState

log = logging.getLogger(__name__)


class Corruption:
    """Handles ``Corrupt`` over ``state``; ``drop_on(unit, partition uid, indexes)`` frees
    the bad copies on their unit, ``copy_again()`` wakes the copier for the samples now held
    once, ``free(part)`` frees a partition that has nothing left to serve."""

    def __init__(
        self,
        state: ControllerState,
        *,
        drop_on: Callable[[int, int, list[int] | None], Coroutine[Any, Any, bool]],
        copy_again: Callable[[], None],
        wake_soon: Callable[[str], None],
        free: Callable[[Partition], None],
    ) -> None:
        self.state = state
        self._drop_on = drop_on
        self._copy_again = copy_again
        self._wake_soon = wake_soon
        self._free = free

    def report(self, ident: bytes, msg: Corrupt, bufs: list[Any]) -> Located:
        part = self.state.partitions.live(msg.partition, msg.partition_uid)
        idx = np.unique(np.asarray(msg.indexes, dtype=np.int64))
        part.samples.check_indexes(idx, part.name)
        s = part.samples
        alive = [u.info.unit_id for u in self.state.units.values() if u.alive]
        held = (s.mask[idx] & (COMMITTED | EXCLUDED)) == COMMITTED
        first = held & (s.unit[idx] == msg.unit_id)
        second = held & (s.second_unit[idx] == msg.unit_id)
        other = s.second_unit[idx]
        moved = first & (other >= 0) & np.isin(other, alive)
        s.unit[idx[moved]] = other[moved]
        s.second_unit[idx[moved | second]] = -1
        bad = idx[first | second]
        lost = idx[first & ~moved]
        part.corrupt += len(bad)
        if (moved | second).any():
            part.twice = True  # held once now (status().single counts them), until copied again
        if len(lost):
            part.lose_samples(lost, "corrupt")
        if len(bad):
            log.warning(
                "partition %r: field %r of %d sample(s) on unit %d failed its checksum at a reader: that copy is "
                "dropped (%d served from their other copy, %d lost)",
                part.name, msg.field, len(bad), msg.unit_id, int(moved.sum()), len(lost),
            )
            self.state.tasks.start(
                self._drop_on(msg.unit_id, part.uid, bad.tolist()),
                f"drop the corrupt copies of partition {part.name!r} on unit {msg.unit_id}",
            )
            self._copy_again()
            self._wake_soon(part.name)
            self._free(part)
        dead = {u.info.unit_id for u in self.state.units.values() if not u.alive}
        asked = np.asarray(msg.indexes, dtype=np.int64)
        units = s.unit[asked]
        gone = np.isin(asked, lost) | np.isin(units, list(dead)) | ((s.mask[asked] & EXCLUDED) != 0)
        copies = part.options.copies or self.state.config.copies
        return Located(units=units.tolist(), gone=gone.tolist(), two_copies=copies > 1,
                       second_units=s.second_unit[asked].tolist())
