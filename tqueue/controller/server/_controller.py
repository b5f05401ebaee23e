"""The controller: one event loop that owns all metadata and never sees payload bytes.

Nothing here blocks. A call that cannot be served yet is parked with its deadline: a
``get_meta`` until enough samples are ready, a put's grant until memory frees or the
trainer's version admits more samples. Each is answered the moment that happens, or with a
typed error at its deadline that says what it waited for, or withdrawn unanswered when its
caller sends ``Cancel``. Leases expire on timers.

What the parts share is one object (:class:`..model._state.ControllerState`); each part
(``..parts``) owns the rest of what it acts on: ``Writes`` (grants, commits, budget,
admission), ``Reads`` (get_meta, rounds, leases), ``Moves`` (postpone, prefetch, seals),
``Cleanup`` (failures, clear, freeing, drops) and the smaller ones. :class:`Controller` owns
the server, composes the parts, hands each the few callables it needs of the others, and
routes each message to one of them (docs/architecture.md, "Controller floor plan").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ...config import ControllerConfig
from ...errors import InvalidArgumentError, ProtocolVersionError
from ...transport import _auth, _zmq_server
from ...transport._metrics import MetricsEndpoint
from ...wire import (
    PROTOCOL_VERSION,
    Ack,
    Admission,
    AllocateRows,
    BindKeys,
    Cancel,
    Checkpoint,
    Clear,
    Commit,
    Commits,
    Corrupt,
    CreatePartition,
    DropKeys,
    Fail,
    GetMeta,
    Grant,
    Granted,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    ListKeys,
    Locate,
    LookupKeys,
    Message,
    MetaReply,
    Ok,
    PartitionStatus,
    Postpone,
    Registered,
    RegisterUnit,
    Renew,
    Reserve,
    ResetConsumption,
    Restore,
    Seal,
    Sealed,
    Select,
    SetTags,
    SetVersion,
    StatusReply,
    StatusRequest,
    TagKeys,
    TaskStatus,
    UnitStatus,
    VersionWait,
    WaiterStatus,
)
from ..model._partition import FAILURE_POLICIES, Options, Partition
from ..model._state import ControllerState
from ..parts._allocations import Allocations
from ..parts._checkpoints import Checkpoints, read_manifest
from ..parts._cleanup import Cleanup
from ..parts._copies import Copier, Failover
from ..parts._corruption import Corruption
from ..parts._moves import Moves
from ..parts._reads import Reads
from ..parts._resets import Resets
from ..parts._trainer import Versions
from ..parts._units import Liveness
from ..parts._user_keys import Keys
from ..parts._writes import Writes
from ..planning._batch_policies import load as load_policies
from ._limits import Door
from ._prometheus import Totals

log = logging.getLogger(__name__)


class Controller:
    """The metadata server. Create inside a running loop, then ``await serve()``."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config or ControllerConfig()
        self._server = _zmq_server.Server(
            self.config.bind,
            name="controller",
            max_header=self.config.max_header_bytes,
            # no request to the controller carries payload: a frame far past the header bound
            # drops its connection before it is received (one a little past it gets a typed reply)
            max_frame_bytes=4 * self.config.max_header_bytes,
            heartbeat=self.config.heartbeat_interval,
            curve=_auth.server_keys(self.config.auth_dir),
            advertise=self.config.advertise,
        )
        self.address = self._server.address
        self.metrics: MetricsEndpoint | None = None
        self.state = ControllerState(self.config, self._server)
        self.totals = Totals()  # freed partitions' counts, for the metrics' counters
        # the parts call each other only through these few bound methods
        self.cleanup = Cleanup(
            self.state, wake_soon=self._wake_soon, retry_parked=self._retry_parked, forgotten=self._forgotten,
        )
        self.reads = Reads(
            self.state, policies=load_policies(self.config.policies), free=self.cleanup.maybe_free,
            prefetch=self._prefetch, needed=self._needed,
        )
        self.moves = Moves(self.state, self.reads, free=self.cleanup.maybe_free)
        self.copier = Copier(self.state)
        self.writes = Writes(
            self.state, free=self.cleanup.maybe_free, wake=self.reads.wake, sealed=self.moves.on_sealed, suspect=self._suspect,
            copy_again=self.copier.wake,
        )
        self.versions = Versions(self.state, retry_parked=self.writes.retry_parked)
        self.allocations = Allocations(self.state, meta_of=self.reads.meta_of)
        self.failover = Failover(self.state, place=self.writes.place)
        self.liveness = Liveness(
            self.state, writes=self.writes, cleanup=self.cleanup, wake=self._wake_soon, leases_gone=self.reads.session_gone,
            copy_again=self.copier.wake, promote=self.failover.promote, unit_gone=self.failover.unit_gone,
        )
        self.checkpoints = Checkpoints(
            self.state, wake=self._wake_soon, copy_again=self.copier.wake, forget=self.cleanup.forget,
            free=lambda part: self.cleanup.drop_everywhere(part, None), landed=self.moves.landed,
        )
        # a controller restarted from a checkpoint: its units get their ids back, and requests
        # wait until the checkpoint is loaded (a missing or damaged one fails the start here)
        self._manifest: dict[str, Any] | None = None
        self.door = Door(self.config)  # every request's way in: bounds, then the restore gate
        self._registered = asyncio.Event()
        if self.config.restore:
            self._manifest = read_manifest(self.config.restore, self.config.checkpoint_root)
            self.liveness.known([(int(u["unit_id"]), str(u["name"])) for u in self._manifest["units"]])
            self.door.restored = asyncio.Event()
        self.keys = Keys(self.state, meta_of=self.reads.meta_of)
        self.corruption = Corruption(
            self.state, drop_on=self.cleanup.drop_on, copy_again=self.copier.wake, wake_soon=self._wake_soon,
            free=self.cleanup.maybe_free,
        )
        self.resets = Resets(self.state, wake_soon=self._wake_soon)
        self._server.on_undelivered = self._undelivered
        # what only the units may send (with auth on: the cluster's key)
        units: tuple[tuple[type[Any], Callable[[bytes, Any, list[Any]], Any]], ...] = (
            (RegisterUnit, self._register_unit),
            (Heartbeat, self._heartbeat),
            (Commit, self.writes.commit),
            (Commits, self.writes.commits),
        )
        for msg_type, handler in units:
            self._server.route(msg_type, self.door.wrap(handler, gated=False), role=_auth.CLUSTER)
        anyone: tuple[tuple[type[Any], Callable[[bytes, Any, list[Any]], Any]], ...] = (
            (Hello, self._hello),
            (CreatePartition, self._create_partition),
            (Grant, self.writes.grant),
            (Reserve, self.writes.reserve),
            (SetVersion, self.versions.set_version),
            (VersionWait, self.versions.wait_version),
            (Admission, self.versions.set_admission),
            (GetMeta, self.reads.get_meta),
            (Ack, self.reads.ack),
            (Renew, self.reads.renew),
            (Fail, self.cleanup.fail),
            (Clear, self.cleanup.clear),
            (Seal, self.moves.seal),
            (Sealed, self.moves.sealed),
            (Postpone, self.moves.postpone),
            (Select, self.moves.select_all),
            (StatusRequest, self._status),
            (Cancel, self._cancel),
            (Checkpoint, self.checkpoints.save),
            (Restore, self.checkpoints.restore),
            (BindKeys, self.keys.bind),
            (TagKeys, self.keys.tag_keys),
            (SetTags, self.keys.set_tags),
            (LookupKeys, self.keys.lookup),
            (ListKeys, self.keys.list_keys),
            (DropKeys, self.keys.drop),
            (ResetConsumption, self.resets.reset),
            (AllocateRows, self.allocations.allocate),
            (Locate, self.failover.locate),
            (Corrupt, self.corruption.report),
        )
        ungated = (Hello, StatusRequest, Cancel)
        for msg_type, handler in anyone:
            self._server.route(msg_type, self.door.wrap(handler, gated=msg_type not in ungated))

    @property
    def s(self) -> ControllerState:
        """``state``, under the short name a debugger or a test types."""
        return self.state

    async def _resume(self) -> None:
        assert self._manifest is not None and self.door.restored is not None
        await self.checkpoints.resume(self.config.restore, self._manifest, self._registered, self.config.restore_wait)
        self.door.restored.set()

    async def serve(self) -> None:
        log.info("controller serving at %s", self.address)
        if self.door.restored is not None:
            # a restore that fails stops the controller: it was asked to resume, not to start empty
            resume = asyncio.get_running_loop().create_task(self._resume())
            serving = asyncio.get_running_loop().create_task(self._serve())
            try:
                await resume
            except BaseException:
                serving.cancel()
                raise
            await serving
            return
        await self._serve()

    async def _serve(self) -> None:
        if self.config.metrics_port >= 0:
            from ._prometheus import families

            self.metrics = MetricsEndpoint(
                asyncio.get_running_loop(),
                lambda: families(
                    self.status(), totals=self.totals, staleness=self.reads.staleness.tolist(),
                    capacity=self.config.capacity_bytes, latency=self._server.latency,
                ),
                bind=self.config.bind, address=self.address, port=self.config.metrics_port,
            )
            log.info("controller metrics at %s", self.metrics.url)
        await self._server.serve()

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.liveness.close()
        await self.state.tasks.close()
        for peer in self.state.units.peers.values():
            await peer.close()
        await self._server.close()

    # --- between the parts ----------------------------------------------------------

    def _wake_soon(self, partition: str) -> None:
        self.reads.wake_soon(partition)

    def _forgotten(self, part: Partition) -> None:
        """A partition was forgotten: its counts go to the totals, its grants, leases and
        rounds go."""
        self.totals.retire(part)
        self.writes.forget(part)
        self.reads.forget(part)

    def _retry_parked(self) -> None:
        self.writes.retry_parked()

    def _suspect(self, unit_id: int, why: str) -> None:
        self.liveness.suspect(unit_id, why)

    def _needed(self, partition: str) -> None:
        self.writes.needed(partition)

    def _undelivered(self, ident: bytes, reply: Message) -> None:
        """A reply that never reached its caller (gone, or too far behind in reading) gives
        back what it handed out: a get_meta's lease (its samples go to a live caller now,
        not at the lease's expiry) and a put's grant. A DP round's share stays: the rank's
        tensor-parallel peers hold the same meta, and a restarted rank asks for it again."""
        if isinstance(reply, MetaReply) and reply.meta.lease and not reply.meta.dp_size:
            self.reads.expire_lease(reply.meta.lease, "was never delivered (its caller is gone)")
        elif isinstance(reply, Granted) and reply.grant_id:
            self.writes.lapse(reply.grant_id, "was never delivered (its caller is gone)")

    def _prefetch(self, part: Partition, msg: GetMeta, count: int, mask: np.uint64, min_version: int | None) -> bool:
        return self.moves.prefetch(part, msg, count, mask, min_version)

    # --- membership -----------------------------------------------------------------

    def _hello(self, ident: bytes, msg: Hello, bufs: list[Any]) -> HelloReply:
        _check_protocol(msg.protocol, "controller")
        return HelloReply(
            protocol=PROTOCOL_VERSION,
            server="controller",
            units=[u.info for u in self.state.units.values()],
            heartbeat=self.config.heartbeat_interval,
        )

    def _register_unit(self, ident: bytes, msg: RegisterUnit, bufs: list[Any]) -> Registered | Awaitable[Registered]:
        _check_protocol(msg.protocol, "controller")
        reply = self.liveness.register(msg, ident)
        if isinstance(reply, Registered):
            self._registered.set()
            return reply
        return self._registered_after(reply)

    async def _registered_after(self, pending: Awaitable[Registered]) -> Registered:
        reply = await pending
        self._registered.set()
        return reply

    def _heartbeat(self, ident: bytes, msg: Heartbeat, bufs: list[Any]) -> HeartbeatReply:
        return self.liveness.heartbeat(msg, ident)

    # --- partitions -----------------------------------------------------------------

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
        if msg.copies not in (0, 1, 2):
            raise InvalidArgumentError(f"copies is 1 or 2 (0: the cluster's), got {msg.copies}")
        self.state.partitions.tombstones.pop(msg.partition, None)  # an explicit new start
        if msg.partition in self.state.partitions:
            if not msg.exist_ok:
                raise InvalidArgumentError(f"partition {msg.partition!r} already exists")
            return Ok()
        self.state.partitions.get_or_create(
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
                step=msg.step,
                copies=msg.copies,
                dedup=frozenset(msg.dedup or ()),
            ),
        )
        return Ok()

    def _cancel(self, ident: bytes, msg: Cancel, bufs: list[Any]) -> None:
        """The caller gave up on request ``msg.of``: withdraw it wherever it waits, so that
        what it waited for goes to a live caller. No reply, to either message."""
        if not self.state.parked.withdraw(ident, msg.of):  # answered already: release what it got
            self.reads.cancelled(ident, msg.of)
            self.writes.cancelled(ident, msg.of)

    # --- status ---------------------------------------------------------------------

    def _status(self, ident: bytes, msg: StatusRequest, bufs: list[Any]) -> StatusReply:
        return self.status()

    def status(self) -> StatusReply:
        """A snapshot of everything the controller knows (``status()`` of a client, and the
        metrics at scrape time)."""
        now = self.state.loop.time()
        parts = [
            PartitionStatus(
                name=p.name,
                uid=p.uid,
                samples=p.committed,
                fields=dict(p.specs),
                tasks={
                    # a declared task that has not read yet has lost every lost sample
                    **{name: TaskStatus(leased=0, consumed=0, lost=p.lost) for name in p.options.tasks or ()},
                    **{
                        name: TaskStatus(
                            leased=t.leased, consumed=t.consumed, refused=t.refused, expired=t.expired, lost=t.lost
                        )
                        for name, t in p.tasks.items()
                    },
                },
                nbytes=p.nbytes,
                ready=p.committed - p.excluded,
                excluded=p.excluded,
                reasons=dict(p.reasons),
                in_flight=p.in_flight,
                groups_complete=len(p.groups.order),
                recycle_to=p.options.recycle_to,
                sealed=p.sealed,
                lost=p.lost,
                copies=p.options.copies or self.config.copies,
                dedup=sorted(p.options.dedup),
                single=p.single,
                corrupt=p.corrupt,
            )
            for p in self.state.partitions.values()
        ]
        units = [
            UnitStatus(
                unit_id=u.info.unit_id, address=u.info.address, host=u.info.host, nbytes=u.nbytes,
                capacity=u.capacity, undropped=self.cleanup.drops.count(u.info.unit_id),
                name=u.name, alive=u.alive, silent=max(0.0, now - u.heard), arena_used=u.arena_used,
                metrics=u.metrics, held_bytes=u.held_bytes, bytes_shared=u.bytes_shared,
            )
            for u in self.state.units.values()
        ]
        waiting = [
            WaiterStatus(
                partition=w.req.partition,
                task=w.req.task,
                reason=f"get_meta for {w.req.batch_size} samples with fields "
                f"{list(w.req.fields)}: {self.reads.readiness(w.req)}",
            )
            for ws in self.state.parked.reads.values()
            for w in ws
        ]
        waiting += [
            WaiterStatus(
                partition=getattr(p.req, "partition", ""),
                task="",
                reason=p.reason,
                kind="put" if isinstance(p.req, Grant) else "reserve",
                cause="memory" if p.full else "staleness",
            )
            for p in self.state.parked.writes
        ]
        limit = -1
        if self.state.trainer.admission is not None:
            limit = (self.state.trainer.version + self.state.trainer.admission[0] + 1) * self.state.trainer.admission[1]
        return StatusReply(
            partitions=parts,
            units=units,
            waiting=waiting,
            version=self.state.trainer.version,
            admitted=self.state.trainer.admitted,
            admission_limit=limit,
            metrics=self.metrics.url if self.metrics is not None else "",
            weights=self.state.trainer.weights,
            keys=self.keys.status(),
        )


def _check_protocol(protocol: int, server: str) -> None:
    if protocol != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks tqueue protocol {protocol}, the {server} speaks protocol "
            f"{PROTOCOL_VERSION}; upgrade the older side"
        )
