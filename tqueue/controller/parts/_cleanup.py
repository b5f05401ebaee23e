"""The controller's cleanup: failed samples, clearing, partitions that free themselves once
every task consumed them, and dropping their bytes on every unit (a drop a unit did not
confirm is remembered and retried, see :mod:`._drops`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._tasks import all_or_none
from ...errors import InvalidArgumentError, PartitionClearedError, TQueueError
from ...wire import Clear, Drop, Dropped, Fail, Ok
from ..model._partition import Partition
from ..model._state import ControllerState
from ._drops import PendingDrops

log = logging.getLogger(__name__)


class Cleanup:
    """Frees partitions and samples, over ``state``."""

    def __init__(
        self,
        state: ControllerState,
        *,
        wake_soon: Callable[[str], None],
        retry_parked: Callable[[], None],
        forgotten: Callable[[Partition], None],
    ) -> None:
        self.state = state
        self._forgotten = forgotten  # a partition was forgotten: the parts forget what they hold of it
        self._wake_soon = wake_soon  # serve parked reads of a partition after this reply
        self._retry_parked = retry_parked  # memory was freed: parked writes may fit now
        self.drops = PendingDrops(state.loop, state.tasks, self.drop_on)

    def fail(self, ident: bytes, msg: Fail, bufs: list[Any]) -> Ok:
        part = self.state.partitions.live(msg.partition, msg.partition_uid) if msg.partition_uid else self.state.partitions.get_or_create(msg.partition)
        if msg.indexes is not None:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            part.samples.check_indexes(indexes, part.name)
            part.fail_samples(indexes, msg.reason)
        elif msg.group is not None and msg.count > 0:
            part.fail_members(msg.group, msg.count, msg.reason)
        else:
            raise InvalidArgumentError("fail needs the samples (a meta) or a group and a count")
        self._wake_soon(part.name)
        self.maybe_free(part)
        return Ok()

    def maybe_free(self, part: Partition, finished: bool | None = None) -> None:
        """Free ``part`` if it is finished (``finished``: what the caller's model call said)."""
        if (part.finished() if finished is None else finished) and self.forget(part, None):
            log.info("partition %r (uid %d) consumed by every task: freeing it", part.name, part.uid)
            self.state.partitions.bury(part.name)
            self._wake_soon(part.name)  # waiters asking with pad learn that it is done
            self.state.tasks.start(self.drop_everywhere(part, None), f"drop partition {part.name!r} on every unit")

    async def clear(self, ident: bytes, msg: Clear, bufs: list[Any]) -> Ok:
        part = self.state.partitions.get(msg.partition)
        if part is None or (msg.partition_uid and part.uid != msg.partition_uid):
            return Ok()  # already gone: clearing is idempotent
        if msg.indexes is not None:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            part.samples.check_indexes(indexes, part.name)
            part.exclude(indexes, "cleared")
            await self.drop_everywhere(part, indexes)
            self.maybe_free(part)
            return Ok()
        await self._free(part, f"partition {part.name!r} was cleared while get_meta waited")
        return Ok()

    async def _free(self, part: Partition, cleared: str | None) -> None:
        if self.forget(part, cleared):
            await self.drop_everywhere(part, None)
            log.info("partition %r freed (uid %d)", part.name, part.uid)

    def forget(self, part: Partition, cleared: str | None) -> bool:
        """Forget a partition at once (a put to its name starts a new one); its bytes are
        dropped next. ``cleared``: waiters on the name get this error (an explicit clear).
        False if it was already forgotten."""
        if self.state.partitions.by_uid.pop(part.uid, None) is None:
            return False
        if self.state.partitions.get(part.name) is part:
            del self.state.partitions[part.name]
        if cleared is not None:
            for waiter in self.state.parked.reads.take(part.name):
                self.state.server.reply_error(waiter.ident, waiter.req.rid, PartitionClearedError(cleared))
        self._forgotten(part)  # its grants, leases and rounds, its counts kept for the metrics
        return True

    async def drop_everywhere(self, part: Partition, indexes: np.ndarray | None) -> None:
        # Every unit, not only those with commits: a grant in flight may have stored bytes.
        listed = None if indexes is None else indexes.tolist()
        await all_or_none(*(self.drop_on(unit_id, part.uid, listed) for unit_id in list(self.state.units.peers)))
        self._retry_parked()

    async def drop_on(self, unit_id: int, partition_uid: int, indexes: list[int] | None) -> bool:
        """Ask one unit to drop; a failure is remembered and retried (see _drops)."""
        peer = self.state.units.peers.get(unit_id)
        if peer is None:
            return True
        try:
            reply, _ = await peer.request(
                Drop(partition_uid=partition_uid, indexes=indexes), timeout=self.state.config.unit_timeout, expect=Dropped
            )
        except TQueueError as exc:
            log.warning("unit %d did not drop partition uid %d (retried later): %s", unit_id, partition_uid, exc)
            self.drops.failed(unit_id, partition_uid, indexes)
            return False
        if indexes is None:
            self.drops.done(unit_id, partition_uid)
        unit = self.state.units.get(unit_id)
        if unit is not None:
            unit.nbytes = reply.unit_bytes
        part = self.state.partitions.by_uid.get(partition_uid)
        if part is not None:
            part.unit_bytes[unit_id] = reply.partition_bytes
        return True
