"""The controller's write side: grants, placement, the memory budget and staleness admission.

A grant is answered at once, or parked (no polling) until memory frees or the trainer's
version admits more samples, or refused with a typed error that says what was asked, used and
allowed. A mixin of :class:`~tqueue.controller._server.Controller` over its state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ..errors import InvalidArgumentError, StorageFullError, WaitTimeoutError
from ..wire import Admission, Grant, Granted, Ok, Reserve, SetVersion
from ._state import GrantRecord, Partition, Unit

if TYPE_CHECKING:
    import asyncio

    from ..transport._zmq import Server

# A put's bytes must be committed within this long after its grant, else the grant lapses
# (a producer that died between grant and store) and the partition can be freed.
GRANT_TIMEOUT = 600.0
log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class ParkedWrite:
    """A grant (or reserve) waiting for memory or for the trainer's version."""

    ident: bytes
    req: Grant | Reserve
    reason: str = ""
    full: bool = False  # waiting for memory (else for admission)
    timer: asyncio.TimerHandle | None = None


class _Wait(Exception):
    """A write cannot be admitted yet; ``reason`` says why, ``full`` if for memory."""

    def __init__(self, reason: str, *, full: bool, never: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.full = full
        self.never = never  # waiting cannot help


class Writes:
    """Grants and admission (mixin; the state is the controller's)."""

    _server: Server
    _loop: asyncio.AbstractEventLoop
    _partitions: dict[str, Partition]
    _by_uid: dict[int, Partition]
    _units: dict[int, Unit]
    _grants: dict[int, GrantRecord]
    _parked: list[ParkedWrite]
    _version: int
    _admission: tuple[int, int] | None
    _admitted: int

    def _buried(self, name: str) -> bool: ...

    def _grant(self, ident: bytes, msg: Grant, bufs: list[Any]) -> Granted | None:
        if msg.count < 1:
            raise InvalidArgumentError(f"partition {msg.partition!r}: a write needs samples")
        if msg.groups is not None and len(msg.groups) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {len(msg.groups)} group ids for {msg.count} samples"
            )
        if msg.versions is not None and len(msg.versions) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {len(msg.versions)} versions for {msg.count} samples"
            )
        if msg.indexes is not None:
            return self._grant_update(msg)
        try:
            return self._grant_put(msg)
        except _Wait as wait:
            return self._park(ident, msg, wait)

    def _grant_put(self, msg: Grant) -> Granted:
        part = self._partitions.get(msg.partition)
        if part is not None and (part.sealed or (not msg.partial and part.target_promised())):
            return self._late_put(part, msg)
        if part is None and self._buried(msg.partition):
            log.info("a put of %d samples to partition %r, sealed and freed, is refused", msg.count, msg.partition)
            return Granted(grant_id=0, partition_uid=0, start=0, status="aborted", sealed=True, partition=msg.partition)
        if part is not None:
            added = part.check_blocks(msg.blocks, msg.count)
        else:  # validate against a scratch partition: nothing is created for a refused put
            added = Partition(msg.partition, 0).check_blocks(msg.blocks, msg.count)
        unit = self._place(msg)
        self._admit(msg.count - min(msg.reserved, msg.count), msg.partition)
        part = self._partition(msg.partition)
        part.add_specs(added)
        start = part.allocate(msg.count, msg.groups, msg.versions)
        part.record_lengths(msg.blocks, slice(start, start + msg.count))
        unit.reserved += msg.nbytes
        grant_id = next(self._grant_ids)
        fields = frozenset(b.name for b in msg.blocks)
        kept = msg.count if msg.partial else part.promise(msg.count)
        self._grants[grant_id] = GrantRecord(
            grant_id, part.uid, unit.info.unit_id, start, msg.count, None, fields, msg.nbytes,
            partial=msg.partial, kept=kept,
        )
        self._loop.call_later(GRANT_TIMEOUT, self._lapse_grant, grant_id)
        return Granted(
            grant_id=grant_id, partition_uid=part.uid, start=start, unit=unit.info, schema=dict(part.specs),
            partition=part.name, kept=-1 if kept == msg.count else kept,
        )

    def _late_put(self, part: Partition, msg: Grant) -> Granted:
        """A put to a sealed partition, or one whose target earlier puts already hold:
        recycled as partial samples into the partition's ``recycle_to``, or refused
        (``aborted``, nothing is sent); the producer learns which from the reply."""
        when = "after seal" if part.sealed else "over target"
        recycle = part.options.recycle_to
        if recycle and recycle != part.name:
            redirected = msgspec.structs.replace(msg, partition=recycle, partial=True)
            granted = self._grant_put(redirected)
            part.reasons[f"recycled {when}"] += msg.count
            return msgspec.structs.replace(granted, status="recycled", sealed=part.sealed)
        part.reasons[f"discarded {when}"] += msg.count
        return Granted(
            grant_id=0, partition_uid=part.uid, start=0, status="aborted", sealed=part.sealed, partition=part.name
        )

    def _grant_update(self, msg: Grant) -> Granted:
        part = self._live(msg.partition, msg.partition_uid)
        added = part.check_blocks(msg.blocks, msg.count)
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        if len(indexes) != msg.count:
            raise InvalidArgumentError("count and indexes disagree")
        part.check_indexes(indexes)
        part.add_specs(added)
        part.record_lengths(msg.blocks, indexes)
        grant_id = next(self._grant_ids)
        fields = frozenset(b.name for b in msg.blocks)
        segment = (int(msg.segment[0]), int(msg.segment[1])) if msg.segment else None
        self._grants[grant_id] = GrantRecord(
            grant_id, part.uid, -1, 0, msg.count, indexes, fields, complete=msg.complete, segment=segment
        )
        return Granted(grant_id=grant_id, partition_uid=part.uid, start=0, schema=dict(part.specs))

    def _place(self, msg: Grant) -> Unit:
        """A unit on the producer's host with room, the least loaded among those."""
        if not self._units:
            raise _Wait("no storage unit is registered with the controller yet", full=True)
        need = msg.nbytes
        cap = self.config.capacity_bytes
        used = sum(u.load for u in self._units.values())
        if cap and used + need > cap:
            raise _Wait(
                f"a write of {need} bytes to partition {msg.partition!r} needs memory: {used} "
                f"bytes used of {cap} allowed in the cluster",
                full=True,
                never=need > cap,
            )
        roomy = [u for u in self._units.values() if u.fits(need)]
        if not roomy:
            largest = max((u.capacity or math.inf) for u in self._units.values())
            per_unit = ", ".join(f"unit {u.info.unit_id}: {u.load} of {u.capacity}" for u in self._units.values())
            raise _Wait(
                f"a write of {need} bytes to partition {msg.partition!r} fits on no storage unit "
                f"({per_unit} bytes used of allowed)",
                full=True,
                never=need > largest,
            )
        local = [u for u in roomy if msg.host and u.info.host == msg.host]
        pool = local or roomy
        turn = next(self._placements)  # ties rotate so that equal units share the work
        return min(pool, key=lambda u: (u.load, (u.info.unit_id - turn) % len(pool)))

    def _admit(self, count: int, partition: str) -> None:
        """AReaL-style staleness admission: raise _Wait if ``count`` more samples would put
        producers more than ``max_staleness`` versions ahead of the trainer.

        The bound is on the running total, so a put larger than the window
        (``(max_staleness + 1) * batch_size``) is not refused: it waits until the trainer's
        version makes room for all of it, as smaller puts do."""
        if self._admission is None or count <= 0:
            return
        k, batch = self._admission
        limit = (self._version + k + 1) * batch
        if self._admitted + count > limit:
            raise _Wait(
                f"{count} samples for partition {partition!r} wait for the trainer: "
                f"{self._admitted} samples admitted of {limit} allowed (trainer version "
                f"{self._version}, max_staleness {k}, batch_size {batch})",
                full=False,  # never "never": the limit grows with each version, so any put fits in time
            )
        self._admitted += count

    def _park(self, ident: bytes, msg: Grant | Reserve, wait: _Wait) -> None:
        timeout = math.inf if msg.timeout is None else msg.timeout  # None: the caller waits forever
        if wait.never or timeout <= 0:
            raise (StorageFullError if wait.full else WaitTimeoutError)(wait.reason)
        parked = ParkedWrite(ident, msg, wait.reason, wait.full)
        if not math.isinf(timeout):
            parked.timer = self._loop.call_later(timeout, self._expire_parked, parked)
        self._parked.append(parked)
        return None

    def _expire_parked(self, parked: ParkedWrite) -> None:
        if parked in self._parked:
            self._parked.remove(parked)
        what = "put" if isinstance(parked.req, Grant) else "reserve"
        err = (StorageFullError if parked.full else WaitTimeoutError)(
            f"{what} timed out after {parked.req.timeout} s: {parked.reason}"
        )
        self._server.reply_error(parked.ident, parked.req.rid, err)

    def _retry_parked(self) -> None:
        for parked in list(self._parked):
            try:
                if isinstance(parked.req, Grant):
                    reply: Any = self._grant_put(parked.req)
                else:
                    self._admit(parked.req.count, "(reserved)")
                    reply = Ok()
            except _Wait as wait:
                parked.reason, parked.full = wait.reason, wait.full
                continue
            except Exception as exc:  # this write's failure is this write's answer alone
                reply = exc
            self._parked.remove(parked)
            if parked.timer is not None:
                parked.timer.cancel()
            if isinstance(reply, Exception):
                self._server.reply_error(parked.ident, parked.req.rid, reply)
            else:
                self._server.reply(parked.ident, parked.req.rid, reply)

    def _reserve(self, ident: bytes, msg: Reserve, bufs: list[Any]) -> Ok | None:
        if msg.count < 1:
            raise InvalidArgumentError(f"reserve needs a count of at least 1, got {msg.count}")
        try:
            self._admit(msg.count, "(reserved)")
        except _Wait as wait:
            return self._park(ident, msg, wait)
        return Ok()

    def _set_version(self, ident: bytes, msg: SetVersion, bufs: list[Any]) -> Ok:
        if msg.version > self._version:
            self._version = msg.version
            log.info("trainer version %d", msg.version)
            self._loop.call_soon(self._retry_parked)  # after this reply
        return Ok()

    def _set_admission(self, ident: bytes, msg: Admission, bufs: list[Any]) -> Ok:
        if msg.max_staleness < 0:
            self._admission = None
        else:
            if msg.batch_size < 1:
                raise InvalidArgumentError(f"batch_size must be at least 1, got {msg.batch_size}")
            self._admission = (msg.max_staleness, msg.batch_size)
        self._loop.call_soon(self._retry_parked)  # after this reply
        return Ok()

    def _lapse_grant(self, grant_id: int) -> None:
        grant = self._grants.pop(grant_id, None)
        if grant is None:
            return  # committed (or its partition is gone)
        log.warning("grant %d was never committed; its %d samples are dropped", grant_id, grant.count)
        unit = self._units.get(grant.unit_id)
        if unit is not None:
            unit.reserved -= grant.nbytes
        part = self._by_uid.get(grant.partition_uid)
        if part is not None:
            part.forget(grant)
            self._maybe_free(part)
        self._retry_parked()

