"""The controller's moves: postpone, prefetch, seals, and reading every live sample.

Samples move between partitions without their bytes moving: the controller moves their
metadata and each unit re-keys their pieces. A mixin of the controller over its state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError, PartitionClearedError, WaitTimeoutError
from ..wire import GetMeta, Meta, Move, Ok, Postpone, Seal, Sealed, Select
from ._state import EXCLUDED, HIDDEN, Moved, Partition

if TYPE_CHECKING:
    from ..transport import _zmq

DROP_TIMEOUT = 30.0
log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Waiter:
    """A parked request (``get_meta`` or ``sealed``) with its deadline timer."""

    ident: bytes
    req: Any
    timer: asyncio.TimerHandle | None = None




class Moves:
    """Moves and seals (mixin; the state is the controller's)."""

    _server: _zmq.Server
    _loop: asyncio.AbstractEventLoop
    _partitions: dict[str, Partition]
    _unit_peers: dict[int, _zmq.Peer]
    _prefetching: set[int]
    _sealed_waiters: dict[str, list[Any]]

    def _prefetch(self, part: Partition, msg: GetMeta, count: int, mask: np.uint64, min_version: int | None) -> bool:
        """Move ready samples of the next partition in, to fill a drained one's short batch."""
        src = self._partitions.get(part.options.prefetch)
        if src is None or src is part:
            return False
        smask, missing = src.field_mask(msg.fields)
        if missing:
            return False
        need = count - len(part.all_ready(part.task(msg.task), mask, min_version))
        taken = src.all_ready(src.task(msg.task), smask, min_version)[:need]
        if len(taken) < need:
            return False
        moved = src.take_out(taken, f"prefetched into {part.name!r}")
        idx = part.reserve_in(moved)
        self._prefetching.add(part.uid)
        task = self._loop.create_task(self._land(moved, part, idx))
        task.add_done_callback(lambda _: self._prefetching.discard(part.uid))
        return True

    async def _land(self, moved: Moved, dst: Partition, idx: np.ndarray) -> None:
        """Re-key the samples' data on their units, then make them visible in ``dst``."""
        units = moved.units
        calls = []
        for unit_id in np.unique(units).tolist():
            peer = self._unit_peers.get(unit_id)
            sel = units == unit_id
            if peer is None:
                continue
            calls.append(
                peer.request(
                    Move(
                        src_uid=moved.uid,
                        dst_uid=dst.uid,
                        dst_name=dst.name,
                        src_indexes=moved.indexes[sel].tolist(),
                        dst_indexes=idx[sel].tolist(),
                    ),
                    timeout=DROP_TIMEOUT,
                    expect=Ok,
                )
            )
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("moving samples into partition %r failed on a unit: %s", dst.name, result)
        dst.land(idx, moved)
        self._wake(dst.name)

    async def _postpone(self, ident: bytes, msg: Postpone, bufs: list[Any]) -> Meta:
        part = self._live(msg.partition, msg.partition_uid)
        if msg.to == part.name:
            raise InvalidArgumentError(f"cannot postpone samples of partition {part.name!r} to itself")
        idx = np.asarray(msg.indexes, dtype=np.int64)
        part.check_indexes(idx)
        if msg.whole_groups:
            members = [part.groups.members[g] for g in np.unique(part.group[idx]).tolist() if g >= 0]
            idx = np.unique(np.concatenate([idx, *(np.asarray(m, dtype=np.int64) for m in members)]))
            idx = idx[(part.mask[idx] & EXCLUDED) == 0]
        dst = self._partition(msg.to)
        if dst.sealed:
            raise InvalidArgumentError(f"partition {msg.to!r} is sealed: it takes no more samples")
        moved = part.take_out(idx, f"postponed to {msg.to!r}")
        new = dst.reserve_in(moved)
        await self._land(moved, dst, new)
        self._maybe_free(part)
        return Meta(meta=self._meta_of(dst, new, list(dst.specs), None, 0, None))

    def _select_all(self, ident: bytes, msg: Select, bufs: list[Any]) -> Meta:
        part = self._partitions.get(msg.partition)
        if part is None:
            raise PartitionClearedError(f"partition {msg.partition!r} does not exist (or was freed)")
        mask, missing = part.field_mask(msg.fields)
        if missing:
            idx = np.zeros(0, dtype=np.int64)
        else:
            idx = np.flatnonzero((part.mask[: part.n] & (mask | HIDDEN)) == mask)
        return Meta(meta=self._meta_of(part, idx, list(msg.fields), None, 0, None))

    def _seal(self, ident: bytes, msg: Seal, bufs: list[Any]) -> Ok:
        part = self._partitions.get(msg.partition)
        if part is not None and not part.sealed:
            part.sealed = True
            self._on_sealed(part)
        return Ok()

    def _on_sealed(self, part: Partition) -> None:
        log.info("partition %r sealed with %d complete samples", part.name, part.complete)
        for waiter in self._sealed_waiters.pop(part.name, []):
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._server.reply(waiter.ident, waiter.req.rid, Ok())
        self._wake_soon(part.name)  # a drained, sealed partition may now pad or prefetch
        self._maybe_free(part)

    def _sealed(self, ident: bytes, msg: Sealed, bufs: list[Any]) -> Ok | None:
        part = self._partitions.get(msg.partition)
        if part is not None and part.sealed:
            return Ok()
        if msg.timeout is not None and msg.timeout <= 0:
            raise WaitTimeoutError(f"partition {msg.partition!r} is not sealed")
        waiter = Waiter(ident, msg)  # type: ignore[arg-type]
        if msg.timeout is not None:
            waiter.timer = self._loop.call_later(msg.timeout, self._expire_sealed, waiter)
        self._sealed_waiters.setdefault(msg.partition, []).append(waiter)
        return None

    def _expire_sealed(self, waiter: Waiter) -> None:
        waiters = self._sealed_waiters.get(waiter.req.partition, [])
        if waiter in waiters:
            waiters.remove(waiter)
        part = self._partitions.get(waiter.req.partition)
        have = f"{part.complete} complete samples" if part else "it does not exist yet"
        self._server.reply_error(
            waiter.ident,
            waiter.req.rid,
            WaitTimeoutError(f"partition {waiter.req.partition!r} was not sealed within {waiter.req.timeout} s ({have})"),
        )

