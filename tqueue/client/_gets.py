"""The read path of a client: leases from the controller (get_meta, renew, ack) and
payload fetched from the storage units in parallel and assembled into a :class:`Batch`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from .._memory import BufferPool
from .._tasks import all_or_none
from ..errors import (
    DataLostError,
    InvalidArgumentError,
    ProtocolError,
    StorageUnitUnavailableError,
    UnknownFieldError,
    did_you_mean,
)
from ..transport import _bulk, _zmq
from ..wire import Ack, BatchMeta, Fetch, Fetched, FieldBlock, GetMeta, Meta, Ok, Renew
from ..wire._layout import int_dtype, itemsize, nbytes
from ..wire._pack import PACKED, Widening
from ._args import _by_unit, _wait, listed
from ._ask import MetaAsk  # defined there; still importable from here
from ._batch import Batch, Options, Part, assemble_field, bulk_targets, dense_dests, paused_gc
from ._connections import ClientStats, Connections

# seconds a read waits, after its unit closed the connection, for ZeroMQ to learn whether the
# unit is gone (a reconnect refused: its samples are lost) or back (restarted, or a network blip)
RECONNECT_VERDICT: Final = 2.0


class Gets:
    """Reads: leases, fetches and acks. Remembers the data-parallel rounds it has seen."""

    def __init__(self, conns: Connections, pool: BufferPool, stats: ClientStats) -> None:
        self._conns = conns
        self.config = conns.config
        self._pool = pool
        self.stats = stats
        self._round_of: dict[tuple[Any, ...], tuple[int, int]] = {}  # DP rounds seen

    async def get_meta(self, ask: MetaAsk) -> BatchMeta:
        """:meth:`AsyncClient.get_meta`."""
        msg, limit = self.request(ask)
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(msg, expect=Meta, timeout=limit)
        return self.got_meta(msg, reply)

    def request(self, ask: MetaAsk) -> tuple[GetMeta, float]:
        """The ``GetMeta`` of a ``get_meta`` call and how long to wait for its answer (shared
        with the blocking client, which sends it from the caller's thread); ``math.inf``:
        no limit."""
        wait = _wait(ask.timeout, self.config.get_timeout)
        lease = _wait(ask.lease_timeout, self.config.lease_timeout, "lease_timeout")
        fields = [ask.fields] if isinstance(ask.fields, str) else list(ask.fields)
        seen_uid, next_round = self._round_of.get((ask.partition, ask.task, ask.dp_rank, ask.dp_size), (0, 0))
        round = ask.round
        if ask.dp_size is not None:
            if ask.dp_rank is None:
                raise InvalidArgumentError("dp_size needs dp_rank")
            if round is None:
                round = next_round
        msg = GetMeta(
            partition=ask.partition,
            fields=fields,
            batch_size=ask.batch_size,
            task=ask.task,
            timeout=None if math.isinf(wait) else wait,
            lease_timeout=None if math.isinf(lease) else lease,
            policy=ask.policy,
            dp_rank=-1 if ask.dp_rank is None else ask.dp_rank,
            dp_size=ask.dp_size or 0,
            round=-1 if round is None else round,
            round_uid=seen_uid,
            max_tokens_per_micro_batch=ask.max_tokens_per_micro_batch or 0,
            balance_by=[ask.balance_by] if isinstance(ask.balance_by, str)
            else list(ask.balance_by) if ask.balance_by is not None else None,
            micro_batch_size=ask.micro_batch_size or 0,
            num_microbatches_multiple_of=ask.num_microbatches_multiple_of,
            min_num_microbatches=ask.min_num_microbatches,
            max_staleness=ask.max_staleness,
            pad=ask.pad,
        )
        return msg, wait + self.config.request_timeout  # math.inf: no limit

    def got_meta(self, msg: GetMeta, reply: Meta) -> BatchMeta:
        meta = reply.meta
        if msg.dp_size:
            key = (msg.partition, msg.task, msg.dp_rank, msg.dp_size)
            self._round_of[key] = (meta.partition_uid, meta.round + 1)
        return meta

    async def renew(self, meta: BatchMeta, *, lease_timeout: float | None = None) -> None:
        """:meth:`AsyncClient.renew`."""
        if meta.task is None or not meta.lease:
            raise InvalidArgumentError("renew takes a meta from get_meta (this one holds no lease)")
        lease = _wait(lease_timeout, self.config.lease_timeout, "lease_timeout")
        ctl = await self._conns.ctl()
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
        self, meta: BatchMeta | MetaAsk, fields: Sequence[str] | None = None, options: Options | None = None
    ) -> Batch:
        """:meth:`AsyncClient.get_data`: of ``meta``, or of what ``get_meta(ask)`` leases."""
        options = options or Options()
        options.check()
        if isinstance(meta, MetaAsk):
            meta = await self.get_meta(meta)
        want = list(meta.fields if fields is None else ([fields] if isinstance(fields, str) else fields))
        for f in want:
            if f not in meta.schema:
                raise UnknownFieldError(
                    f"field {f!r} is not in the schema of this meta of partition "
                    f"{meta.partition!r}{did_you_mean(f, meta.schema)}; known: {sorted(meta.schema)}"
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
            return Batch(meta, values, lengths, options)
        bulk = any(self._conns.bulk_to(u) for u in positions)
        dests = dense_dests(meta, fields, self._pool) if bulk else {}
        jobs = [(u, lane) for u, p in positions.items() for lane in self._lanes(meta, fields, u, p)]
        indexes = np.asarray(meta.indexes, dtype=np.int64)
        pads = np.flatnonzero(indexes < 0)
        parts = list(
            await all_or_none(*(self._fetch_part(meta, u, p, indexes[p].tolist(), fields, dests) for u, p in jobs))
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
        return Batch(meta, {f: values[f] for f in fields}, lengths, options)

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
        peer = await self._conns.unit(unit_id)
        try:
            return await self._fetch_from(peer, meta, unit_id, pos, idx, fields, dests)
        except StorageUnitUnavailableError as exc:
            if not await peer.settled(RECONNECT_VERDICT):  # slow or restarting: the samples may well be there
                raise
            address = self._conns.units[unit_id].address
            raise DataLostError(
                f"partition {meta.partition!r}: samples {listed(idx)} on storage unit {unit_id} at "
                f"{address} cannot be read: {exc}"
            ) from exc

    async def _fetch_from(
        self,
        peer: _zmq.Peer,
        meta: BatchMeta,
        unit_id: int,
        pos: np.ndarray,
        idx: list[int],
        fields: list[str],
        dests: dict[str, np.ndarray],
    ) -> Part:
        arena = self._conns.arena(self._conns.units[unit_id])
        stream = await self._conns.stream(unit_id) if self._conns.bulk_to(unit_id) else None
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
                self._conns.streams.setdefault(unit_id, []).append(stream)
        if reply.shm is not None and arena is not None:
            frames = self._conns.resolve(unit_id, arena, reply, frames)
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
        if lanes <= 1 or len(pos) < 2 * lanes or not self._conns.bulk_to(unit_id):
            return [pos]
        dense = 0
        for f in fields:
            spec = meta.schema[f]
            if spec.kind != "object" and spec.layout == "dense":
                dense += int(np.prod(spec.shape, dtype=np.int64)) * itemsize(spec)
        if dense * len(pos) < self.config.bulk_lane_min_bytes * lanes:
            return [pos]
        return np.array_split(pos, lanes)

    async def ack(self, meta: BatchMeta) -> None:
        """:meth:`AsyncClient.ack`."""
        if meta.task is None:
            raise InvalidArgumentError("ack takes a meta from get_meta (this one has no task)")
        ctl = await self._conns.ctl()
        await ctl.request(
            Ack(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                task=meta.task,
                indexes=[i for i in meta.indexes if i >= 0],  # pad rows are nobody's
                lease=meta.lease,
            ),
            expect=Ok,
        )


def _widened(block: FieldBlock, sizes: list[int]) -> int:
    """Bytes of a block's frames (``sizes``) once packed ones are widened."""
    wide = int_dtype(block.spec)
    assert wide is not None and block.packed is not None  # checked when the batch was assembled
    return sum(n // PACKED[p].itemsize * wide.itemsize if p else n for p, n in zip(block.packed, sizes))
