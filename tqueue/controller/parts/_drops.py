"""Drops a storage unit did not confirm: remembered per unit, retried with backoff a bounded
number of times, and counted in ``status()`` until they succeed (no bytes leak silently).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from ..._tasks import Tasks

log = logging.getLogger(__name__)

DROP_RETRIES = 5  # then the drop stays listed in status() until a later drop of it succeeds
DROP_RETRY_SECONDS = 2.0  # first retry; each next one waits twice as long

# A pending drop of a whole partition (as ``Drop.indexes`` None means).
WHOLE: frozenset[int] = frozenset({-1})


@dataclasses.dataclass
class _UnitDrops:
    pending: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)  # uid -> samples or WHOLE
    attempts: int = 0
    timer: asyncio.TimerHandle | None = None


class PendingDrops:
    """Per unit, the partitions (or samples) whose bytes a unit was asked to drop and did
    not confirm. ``send(unit_id, partition_uid, indexes)`` is the controller's drop call."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, tasks: Tasks, send: Callable[[int, int, list[int] | None], Awaitable[bool]]
    ) -> None:
        self._loop = loop
        self._tasks = tasks
        self._send = send
        self._units: dict[int, _UnitDrops] = {}

    def failed(self, unit_id: int, partition_uid: int, indexes: list[int] | None) -> None:
        entry = self._units.setdefault(unit_id, _UnitDrops())
        had = entry.pending.get(partition_uid, frozenset())
        if indexes is None or had == WHOLE:
            entry.pending[partition_uid] = WHOLE
        else:
            entry.pending[partition_uid] = had | frozenset(indexes)
        if entry.timer is None and entry.attempts < DROP_RETRIES:
            delay = DROP_RETRY_SECONDS * 2**entry.attempts
            entry.timer = self._loop.call_later(delay, self._start_retry, unit_id)

    def done(self, unit_id: int, partition_uid: int) -> None:
        """A drop of the whole partition succeeded on the unit."""
        entry = self._units.get(unit_id)
        if entry is not None:
            entry.pending.pop(partition_uid, None)
            self._tidy(unit_id, entry)

    def count(self, unit_id: int) -> int:
        entry = self._units.get(unit_id)
        return len(entry.pending) if entry else 0

    def armed(self, unit_id: int) -> bool:
        entry = self._units.get(unit_id)
        return entry is not None and entry.timer is not None

    def forget_unit(self, unit_id: int) -> None:
        entry = self._units.pop(unit_id, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()

    def _start_retry(self, unit_id: int) -> None:
        self._tasks.start(self.retry(unit_id), f"retry the drops of unit {unit_id}")

    async def retry(self, unit_id: int) -> None:
        """Send every pending drop of ``unit_id`` once more."""
        entry = self._units.get(unit_id)
        if entry is None:
            return
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.attempts += 1
        pending, entry.pending = entry.pending, {}
        for uid, samples in pending.items():
            listed = None if samples == WHOLE else sorted(samples)
            if await self._send(unit_id, uid, listed):  # a failure lands back in failed()
                log.info("unit %d dropped partition uid %d on retry %d", unit_id, uid, entry.attempts)
        if entry.pending and entry.attempts >= DROP_RETRIES:
            log.error(
                "unit %d did not drop %d partitions after %d retries; status() lists them",
                unit_id, len(entry.pending), entry.attempts,
            )
        self._tidy(unit_id, entry)

    def _tidy(self, unit_id: int, entry: _UnitDrops) -> None:
        if not entry.pending and entry.timer is None:
            self._units.pop(unit_id, None)
