"""The asynchronous client: metadata with the controller, bytes with storage units directly."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import _env, _memory
from .._memory import BufferPool
from ..config import ClientConfig
from ..errors import (
    ControllerUnavailableError,
    InvalidArgumentError,
    ProtocolError,
    ProtocolVersionError,
    SchemaError,
    StorageUnitUnavailableError,
    UnavailableError,
    UnknownFieldError,
)
from ..transport import _bulk, _zmq
from ..transport._arena import ArenaMap, aligned, open_arena
from ..wire import (
    PROTOCOL_VERSION,
    Ack,
    Alloc,
    Allocated,
    BatchMeta,
    Clear,
    CreatePartition,
    Fetch,
    Fetched,
    FieldBlock,
    GetMeta,
    Grant,
    Granted,
    GroupId,
    Hello,
    HelloReply,
    Meta,
    Ok,
    Release,
    Renew,
    StatusReply,
    StatusRequest,
    Store,
    Stored,
    UnitInfo,
)
from ..wire._layout import int_dtype, itemsize, nbytes, split_lanes
from ..wire._pack import PACKED, Misfit, Narrowing, Widening
from ._args import _groups, _versions, _wait
from ._batch import Batch, JaggedAs, Options, Part, assemble_field, bulk_targets, dense_dests, paused_gc
from ._encode import Encoded, encode, pack, sample_count
from ._lifecycle import Lifecycle

log = logging.getLogger(__name__)

LANE_MIN_BYTES = 4 << 20  # a fetch is split over parallel bulk streams only above this per stream
# Puts below this go inline on ZeroMQ: the unit keeps ZeroMQ's frames as they arrived, so a
# stream saves no copy there, and its two thread hand-offs cost 1.5-2.5 ms a put (a 1 MB put:
# 8.4 against 5.9 ms here); from about 8 MiB up the parallel lanes win (34 MB: 26 against 34 ms).
PUT_BULK_MIN_BYTES = 8 << 20
LANE_GRACE = 2.0  # seconds to wait for a unit's reason after it closed a put's stream


@dataclasses.dataclass
class ClientStats:
    """Payload counters of one client, for throughput and copy accounting.

    ``put_bytes`` and ``get_bytes`` count payload as the fields hold it; ``wire_bytes``
    what of it was sent or received, after integer fields were packed (tqueue/wire/_pack.py).
    ``copied_bytes`` counts copies tqueue made in this process (contiguous copies, joins
    and narrowing on put, assembly and widening on get); kernel socket copies are not
    included.
    """

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    copied_bytes: int = 0
    wire_bytes: int = 0


class AsyncClient(Lifecycle):
    """Talks to a tqueue cluster from inside an asyncio program.

    Connects lazily on first use. Flow control and the rollout lifecycle (``seal``,
    ``fail``, ``reserve``, ``set_version``, ``complete``, ``postpone``...) come from
    :class:`~tqueue.client._lifecycle.Lifecycle`. Every call has a timeout: ``request_timeout`` from the
    config bounds how long a server may take to answer; ``get_meta`` additionally waits
    up to its own ``timeout`` for samples to become ready.
    """

    def __init__(self, address: str, *, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config or ClientConfig.from_env()
        self.host = self.config.host or _env.host()
        self.stats = ClientStats()
        if self.config.pin_memory and not torch.cuda.is_available():
            raise InvalidArgumentError("ClientConfig.pin_memory needs a CUDA device, and torch sees none")
        self._pool = BufferPool(self.config.buffer_pool_bytes, pinned=self.config.pin_memory)
        self._arenas: dict[int, ArenaMap | None] = {}
        self._releases: dict[int, list[int]] = {}
        self._reserved = 0  # samples admitted by reserve() and not yet put
        self._round_of: dict[tuple[Any, ...], tuple[int, int]] = {}  # DP rounds seen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._controller: _zmq.Peer | None = None
        self._units: dict[int, UnitInfo] = {}
        self._unit_peers: dict[int, _zmq.Peer] = {}
        self._streams: dict[int, list[_bulk.BulkStream]] = {}  # idle bulk streams per unit
        self._no_bulk: set[int] = set()  # units whose bulk listener could not be reached
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    # --- connection -----------------------------------------------------------------

    async def connect(self) -> None:
        """Handshake with the controller (protocol version) and learn the storage units."""
        if self._controller is not None:
            return
        if self._closed:
            raise InvalidArgumentError("the client is closed")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._controller is not None:
                return
            self._loop = asyncio.get_running_loop()
            if self.config.keep_freed_bytes > 0:
                _memory.keep_freed(self.config.keep_freed_bytes)
            peer = _zmq.Peer(
                self.address,
                name="controller",
                unavailable=ControllerUnavailableError,
                timeout=self.config.request_timeout,
            )
            try:
                reply, _ = await peer.request(
                    Hello(protocol=PROTOCOL_VERSION, role="client", host=self.host),
                    expect=HelloReply,
                )
            except BaseException:
                await peer.close()
                raise
            _check_hello(reply, "controller")
            self._units = {u.unit_id: u for u in reply.units}
            self._controller = peer

    async def _ctl(self) -> _zmq.Peer:
        await self.connect()
        assert self._controller is not None
        return self._controller

    async def _unit(self, unit_id: int) -> _zmq.Peer:
        peer = self._unit_peers.get(unit_id)
        if peer is not None:
            return peer
        info = self._units.get(unit_id)
        if info is None:
            ctl = await self._ctl()
            reply, _ = await ctl.request(Hello(protocol=PROTOCOL_VERSION, host=self.host), expect=HelloReply)
            self._units = {u.unit_id: u for u in reply.units}
            info = self._units.get(unit_id)
            if info is None:
                raise StorageUnitUnavailableError(f"storage unit {unit_id} is not registered")
        return self._connect_unit(info)

    def _connect_unit(self, info: UnitInfo) -> _zmq.Peer:
        peer = self._unit_peers.get(info.unit_id)
        if peer is None:
            self._units[info.unit_id] = info
            peer = self._unit_peers[info.unit_id] = _zmq.Peer(
                info.address,
                name=f"storage unit {info.unit_id}",
                unavailable=StorageUnitUnavailableError,
                timeout=self.config.request_timeout,
            )
        return peer

    async def close(self) -> None:
        """Close every connection. Idempotent."""
        self._closed = True
        await self._flush_releases()
        peers = list(self._unit_peers.values())
        if self._controller is not None:
            peers.append(self._controller)
        self._unit_peers.clear()
        self._controller = None
        for peer in peers:
            await peer.close()
        streams = [st for idle in self._streams.values() for st in idle]
        self._streams.clear()
        for st in streams:
            st.close()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- partitions -----------------------------------------------------------------

    async def create_partition(
        self,
        partition: str,
        *,
        fields: Sequence[str] | None = None,
        tasks: Sequence[str] | None = None,
        group_size: int = 0,
        on_member_failure: str = "drop_group",
        auto_free: bool = True,
        target: int = 0,
        target_groups: int = 0,
        recycle_to: str = "",
        prefetch: str = "",
    ) -> None:
        """Create ``partition`` now, with options; otherwise its first put creates it.

        ``fields``: the only fields it accepts. ``tasks``: the tasks that must consume every
        sample before it frees itself (default: the tasks that asked for samples).
        ``group_size``: samples per GRPO group, for ``policy="groups"``.
        ``on_member_failure``: ``"drop_group"`` aborts a group when a member fails,
        ``"mask_member"`` releases it without that member. ``auto_free``: free the
        partition once every task has consumed every sample.
        ``target`` / ``target_groups``: over-sampling; once that many samples (or whole
        groups) are complete, the partition seals itself and aborts the surplus: later puts
        are discarded, or with ``recycle_to`` stored there as partial samples.
        ``prefetch``: a consumer short of samples here, once this partition is sealed and
        drained, takes ready samples from that (later) partition; they count as taken there.
        """
        ctl = await self._ctl()
        await ctl.request(
            CreatePartition(
                partition=partition,
                fields=list(fields) if fields is not None else None,
                tasks=list(tasks) if tasks is not None else None,
                group_size=group_size,
                on_member_failure=on_member_failure,
                auto_free=auto_free,
                target=target,
                target_groups=target_groups,
                recycle_to=recycle_to,
                prefetch=prefetch,
            ),
            expect=Ok,
        )

    async def clear(self, target: str | BatchMeta) -> None:
        """Free a partition (by name), or only the samples of a meta, on every unit.

        Readers waiting on a cleared partition get :class:`PartitionClearedError`; a later
        put to its name starts a new partition (indexes are never reused)."""
        ctl = await self._ctl()
        if isinstance(target, BatchMeta):
            msg = Clear(partition=target.partition, partition_uid=target.partition_uid, indexes=list(target.indexes))
        else:
            msg = Clear(partition=target)
        await ctl.request(msg, expect=Ok)

    async def status(self) -> StatusReply:
        """Partitions, per-task progress, units and waiting callers, from the controller."""
        ctl = await self._ctl()
        reply, _ = await ctl.request(StatusRequest(), expect=StatusReply)
        return reply

    # --- writes ---------------------------------------------------------------------

    async def put(
        self,
        partition: str,
        data: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        groups: Sequence[GroupId] | GroupId = None,
        version: int | Sequence[int] | None = None,
        timeout: float | None = None,
        partial: bool = False,
    ) -> BatchMeta:
        """Write new samples to ``partition`` (created on first use) and return their meta.

        ``data`` maps field name to per-sample values (see the module docs of the encoder),
        or is a list of per-sample mappings. ``groups`` gives each sample's group id (the
        prompt uid of a GRPO group), or one id for all; ``version`` the policy version that
        produced them (one, or one per sample). Everything is validated before a byte is
        sent. Returns once the bytes are stored and the controller knows them.

        When the memory budget or the staleness bound has no room, the put waits up to
        ``timeout`` seconds (None: the config's ``put_timeout``; 0: not at all), then
        raises :class:`StorageFullError` (memory) or :class:`WaitTimeoutError` (staleness),
        saying what it asked for and what was used and allowed.

        ``partial``: unfinished rollouts; stored but never served until :meth:`complete`.
        A put to a sealed partition (its over-sampling target was reached) sends nothing and
        returns a meta with ``status="aborted"``, or, where the partition recycles late
        samples, stores them as partial samples there (``status="recycled"``). A put that
        crosses the target keeps only the samples that reach it (``status="trimmed"``,
        ``fates`` per sample "ok" or "aborted"); every fate is final when the put returns.
        A put to a partition that sealed and freed itself is aborted for 10 minutes after
        (stragglers), unless :meth:`create_partition` starts it again.
        """
        enc = encode(data, partition=partition, chunk_bytes=self.config.chunk_bytes)
        group_ids = _groups(groups, enc.count, partition)
        versions = _versions(version, enc.count, partition)
        wait = _wait(timeout, self.config.put_timeout)
        reserved = min(self._reserved, enc.count)
        ctl = await self._ctl()
        reply, _ = await ctl.request(
            Grant(
                partition=partition,
                count=enc.count,
                blocks=enc.grant_blocks(),
                host=self.host,
                groups=group_ids,
                nbytes=enc.nbytes,
                versions=versions,
                timeout=None if math.isinf(wait) else wait,
                reserved=reserved,
                partial=partial,
            ),
            timeout=None if math.isinf(wait) else wait + self.config.request_timeout,
            expect=Granted,
        )
        self._reserved -= reserved
        fields = [b.name for b in enc.blocks]
        if reply.status == "aborted":
            return BatchMeta(
                partition=partition, partition_uid=reply.partition_uid, indexes=[], units=[],
                fields=fields, schema={}, status="aborted", sealed=reply.sealed,
            )
        assert reply.unit is not None
        where = reply.partition or partition
        await self._store(reply.unit, where, reply, enc, None)
        trimmed = 0 <= reply.kept < enc.count
        return BatchMeta(
            partition=where,
            partition_uid=reply.partition_uid,
            indexes=list(range(reply.start, reply.start + enc.count)),
            units=[reply.unit.unit_id] * enc.count,
            fields=fields,
            schema=reply.schema,
            groups=group_ids,
            versions=versions,
            status="trimmed" if trimmed else reply.status,
            sealed=reply.sealed,
            recycled_to=where if reply.status == "recycled" else "",
            fates=["ok"] * reply.kept + ["aborted"] * (enc.count - reply.kept) if trimmed else None,
        )

    async def _store(self, unit: UnitInfo, partition: str, grant: Granted, enc: Encoded, indexes: list[int] | None) -> None:
        peer = self._connect_unit(unit)
        store = Store(
            grant_id=grant.grant_id,
            partition=partition,
            partition_uid=grant.partition_uid,
            start=grant.start,
            count=enc.count,
            blocks=enc.blocks,
            indexes=indexes,
        )
        arena = self._arena(unit) if enc.nbytes >= self.config.shm_min_bytes else None
        placed = await self._into_arena(peer, arena, enc) if arena is not None else None
        logical, wide = enc.nbytes, enc
        bulk = arena is None and self._bulk_to(unit.unit_id)
        if placed is None and self.config.pack_ints:  # through a socket: fewer bytes pay
            # over bulk streams big fields are narrowed as they are sent (frames in cache)
            enc = pack(wide, self.config.chunk_bytes, self._pool.take, defer=bulk)
            store.blocks = enc.blocks
        buffers: Sequence[Any] | None = enc.buffers
        copied = enc.copied
        if placed is not None:
            store.blocks, store.shm, store.region = placed
            buffers = ()
            copied += enc.nbytes
        elif bulk and enc.nbytes >= PUT_BULK_MIN_BYTES:
            try:
                sent = await self._store_bulk(unit.unit_id, peer, store, enc)
            except Misfit:  # a value past the first ones' range: narrow knowing them all
                enc = pack(wide, self.config.chunk_bytes, self._pool.take)
                store.blocks, store.bulk = enc.blocks, None
                sent = await self._store_bulk(unit.unit_id, peer, store, enc)
            if sent:
                buffers = None
        if buffers is not None and enc.deferred:
            enc = pack(wide, self.config.chunk_bytes, self._pool.take)  # inline after all
            store.blocks, buffers, copied = enc.blocks, enc.buffers, enc.copied
        if buffers is not None:
            await peer.request(store, buffers, expect=Stored)
        self.stats.puts += 1
        self.stats.put_bytes += logical
        self.stats.wire_bytes += enc.nbytes
        self.stats.copied_bytes += copied

    async def _store_bulk(self, unit_id: int, peer: _zmq.Peer, store: Store, enc: Encoded) -> bool:
        """Send a put's frames over bulk streams (two lanes at once when big) while the
        ``Store`` goes on ZeroMQ; False if no stream could be opened (send inline instead)."""
        want = self.config.bulk_lanes if enc.nbytes >= LANE_MIN_BYTES * self.config.bulk_lanes else 1
        counts = split_lanes([b.cost if isinstance(b, Narrowing) else nbytes(b) for b in enc.buffers], max(1, want))
        streams: list[_bulk.BulkStream] = []
        for _ in counts:
            st = await self._stream(unit_id)
            if st is None:
                break
            streams.append(st)
        if len(streams) < len(counts):
            self._streams.setdefault(unit_id, []).extend(streams)
            return False
        store.bulk = [[st.token, n] for st, n in zip(streams, counts)]
        limit = self.config.request_timeout
        reply = asyncio.ensure_future(peer.request(store, expect=Stored))
        writes, at = [], 0
        for st, n in zip(streams, counts):
            writes.append(asyncio.ensure_future(_bulk.run_blocking(st.write, enc.buffers[at : at + n], limit)))
            at += n
        try:
            await asyncio.wait([reply, *writes], return_when=asyncio.FIRST_EXCEPTION)
            broken = next((w for w in writes if w.done() and w.exception() is not None), None)
            if broken is not None and isinstance(broken.exception(), Misfit):
                broken.result()  # the unit is left mid-write and will refuse it: send again
            if broken is not None and not reply.done():
                # a unit that refuses a put closes its streams, then says why: wait for that
                await asyncio.wait([reply], timeout=LANE_GRACE)
            if reply.done():
                reply.result()  # the unit's error, if it refused
            if broken is not None:
                broken.result()
            await asyncio.gather(reply, *writes)
        except BaseException:
            for st in streams:  # the unit may have left bytes unread: never reuse these
                st.close()
            for task in (reply, *writes):
                if not task.done():
                    task.cancel()
                task.add_done_callback(_consume)
            raise
        self._streams.setdefault(unit_id, []).extend(streams)
        return True

    async def _into_arena(
        self, peer: _zmq.Peer, arena: ArenaMap, enc: Encoded
    ) -> tuple[list[FieldBlock], list[list[int]], int] | None:
        """Copy a write's payload into the unit's arena: one range per field."""
        fields, at = [], 0
        for block, whole in zip(enc.blocks, enc.whole):
            bufs = enc.buffers[at : at + len(block.counts)]
            at += len(block.counts)
            fields.append((block, [whole] if whole is not None else bufs, sum(memoryview(b).nbytes for b in bufs)))
        reply, _ = await peer.request(Alloc(nbytes=sum(aligned(n) for _, _, n in fields)), expect=Allocated)
        if reply.offset < 0:
            return None  # the arena is full: the socket path still works
        blocks, refs, off = [], [], reply.offset
        for block, bufs, n in fields:
            arena.fill(off, bufs)
            blocks.append(
                FieldBlock(
                    name=block.name, spec=block.spec, counts=[sum(block.counts)], shapes=block.shapes,
                    sizes=block.sizes, packed=block.packed[:1] if block.packed else None,
                )
            )
            refs.append([off, n])
            off += aligned(n)
        return blocks, refs, reply.offset

    def _arena(self, unit: UnitInfo) -> ArenaMap | None:
        if unit.unit_id not in self._arenas:
            local = self.config.shm and unit.shm and unit.host == self.host
            self._arenas[unit.unit_id] = open_arena(unit.shm) if local else None
        return self._arenas[unit.unit_id]

    async def update(self, meta: BatchMeta, data: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Add or overwrite fields of the samples of ``meta`` (e.g. a reward worker adding
        ``rewards``). ``data`` has one value per sample of ``meta``, in its order.

        Atomic per sample: all of a sample's fields live on one unit, which installs a write
        whole, so a reader gets every field old or every field new, never a mix."""
        await self._update(meta, data)

    async def _update(
        self,
        meta: BatchMeta,
        data: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        complete: bool = False,
        segment: tuple[int, int] | None = None,
    ) -> None:
        positions = _by_unit(meta)
        cols, n = sample_count(data, meta.partition)
        if n != len(meta):
            raise SchemaError(
                f"the update of partition {meta.partition!r} has {n} samples, its meta has {len(meta)}"
            )
        writes = []
        for unit_id, pos in positions.items():
            sub = cols if len(positions) == 1 else _select(cols, pos)
            enc = encode(sub, partition=meta.partition, chunk_bytes=self.config.chunk_bytes)
            writes.append((unit_id, [meta.indexes[i] for i in pos.tolist()], enc))
        ctl = await self._ctl()

        async def write(unit_id: int, indexes: list[int], enc: Encoded) -> None:
            reply, _ = await ctl.request(
                Grant(
                    partition=meta.partition,
                    partition_uid=meta.partition_uid,
                    count=enc.count,
                    blocks=enc.grant_blocks(),
                    indexes=indexes,
                    complete=complete,
                    segment=list(segment) if segment is not None else None,
                ),
                expect=Granted,
            )
            await self._unit(unit_id)
            await self._store(self._units[unit_id], meta.partition, reply, enc, indexes)

        await asyncio.gather(*(write(*w) for w in writes))

    # --- reads ----------------------------------------------------------------------

    async def get_meta(
        self,
        partition: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        task: str,
        timeout: float | None = None,
        lease_timeout: float | None = None,
        policy: str = "first_ready",
        dp_rank: int | None = None,
        dp_size: int | None = None,
        round: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        balance_by: Sequence[str] | None = None,
        max_staleness: int | None = None,
        pad: bool = False,
    ) -> BatchMeta:
        """Lease ``batch_size`` samples of ``partition`` that have every field in ``fields``
        and that ``task`` has not consumed; wait until enough are ready.

        ``timeout``: seconds to wait (None: the config's ``get_timeout``; ``math.inf``:
        forever). Raises :class:`~tqueue.errors.WaitTimeoutError` saying what was ready.
        ``lease_timeout``: the samples return to the task's pool unless acked (or renewed)
        in time (None: the config's ``lease_timeout``; ``math.inf``: never).
        ``policy``: ``first_ready``, or ``groups`` for whole GRPO groups only.
        ``dp_rank`` / ``dp_size``: this rank's token-balanced share of a round of
        ``dp_size * batch_size`` samples; every caller asking for the same round and rank
        (tensor/pipeline parallel peers) gets the identical meta. Rounds count per client
        (``round`` overrides). ``max_tokens_per_micro_batch`` caps micro-batches (every rank
        gets the same number); ``balance_by`` names the jagged fields whose lengths are the
        tokens (default: the jagged fields asked for).
        ``max_staleness``: refuse (and count) samples older than the trainer's version
        minus this.
        ``pad``: once the partition is sealed and has fewer samples left than asked, return
        them with pad rows (index -1; all-zero tensors, ``batch.is_pad``) instead of waiting,
        so that a batch still divides evenly across ranks and micro-batches.
        """
        msg, limit = self._get_meta_request(
            partition, fields, batch_size, task=task, timeout=timeout, lease_timeout=lease_timeout,
            policy=policy, dp_rank=dp_rank, dp_size=dp_size, round=round,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch, balance_by=balance_by,
            max_staleness=max_staleness, pad=pad,
        )
        ctl = await self._ctl()
        reply, _ = await ctl.request(msg, expect=Meta, timeout=limit)
        return self._got_meta(msg, reply)

    def _get_meta_request(
        self,
        partition: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        task: str,
        timeout: float | None,
        lease_timeout: float | None,
        policy: str,
        dp_rank: int | None,
        dp_size: int | None,
        round: int | None,
        max_tokens_per_micro_batch: int | None,
        balance_by: Sequence[str] | None,
        max_staleness: int | None,
        pad: bool,
    ) -> tuple[GetMeta, float | None]:
        """The ``GetMeta`` of a ``get_meta`` call and how long to wait for its answer (shared
        with the blocking client, which sends it from the caller's thread)."""
        wait = _wait(timeout, self.config.get_timeout)
        lease = _wait(lease_timeout, self.config.lease_timeout, "lease_timeout")
        if isinstance(fields, str):
            fields = [fields]
        seen_uid, next_round = self._round_of.get((partition, task, dp_rank, dp_size), (0, 0))
        if dp_size is not None:
            if dp_rank is None:
                raise InvalidArgumentError("dp_size needs dp_rank")
            if round is None:
                round = next_round
        msg = GetMeta(
            partition=partition,
            fields=list(fields),
            batch_size=batch_size,
            task=task,
            timeout=None if math.isinf(wait) else wait,
            lease_timeout=None if math.isinf(lease) else lease,
            policy=policy,
            dp_rank=-1 if dp_rank is None else dp_rank,
            dp_size=dp_size or 0,
            round=-1 if round is None else round,
            round_uid=seen_uid,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch or 0,
            balance_by=list(balance_by) if balance_by is not None else None,
            max_staleness=max_staleness,
            pad=pad,
        )
        return msg, None if math.isinf(wait) else wait + self.config.request_timeout

    def _got_meta(self, msg: GetMeta, reply: Meta) -> BatchMeta:
        meta = reply.meta
        if msg.dp_size:
            key = (msg.partition, msg.task, msg.dp_rank, msg.dp_size)
            self._round_of[key] = (meta.partition_uid, meta.round + 1)
        return meta

    async def renew(self, meta: BatchMeta, *, lease_timeout: float | None = None) -> None:
        """Extend the lease of a meta from ``get_meta`` by ``lease_timeout`` from now."""
        if meta.task is None or not meta.lease:
            raise InvalidArgumentError("renew takes a meta from get_meta (this one holds no lease)")
        lease = _wait(lease_timeout, self.config.lease_timeout, "lease_timeout")
        ctl = await self._ctl()
        await ctl.request(
            Renew(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                task=meta.task,
                lease=meta.lease,
                timeout=None if math.isinf(lease) else lease,
            ),
            expect=Ok,
        )

    async def get_data(
        self,
        meta: BatchMeta | str,
        fields: Sequence[str] | None = None,
        batch_size: int | None = None,
        *,
        task: str | None = None,
        timeout: float | None = None,
        lease_timeout: float | None = None,
        policy: str = "first_ready",
        dp_rank: int | None = None,
        dp_size: int | None = None,
        round: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        balance_by: Sequence[str] | None = None,
        max_staleness: int | None = None,
        pad: bool = False,
        jagged: JaggedAs | Mapping[str, JaggedAs] = "list",
        pad_value: float | int | bool = 0,
        padding_side: str = "right",
    ) -> Batch:
        """Fetch the payload of a batch, straight from the storage units, in parallel.

        Either ``get_data(meta, fields=None)`` for a meta from ``get_meta`` (all of its
        fields by default), or the one-call form ``get_data(partition, fields,
        batch_size, task=..., ...)`` that leases (with every option of ``get_meta``) and
        fetches together. ``jagged`` chooses how jagged fields come back: ``list`` of
        per-sample tensors (zero-copy), ``padded`` (with ``pad_value`` on
        ``padding_side``; lengths via ``batch.lengths(field)``), or ``nested`` (a torch
        jagged nested tensor); one mode, or a mapping per field.
        """
        options = Options(jagged=jagged, pad_value=pad_value, padding_side=padding_side)  # type: ignore[arg-type]
        options.check()
        if isinstance(meta, str):
            if fields is None or batch_size is None or task is None:
                raise InvalidArgumentError(
                    "get_data(partition, ...) needs fields, batch_size and task"
                )
            meta = await self.get_meta(
                meta,
                fields,
                batch_size,
                task=task,
                timeout=timeout,
                lease_timeout=lease_timeout,
                policy=policy,
                dp_rank=dp_rank,
                dp_size=dp_size,
                round=round,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                balance_by=balance_by,
                max_staleness=max_staleness,
                pad=pad,
            )
        elif batch_size is not None or task is not None or dp_size is not None:
            raise InvalidArgumentError("get_data(meta) takes no batch_size, task or dp options: the meta has them")
        want = list(meta.fields if fields is None else ([fields] if isinstance(fields, str) else fields))
        for f in want:
            if f not in meta.schema:
                raise UnknownFieldError(
                    f"field {f!r} is not in the schema of this meta of partition "
                    f"{meta.partition!r}; known: {sorted(meta.schema)}"
                )
        return await self._fetch(meta, want, options)

    async def _fetch(self, meta: BatchMeta, fields: list[str], options: Options) -> Batch:
        """Fetch from every unit in parallel (one request each), then assemble.

        (Splitting the request per field, to copy one field while the next arrives, was
        slower on two cores: the copy competes with ZeroMQ's receive for the CPU.)"""
        positions = _by_unit(meta)
        values: dict[str, Any] = {}
        lengths: dict[str, torch.Tensor] = {}
        if not positions:  # nothing to fetch: an empty batch, or pad rows only
            for f in fields:
                values[f], lens, _ = assemble_field(meta, f, [], options, self._pool)
                if lens is not None:
                    lengths[f] = lens
            return Batch(meta, values, lengths)
        bulk = any(self._bulk_to(u) for u in positions)
        dests = dense_dests(meta, fields, self._pool) if bulk else {}
        jobs = [(u, lane) for u, p in positions.items() for lane in self._lanes(meta, fields, u, p)]
        indexes = np.asarray(meta.indexes, dtype=np.int64)
        pads = np.flatnonzero(indexes < 0)
        parts = list(
            await asyncio.gather(*(self._fetch_part(meta, u, p, indexes[p].tolist(), fields, dests) for u, p in jobs))
        )
        received = logical = copied = 0
        for part in parts:
            for block, frames in part.blocks.values():
                got = [nbytes(f) for f in frames]
                received += sum(got) if part.wire < 0 else 0
                logical += sum(got) if not block.packed else _widened(block, got)
            received += max(part.wire, 0)
            copied += part.widened
        with paused_gc():
            for field in fields:
                values[field], lens, n = assemble_field(
                    meta, field, parts, options, self._pool, dests.get(field), pads
                )
                copied += n
                if lens is not None:
                    lengths[field] = lens
        self.stats.gets += 1
        self.stats.get_bytes += logical
        self.stats.wire_bytes += received
        self.stats.copied_bytes += copied
        return Batch(meta, {f: values[f] for f in fields}, lengths)

    async def _fetch_part(
        self,
        meta: BatchMeta,
        unit_id: int,
        pos: np.ndarray,
        idx: list[int],
        fields: list[str],
        dests: dict[str, np.ndarray],
    ) -> Part:
        """The samples at batch positions ``pos`` (partition indexes ``idx``) from one unit."""
        peer = await self._unit(unit_id)
        arena = self._arena(self._units[unit_id])
        stream = await self._stream(unit_id) if self._bulk_to(unit_id) else None
        wire, widened = -1, 0
        try:
            reply, frames = await peer.request(
                Fetch(
                    partition=meta.partition,
                    partition_uid=meta.partition_uid,
                    indexes=idx,
                    fields=fields,
                    shm=arena is not None,
                    bulk=stream.token if stream is not None else 0,
                ),
                expect=Fetched,
            )
            if reply.bulk:
                if stream is None or frames:
                    raise ProtocolError("a bulk reply to a fetch that asked for none, or with inline frames")
                frames, targets = bulk_targets(pos, reply.blocks, meta.schema, dests, reply.bulk, self._pool)
                await _bulk.run_blocking(stream.read, targets, self.config.request_timeout)
                wire, widened = reply.bulk, sum(t.dst.nbytes for t in targets if isinstance(t, Widening))
        except BaseException:
            if stream is not None:
                stream.close()  # bytes may be in flight: never read this stream again
                stream = None
            raise
        finally:
            if stream is not None:
                self._streams.setdefault(unit_id, []).append(stream)
        if reply.shm is not None and arena is not None:
            frames = self._resolve(unit_id, arena, reply, frames)
        blocks, at = {}, 0
        for block in reply.blocks:
            blocks[block.name] = (block, frames[at : at + len(block.counts)])
            at += len(block.counts)
        return Part(positions=pos, blocks=blocks, wire=wire, widened=widened)

    def _lanes(self, meta: BatchMeta, fields: list[str], unit_id: int, pos: np.ndarray) -> list[np.ndarray]:
        """The samples of one unit split into runs fetched at once over parallel bulk streams.

        One TCP stream on loopback leaves both cores half idle (each side waits on the other's
        copy); two streams moved 1.3-3x the bytes of one here. Only for big fetches."""
        lanes = self.config.bulk_lanes
        if lanes <= 1 or len(pos) < 2 * lanes or not self._bulk_to(unit_id):
            return [pos]
        dense = 0
        for f in fields:
            spec = meta.schema[f]
            if spec.kind != "object" and spec.layout == "dense":
                dense += int(np.prod(spec.shape, dtype=np.int64)) * itemsize(spec)
        if dense * len(pos) < LANE_MIN_BYTES * lanes:
            return [pos]
        return np.array_split(pos, lanes)

    def _bulk_to(self, unit_id: int) -> bool:
        """Whether fetches from this unit come over its bulk stream."""
        info = self._units.get(unit_id)
        return (
            self.config.bulk and info is not None and bool(info.bulk)
            and unit_id not in self._no_bulk and self._arena(info) is None
        )

    async def _stream(self, unit_id: int) -> _bulk.BulkStream | None:
        """An idle bulk stream to the unit, opened if none is; None if it cannot be reached
        (fetches from it then come in ZeroMQ frames)."""
        idle = self._streams.get(unit_id)
        if idle:
            return idle.pop()
        info = self._units[unit_id]
        try:
            return await _bulk.run_blocking(_bulk.BulkStream, info.bulk, self.config.request_timeout)
        except UnavailableError as exc:
            log.warning("%s; payload from unit %d comes over ZeroMQ instead", exc, unit_id)
            self._no_bulk.add(unit_id)
            return None

    def _resolve(self, unit_id: int, arena: ArenaMap, reply: Fetched, raw: list[Any]) -> list[Any]:
        """Frames of a same-host reply: arena views (holding the unit's hold) and raw frames."""
        assert reply.shm is not None
        ranges = [r for r in reply.shm if r]
        if not ranges:
            return raw
        hold = reply.hold
        views = iter(arena.views(ranges, lambda: self._release_soon(unit_id, hold)))
        frames = iter(raw)
        return [next(views) if r else next(frames) for r in reply.shm]

    def _release_soon(self, unit_id: int, hold: int) -> None:
        """Queue a hold's release; called from whichever thread dropped the last view."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # the unit lets the hold lapse after its hold_timeout
        try:
            loop.call_soon_threadsafe(self._queue_release, unit_id, hold)
        except RuntimeError:
            pass

    def _queue_release(self, unit_id: int, hold: int) -> None:
        if not self._releases:
            asyncio.get_running_loop().create_task(self._flush_releases())
        self._releases.setdefault(unit_id, []).append(hold)

    async def _flush_releases(self) -> None:
        pending, self._releases = self._releases, {}
        for unit_id, holds in pending.items():
            peer = self._unit_peers.get(unit_id)
            if peer is None or peer.closed:
                continue
            try:
                await peer.request(Release(holds=holds), expect=Ok)
            except (UnavailableError, ProtocolError) as exc:
                # the unit lets holds lapse after its hold_timeout; nothing is lost
                log.info("could not release %d arena holds on unit %d: %s", len(holds), unit_id, exc)

    async def ack(self, meta: BatchMeta) -> None:
        """Mark the samples of ``meta`` consumed for its task. Acking twice is harmless."""
        if meta.task is None:
            raise InvalidArgumentError("ack takes a meta from get_meta (this one has no task)")
        ctl = await self._ctl()
        await ctl.request(
            Ack(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                task=meta.task,
                indexes=list(meta.indexes),
                lease=meta.lease,
            ),
            expect=Ok,
        )


def _widened(block: FieldBlock, sizes: list[int]) -> int:
    """Bytes of a block's frames (``sizes``) once packed ones are widened."""
    wide = int_dtype(block.spec)
    assert wide is not None and block.packed is not None  # checked when the batch was assembled
    return sum(n // PACKED[p].itemsize * wide.itemsize if p else n for p, n in zip(block.packed, sizes))


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome (already reported another way)."""
    if not task.cancelled():
        task.exception()


def _check_hello(reply: Any, server: str) -> None:
    if not isinstance(reply, HelloReply) or reply.protocol != PROTOCOL_VERSION:
        got = getattr(reply, "protocol", "?")
        raise ProtocolVersionError(
            f"the {server} speaks tqueue protocol {got}, this client speaks {PROTOCOL_VERSION}"
        )


def _by_unit(meta: BatchMeta) -> dict[int, np.ndarray]:
    units = np.asarray(meta.units, dtype=np.int64)
    if len(units) != len(meta.indexes):
        raise InvalidArgumentError("meta has a different number of units and indexes")
    return {int(u): np.flatnonzero(units == u) for u in np.unique(units) if u >= 0}  # -1: pad rows


def _select(cols: dict[str, Any], pos: np.ndarray) -> dict[str, Any]:
    """The samples at ``pos`` of each column (a copy for tensors and arrays)."""
    out: dict[str, Any] = {}
    for name, value in cols.items():
        if isinstance(value, torch.Tensor):
            out[name] = value[torch.from_numpy(pos)]
        elif isinstance(value, np.ndarray):
            out[name] = value[pos]
        else:
            out[name] = [value[i] for i in pos.tolist()]
    return out
