"""The controller's read side: ``get_meta`` (served at once or parked until samples are
ready), DP rounds, leases (expiry, renewal, acknowledgement) and waking parked reads.

A parked read is served after the handler that made it servable has replied; any exception
while serving one (a policy's or the planner's, typed or not) is that read's error reply alone.

A lease id carries the controller's incarnation in its high bits (``LEASE_EPOCH_BITS``, drawn at
random when the controller starts), its low bits are random too: an ack or renew of a lease that
an earlier controller at this address gave (before a restart, with or without ``restore``) is
refused with ``InvalidArgumentError`` saying so, and never matches a lease of this one. An ack
of a lease this controller gave that is no longer held (acked already, or lapsed and its samples
ready again or leased to another reader) consumes nothing and succeeds: a retried ack, and a
restarted data-parallel rank acking its round's share again, are normal.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np

from ...errors import InvalidArgumentError, PermissionDeniedError, UnknownFieldError, WaitTimeoutError, did_you_mean
from ...transport._liveness import session_of
from ...wire import Ack, BatchMeta, GetMeta, MetaReply, Ok, Renew
from ..model._partition import SMALL, Partition
from ..model._samples import CONSUMED, LEASED, TaskState
from ..model._state import MAX_SERVED, ControllerState, Waiter, random_ids
from ..planning._batch_policies import BUILT_IN, FIRST_READY, Candidates, Policy, check
from ..planning._rounds import Round, RoundBook, token_counts

log = logging.getLogger(__name__)

LEASE_EPOCH_BITS = 20  # high bits of a lease id: the controller incarnation that gave it
_LEASE_BITS = 63 - LEASE_EPOCH_BITS  # ids stay positive 63-bit integers
_LEASE_MASK = (1 << _LEASE_BITS) - 1

# prefetch(partition, request, count, field mask, min_version): True if samples are on their way in
Prefetch = Callable[[Partition, GetMeta, int, np.uint64, "int | None"], bool]


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    partition_uid: int
    task: str
    indexes: np.ndarray
    timer: asyncio.TimerHandle | None = None
    principal: str = ""  # with auth on: the client it was given to, the only one that acks or renews it
    session: bytes = b""  # the client session it was sent to (not a DP round's share: its peers hold it too)
    given: float = 0.0  # loop time it was sent


class Reads:
    """Serves, parks and wakes ``get_meta``. Owns the leases, the DP rounds, the batch
    policies and the staleness of what it served; the partitions and parked reads are
    ``state``'s."""

    def __init__(
        self,
        state: ControllerState,
        *,
        policies: Mapping[str, Policy],
        free: Callable[[Partition, bool | None], None],
        prefetch: Prefetch,
        needed: Callable[[str], None],
    ) -> None:
        self.state = state
        self.policies = policies
        self.leases: dict[int, Lease] = {}
        self.lease_ids = random_ids()  # not guessable: a lease id is what an ack names
        self.served: collections.OrderedDict[tuple[bytes, int], int] = collections.OrderedDict()  # (ident, rid) -> lease
        self.rounds: dict[tuple[int, str, str], RoundBook] = {}  # (partition uid, task, replica group)
        self.staleness = np.zeros(17, dtype=np.int64)  # samples served, by versions behind (16: 16 or more)
        self._free = free  # free a partition if every task consumed it
        self._prefetch = prefetch
        self._needed = needed  # a consumer parked on this partition: its puts are admitted
        self.epoch = secrets.randbits(LEASE_EPOCH_BITS) or 1  # this incarnation's, in every lease id

    def get_meta(self, ident: bytes, msg: GetMeta, bufs: list[Any]) -> MetaReply | None:
        _check_get(msg)
        served = self.try_serve(msg)
        if served is not None:
            self._remember(ident, msg, served, self.state.server.principal)
            return served
        if msg.timeout <= 0:
            raise self.timeout_error(msg)
        self.state.parked.check(f"get_meta on partition {msg.partition!r}")
        waiter = Waiter(ident, msg, principal=self.state.server.principal)
        self.state.parked.reads.park(waiter, msg.timeout, self.expire)
        self._needed(msg.partition)
        return None

    def _remember(self, ident: bytes, msg: GetMeta, served: MetaReply, principal: str) -> None:
        """Who holds the lease (with auth on), and which lease answered which request, for a
        cancel that crosses the reply (a DP round's share is not released: its peers on
        other ranks hold the same meta)."""
        record = self.leases.get(served.meta.lease)
        if record is not None and not record.principal:
            record.principal = principal
        if msg.dp_size or not served.meta.lease:
            return
        if record is not None:
            record.session, record.given = session_of(ident), self.state.loop.time()
        self.served[(ident, msg.rid)] = served.meta.lease
        while len(self.served) > MAX_SERVED:
            self.served.popitem(last=False)

    def policy_of(self, part: Partition, msg: GetMeta) -> str:
        """The policy a request reads with: the one it names, or its partition's default
        (``Partition.default_policy``)."""
        return msg.policy or part.default_policy

    def select(self, part: Partition, msg: GetMeta, count: int, lease_id: int = 0) -> np.ndarray | None:
        """Samples for a request (index -1: a pad row), or None if it must wait. With
        ``lease_id``, the samples are leased under it as they are found (the default
        policy's scan takes them in the same call)."""
        name = self.policy_of(part, msg)
        policy = self.policies.get(name)
        if policy is None:
            raise InvalidArgumentError(f"unknown policy {name!r}; known: {sorted(self.policies)}")
        mask, missing, task = part.reading(msg.fields, msg.task)
        if task is None:
            self._check_can_come(part, missing)
            return None
        min_version = None if msg.max_staleness is None else self.state.trainer.version - msg.max_staleness
        if policy is BUILT_IN[FIRST_READY]:  # the default, the hot path: FirstReady.select's own call
            found = task.find_ready(mask, count, min_version, lease_id)
            if found is not None:
                return found
        args = MappingProxyType(msg.policy_args) if msg.policy_args else MappingProxyType({})
        candidates = Candidates(part, task, mask, min_version, args)
        if policy is not BUILT_IN[FIRST_READY]:
            found = policy.select(candidates, count)
            if found is not None:
                return _leased(task, found if BUILT_IN.get(name) is policy else check(found, candidates, name), lease_id)
        if not part.drained() or part.uid in self.state.prefetching:
            return None
        prefetches = getattr(policy, "prefetches", True)
        if prefetches and part.options.prefetch and self._prefetch(part, msg, count, mask, min_version):
            return None  # samples are on their way in; their landing wakes this request
        if msg.pad:
            last = getattr(policy, "last", None)
            ready = candidates.ready() if last is None else last(candidates, count)
            if len(ready):
                return _leased(task, np.concatenate([ready, np.full(count - len(ready), -1, dtype=np.int64)]), lease_id)
            if not msg.dp_size and not task.leased:  # nothing left, nothing to come back: the end
                return np.zeros(0, dtype=np.int64)
        return None

    def _check_can_come(self, part: Partition, missing: list[str]) -> None:
        """Raise UnknownFieldError for a field that no sample of ``part`` has and none can
        get: the partition is sealed, does not declare its fields, and no put or update in
        flight writes it. (A partition that declares its fields waits for them: a later
        update may write them.) On an open partition, a name one typo from a field its
        samples have (:func:`_one_edit`; no put or update in flight writes it) fails at once
        too; any other field no sample has yet is waited for (a later put or update may write
        it: ``ref_log_prob`` beside ``old_log_probs`` is no typo)."""
        if part.schema.declared is not None:
            return
        writing: set[str] = set()
        for grant in self.state.grants.values():
            if grant.partition_uid == part.uid:
                writing |= grant.fields
        if not part.sealed:
            for name in missing:
                near = did_you_mean(name, [f for f in part.specs if _one_edit(name, f)])
                if near and name not in writing:
                    raise UnknownFieldError(
                        f"no sample of partition {part.name!r} has field {name!r} and no put or update under way "
                        f"writes it{near} (fields: {sorted(part.specs)}; a field that looks like none of them is "
                        "waited for, as a later put or update may write it)"
                    )
            return
        for name in missing:
            if name not in writing:
                raise UnknownFieldError(
                    f"no sample of partition {part.name!r} has field {name!r} and none can: the partition "
                    f"is sealed and no update writes it{did_you_mean(name, part.specs)} (fields: "
                    f"{sorted(part.specs)}; a partition that declares its fields, create_partition(fields=...), "
                    f"waits for a field that a later update writes)"
                )

    def try_serve(self, msg: GetMeta) -> MetaReply | None:
        part = self.state.partitions.get(msg.partition)
        if part is None:
            if msg.pad and not msg.dp_size and self.state.partitions.buried(msg.partition):  # consumed and freed: the end
                return MetaReply(meta=BatchMeta(partition=msg.partition, partition_uid=0, indexes=[], units=[],
                                           fields=list(msg.fields), schema={}, task=msg.task))
            return None
        if msg.dp_size:
            return self.serve_round(part, msg)
        lease_id = self.new_lease_id()
        indexes = self.select(part, msg, msg.batch_size, lease_id)
        if indexes is None:
            return None
        if not len(indexes):  # the end of a drained partition: nothing to lease
            return MetaReply(meta=self.meta(part, msg, indexes, 0))
        lease = self.lease(part, msg.task, indexes, msg.lease_timeout, taken=lease_id)
        return MetaReply(meta=self.meta(part, msg, indexes, lease))

    def serve_round(self, part: Partition, msg: GetMeta) -> MetaReply | None:
        key = (part.uid, msg.task, msg.replica_group)
        book = self.rounds.get(key)
        if book is None:
            if msg.replica_group and sum(k[0] == part.uid for k in self.rounds) >= self.state.config.max_tasks_per_partition:
                raise InvalidArgumentError(
                    f"partition {part.name!r}: rounds of more than max_tasks_per_partition="
                    f"{self.state.config.max_tasks_per_partition} tasks and replica groups at once"
                )
            book = self.rounds[key] = RoundBook.of(msg)
        book.check(msg, f"partition {part.name!r}, task {msg.task!r}")
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
            indexes = self.select(part, msg, msg.dp_size * msg.batch_size)
            if indexes is None:
                return None
            lengths = token_counts(part.schema.lengths, indexes, msg.fields, msg.balance_by)
            deal = getattr(self.policies[self.policy_of(part, msg)], "deal", None)  # whole groups per rank
            rnd = book.form(indexes, lengths, [], None if deal is None else deal(part, indexes))
            rnd.leases = [self.lease(part, msg.task, share, msg.lease_timeout) for share in rnd.shares]
            self.state.loop.call_soon(self.wake, part.name)  # peers of other ranks may be waiting
        meta = rnd.metas[msg.dp_rank]
        if meta is None:
            share = rnd.shares[msg.dp_rank]
            meta = self.meta(part, msg, share, rnd.leases[msg.dp_rank])
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
        elif meta.lease not in self.leases:  # acked or lapsed: asked again by a restarted rank
            meta = self._relet(part, msg, rnd, meta)
        return MetaReply(meta=meta)

    def _relet(self, part: Partition, msg: GetMeta, rnd: Round, meta: BatchMeta) -> BatchMeta:
        """A round's share whose lease ended, asked for again. Acked: the same meta (an ack
        of it again does nothing). Lapsed (``lease_timeout``): exactly its samples, if the task
        can still take every one of them, under a new lease; the new meta then answers this
        rank and its peers after it. Raises InvalidArgumentError where another read took them."""
        share = rnd.shares[msg.dp_rank]
        real = share[share >= 0]
        task = part.task(msg.task)
        if (task.state[real] == CONSUMED).all():
            return meta
        mask, missing = part.schema.field_mask(meta.fields)
        if missing or not np.isin(real, task.all_ready(mask)).all():
            raise InvalidArgumentError(
                f"round {rnd.number} of task {msg.task!r} on partition {part.name!r}: the lease of data-parallel "
                f"rank {msg.dp_rank}'s share (lease {meta.lease}) lapsed, and its samples {real.tolist()} are no "
                f"longer all there for the task (another read took some, or they were dropped)"
            )
        lease = self.lease(part, msg.task, share, msg.lease_timeout)
        rnd.leases[msg.dp_rank] = lease
        fresh = _with(meta, lease=lease, lease_timeout=msg.lease_timeout)
        rnd.metas[msg.dp_rank] = fresh
        log.info(
            "round %d of task %r on partition %r: data-parallel rank %d's share, whose lease %d lapsed, is "
            "leased again as %d", rnd.number, msg.task, part.name, msg.dp_rank, meta.lease, lease,
        )
        return fresh

    def meta(self, part: Partition, msg: GetMeta, indexes: np.ndarray, lease: int) -> BatchMeta:
        return self.meta_of(part, indexes, list(msg.fields), msg.task, lease, msg.lease_timeout)

    def meta_of(
        self, part: Partition, indexes: np.ndarray, fields: list[str], task: str | None, lease: int, lease_timeout: float
    ) -> BatchMeta:
        samples = part.samples
        listed = indexes.tolist()
        # pad rows (index -1) among them? (Python's min on short lists: no call into the model)
        padded = bool(listed) and (min(listed) if len(listed) <= SMALL else int(indexes.min())) < 0
        if padded:
            real = indexes >= 0
            safe = np.where(real, indexes, 0)

            def per_sample(arr: np.ndarray, pad: int) -> list[int]:
                return np.where(real, arr[safe], pad).tolist()

            versions = np.where(real, samples.version[safe], -1)
        else:  # the usual case, without the masks
            safe = indexes

            def per_sample(arr: np.ndarray, pad: int) -> list[int]:
                return arr[indexes].tolist()

            versions = samples.version[indexes]
        versioned = bool((versions >= 0).any())
        if task is not None and lease and versioned:  # served to a consumer: how far behind the trainer it is
            known = versions[versions >= 0]
            behind = np.clip(self.state.trainer.version - known, 0, len(self.staleness) - 1)
            self.staleness += np.bincount(behind, minlength=len(self.staleness))
        groups = samples.groups_of(safe) if samples.has_groups else None  # (no call where none)
        if groups is not None and padded:
            groups = [g if r else None for g, r in zip(groups, real.tolist())]
        segments = samples.segments_of(indexes[real] if padded else indexes) if samples.segments else None
        splices = samples.splices_of(indexes[real] if padded else indexes) if segments is not None else None
        if segments is not None and padded:
            segments = _padded(segments, real)
            splices = None if splices is None else {f: _padded(rows, real) for f, rows in splices.items()}
        return BatchMeta(
            partition=part.name,
            partition_uid=part.uid,
            indexes=listed,
            units=per_sample(samples.unit, -1),
            fields=fields,
            schema=dict(part.schema.specs),
            groups=groups,
            task=task,
            lease=lease,
            lease_timeout=lease_timeout,
            versions=versions.tolist() if versioned else None,
            versions_max=per_sample(samples.version_max, -1) if versioned else None,
            segments=segments,
            splices=splices,
            revisions=per_sample(samples.revision, 0) if samples.revision[safe].any() else None,
            global_batch_size=len(listed),
            sealed=part.sealed,
            two_copies=(part.options.copies or self.state.config.copies) > 1,
        )

    def new_lease_id(self) -> int:
        return (self.epoch << _LEASE_BITS) | (next(self.lease_ids) & _LEASE_MASK) | 1

    def lease(self, part: Partition, task: str, indexes: np.ndarray, timeout: float, taken: int = 0) -> int:
        """Lease ``indexes`` to ``task`` (``taken``: the lease id ``select`` already took
        them under); returns the lease id."""
        lease_id = taken or self.new_lease_id()
        indexes = indexes[indexes >= 0]  # pad rows are nobody's
        if not taken:
            part.tasks[task].take(indexes, lease_id)  # (the read that leases made the task's state)
        record = Lease(lease_id, part.uid, task, indexes)
        if not math.isinf(timeout):
            record.timer = self.state.loop.call_later(timeout, self.expire_lease, lease_id)
        self.leases[lease_id] = record
        return lease_id

    def expire_lease(self, lease_id: int, why: str = "expired") -> None:
        record = self.leases.pop(lease_id, None)
        part = self.state.partitions.by_uid.get(record.partition_uid) if record else None
        if record is None or part is None:
            return
        if record.timer is not None:
            record.timer.cancel()
        back = part.task(record.task).expire(record.indexes, lease_id)
        if back:
            log.info(
                "lease %d of task %r %s: %d samples of partition %r are ready again",
                lease_id, record.task, why, back, part.name,
            )
            self.wake_soon(part.name)

    def cancelled(self, ident: bytes, rid: int) -> None:
        """The caller of an answered ``get_meta`` gave up on it (its reply crossed the
        cancel): the lease it never saw is released, its samples go to a live caller."""
        lease_id = self.served.pop((ident, rid), None)
        if lease_id is not None:
            self.expire_lease(lease_id, "cancelled by its caller")

    def forget(self, part: Partition) -> None:
        """A partition is forgotten: so are its leases and DP rounds."""
        for lease_id in [i for i, r in self.leases.items() if r.partition_uid == part.uid]:
            record = self.leases.pop(lease_id)
            if record.timer is not None:
                record.timer.cancel()
        for key in [k for k in self.rounds if k[0] == part.uid]:
            del self.rounds[key]

    def session_gone(self, session: bytes, silent_since: float) -> int:
        """A client session ended: forget which of its requests got which lease, and release
        the leases sent to it after it fell silent (the reply went down a connection that
        was already dead, in the instant before ZeroMQ knew): their samples go to a live
        consumer now, not at the lease's expiry. The number released."""
        for key in [k for k in self.served if session_of(k[0]) == session]:
            del self.served[key]
        unheard = [lid for lid, r in self.leases.items() if r.session == session and r.given > silent_since]
        for lease_id in unheard:
            self.expire_lease(lease_id, "was sent to a client that is gone, after it fell silent")
        return len(unheard)

    def wake_soon(self, partition: str) -> None:
        """Wake the waiters of ``partition`` once the running handler has replied."""
        self.state.loop.call_soon(self.wake, partition)

    def _check_owner(self, lease_id: int, task: str, what: str) -> None:
        """With auth on, only the client a lease was given to may ack or renew it."""
        if self.state.server.curve is None:
            return
        if not lease_id:
            raise PermissionDeniedError(f"with authentication on, {what} of task {task!r} must name its lease")
        record = self.leases.get(lease_id)
        principal = self.state.server.principal
        if record is not None and record.principal and record.principal != principal:
            raise PermissionDeniedError(
                f"lease {lease_id} of task {task!r} was given to {record.principal}; {principal} "
                f"may not {what} it"
            )

    def _check_incarnation(self, lease_id: int, task: str, partition: str, what: str) -> None:
        """Refuse a lease an earlier controller gave (before a restart at this address)."""
        if lease_id and lease_id >> _LEASE_BITS != self.epoch:
            raise InvalidArgumentError(
                f"lease {lease_id} of task {task!r} on partition {partition!r} is unknown: it is from before a "
                f"controller restart (another incarnation gave it), so nothing was {what}; its samples are served "
                f"again (a controller restored from a checkpoint makes the samples leased then ready again)"
            )

    def renew(self, ident: bytes, msg: Renew, bufs: list[Any]) -> Ok:
        self._check_incarnation(msg.lease, msg.task, msg.partition, "renewed")
        self._check_owner(msg.lease, msg.task, "renew")
        record = self.leases.get(msg.lease)
        if record is None:
            raise InvalidArgumentError(
                f"lease {msg.lease} of task {msg.task!r} on partition {msg.partition!r} is "
                f"no longer held (acknowledged or expired)"
            )
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        if not math.isinf(msg.timeout):
            record.timer = self.state.loop.call_later(msg.timeout, self.expire_lease, msg.lease)
        return Ok()

    def wake(self, partition: str) -> None:
        """Serve the parked reads of ``partition`` that can be served now."""
        for waiter in list(self.state.parked.reads.by_key.get(partition, ())):
            try:
                reply = self.try_serve(waiter.req)
            except Exception as exc:  # this waiter's failure is this waiter's answer alone
                self.state.parked.finish(waiter)
                self.state.parked.answer(waiter.ident, waiter.req.rid, exc)
                continue
            if reply is not None:
                self.state.parked.finish(waiter)
                self._remember(waiter.ident, waiter.req, reply, waiter.principal)
                self.state.parked.answer(waiter.ident, waiter.req.rid, reply)

    def expire(self, waiter: Waiter) -> None:
        waiter.timer = None
        self.state.parked.finish(waiter)
        self.state.parked.answer(waiter.ident, waiter.req.rid, self.timeout_error(waiter.req))

    def timeout_error(self, msg: GetMeta) -> WaitTimeoutError:
        return WaitTimeoutError(
            f"get_meta timed out after {msg.timeout} s waiting for {msg.batch_size} samples "
            f"of partition {msg.partition!r} with fields {list(msg.fields)} for task "
            f"{msg.task!r}: {self.readiness(msg)}"
        )

    def readiness(self, msg: GetMeta) -> str:
        part = self.state.partitions.get(msg.partition)
        if part is None:
            return "the partition does not exist yet (nothing was put to it)"
        mask, missing = part.schema.field_mask(msg.fields)
        if missing:
            ready = 0
            note = f"; fields never written to it: {missing}{did_you_mean(missing[0], part.specs)} (known: {sorted(part.specs)})"
        else:
            ready = part.count_ready(part.tasks.get(msg.task), mask)
            note = ""
        note_of = getattr(self.policies.get(self.policy_of(part, msg)), "note", None)
        if note_of is not None:
            note += note_of(part)
        if msg.dp_size:
            book = self.rounds.get((part.uid, msg.task, msg.replica_group))
            formed = book.next if book else 0
            note += f"; round {msg.round} asked, {formed} rounds formed"
        return (
            f"{ready} ready for this task ({part.committed} samples committed in the "
            f"partition){note}"
        )

    def ack(self, ident: bytes, msg: Ack, bufs: list[Any]) -> Ok:
        self._check_incarnation(msg.lease, msg.task, msg.partition, "acknowledged")
        self._check_owner(msg.lease, msg.task, "ack")
        part = self.state.partitions.get(msg.partition)
        if part is None or (msg.partition_uid and part.uid != msg.partition_uid):
            return Ok()  # freed or cleared: nothing is left to acknowledge
        task, acked, finished = part.ack(msg.task, msg.indexes, msg.lease)
        record = self.leases.get(msg.lease)
        if record is not None:
            # the whole lease acknowledged: at once when this ack took every sample of it (the
            # usual case), else when none of it is still held
            whole = acked == len(record.indexes) or not (
                (task.state[record.indexes] == LEASED) & (task.lease[record.indexes] == msg.lease)
            ).any()
            if whole:
                del self.leases[msg.lease]
                if record.timer is not None:
                    record.timer.cancel()
        self._free(part, finished)
        if part.sealed and msg.partition in self.state.parked.reads and part.drained() and not task.leased:
            self.wake_soon(part.name)  # a waiter asking with pad may now learn the partition is done
        return Ok()




def _with(meta: BatchMeta, **changes: Any) -> BatchMeta:

    return msgspec.structs.replace(meta, **changes)


def _check_get(msg: GetMeta) -> None:
    if msg.batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be at least 1, got {msg.batch_size}")
    for name, value in (("timeout", msg.timeout), ("lease_timeout", msg.lease_timeout)):
        if math.isnan(value) or value < 0:
            raise InvalidArgumentError(f"{name} must be >= 0 seconds (math.inf: none), got {value}")
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


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` is one typo from ``b``: a character added, dropped, changed, or two
    neighbours swapped; names of four characters or more (``x`` and ``y`` are two fields)."""
    if min(len(a), len(b)) < 4 or a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((k for k in range(len(short)) if short[k] != long[k]), len(short))
    return short[i:] == long[i + 1 :]


def _padded(per_sample: list[list[Any]], real: np.ndarray) -> list[list[Any]]:
    """Per-sample lists of the real samples, with ``[]`` at the pad rows."""
    it = iter(per_sample)
    return [next(it) if r else [] for r in real.tolist()]


def _leased(task: TaskState, indexes: np.ndarray, lease_id: int) -> np.ndarray:
    """``indexes``, leased to ``task`` under ``lease_id`` where one is given."""
    if lease_id:
        task.take(indexes[indexes >= 0], lease_id)
    return indexes
