"""A storage unit: holds payload bytes for the partitions placed on it.

It registers with the controller, stores what clients send under a grant, commits each
write to the controller before answering (so what a put acknowledged is visible to the
next ``get_meta``), and serves any subset of fields and samples without copying.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Final

import msgspec
import numpy as np

from .. import _env, _memory
from .._memory import BufferPool
from .._tasks import all_or_none
from ..config import StorageConfig
from ..errors import (
    InvalidArgumentError,
    ProtocolError,
    ProtocolVersionError,
    UnavailableError,
)
from ..transport import _auth, _bulk, _nixl, _zmq_server
from ..transport._arena import Arena, Region
from ..transport._liveness import session_of
from ..transport._metrics import MetricsEndpoint, latency_family
from ..wire import (
    PROTOCOL_VERSION,
    Alloc,
    Allocated,
    Cancel,
    Drop,
    Dropped,
    Fetch,
    Fetched,
    Heartbeat,
    Hello,
    HelloReply,
    LoadUnit,
    Move,
    Ok,
    RegisterUnit,
    Release,
    SaveUnit,
    Store,
    Stored,
    UnitFile,
)
from ..wire._durable import confined, read_manifest
from ..wire._layout import frame_sizes
from ..wire._layout import nbytes as nbytes_of
from ._checkpoint import UnitCheckpoints
from ._commit_queue import CommitQueue
from ._holds import Holds
from ._membership import Membership
from ._store import PayloadStore
from ._trim import Trimmer

log = logging.getLogger(__name__)

COMMIT_SHARE: Final = 0.75  # fixed: of the writer's request timeout, what a commit may wait for the controller


class StorageUnit:
    """The unit server. Create inside a running loop, ``await start()``, then ``serve()``."""

    def __init__(self, config: StorageConfig) -> None:
        if config.nixl:  # before anything is bound or mapped
            if config.shm_bytes <= 0 or not hasattr(os, "memfd_create"):
                raise InvalidArgumentError("StorageConfig.nixl needs an arena: set shm_bytes above 0 (on Linux)")
            _nixl.load()  # an ImportError naming the extra where it is missing
        self.config = config
        self.host = config.host or _env.host()
        per_peer, total = config.queued_bounds()
        self._server = _zmq_server.Server(
            config.bind,
            name="storage unit",
            max_header=config.max_header_bytes,
            max_frames=config.max_frames,
            max_frame_bytes=config.max_frame_bytes,
            max_queued_bytes=per_peer,
            max_queued_bytes_total=total,
            max_queued_replies=config.max_queued_replies,
            heartbeat=0.0,  # the cluster's interval comes with the registration
            curve=_auth.server_keys(config.auth_dir),
            advertise=config.advertise,
        )
        self.address = self._server.address
        self._loop = asyncio.get_running_loop()
        _memory.keep_freed(config.retain_bytes)
        self.arena = Arena(config.shm_bytes) if config.shm_bytes > 0 and hasattr(os, "memfd_create") else None
        self.nixl: _nixl.Agent | None = None
        self._nixl_base = 0
        if config.nixl:
            self.nixl, self._nixl_base = self._register_arena()
        self.data = PayloadStore(self.arena, self._release_soon, max_index=config.max_index)
        self.bulk = _bulk_server(config, self.address, self._sent_soon)
        # bulk puts land in recycled buffers: glibc trims a heap top above 2 GiB on its own
        # (mallopt takes an int), so a 2 GB put freed and put again would fault every page
        self._buffers = BufferPool(config.retain_bytes)
        self.membership = Membership(
            config, self._server, self.bulk, describe=self._describe, beat=self._beat, forgotten=self._forget_everything,
            keep_only=self._keep_only,
        )
        self._restored = ("", "")  # (checkpoint directory, generation) of the payload loaded at start
        # registered memory stays mapped: a page punched under a registration would be orphaned
        self.trim = Trimmer(config, None if self.nixl else self.arena, self._buffers, lambda: self.held_bytes)
        self.holds = Holds(config, self.arena, self._decref, lambda: f"unit {self.unit_id}")
        self.commits = CommitQueue(self.membership.ctl, lambda: (self.unit_id, self.data.resident))
        self.metrics: MetricsEndpoint | None = None
        self.checkpoints = UnitCheckpoints(
            self.data, self.arena, self._decref, root=config.checkpoint_root, auth=bool(config.auth_dir)
        )
        self._server.sessions.on_gone(self.holds.session_gone)
        s = self._server
        s.route(Hello, self._hello)
        s.route(Store, self._store)
        s.route(Fetch, self._fetch)
        s.route(Drop, self._drop, role=_auth.CLUSTER)  # the controller's alone
        s.route(Alloc, self._alloc)
        s.route(Release, self._release)
        s.route(Move, self._move, role=_auth.CLUSTER)
        s.route(Cancel, self._cancel)
        s.route(SaveUnit, lambda ident, msg, bufs: self.checkpoints.save(msg), role=_auth.CLUSTER)
        s.route(LoadUnit, lambda ident, msg, bufs: self.checkpoints.load(msg), role=_auth.CLUSTER)

    async def start(self) -> None:
        """Register with the controller; afterwards the unit receives placements and sends
        its heartbeats."""
        if self.config.metrics_port >= 0 and self.metrics is None:
            self.metrics = MetricsEndpoint(
                self._loop, self._families, bind=self.config.bind, address=self.address, port=self.config.metrics_port
            )
        if self.config.restore:
            await self._restore(self.config.restore)
        await self.membership.start()

    async def _restore(self, directory: str) -> None:
        """Load this unit's payload (by name) from the checkpoint in ``directory``, before
        registering: the id it had goes with the registration."""
        place = confined(directory, self.config.checkpoint_root)
        manifest = read_manifest(place.path, place.root)
        name = self.config.name or self.address
        mine = [u for u in manifest["units"] if u["name"] == name]
        if not mine:
            names = sorted(str(u["name"]) for u in manifest["units"])
            raise InvalidArgumentError(
                f"the checkpoint in {directory} holds no payload of a unit named {name!r} (it names {names}); "
                "give the unit the name it had (StorageConfig.name)"
            )
        files = [msgspec.convert(f, UnitFile) for f in mine[0]["files"]]
        gen_dir = os.path.join(place.path, str(manifest["generation"]))
        await self.checkpoints.load(LoadUnit(directory=gen_dir, files=files))
        self.membership.unit_id = int(mine[0]["unit_id"])
        self._restored = (place.path, str(manifest["generation"]))
        log.info("unit %s: loaded %d files of the checkpoint in %s", name, len(files), directory)

    @property
    def unit_id(self) -> int:
        return self.membership.unit_id

    def _register_arena(self) -> tuple[_nixl.Agent, int]:
        """A NIXL agent with the arena registered (its metadata goes to the controller)."""
        assert self.arena is not None
        agent = _nixl.Agent("unit")
        base = _nixl.address_of(self.arena.mm)
        agent.register(base, self.arena.size)
        return agent, base

    def _describe(self) -> RegisterUnit:
        return RegisterUnit(
            protocol=PROTOCOL_VERSION,
            address=self.address,
            host=self.host,
            capacity=self.config.capacity_bytes,
            shm=self.arena.path if self.arena is not None else "",
            bulk=self.bulk.address if self.bulk is not None else "",
            name=self.config.name,
            metrics=self.metrics.url if self.metrics is not None else "",
            nixl=self.nixl.metadata() if self.nixl is not None else b"",
            nixl_base=self._nixl_base,
            rdma=bool(_nixl.rdma_devices()),
            unit_id=self.membership.unit_id,
            restored=self._restored[0],
            generation=self._restored[1],
        )

    def _beat(self, unit_id: int) -> Heartbeat:
        self.trim.sent()  # replies of a cleared partition that ZeroMQ let go of meanwhile
        return Heartbeat(
            unit_id=unit_id, name=self.config.name, nbytes=self.data.resident,
            arena_used=self.arena.used if self.arena is not None else 0, held_bytes=self.held_bytes,
            bytes_shared=self.data.bytes_shared(),
        )

    def _keep_only(self, uids: set[int]) -> None:
        """Free the partitions of the restored payload that the controller no longer has."""
        gone = [uid for uid in self.data.partitions if uid not in uids]
        freed = sum(self.data.drop(uid) for uid in gone)
        if gone:
            log.info("unit %d: freed %d restored partitions the controller no longer has (%d bytes)", self.unit_id, len(gone), freed)
            self.trim.forgot()
        self._restored = ("", "")

    def _forget_everything(self, why: str) -> None:
        """Free every partition held: the controller declared them lost (or never knew them)."""
        self._restored = ("", "")
        uids = list(self.data.partitions)
        freed = sum(self.data.drop(uid) for uid in uids)
        log.warning("unit %d: %s; freeing its %d partitions (%d bytes)", self.unit_id, why, len(uids), freed)
        self.trim.forgot()

    async def serve(self) -> None:
        await self._server.serve()

    def _families(self) -> Iterator[Any]:
        """The unit's Prometheus metrics, read on its loop at scrape time: bytes held against
        its budget, its arena, its partitions, and request latency per message kind."""
        from prometheus_client.core import GaugeMetricFamily

        unit = [str(self.unit_id)]
        for name, doc, value in (
            ("tqueue_unit_stored_bytes", "Payload bytes the unit holds", self.data.resident),
            ("tqueue_unit_held_bytes", "Bytes of replies its readers have not taken yet", self.held_bytes),
            ("tqueue_unit_budget_bytes", "The unit's budget (0: none)", self.config.capacity_bytes),
            ("tqueue_unit_arena_used_bytes", "Bytes of its shared-memory arena in use", self.arena.used if self.arena else 0),
            ("tqueue_unit_partitions", "Partitions with samples here", len(self.data.partitions)),
        ):
            family = GaugeMetricFamily(name, doc, labels=["unit"])
            family.add_metric(unit, value)
            yield family
        yield latency_family("tqueue_unit_request_seconds", "Storage unit request latency by message kind", self._server.latency)

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.trim.close()
        self.commits.close()
        await self.membership.close()
        await self._server.close()
        await self.checkpoints.close()
        if self.bulk is not None:
            self.bulk.close()
        self.data.partitions.clear()
        if self.nixl is not None:
            self.nixl.close()
        if self.arena is not None:
            self.arena.close()

    def _cancel(self, ident: bytes, msg: Cancel, bufs: list[Any]) -> None:
        """A client gave up on a request. Nothing here waits on anything but its own bytes
        (a store or a fetch runs to its end), so there is nothing to withdraw."""

    def _hello(self, ident: bytes, msg: Hello, bufs: list[Any]) -> HelloReply:
        if msg.protocol != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"peer speaks tqueue protocol {msg.protocol}, the storage unit speaks protocol "
                f"{PROTOCOL_VERSION}; upgrade the older side"
            )
        return HelloReply(protocol=PROTOCOL_VERSION, server="storage")

    async def _store(self, ident: bytes, msg: Store, raw: list[Any]) -> Stored:
        received = self._loop.time()
        self.trim.busy()
        if msg.release:  # first: whatever else this Store fails on, the regions go back
            self.holds.release_allocs(msg.release, session_of(ident))
        if msg.indexes is None:
            if msg.count < 0 or msg.start < 0 or msg.start + msg.count > self.data.max_index:
                raise InvalidArgumentError(
                    f"partition {msg.partition!r}: samples [{msg.start}, {msg.start + msg.count}) lie "
                    f"outside [0, {self.data.max_index}) (StorageConfig.max_index)"
                )
            indexes = np.arange(msg.start, msg.start + msg.count, dtype=np.int64)
        else:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            if len(indexes) != msg.count:
                raise ProtocolError(f"Store lists {len(indexes)} indexes for {msg.count} samples")
        if msg.bulk is not None:
            raw = await self._read_bulk(msg, raw)
        region = self.holds.take_alloc(msg.region, session_of(ident), msg.keep) if msg.region >= 0 else None
        try:
            frames, where = self.holds.frames(msg, raw, region)
            pending = self.data.write(
                msg.partition_uid, msg.partition, indexes, msg.blocks, frames, arena=where, region=region,
                grant=msg.grant_id, append=msg.append or (),
            )
            nbytes = sum(nbytes_of(f) for f in frames)
            part = self.data.partitions[msg.partition_uid]
            try:
                sealed = await self.commits.commit(
                    msg.grant_id, [b.name for b in msg.blocks], nbytes, part.nbytes,
                    _commit_limit(msg.timeout, self._loop.time() - received),
                )
            except BaseException:
                pending.rollback()
                raise
            pending.commit()
        finally:
            if region is not None:
                self._decref(region)  # the reference the Store took (the allocation's own, without keep)
        return Stored(nbytes=nbytes, sealed=sealed)

    async def _read_bulk(self, msg: Store, raw: list[Any]) -> list[Any]:
        """Receive a put's frames from the writer's bulk streams, the lanes at once, into
        fresh heap buffers (warm: freed payload stays mapped)."""
        assert msg.bulk is not None
        tokens = [token for token, _ in msg.bulk]  # lanes are pairs: decoding checked
        try:
            if self.bulk is None:
                raise ProtocolError("a Store over bulk streams to a unit without a bulk listener")
            if raw or msg.shm is not None:
                raise ProtocolError("a Store over bulk streams lists [token, frames] lanes and nothing else")
            sizes = [n for block in msg.blocks for n in frame_sizes(block)]
            if any(n > self.config.max_frame_bytes for n in sizes):
                raise ProtocolError(
                    f"a Store over bulk streams declares a frame of {max(sizes)} bytes; at most "
                    f"{self.config.max_frame_bytes} (StorageConfig.max_frame_bytes)"
                )
            if sum(lane[1] for lane in msg.bulk) != len(sizes) or any(lane[1] < 0 for lane in msg.bulk):
                raise ProtocolError(f"the Store's lanes carry {sum(lane[1] for lane in msg.bulk)} frames, its blocks {len(sizes)}")
            frames = [self._buffers.take(n) for n in sizes]
            jobs, at = [], 0
            for token, n in msg.bulk:
                views = [f.data for f in frames[at : at + n] if f.nbytes]
                jobs.append(_bulk.run_blocking(self.bulk.read, token, views))
                at += n
            await all_or_none(*jobs)
        except BaseException:
            for token in tokens:  # bytes may be left unread: those streams are out of step
                if self.bulk is not None:
                    self.bulk.drop(token)
            raise
        return frames

    def _alloc(self, ident: bytes, msg: Alloc, bufs: list[Any]) -> Allocated:
        region = self.holds.alloc(msg.nbytes, session_of(ident))
        if region is None:
            return Allocated(offset=-1)
        return Allocated(
            offset=region.offset, length=region.length, epoch=self.arena.epoch if self.arena else 0,
            ttl=self.config.alloc_timeout, token=self.holds.allocs[region.offset][3],
        )

    def _fetch(self, ident: bytes, msg: Fetch, bufs: list[Any]) -> tuple[Fetched, list[Any], int]:
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        shm = msg.shm and self.arena is not None
        reply = self.data.read(msg.partition_uid, msg.partition, indexes, msg.fields, shm=shm)
        hold = 0
        if reply.held:
            hold = self.holds.hold(reply.held, session_of(ident))
        elif msg.bulk and self.bulk is not None:
            total = sum(nbytes_of(f) for f in reply.frames)
            if total >= _bulk.MIN_BYTES and self.bulk.send(msg.bulk, reply.frames):
                return Fetched(blocks=reply.blocks, bulk=total), [], 0
        epoch = self.arena.epoch if self.arena is not None else 0
        # the frames' bytes counted under their partition's uid: a clear frees them (free_stalled)
        return Fetched(blocks=reply.blocks, shm=reply.refs, hold=hold, epoch=epoch), reply.frames, msg.partition_uid

    def _move(self, ident: bytes, msg: Move, bufs: list[Any]) -> Ok:
        src = np.asarray(msg.src_indexes, dtype=np.int64)
        dst = np.asarray(msg.dst_indexes, dtype=np.int64)
        if len(src) != len(dst):
            raise ProtocolError(f"Move lists {len(src)} source and {len(dst)} target samples")
        self.data.move(msg.src_uid, msg.dst_uid, msg.dst_name, src, dst)
        return Ok()

    def _release(self, ident: bytes, msg: Release, bufs: list[Any]) -> Ok:
        """End holds of the caller's session (see ``Holds.release``)."""
        self.holds.release(msg.holds, session_of(ident))
        return Ok()

    def _release_soon(self, region: Region) -> None:
        """Drop a reference from any thread (ZeroMQ lets go of sent buffers in its own)."""
        try:
            self._loop.call_soon_threadsafe(self._decref, region)
        except RuntimeError:
            pass  # the loop is closed: the unit is gone and its arena with it

    def _decref(self, region: Region) -> None:
        """Drop a reference to an arena region; the last one frees it, and its pages go back
        to the OS as ``retain_bytes`` says, whether a drop, a release or a send came last."""
        if self.arena is not None and self.arena.decref(region):
            self.trim.reclaim()

    @property
    def held_bytes(self) -> int:
        """Bytes of replies not yet taken by their readers, on ZeroMQ and on bulk streams:
        memory the unit holds beyond what it stores (a cleared partition's bytes stay until
        then; bounded by max_queued_bytes, max_queued_bytes_total and the bulk streams' pace)."""
        return self._server.queues.total + (self.bulk.held_bytes if self.bulk is not None else 0)

    def _sent_soon(self) -> None:
        """A bulk stream let go of a reply (from its writer thread)."""
        try:
            self._loop.call_soon_threadsafe(self.trim.sent)
        except RuntimeError:
            pass  # the loop is closed: the unit is gone

    def _drop(self, ident: bytes, msg: Drop, bufs: list[Any]) -> Dropped:
        if msg.indexes is None:
            freed = self.data.drop(msg.partition_uid)
        else:
            freed = self.data.drop_samples(msg.partition_uid, np.asarray(msg.indexes, dtype=np.int64))
        self._server.free_stalled(msg.partition_uid)  # what replies to stalled readers hold of it
        if freed:
            self.trim.freed()
            log.info("unit %d freed %d bytes of partition uid %d", self.unit_id, freed, msg.partition_uid)
        part = self.data.partitions.get(msg.partition_uid)
        return Dropped(unit_bytes=self.data.resident, partition_bytes=part.nbytes if part else 0)


def _bulk_server(config: StorageConfig, address: str, on_sent: Callable[[], None]) -> _bulk.BulkServer | None:
    """The bulk listener, on the interface of the ZeroMQ bind (``tcp://`` binds only)."""
    if not config.bulk or not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    try:
        return _bulk.BulkServer(
            host, max_streams=config.bulk_streams, max_per_peer=config.bulk_streams_per_peer,
            max_queued=config.queued_bounds()[0], stall=config.bulk_stall_timeout, min_rate=config.bulk_min_rate,
            on_sent=on_sent,
        )
    except UnavailableError as exc:
        log.warning("%s; fetched payload goes over ZeroMQ", exc)
        return None


def _commit_limit(writer_timeout: float | None, elapsed: float) -> float | None:
    """How long a commit may wait for the controller: within the writer's own timeout, so
    that a dead controller is reported by this unit as ControllerUnavailableError before
    the writer gives up on the unit (and blames it); unknown (None): the peer's own limit."""
    if writer_timeout is None or math.isinf(writer_timeout):
        return None
    return max(0.05, COMMIT_SHARE * writer_timeout - elapsed)

