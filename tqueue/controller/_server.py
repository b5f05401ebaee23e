"""The controller: one event loop that owns all metadata and never sees payload bytes.

Nothing here blocks. A call that cannot be served yet is parked with its deadline: a
``get_meta`` until enough samples are ready, a put's grant until memory frees or the
trainer's version admits more samples. Each is answered the moment that happens, or with a
typed error at its deadline that says what it waited for. Leases expire on timers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
from typing import Any

import msgspec
import numpy as np

from ..config import ControllerConfig
from ..errors import (
    InvalidArgumentError,
    PartitionClearedError,
    ProtocolVersionError,
    StorageUnitUnavailableError,
    TQueueError,
    WaitTimeoutError,
)
from ..transport import _zmq
from ..wire import (
    PROTOCOL_VERSION,
    Ack,
    Admission,
    BatchMeta,
    Cancel,
    Clear,
    Commit,
    CreatePartition,
    Drop,
    Dropped,
    Fail,
    GetMeta,
    Grant,
    Hello,
    HelloReply,
    Meta,
    Ok,
    PartitionStatus,
    Postpone,
    Registered,
    RegisterUnit,
    Renew,
    Reserve,
    Seal,
    Sealed,
    Select,
    SetVersion,
    StatusReply,
    StatusRequest,
    TaskStatus,
    UnitInfo,
    UnitStatus,
    WaiterStatus,
)
from ._drops import PendingDrops
from ._moves import DROP_TIMEOUT, Moves, Waiter
from ._policies import BUILT_IN, Candidates, check
from ._policies import load as load_policies
from ._rounds import RoundBook
from ._state import FAILURE_POLICIES, LEASED, GrantRecord, Options, Partition, Unit
from ._writes import ParkedWrite, Writes

log = logging.getLogger(__name__)

# A partition that sealed and freed itself leaves a tombstone: puts to its name are refused
# ("aborted") for this long, so that stragglers do not start a new partition that nobody
# consumes or frees. ``create_partition`` lifts it; the oldest go first past the count.
TOMBSTONE_SECONDS = 600.0
MAX_TOMBSTONES = 10_000


@dataclasses.dataclass(eq=False)
class _Lease:
    lease_id: int
    partition_uid: int
    task: str
    indexes: np.ndarray
    timer: asyncio.TimerHandle | None = None


class Controller(Writes, Moves):
    """The metadata server. Create inside a running loop, then ``await serve()``.

    Writes (grants, admission) and moves (postpone, prefetch, seals) live in their own
    modules as mixins over the same state."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config or ControllerConfig()
        self._server = _zmq.Server(
            self.config.bind, name="controller", max_header=self.config.max_header_bytes
        )
        self.address = self._server.address
        self._loop = asyncio.get_running_loop()
        self._policies = load_policies(self.config.policies)
        self._partitions: dict[str, Partition] = {}
        self._by_uid: dict[int, Partition] = {}
        self._units: dict[int, Unit] = {}
        self._unit_peers: dict[int, _zmq.Peer] = {}
        self._grants: dict[int, GrantRecord] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        self._parked: list[ParkedWrite] = []
        self._leases: dict[int, _Lease] = {}
        self._rounds: dict[tuple[int, str], RoundBook] = {}
        self._sealed_waiters: dict[str, list[Waiter]] = {}
        self._prefetching: set[int] = set()  # partitions a prefetch is moving samples into
        self._tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()  # name -> until
        self._drops = PendingDrops(self._loop, self._drop_on)
        self._version = 0
        self._admission: tuple[int, int] | None = None  # (max_staleness, batch_size)
        self._admitted = 0
        self._uids = itertools.count(1)
        self._grant_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._unit_ids = itertools.count(0)
        self._placements = itertools.count()
        s = self._server
        for msg_type, handler in (
            (Hello, self._hello),
            (RegisterUnit, self._register_unit),
            (CreatePartition, self._create_partition),
            (Grant, self._grant),
            (Commit, self._commit),
            (GetMeta, self._get_meta),
            (Ack, self._ack),
            (Renew, self._renew),
            (Fail, self._fail),
            (Clear, self._clear),
            (Seal, self._seal),
            (Sealed, self._sealed),
            (Postpone, self._postpone),
            (Select, self._select_all),
            (SetVersion, self._set_version),
            (Admission, self._set_admission),
            (Reserve, self._reserve),
            (StatusRequest, self._status),
            (Cancel, self._cancel),
        ):
            s.route(msg_type, handler)

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
            protocol=PROTOCOL_VERSION, server="controller", units=[u.info for u in self._units.values()]
        )

    def _register_unit(self, ident: bytes, msg: RegisterUnit, bufs: list[Any]) -> Registered:
        _check_protocol(msg.protocol, "controller")
        unit_id = next(self._unit_ids)
        info = UnitInfo(unit_id=unit_id, address=msg.address, host=msg.host, shm=msg.shm, bulk=msg.bulk)
        self._units[unit_id] = Unit(info=info, capacity=msg.capacity)
        self._unit_peers[unit_id] = _zmq.Peer(
            msg.address, name=f"storage unit {unit_id}", unavailable=StorageUnitUnavailableError
        )
        log.info("storage unit %d registered at %s (host %s)", unit_id, msg.address, msg.host)
        self._loop.call_soon(self._retry_parked)
        return Registered(unit_id=unit_id)

    # --- partitions -----------------------------------------------------------------

    def _partition(self, name: str, options: Options | None = None) -> Partition:
        part = self._partitions.get(name)
        if part is None:
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError("a partition name is a non-empty string")
            part = Partition(name, next(self._uids), options)
            self._partitions[name] = part
            self._by_uid[part.uid] = part
            log.info("partition %r created (uid %d)", name, part.uid)
        return part

    def _create_partition(self, ident: bytes, msg: CreatePartition, bufs: list[Any]) -> Ok:
        if msg.on_member_failure not in FAILURE_POLICIES:
            raise InvalidArgumentError(
                f"on_member_failure is one of {list(FAILURE_POLICIES)}, got {msg.on_member_failure!r}"
            )
        for name in ("group_size", "target", "target_groups"):
            if getattr(msg, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(msg, name)}")
        if msg.target_groups and not msg.group_size:
            raise InvalidArgumentError("target_groups needs a group_size")
        self._tombstones.pop(msg.partition, None)  # an explicit new start
        if msg.partition in self._partitions:
            if not msg.exist_ok:
                raise InvalidArgumentError(f"partition {msg.partition!r} already exists")
            return Ok()
        self._partition(
            msg.partition,
            Options(
                fields=frozenset(msg.fields) if msg.fields is not None else None,
                tasks=frozenset(msg.tasks) if msg.tasks is not None else None,
                group_size=msg.group_size,
                on_member_failure=msg.on_member_failure,
                auto_free=msg.auto_free,
                target=msg.target,
                target_groups=msg.target_groups,
                recycle_to=msg.recycle_to,
                prefetch=msg.prefetch,
            ),
        )
        return Ok()

    def _live(self, name: str, uid: int) -> Partition:
        part = self._partitions.get(name)
        if part is None or (uid and part.uid != uid):
            raise PartitionClearedError(f"partition {name!r} was cleared (or never existed)")
        return part

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
            part.forget(grant)
            raise InvalidArgumentError(
                f"grant {msg.grant_id} was for fields {sorted(grant.fields)}, "
                f"the unit stored {sorted(msg.fields)}"
            )
        was_sealed = part.sealed
        part.commit(grant, msg.unit_id)
        if unit is not None:
            unit.nbytes = msg.unit_bytes
        part.unit_bytes[msg.unit_id] = msg.partition_bytes
        # Waiters are served after this reply is sent: a failure while serving one of them
        # must not undo (or even delay) a commit the controller already recorded.
        self._loop.call_soon(self._after_commit, part, part.sealed and not was_sealed)
        return Ok()

    def _after_commit(self, part: Partition, sealed_now: bool) -> None:
        self._wake(part.name)
        if sealed_now:
            self._on_sealed(part)

    # --- reads ----------------------------------------------------------------------

    def _get_meta(self, ident: bytes, msg: GetMeta, bufs: list[Any]) -> Meta | None:
        _check_get(msg)
        served = self._try_serve(msg)
        if served is not None:
            return served
        if msg.timeout is not None and msg.timeout <= 0:
            raise self._timeout_error(msg)
        waiter = Waiter(ident, msg)
        if msg.timeout is not None:
            waiter.timer = self._loop.call_later(msg.timeout, self._expire, waiter)
        self._waiters.setdefault(msg.partition, []).append(waiter)
        return None

    def _select(self, part: Partition, msg: GetMeta, count: int) -> np.ndarray | None:
        """Samples for a request (index -1: a pad row), or None if it must wait."""
        policy = self._policies.get(msg.policy)
        if policy is None:
            raise InvalidArgumentError(f"unknown policy {msg.policy!r}; known: {sorted(self._policies)}")
        mask, missing = part.field_mask(msg.fields)
        if missing:
            return None
        task = part.task(msg.task)
        min_version = None if msg.max_staleness is None else self._version - msg.max_staleness
        candidates = Candidates(part, task, mask, min_version)
        found = policy.select(candidates, count)
        if found is not None:
            return found if msg.policy in BUILT_IN else check(found, candidates, msg.policy)
        if msg.policy == "groups" or not part.drained() or part.uid in self._prefetching:
            return None
        if part.options.prefetch and self._prefetch(part, msg, count, mask, min_version):
            return None  # samples are on their way in; their landing wakes this request
        if msg.pad:
            ready = candidates.ready()
            if len(ready):
                return np.concatenate([ready, np.full(count - len(ready), -1, dtype=np.int64)])
        return None

    def _try_serve(self, msg: GetMeta) -> Meta | None:
        part = self._partitions.get(msg.partition)
        if part is None:
            return None
        if msg.dp_size:
            return self._serve_round(part, msg)
        indexes = self._select(part, msg, msg.batch_size)
        if indexes is None:
            return None
        lease = self._lease(part, msg.task, indexes, msg.lease_timeout)
        return Meta(meta=self._meta(part, msg, indexes, lease))

    def _serve_round(self, part: Partition, msg: GetMeta) -> Meta | None:
        key = (part.uid, msg.task)
        book = self._rounds.get(key)
        if book is None:
            book = self._rounds[key] = RoundBook(msg.dp_size, msg.batch_size, msg.max_tokens_per_micro_batch)
        book.check(msg.dp_size, msg.batch_size, msg.max_tokens_per_micro_batch, f"partition {part.name!r}, task {msg.task!r}")
        # a caller counting rounds of an earlier partition of this name starts over
        number = 0 if msg.round_uid and msg.round_uid != part.uid else msg.round
        rnd = book.rounds.get(number)
        if rnd is None:
            if number < book.next:
                raise InvalidArgumentError(
                    f"round {number} of task {msg.task!r} on partition {part.name!r} is too old"
                )
            if number > book.next:
                return None  # earlier rounds are not formed yet
            indexes = self._select(part, msg, msg.dp_size * msg.batch_size)
            if indexes is None:
                return None
            fields = msg.balance_by if msg.balance_by is not None else msg.fields
            lengths = part.balance_lengths(indexes, fields)
            groups = None
            if msg.policy == "groups":  # whole groups per rank
                ordinals = part.group[indexes]
                groups = [np.flatnonzero(ordinals == g) for g in dict.fromkeys(ordinals.tolist())]
            rnd = book.form(indexes, lengths, [], groups)
            rnd.leases = [self._lease(part, msg.task, share, msg.lease_timeout) for share in rnd.shares]
            self._loop.call_soon(self._wake, part.name)  # peers of other ranks may be waiting
        meta = rnd.metas[msg.dp_rank]
        if meta is None:
            share = rnd.shares[msg.dp_rank]
            meta = self._meta(part, msg, share, rnd.leases[msg.dp_rank])
            meta = _with(
                meta,
                dp_rank=msg.dp_rank,
                dp_size=msg.dp_size,
                round=rnd.number,
                global_batch_size=rnd.size,
                num_microbatches=rnd.num_micro,
                micro_batch_indices=rnd.micro[msg.dp_rank],
            )
            rnd.metas[msg.dp_rank] = meta
        return Meta(meta=meta)

    def _meta(self, part: Partition, msg: GetMeta, indexes: np.ndarray, lease: int) -> BatchMeta:
        return self._meta_of(part, indexes, list(msg.fields), msg.task, lease, msg.lease_timeout)

    def _meta_of(
        self, part: Partition, indexes: np.ndarray, fields: list[str], task: str | None, lease: int, lease_timeout: float | None
    ) -> BatchMeta:
        real = indexes >= 0
        safe = np.where(real, indexes, 0)

        def per_sample(arr: np.ndarray, pad: int) -> list[int]:
            return np.where(real, arr[safe], pad).tolist()

        versions = np.where(real, part.version[safe], -1)
        groups = part.groups_of(safe)
        if groups is not None and not real.all():
            groups = [g if r else None for g, r in zip(groups, real.tolist())]
        segments = part.segments_of(indexes[real])
        if segments is not None and not real.all():
            it = iter(segments)
            segments = [next(it) if r else [] for r in real.tolist()]
        return BatchMeta(
            partition=part.name,
            partition_uid=part.uid,
            indexes=indexes.tolist(),
            units=per_sample(part.unit, -1),
            fields=fields,
            schema=dict(part.specs),
            groups=groups,
            task=task,
            lease=lease,
            lease_timeout=lease_timeout,
            versions=versions.tolist() if (versions >= 0).any() else None,
            versions_max=per_sample(part.version_max, -1) if (versions >= 0).any() else None,
            segments=segments,
            revisions=per_sample(part.revision, 0) if part.revision[safe].any() else None,
            global_batch_size=len(indexes),
            sealed=part.sealed,
        )

    def _lease(self, part: Partition, task: str, indexes: np.ndarray, timeout: float | None) -> int:
        lease_id = next(self._lease_ids)
        indexes = indexes[indexes >= 0]  # pad rows are nobody's
        part.lease(part.task(task), indexes, lease_id)
        record = _Lease(lease_id, part.uid, task, indexes)
        if timeout is not None and not math.isinf(timeout):
            record.timer = self._loop.call_later(timeout, self._expire_lease, lease_id)
        self._leases[lease_id] = record
        return lease_id

    def _expire_lease(self, lease_id: int) -> None:
        record = self._leases.pop(lease_id, None)
        part = self._by_uid.get(record.partition_uid) if record else None
        if record is None or part is None:
            return
        back = part.expire(part.task(record.task), record.indexes, lease_id)
        if back:
            log.info(
                "lease %d of task %r expired: %d samples of partition %r are ready again",
                lease_id, record.task, back, part.name,
            )
            self._wake(part.name)

    def _wake_soon(self, partition: str) -> None:
        """Wake the waiters of ``partition`` once the running handler has replied."""
        self._loop.call_soon(self._wake, partition)

    def _renew(self, ident: bytes, msg: Renew, bufs: list[Any]) -> Ok:
        record = self._leases.get(msg.lease)
        if record is None:
            raise InvalidArgumentError(
                f"lease {msg.lease} of task {msg.task!r} on partition {msg.partition!r} is "
                f"no longer held (acknowledged or expired)"
            )
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        if msg.timeout is not None and not math.isinf(msg.timeout):
            record.timer = self._loop.call_later(msg.timeout, self._expire_lease, msg.lease)
        return Ok()

    def _wake(self, partition: str) -> None:
        waiters = self._waiters.get(partition)
        if not waiters:
            return
        for waiter in list(waiters):
            try:
                reply = self._try_serve(waiter.req)
            except Exception as exc:  # this waiter's failure is this waiter's answer alone
                self._finish(waiter)
                self._server.reply_error(waiter.ident, waiter.req.rid, exc)  # logs a non-tqueue one
                continue
            if reply is not None:
                self._finish(waiter)
                self._server.reply(waiter.ident, waiter.req.rid, reply)

    def _finish(self, waiter: Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiters = self._waiters.get(waiter.req.partition, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(waiter.req.partition, None)

    def _expire(self, waiter: Waiter) -> None:
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
        if msg.policy == "groups":
            note += f"; {len(part.groups.order)} groups complete"
        if msg.dp_size:
            book = self._rounds.get((part.uid, msg.task))
            formed = book.next if book else 0
            note += f"; round {msg.round} asked, {formed} rounds formed"
        return (
            f"{ready} ready for this task ({part.committed} samples committed in the "
            f"partition){note}"
        )

    def _ack(self, ident: bytes, msg: Ack, bufs: list[Any]) -> Ok:
        part = self._partitions.get(msg.partition)
        if part is None or (msg.partition_uid and part.uid != msg.partition_uid):
            return Ok()  # freed or cleared: nothing is left to acknowledge
        task = part.tasks.get(msg.task)
        if task is None:
            raise InvalidArgumentError(
                f"task {msg.task!r} has no samples of partition {msg.partition!r} to acknowledge"
            )
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        if len(indexes) and (indexes.min() < 0 or indexes.max() >= part.n):
            raise InvalidArgumentError(f"partition {msg.partition!r} has no sample {msg.indexes}")
        part.ack(task, indexes, msg.lease)
        record = self._leases.get(msg.lease)
        if record is not None:
            held = (task.state[record.indexes] == LEASED) & (task.lease[record.indexes] == msg.lease)
            if not held.any():  # the whole lease is acknowledged
                del self._leases[msg.lease]
                if record.timer is not None:
                    record.timer.cancel()
        self._maybe_free(part)
        return Ok()

    def _cancel(self, ident: bytes, msg: Cancel, bufs: list[Any]) -> None:
        """The caller gave up on request ``msg.of``: withdraw it wherever it waits, so that
        what it waited for goes to a live caller. No reply, to either message."""
        for waiters in self._waiters.values():
            for waiter in waiters:
                if waiter.ident == ident and waiter.req.rid == msg.of:
                    self._finish(waiter)
                    return None
        for parked in self._parked:
            if parked.ident == ident and parked.req.rid == msg.of:
                self._parked.remove(parked)
                if parked.timer is not None:
                    parked.timer.cancel()
                return None
        for sealed in self._sealed_waiters.values():
            for waiter in sealed:
                if waiter.ident == ident and waiter.req.rid == msg.of:
                    sealed.remove(waiter)
                    if waiter.timer is not None:
                        waiter.timer.cancel()
                    return None
        return None  # already answered: nothing to withdraw

    # --- failures and cleanup -------------------------------------------------------

    def _fail(self, ident: bytes, msg: Fail, bufs: list[Any]) -> Ok:
        part = self._live(msg.partition, msg.partition_uid) if msg.partition_uid else self._partition(msg.partition)
        if msg.indexes is not None:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            part.check_indexes(indexes)
            part.fail_samples(indexes, msg.reason)
        elif msg.group is not None and msg.count > 0:
            part.fail_members(msg.group, msg.count, msg.reason)
        else:
            raise InvalidArgumentError("fail needs the samples (a meta) or a group and a count")
        self._wake_soon(part.name)
        self._maybe_free(part)
        return Ok()

    def _maybe_free(self, part: Partition) -> None:
        if part.finished() and self._forget(part, None):
            log.info("partition %r (uid %d) consumed by every task: freeing it", part.name, part.uid)
            self._bury(part.name)
            self._loop.create_task(self._drop_everywhere(part, None))

    async def _clear(self, ident: bytes, msg: Clear, bufs: list[Any]) -> Ok:
        part = self._partitions.get(msg.partition)
        if part is None or (msg.partition_uid and part.uid != msg.partition_uid):
            return Ok()  # already gone: clearing is idempotent
        if msg.indexes is not None:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            part.check_indexes(indexes)
            part.exclude(indexes, "cleared")
            await self._drop_everywhere(part, indexes)
            self._maybe_free(part)
            return Ok()
        await self._free(part, f"partition {part.name!r} was cleared while get_meta waited")
        return Ok()

    def _bury(self, name: str) -> None:
        self._tombstones.pop(name, None)
        self._tombstones[name] = self._loop.time() + TOMBSTONE_SECONDS
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _buried(self, name: str) -> bool:
        """A put to ``name`` is refused: its partition sealed and freed itself lately."""
        now = self._loop.time()
        while self._tombstones and next(iter(self._tombstones.values())) <= now:
            self._tombstones.popitem(last=False)  # kept in order of expiry: oldest first
        return name in self._tombstones

    async def _free(self, part: Partition, cleared: str | None) -> None:
        if self._forget(part, cleared):
            await self._drop_everywhere(part, None)
            log.info("partition %r freed (uid %d)", part.name, part.uid)

    def _forget(self, part: Partition, cleared: str | None) -> bool:
        """Forget a partition at once (a put to its name starts a new one); its bytes are
        dropped next. ``cleared``: waiters on the name get this error (an explicit clear).
        False if it was already forgotten."""
        if self._by_uid.pop(part.uid, None) is None:
            return False
        if self._partitions.get(part.name) is part:
            del self._partitions[part.name]
        if cleared is not None:
            for waiter in list(self._waiters.get(part.name, [])):
                self._finish(waiter)
                self._server.reply_error(waiter.ident, waiter.req.rid, PartitionClearedError(cleared))
        self._grants = {g: r for g, r in self._grants.items() if r.partition_uid != part.uid}
        for lease_id in [i for i, r in self._leases.items() if r.partition_uid == part.uid]:
            record = self._leases.pop(lease_id)
            if record.timer is not None:
                record.timer.cancel()
        for key in [k for k in self._rounds if k[0] == part.uid]:
            del self._rounds[key]
        return True

    async def _drop_everywhere(self, part: Partition, indexes: np.ndarray | None) -> None:
        # Every unit, not only those with commits: a grant in flight may have stored bytes.
        listed = None if indexes is None else indexes.tolist()
        await asyncio.gather(*(self._drop_on(unit_id, part.uid, listed) for unit_id in list(self._unit_peers)))
        self._retry_parked()

    async def _drop_on(self, unit_id: int, partition_uid: int, indexes: list[int] | None) -> bool:
        """Ask one unit to drop; a failure is remembered and retried (see _drops)."""
        peer = self._unit_peers.get(unit_id)
        if peer is None:
            return True
        try:
            reply, _ = await peer.request(
                Drop(partition_uid=partition_uid, indexes=indexes), timeout=DROP_TIMEOUT, expect=Dropped
            )
        except TQueueError as exc:
            log.warning("unit %d did not drop partition uid %d (retried later): %s", unit_id, partition_uid, exc)
            self._drops.failed(unit_id, partition_uid, indexes)
            return False
        if indexes is None:
            self._drops.done(unit_id, partition_uid)
        unit = self._units.get(unit_id)
        if unit is not None:
            unit.nbytes = reply.unit_bytes
        part = self._by_uid.get(partition_uid)
        if part is not None:
            part.unit_bytes[unit_id] = reply.partition_bytes
        return True

    # --- status ---------------------------------------------------------------------

    def _status(self, ident: bytes, msg: StatusRequest, bufs: list[Any]) -> StatusReply:
        parts = [
            PartitionStatus(
                name=p.name,
                uid=p.uid,
                samples=p.committed,
                fields=dict(p.specs),
                tasks={
                    t: TaskStatus(leased=s.leased, consumed=s.consumed, refused=s.refused, expired=s.expired)
                    for t, s in p.tasks.items()
                },
                nbytes=p.nbytes,
                ready=p.committed - p.excluded,
                excluded=p.excluded,
                reasons=dict(p.reasons),
                in_flight=p.in_flight,
                groups_complete=len(p.groups.order),
                sealed=p.sealed,
            )
            for p in self._partitions.values()
        ]
        units = [
            UnitStatus(
                unit_id=u.info.unit_id, address=u.info.address, host=u.info.host, nbytes=u.nbytes,
                capacity=u.capacity, undropped=self._drops.count(u.info.unit_id),
            )
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
        waiting += [
            WaiterStatus(
                partition=getattr(p.req, "partition", ""),
                task="",
                reason=p.reason,
                kind="put" if isinstance(p.req, Grant) else "reserve",
            )
            for p in self._parked
        ]
        limit = -1
        if self._admission is not None:
            limit = (self._version + self._admission[0] + 1) * self._admission[1]
        return StatusReply(
            partitions=parts,
            units=units,
            waiting=waiting,
            version=self._version,
            admitted=self._admitted,
            admission_limit=limit,
        )


def _with(meta: BatchMeta, **changes: Any) -> BatchMeta:

    return msgspec.structs.replace(meta, **changes)


def _check_protocol(protocol: int, server: str) -> None:
    if protocol != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks tqueue protocol {protocol}, the {server} speaks protocol "
            f"{PROTOCOL_VERSION}; upgrade the older side"
        )


def _check_get(msg: GetMeta) -> None:
    if msg.batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be at least 1, got {msg.batch_size}")
    for name, value in (("timeout", msg.timeout), ("lease_timeout", msg.lease_timeout)):
        if value is not None and (math.isnan(value) or value < 0):
            raise InvalidArgumentError(f"{name} must be >= 0 seconds or None, got {value}")
    if not msg.task:
        raise InvalidArgumentError("get_meta needs a task name")
    if not msg.fields or len(set(msg.fields)) != len(msg.fields):
        raise InvalidArgumentError(f"get_meta needs distinct field names, got {msg.fields}")
    if msg.dp_size:
        if msg.dp_size < 1 or not 0 <= msg.dp_rank < msg.dp_size:
            raise InvalidArgumentError(f"dp_rank must be in [0, dp_size), got {msg.dp_rank} of {msg.dp_size}")
        if msg.round < 0:
            raise InvalidArgumentError(f"round must be >= 0, got {msg.round}")
    if msg.max_staleness is not None and msg.max_staleness < 0:
        raise InvalidArgumentError(f"max_staleness must be >= 0, got {msg.max_staleness}")
