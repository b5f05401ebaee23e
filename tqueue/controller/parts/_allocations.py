"""Rows allocated ahead of their data (``AllocateRows``; where one lives is placed at its first
``Locate``, in :mod:`._copies`).

An allocated row is a committed sample with no fields and no unit. Readers never see it until
it holds the fields they ask for; its first write (a client's ``update``) asks ``Locate`` for
its unit, which places it then, as a put would be placed, so that every field of a sample
lives on one unit as always. Partitions with a target or with groups take no allocated rows:
a row with no data counts toward neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...wire import AllocateRows, MetaReply
from ..model._partition import Partition
from ..model._samples import COMMITTED
from ..model._state import ControllerState

MetaOf = Callable[..., Any]


class Allocations:
    """The controller's part for allocated rows."""

    def __init__(self, state: ControllerState, *, meta_of: MetaOf) -> None:
        self.state = state
        self._meta_of = meta_of

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


def _allocate(part: Partition, count: int) -> int:
    """``count`` committed samples with no fields and no unit; the first one's index."""
    start = part.allocate(count, None, None)
    part.samples.mask[start : start + count] |= COMMITTED
    part.committed += count
    part.in_flight -= 1  # allocate() counts a grant in flight: there is none
    return start
