"""Rows allocated ahead of their data, and where samples live (``AllocateRows``, ``Locate``).

An allocated row is a committed sample with no fields and no unit. Readers never see it until
it holds the fields they ask for; its first write (a client's ``update``) asks ``Locate`` for
its unit, which places it then, as a put would be placed, so that every field of a sample
lives on one unit as always. Partitions with a target or with groups take no allocated rows:
a row with no data counts toward neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError, TQueueError
from ...wire import AllocateRows, Grant, Locate, Located, MetaReply
from ..model._partition import Partition
from ..model._samples import COMMITTED
from ..model._state import ControllerState, Unit

MetaOf = Callable[..., Any]


class Allocations:
    """The controller's part for allocated rows; ``place`` picks a unit as a put's grant does."""

    def __init__(self, state: ControllerState, *, meta_of: MetaOf, place: Callable[[Grant], Unit]) -> None:
        self.state = state
        self._parked: dict[int, list[tuple[bytes, Locate, asyncio.TimerHandle]]] = {}  # unit id -> Locates waiting
        self._meta_of = meta_of
        self._place = place

    def allocate(self, ident: bytes, msg: AllocateRows, bufs: list[Any]) -> MetaReply:
        existing = self.state.partitions.get(msg.partition)
        if existing is not None:
            existing.check_room(msg.count)
        part = self.state.partitions.get_or_create(msg.partition)
        if part.options.target or part.options.group_size:
            raise InvalidArgumentError(
                f"partition {msg.partition!r} has a target or groups: rows allocated ahead of their data "
                "count toward neither, so it takes none"
            )
        if part.sealed:
            raise InvalidArgumentError(f"partition {msg.partition!r} is sealed: it takes no new rows")
        start = _allocate(part, msg.count)
        indexes = np.arange(start, start + msg.count, dtype=np.int64)
        return MetaReply(meta=self._meta_of(part, indexes, [], None, 0, 0.0))

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


def _allocate(part: Partition, count: int) -> int:
    """``count`` committed samples with no fields and no unit; the first one's index."""
    start = part.allocate(count, None, None)
    part.samples.mask[start : start + count] |= COMMITTED
    part.committed += count
    part.in_flight -= 1  # allocate() counts a grant in flight: there is none
    return start
