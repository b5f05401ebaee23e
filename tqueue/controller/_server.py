"""The controller: one event loop that owns all metadata and never sees payload bytes.

Nothing here blocks. A ``get_meta`` that cannot be served yet is parked with its deadline
and answered the moment a commit makes enough samples ready, or with a timeout error that
says what it waited for. Storage units register here and are told to drop data on clear.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
from typing import Any

import numpy as np

from .. import _transport
from .._wire import (
    PROTOCOL_VERSION,
    Ack,
    BatchMeta,
    Clear,
    Commit,
    CreatePartition,
    Drop,
    GetMeta,
    Grant,
    Granted,
    Hello,
    HelloReply,
    Meta,
    Ok,
    PartitionStatus,
    Registered,
    RegisterUnit,
    StatusReply,
    StatusRequest,
    TaskStatus,
    UnitInfo,
    UnitStatus,
    WaiterStatus,
)
from ..config import ControllerConfig
from ..errors import (
    InvalidArgumentError,
    PartitionClearedError,
    ProtocolVersionError,
    StorageUnitUnavailableError,
    TQueueError,
    WaitTimeoutError,
)
from ._state import GrantRecord, Partition, Unit

log = logging.getLogger(__name__)

DROP_TIMEOUT = 30.0


@dataclasses.dataclass(eq=False)
class _Waiter:
    ident: bytes
    req: GetMeta
    timer: asyncio.TimerHandle | None = None


class Controller:
    """The metadata server. Create inside a running loop, then ``await serve()``."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config or ControllerConfig()
        self._server = _transport.Server(
            self.config.bind, name="controller", max_header=self.config.max_header_bytes
        )
        self.address = self._server.address
        self._partitions: dict[str, Partition] = {}
        self._by_uid: dict[int, Partition] = {}
        self._units: dict[int, Unit] = {}
        self._unit_peers: dict[int, _transport.Peer] = {}
        self._grants: dict[int, GrantRecord] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._uids = itertools.count(1)
        self._grant_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._unit_ids = itertools.count(0)
        self._placements = itertools.count()
        s = self._server
        s.route(Hello, self._hello)
        s.route(RegisterUnit, self._register_unit)
        s.route(CreatePartition, self._create_partition)
        s.route(Grant, self._grant)
        s.route(Commit, self._commit)
        s.route(GetMeta, self._get_meta)
        s.route(Ack, self._ack)
        s.route(Clear, self._clear)
        s.route(StatusRequest, self._status)

    async def serve(self) -> None:
        log.info("controller serving at %s", self.address)
        await self._server.serve()

    async def close(self) -> None:
        for peer in self._unit_peers.values():
            await peer.close()
        await self._server.close()

    # --- membership -----------------------------------------------------------------

    def _hello(self, ident: bytes, msg: Hello, bufs: list[Any]) -> HelloReply:
        _check_protocol(msg.protocol, "controller")
        return HelloReply(
            protocol=PROTOCOL_VERSION,
            server="controller",
            units=[u.info for u in self._units.values()],
        )

    def _register_unit(self, ident: bytes, msg: RegisterUnit, bufs: list[Any]) -> Registered:
        _check_protocol(msg.protocol, "controller")
        unit_id = next(self._unit_ids)
        info = UnitInfo(unit_id=unit_id, address=msg.address, host=msg.host, shm=msg.shm)
        self._units[unit_id] = Unit(info=info)
        self._unit_peers[unit_id] = _transport.Peer(
            msg.address, name=f"storage unit {unit_id}", unavailable=StorageUnitUnavailableError
        )
        log.info("storage unit %d registered at %s (host %s)", unit_id, msg.address, msg.host)
        return Registered(unit_id=unit_id)

    # --- writes ---------------------------------------------------------------------

    def _partition(self, name: str, declared: list[str] | None = None) -> Partition:
        part = self._partitions.get(name)
        if part is None:
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError("a partition name is a non-empty string")
            part = Partition(name, next(self._uids), declared)
            self._partitions[name] = part
            self._by_uid[part.uid] = part
            log.info("partition %r created (uid %d)", name, part.uid)
        return part

    def _create_partition(self, ident: bytes, msg: CreatePartition, bufs: list[Any]) -> Ok:
        if msg.partition in self._partitions:
            if not msg.exist_ok:
                raise InvalidArgumentError(f"partition {msg.partition!r} already exists")
            return Ok()
        self._partition(msg.partition, msg.fields)
        return Ok()

    def _grant(self, ident: bytes, msg: Grant, bufs: list[Any]) -> Granted:
        if msg.count < 1:
            raise InvalidArgumentError(f"partition {msg.partition!r}: a write needs samples")
        if msg.indexes is None:
            part = self._partition(msg.partition)
        else:
            part = self._live(msg.partition, msg.partition_uid)
        added = part.check_blocks(msg.blocks, msg.count)
        if msg.groups is not None and len(msg.groups) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {len(msg.groups)} group ids for {msg.count} samples"
            )
        part.add_specs(added)
        fields = frozenset(b.name for b in msg.blocks)
        grant_id = next(self._grant_ids)
        if msg.indexes is None:
            unit = self._place(msg.host)
            start = part.allocate(msg.count, msg.groups)
            unit.reserved += msg.nbytes
            self._grants[grant_id] = GrantRecord(
                grant_id, part.uid, unit.info.unit_id, start, msg.count, None, fields, msg.nbytes
            )
            info: UnitInfo | None = unit.info
        else:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            if len(indexes) != msg.count:
                raise InvalidArgumentError("count and indexes disagree")
            part.check_indexes(indexes)
            start, info = 0, None
            self._grants[grant_id] = GrantRecord(grant_id, part.uid, -1, 0, msg.count, indexes, fields)
        return Granted(
            grant_id=grant_id,
            partition_uid=part.uid,
            start=start,
            unit=info,
            schema=dict(part.specs),
        )

    def _place(self, host: str) -> Unit:
        """A unit on the producer's host if there is one, the least loaded among those."""
        if not self._units:
            raise StorageUnitUnavailableError("no storage unit is registered with the controller")
        local = [u for u in self._units.values() if host and u.info.host == host]
        pool = local or list(self._units.values())
        # ties rotate so that equal units share the work
        turn = next(self._placements)
        return min(pool, key=lambda u: (u.load, (u.info.unit_id - turn) % len(pool)))

    def _commit(self, ident: bytes, msg: Commit, bufs: list[Any]) -> Ok:
        grant = self._grants.pop(msg.grant_id, None)
        if grant is None:
            raise InvalidArgumentError(f"grant {msg.grant_id} is unknown or already committed")
        unit = self._units.get(msg.unit_id)
        if unit is not None and grant.indexes is None:
            unit.reserved -= grant.nbytes
        part = self._by_uid.get(grant.partition_uid)
        if part is None:
            raise PartitionClearedError(
                f"the partition of grant {msg.grant_id} was cleared before its data was stored"
            )
        if set(msg.fields) != grant.fields:
            raise InvalidArgumentError(
                f"grant {msg.grant_id} was for fields {sorted(grant.fields)}, "
                f"the unit stored {sorted(msg.fields)}"
            )
        part.commit(grant, msg.unit_id)
        if unit is not None:
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        self._wake(part.name)
        return Ok()

    # --- reads ----------------------------------------------------------------------

    def _get_meta(self, ident: bytes, msg: GetMeta, bufs: list[Any]) -> Meta | None:
        _check_get(msg)
        served = self._try_serve(msg)
        if served is not None:
            return served
        if msg.timeout is not None and msg.timeout <= 0:
            raise self._timeout_error(msg)
        waiter = _Waiter(ident, msg)
        if msg.timeout is not None:
            loop = asyncio.get_running_loop()
            waiter.timer = loop.call_later(msg.timeout, self._expire, waiter)
        self._waiters.setdefault(msg.partition, []).append(waiter)
        return None

    def _try_serve(self, msg: GetMeta) -> Meta | None:
        part = self._partitions.get(msg.partition)
        if part is None:
            return None
        mask, missing = part.field_mask(msg.fields)
        if missing:
            return None
        task = part.task(msg.task)
        indexes = part.find_ready(task, mask, msg.batch_size)
        if indexes is None:
            return None
        lease = next(self._lease_ids)
        part.lease(task, indexes, lease)
        meta = BatchMeta(
            partition=part.name,
            partition_uid=part.uid,
            indexes=indexes.tolist(),
            units=part.unit[indexes].tolist(),
            fields=list(msg.fields),
            schema=dict(part.specs),
            groups=part.groups_of(indexes),
            task=msg.task,
            lease=lease,
        )
        return Meta(meta=meta)

    def _wake(self, partition: str) -> None:
        waiters = self._waiters.get(partition)
        if not waiters:
            return
        for waiter in list(waiters):
            try:
                reply = self._try_serve(waiter.req)
            except TQueueError as exc:
                self._finish(waiter)
                self._server.reply_error(waiter.ident, waiter.req.rid, exc)
                continue
            if reply is not None:
                self._finish(waiter)
                self._server.reply(waiter.ident, waiter.req.rid, reply)

    def _finish(self, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiters = self._waiters.get(waiter.req.partition, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(waiter.req.partition, None)

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        self._finish(waiter)
        self._server.reply_error(waiter.ident, waiter.req.rid, self._timeout_error(waiter.req))

    def _timeout_error(self, msg: GetMeta) -> WaitTimeoutError:
        return WaitTimeoutError(
            f"get_meta timed out after {msg.timeout} s waiting for {msg.batch_size} samples "
            f"of partition {msg.partition!r} with fields {list(msg.fields)} for task "
            f"{msg.task!r}: {self._readiness(msg)}"
        )

    def _readiness(self, msg: GetMeta) -> str:
        part = self._partitions.get(msg.partition)
        if part is None:
            return "the partition does not exist yet (nothing was put to it)"
        mask, missing = part.field_mask(msg.fields)
        if missing:
            ready = 0
            note = f"; fields never written to it: {missing} (known: {sorted(part.specs)})"
        else:
            ready = part.count_ready(part.tasks.get(msg.task), mask)
            note = ""
        return (
            f"{ready} ready for this task ({part.committed} samples committed in the "
            f"partition){note}"
        )

    def _ack(self, ident: bytes, msg: Ack, bufs: list[Any]) -> Ok:
        part = self._live(msg.partition, msg.partition_uid)
        task = part.tasks.get(msg.task)
        if task is None:
            raise InvalidArgumentError(
                f"task {msg.task!r} has no samples of partition {msg.partition!r} to acknowledge"
            )
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        if len(indexes) and (indexes.min() < 0 or indexes.max() >= part.n):
            raise InvalidArgumentError(f"partition {msg.partition!r} has no sample {msg.indexes}")
        part.ack(task, indexes, msg.lease)
        return Ok()

    def _live(self, name: str, uid: int) -> Partition:
        part = self._partitions.get(name)
        if part is None or (uid and part.uid != uid):
            raise PartitionClearedError(f"partition {name!r} was cleared (or never existed)")
        return part

    # --- cleanup --------------------------------------------------------------------

    async def _clear(self, ident: bytes, msg: Clear, bufs: list[Any]) -> Ok:
        part = self._partitions.pop(msg.partition, None)
        if part is None:
            return Ok()
        del self._by_uid[part.uid]
        for waiter in list(self._waiters.get(part.name, [])):
            self._finish(waiter)
            self._server.reply_error(
                waiter.ident,
                waiter.req.rid,
                PartitionClearedError(f"partition {part.name!r} was cleared while get_meta waited"),
            )
        self._grants = {g: r for g, r in self._grants.items() if r.partition_uid != part.uid}
        await self._drop_everywhere(part)
        log.info("partition %r cleared (uid %d)", part.name, part.uid)
        return Ok()

    async def _drop_everywhere(self, part: Partition) -> None:
        # Every unit, not only those with commits: a grant in flight may have stored bytes.
        units = list(self._unit_peers.items())
        results = await asyncio.gather(
            *(peer.request(Drop(partition_uid=part.uid), timeout=DROP_TIMEOUT) for _, peer in units),
            return_exceptions=True,
        )
        for (unit_id, _), result in zip(units, results):
            if isinstance(result, BaseException):
                log.warning("unit %d did not drop partition %r: %s", unit_id, part.name, result)
            elif unit_id in self._units:
                self._units[unit_id].nbytes -= part.unit_bytes.get(unit_id, 0)

    # --- status ---------------------------------------------------------------------

    def _status(self, ident: bytes, msg: StatusRequest, bufs: list[Any]) -> StatusReply:
        parts = [
            PartitionStatus(
                name=p.name,
                uid=p.uid,
                samples=p.committed,
                fields=dict(p.specs),
                tasks={
                    t: TaskStatus(leased=s.leased, consumed=s.consumed) for t, s in p.tasks.items()
                },
                nbytes=p.nbytes,
            )
            for p in self._partitions.values()
        ]
        units = [
            UnitStatus(unit_id=u.info.unit_id, address=u.info.address, host=u.info.host, nbytes=u.nbytes)
            for u in self._units.values()
        ]
        waiting = [
            WaiterStatus(
                partition=w.req.partition,
                task=w.req.task,
                reason=f"get_meta for {w.req.batch_size} samples with fields "
                f"{list(w.req.fields)}: {self._readiness(w.req)}",
            )
            for ws in self._waiters.values()
            for w in ws
        ]
        return StatusReply(partitions=parts, units=units, waiting=waiting)


def _check_protocol(protocol: int, server: str) -> None:
    if protocol != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks tqueue protocol {protocol}, the {server} speaks protocol "
            f"{PROTOCOL_VERSION}; upgrade the older side"
        )


def _check_get(msg: GetMeta) -> None:
    if msg.batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be at least 1, got {msg.batch_size}")
    if msg.timeout is not None and (math.isnan(msg.timeout) or msg.timeout < 0):
        raise InvalidArgumentError(f"timeout must be >= 0 seconds or None, got {msg.timeout}")
    if not msg.task:
        raise InvalidArgumentError("get_meta needs a task name")
    if not msg.fields or len(set(msg.fields)) != len(msg.fields):
        raise InvalidArgumentError(f"get_meta needs distinct field names, got {msg.fields}")
