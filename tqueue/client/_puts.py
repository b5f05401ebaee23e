"""The write path of a client: encode, grant, store (inline, over bulk streams or into a
unit's arena) and updates of stored samples."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch

from .._memory import BufferPool
from .._tasks import all_or_none
from ..errors import SchemaError, StorageUnitUnavailableError
from ..transport import _bulk, _zmq
from ..transport._arena import ArenaMap, aligned
from ..wire import Alloc, Allocated, BatchMeta, FieldBlock, Grant, Granted, GroupId, Store, Stored, UnitInfo
from ..wire._layout import nbytes, split_lanes
from ..wire._messages import SampleFate
from ..wire._pack import Narrowing
from ._args import _by_unit, _groups, _versions, _wait, listed
from ._connections import ClientStats, Connections
from ._encode import Encoded, encode, pack, sample_count

log = logging.getLogger(__name__)
LANE_GRACE: Final = 2.0  # fixed: seconds to wait for a unit's reason after it closed a put's stream


class Puts:
    """Writes new samples and fields. Holds what ``reserve`` admitted and puts not yet used."""

    def __init__(self, conns: Connections, pool: BufferPool, stats: ClientStats) -> None:
        self._conns = conns
        self.config = conns.config
        self._pool = pool
        self.stats = stats
        self.reserved = 0  # samples admitted by reserve() and not yet put

    async def put(
        self,
        partition: str,
        data: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        groups: Sequence[GroupId] | GroupId,
        version: int | Sequence[int] | None,
        timeout: float | None,
        partial: bool,
    ) -> BatchMeta:
        """:meth:`AsyncClient.put`."""
        enc = encode(data, partition=partition, chunk_bytes=self.config.chunk_bytes)
        group_ids = _groups(groups, enc.count, partition)
        versions = _versions(version, enc.count, partition)
        wait = _wait(timeout, self.config.put_timeout)
        reserved = min(self.reserved, enc.count)
        grant = Grant(
            partition=partition, count=enc.count, blocks=enc.grant_blocks(), host=self._conns.host,
            groups=group_ids, nbytes=enc.nbytes, versions=versions, reserved=reserved, partial=partial,
        )
        deadline = time.monotonic() + wait  # math.inf: none
        first: Granted | None = None  # a grant replaced after its unit failed was already stored
        left = wait
        while True:
            grant.timeout = None if math.isinf(left) else left
            ctl = await self._conns.ctl()
            reply, _ = await ctl.request(grant, timeout=left + self.config.request_timeout, expect=Granted)
            self.reserved -= reserved
            reserved = 0  # the reservation stays with the write when it is placed again
            if reply.stored and first is not None:
                reply, stored = first, Stored(nbytes=enc.nbytes)
                break
            if reply.status == "aborted":
                return BatchMeta(
                    partition=partition, partition_uid=reply.partition_uid, indexes=[], units=[],
                    fields=[b.name for b in enc.blocks], schema={}, status="aborted", sealed=reply.sealed,
                )
            assert reply.unit is not None
            try:
                stored = await self._store(reply.unit, reply.partition or partition, reply, enc, None)
                break
            except StorageUnitUnavailableError as exc:
                if first is not None and time.monotonic() >= deadline:
                    raise  # placed again once at least, whatever the timeout
                # another unit may have room: the controller places the write again and
                # probes this one (a failed store is evidence that it died)
                log.warning("%s; placing the put again", exc)
                grant.replaces, grant.failed_unit, first = reply.grant_id, reply.unit.unit_id, reply
                left = max(0.0, deadline - time.monotonic())
        assert reply.unit is not None
        fields = [b.name for b in enc.blocks]
        where = reply.partition or partition
        trimmed = 0 <= reply.kept < enc.count
        fates: list[SampleFate] | None = None
        if trimmed:  # the target was reached inside this put: the first ``kept`` samples count
            fates = ["ok" if i < reply.kept else "aborted" for i in range(enc.count)]
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
            sealed=reply.sealed or stored.sealed,
            recycled_to=where if reply.status == "recycled" else "",
            fates=fates,
        )

    async def _store(self, unit: UnitInfo, partition: str, grant: Granted, enc: Encoded, indexes: list[int] | None) -> Stored:
        """Store one put's bytes on its unit; a unit that went silent is named with the
        partition and the samples the put would have written."""
        try:
            return await self._store_on(unit, partition, grant, enc, indexes)
        except StorageUnitUnavailableError as exc:
            samples = indexes if indexes is not None else list(range(grant.start, grant.start + enc.count))
            raise type(exc)(
                f"partition {partition!r}: samples {listed(samples)} were not stored on storage unit "
                f"{unit.unit_id} at {unit.address}: {exc}"
            ) from exc

    async def _store_on(
        self, unit: UnitInfo, partition: str, grant: Granted, enc: Encoded, indexes: list[int] | None
    ) -> Stored:
        peer = self._conns.connect_unit(unit)
        store = Store(
            grant_id=grant.grant_id,
            partition=partition,
            partition_uid=grant.partition_uid,
            start=grant.start,
            count=enc.count,
            blocks=enc.blocks,
            indexes=indexes,
            timeout=self.config.request_timeout,
        )
        arena = self._conns.arena(unit) if enc.nbytes >= self.config.shm_min_bytes else None
        placed = await self._into_arena(peer, arena, enc) if arena is not None else None
        logical, wide = enc.nbytes, enc
        bulk = arena is None and self._conns.bulk_to(unit.unit_id)
        if placed is None and self.config.pack_ints:  # through a socket: fewer bytes pay
            # over bulk streams big fields are narrowed as they are sent (frames in cache)
            enc = pack(wide, self.config.chunk_bytes, self._pool.take, defer=bulk)
            store.blocks = enc.blocks
        buffers: Sequence[Any] | None = enc.buffers
        copied = enc.copied
        stored: Stored | None = None
        if placed is not None:
            store.blocks, store.shm, store.region = placed
            buffers = ()
            copied += enc.nbytes
        elif bulk and enc.nbytes >= self.config.bulk_put_min_bytes:
            try:
                stored = await self._store_bulk(unit.unit_id, peer, store, enc)
            except _bulk.FrameRefused:  # a value past the first ones' range: narrow knowing them all
                enc = pack(wide, self.config.chunk_bytes, self._pool.take)
                store.blocks, store.bulk = enc.blocks, None
                stored = await self._store_bulk(unit.unit_id, peer, store, enc)
            if stored is not None:
                buffers = None
        if buffers is not None and enc.deferred:
            enc = pack(wide, self.config.chunk_bytes, self._pool.take)  # inline after all
            store.blocks, buffers, copied = enc.blocks, enc.buffers, enc.copied
        if buffers is not None:
            stored, _ = await peer.request(store, buffers, expect=Stored)
        assert stored is not None  # by the bulk stream or the request just made
        self.stats.puts += 1
        self.stats.put_bytes += logical
        self.stats.wire_bytes += enc.nbytes
        self.stats.copied_bytes += copied
        return stored

    async def _store_bulk(self, unit_id: int, peer: _zmq.Peer, store: Store, enc: Encoded) -> Stored | None:
        """Send a put's frames over bulk streams (two lanes at once when big) while the
        ``Store`` goes on ZeroMQ: the unit's reply, or None if no stream could be opened
        (send inline instead)."""
        lane_min = self.config.bulk_lane_min_bytes
        want = self.config.bulk_lanes if enc.nbytes >= lane_min * self.config.bulk_lanes else 1
        counts = split_lanes([b.cost if isinstance(b, Narrowing) else nbytes(b) for b in enc.buffers], max(1, want))
        streams: list[_bulk.BulkStream] = []
        for _ in counts:
            st = await self._conns.stream(unit_id)
            if st is None:
                break
            streams.append(st)
        if len(streams) < len(counts):
            self._conns.streams.setdefault(unit_id, []).extend(streams)
            return None
        store.bulk = [(st.token, n) for st, n in zip(streams, counts)]
        limit = self.config.request_timeout
        reply: asyncio.Future[Any] = asyncio.ensure_future(peer.request(store, expect=Stored))
        writes: list[asyncio.Future[Any]] = []
        at = 0
        for st, n in zip(streams, counts):
            writes.append(asyncio.ensure_future(_bulk.run_blocking(st.write, enc.buffers[at : at + n], limit)))
            at += n
        try:
            await asyncio.wait([reply, *writes], return_when=asyncio.FIRST_EXCEPTION)
            broken = next((w for w in writes if w.done() and w.exception() is not None), None)
            if broken is not None and isinstance(broken.exception(), _bulk.FrameRefused):
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
        self._conns.streams.setdefault(unit_id, []).extend(streams)
        return reply.result()[0]

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

    async def update(
        self,
        meta: BatchMeta,
        data: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        complete: bool = False,
        segment: tuple[int, int] | None = None,
    ) -> list[int]:
        """:meth:`AsyncClient.update`; ``complete`` and ``segment`` for
        :meth:`AsyncClient.complete`. Returns the indexes not written because completing them
        would pass the partition's target (each unit's share is written whole or not at all)."""
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
        ctl = await self._conns.ctl()
        refused: list[int] = []

        async def write(unit_id: int, indexes: list[int], enc: Encoded) -> None:
            reply, _ = await ctl.request(
                Grant(
                    partition=meta.partition,
                    partition_uid=meta.partition_uid,
                    count=enc.count,
                    blocks=enc.grant_blocks(),
                    indexes=indexes,
                    complete=complete,
                    segment=(segment[0], segment[1]) if segment is not None else None,
                ),
                expect=Granted,
            )
            if reply.status == "aborted":  # the target is full: these stay partial, untouched
                refused.extend(indexes)
                return
            await self._conns.unit(unit_id)
            await self._store(self._conns.units[unit_id], meta.partition, reply, enc, indexes)

        await all_or_none(*(write(*w) for w in writes))
        return sorted(refused)


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome (already reported another way)."""
    if not task.cancelled():
        task.exception()


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
