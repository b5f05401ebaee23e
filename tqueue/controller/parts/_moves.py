"""The controller's moves: postpone, prefetch, seals, and reading every live sample.

Samples move between partitions without their bytes moving: the controller moves their
metadata and each unit re-keys their pieces. Acts on the controller's state it is given.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError, PartitionClearedError, RemoteError, UnavailableError, WaitTimeoutError
from ...wire import GetMeta, MetaReply, Move, Ok, Postpone, Seal, Sealed, Select
from ..model._partition import Partition
from ..model._samples import CONSUMED, EXCLUDED, HIDDEN, Moved
from ..model._state import ControllerState, Waiter
from ._reads import Reads

log = logging.getLogger(__name__)


class Moves:
    """Moves and seals, over ``state``; ``reads`` serves what a landing or a seal wakes."""

    def __init__(self, state: ControllerState, reads: Reads, *, free: Callable[[Partition], None]) -> None:
        self.state = state
        self.reads = reads
        self._free = free  # free a partition if every task consumed it
        self.moving = 0  # moves sent to units, not landed yet
        self.moved = asyncio.Event()  # set while no move is under way (a checkpoint waits for it)
        self.moved.set()

    async def landed(self, within: float) -> None:
        """Return once no move between partitions is under way (a checkpoint's wait);
        UnavailableError if some still are after ``within`` seconds."""
        loop = self.state.loop  # its clock, which the timers follow (a test may move it on)
        deadline = loop.time() + within
        while self.moving:
            try:
                await asyncio.wait_for(self.moved.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise UnavailableError(
                    f"a checkpoint waits for no move between partitions to be under way; {self.moving} "
                    f"still were after {within:g} s"
                ) from None

    def prefetch(self, part: Partition, msg: GetMeta, count: int, mask: np.uint64, min_version: int | None) -> bool:
        """Move ready samples of the next partition in, to fill a drained one's short batch."""
        src = self.state.partitions.get(part.options.prefetch)
        if src is None or src is part:
            return False
        smask, missing = src.schema.field_mask(msg.fields)
        if missing:
            return False
        need = count - len(part.task(msg.task).all_ready(mask, min_version))
        taken = src.task(msg.task).all_ready(smask, min_version)[:need]
        if len(taken) < need:
            return False
        reason = f"prefetched into {part.name!r}"
        moved = src.take_out(taken, reason)
        idx = part.reserve_in(moved)
        self.state.prefetching.add(part.uid)
        task = self.state.tasks.start(self._land(moved, part, idx, reason), f"prefetch into {part.name!r}")
        task.add_done_callback(lambda _: self.state.prefetching.discard(part.uid))
        return True

    def _land(self, moved: Moved, dst: Partition, idx: np.ndarray, reason: str) -> Coroutine[Any, Any, list[str]]:
        """Re-key the samples' data on their units, then make them visible in ``dst``.

        Samples a unit did not re-key (it refused, or did not answer) are not landed: they
        stay where they were (their data never left) and are never served in ``dst``.
        Returns one line per unit that failed, empty if every sample moved. The move counts
        as under way from this call (the samples left their partition in this loop step):
        a checkpoint waits until none is."""
        self.moving += 1
        self.moved.clear()
        return self._landing(moved, dst, idx, reason)

    async def _landing(self, moved: Moved, dst: Partition, idx: np.ndarray, reason: str) -> list[str]:
        try:
            asked: list[tuple[int, np.ndarray]] = []
            calls = []
            failed: list[str] = []
            ok = np.ones(len(idx), dtype=bool)
            # each copy is re-keyed on its unit (the first, and the second of samples held twice);
            # rows allocated ahead of their data are on no unit: nothing to re-key
            held = [(u, moved.units == u) for u in np.unique(moved.units).tolist() if u >= 0]
            held += [(u, moved.second_units == u) for u in np.unique(moved.second_units).tolist() if u >= 0]
            for unit_id, sel in held:
                peer = self.state.units.peers.get(unit_id)
                if peer is None:
                    ok &= ~sel
                    failed.append(f"unit {unit_id} is not registered (samples {moved.indexes[sel].tolist()})")
                    continue
                move = Move(
                    src_uid=moved.uid,
                    dst_uid=dst.uid,
                    dst_name=dst.name,
                    src_indexes=moved.indexes[sel].tolist(),
                    dst_indexes=idx[sel].tolist(),
                )
                calls.append(peer.request(move, timeout=self.state.config.unit_timeout, expect=Ok))
                asked.append((unit_id, sel))
            for (unit_id, sel), result in zip(asked, await asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(result, BaseException):
                    ok &= ~sel
                    failed.append(f"unit {unit_id} refused samples {moved.indexes[sel].tolist()}: {result}")
            if failed:
                log.error("moving samples into partition %r failed: %s", dst.name, "; ".join(failed))
                src = self.state.partitions.by_uid.get(moved.uid)
                if src is not None:
                    src.restore(moved.indexes[~ok], reason)
                dst.samples.mask[idx[~ok]] |= EXCLUDED  # reserved, never committed: never served
            dst.land(idx[ok], moved.subset(ok))
            self.reads.wake_soon(dst.name)
            return failed
        finally:
            self.moving -= 1
            if not self.moving:
                self.moved.set()

    async def postpone(self, ident: bytes, msg: Postpone, bufs: list[Any]) -> MetaReply:
        part = self.state.partitions.live(msg.partition, msg.partition_uid)
        if msg.to == part.name:
            raise InvalidArgumentError(f"cannot postpone samples of partition {part.name!r} to itself")
        idx = np.asarray(msg.indexes, dtype=np.int64)
        part.samples.check_indexes(idx, part.name)
        if msg.whole_groups:
            idx = part.samples.with_groups(idx)
        dst = self.state.partitions.get_or_create(msg.to)
        if dst.sealed:
            raise InvalidArgumentError(f"partition {msg.to!r} is sealed: it takes no more samples")
        reason = f"postponed to {msg.to!r}"
        moved = part.take_out(idx, reason)
        new = dst.reserve_in(moved)
        failed = await self._land(moved, dst, new, reason)
        self._free(part)
        if failed:
            raise RemoteError(
                f"postponing samples {idx.tolist()} of partition {part.name!r} to {msg.to!r}: "
                f"{'; '.join(failed)}; those samples stay in {part.name!r}, the others moved"
            )
        return MetaReply(meta=self.reads.meta_of(dst, new, list(dst.specs), None, 0, math.inf))

    def select_all(self, ident: bytes, msg: Select, bufs: list[Any]) -> MetaReply:
        part = self.state.partitions.get(msg.partition)
        if part is None:
            raise PartitionClearedError(f"partition {msg.partition!r} does not exist (or was freed)")
        mask, missing = part.schema.field_mask(msg.fields)
        if missing:
            idx = np.zeros(0, dtype=np.int64)
        else:
            idx = np.flatnonzero((part.samples.mask[: part.n] & (mask | HIDDEN)) == mask)
        if msg.consumed_by is not None:
            task = part.tasks.get(msg.consumed_by)
            idx = idx[task.state[idx] == CONSUMED] if task is not None else idx[:0]
        if msg.limit >= 0:
            idx = idx[: msg.limit]  # cut here: the reply carries only what was asked for
        return MetaReply(meta=self.reads.meta_of(part, idx, list(msg.fields), None, 0, math.inf))

    def seal(self, ident: bytes, msg: Seal, bufs: list[Any]) -> Ok:
        part = self.state.partitions.get(msg.partition)
        if part is not None and not part.sealed:
            part.sealed = True
            self.on_sealed(part)
        return Ok()

    def on_sealed(self, part: Partition) -> None:
        log.info("partition %r sealed with %d complete samples", part.name, part.complete)
        for waiter in self.state.parked.seals.take(part.name):
            self.state.server.reply(waiter.ident, waiter.req.rid, Ok())
        self.reads.wake_soon(part.name)  # a drained, sealed partition may now pad or prefetch
        self._free(part)

    def sealed(self, ident: bytes, msg: Sealed, bufs: list[Any]) -> Ok | None:
        part = self.state.partitions.get(msg.partition)
        if part is not None and part.sealed:
            return Ok()
        if msg.timeout <= 0:
            raise WaitTimeoutError(f"partition {msg.partition!r} is not sealed")
        self.state.parked.check(f"sealed({msg.partition!r})")
        self.state.parked.seals.park(Waiter(ident, msg), msg.timeout, self._expire_sealed)
        return None

    def _expire_sealed(self, waiter: Waiter) -> None:
        part = self.state.partitions.get(waiter.req.partition)
        have = f"{part.complete} complete samples" if part else "it does not exist yet"
        self.state.server.reply_error(
            waiter.ident,
            waiter.req.rid,
            WaitTimeoutError(f"partition {waiter.req.partition!r} was not sealed within {waiter.req.timeout} s ({have})"),
        )

