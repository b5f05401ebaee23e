"""The NIXL route: one-sided transfers of a unit's registered arena (tqueue/transport/_nixl.py).

A fetch asks the unit for arena ranges, as a same-host reader does, then READs them into one
buffer of this process registered for the read; the unit's CPU does nothing for the bytes. Once
the read has ended, or failed, the client releases the unit's hold on those ranges: that release
is the read's completion notice, after which the unit may reuse them. Samples that are not in the
arena (they came over a socket) come as frames in the reply. A put of at least ``min_bytes``
takes a range of the arena (``Alloc``), is staged into a registered buffer and WRITten there,
then stored with its ranges; smaller puts, and those a full arena refuses, go inline.

A unit that dies mid-transfer fails it with :class:`StorageUnitUnavailableError` (NIXL notices
the disconnect within milliseconds); the route's peer is then forgotten, and the next call asks
the controller again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._memory import BufferPool
from ...transport import _nixl, _zmq
from ...transport._arena import aligned
from ...transport._liveness import TRANSIT_RATE
from ...wire import Alloc, Allocated, BatchMeta, Fetched, FieldBlock, Store, Stored, UnitInfo
from .._assemble import Part
from .arena import in_one_range
from .base import BatchBuffers, Outgoing, Releases, Route, Sent
from .bulk import bulk_targets
from .inline import InlineRoute, fetch_msg, received


class NixlRoute(Route):
    """Reads and writes of the unit's arena through this client's NIXL agent."""

    def __init__(
        self, info: UnitInfo, peer: _zmq.Peer, agent: _nixl.Agent, releases: Releases, pool: BufferPool,
        min_bytes: int, timeout: float,
    ) -> None:
        super().__init__(info)
        self.peer = peer
        self.inline = InlineRoute(info, peer)
        self.agent = agent
        self.remote = agent.connect(info.nixl)
        self.base = info.nixl_base
        self._releases = releases
        self._pool = pool  # warm buffers: fresh pages would cost more than the transfer
        self._min_bytes = min_bytes
        self._timeout = timeout
        self._where = f"storage unit {info.unit_id} at {info.address}"

    def close(self) -> None:
        self.agent.forget(self.remote)

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        enc = put.wide
        enc.materialize()  # CUDA fields cross to the host first (device_writes is False)
        placed = await self._place(enc.blocks, enc.buffers, enc.whole) if enc.nbytes >= self._min_bytes else None
        if placed is None:
            return await self.inline.store(put, msg)
        msg.blocks, msg.shm, msg.region = placed
        stored, _ = await self.peer.request(msg, (), expect=Stored)
        return Sent(stored, enc.nbytes, enc.copied + enc.nbytes)  # staged once

    async def _place(
        self, blocks: list[FieldBlock], buffers: list[Any], whole: list[Any]
    ) -> tuple[list[FieldBlock], list[list[int]], int] | None:
        """Write each field into one range of a region the unit allocates; None where the
        arena is full."""
        fields: list[tuple[FieldBlock, list[Any], int]] = []
        at = 0
        for block, one in zip(blocks, whole):
            bufs = buffers[at : at + len(block.counts)]
            at += len(block.counts)
            fields.append((block, [one] if one is not None else bufs, sum(memoryview(b).nbytes for b in bufs)))
        total = sum(aligned(n) for _, _, n in fields)
        reply, _ = await self.peer.request(Alloc(nbytes=total), expect=Allocated)
        if reply.offset < 0:
            return None
        stage = self._pool.take(max(total, 1))
        local = _nixl.address_of(stage)
        out_blocks, refs, pieces, off = [], [], [], 0
        for block, bufs, n in fields:
            pos = off
            for b in bufs:
                view = np.frombuffer(b, dtype=np.uint8) if not isinstance(b, np.ndarray) else b.reshape(-1).view(np.uint8)
                stage[pos : pos + view.nbytes] = view
                pos += view.nbytes
            if n:
                pieces.append((local + off, self.base + reply.offset + off, n))
            out_blocks.append(in_one_range(block))
            refs.append([reply.offset + off, n])
            off += aligned(n)
        await self._transfer("WRITE", pieces, [(local, stage.nbytes)])
        return out_blocks, refs, reply.offset

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str],
        rows: BatchBuffers,
    ) -> Part:
        reply, frames = await self.peer.request(fetch_msg(meta, indexes, fields, shm=True), expect=Fetched)
        if reply.shm is not None and not reply.bulk:
            frames = await self._read(reply, frames, positions, rows)
        return received(positions, reply, frames)

    async def _read(self, reply: Fetched, raw: list[Any], positions: np.ndarray, rows: BatchBuffers) -> list[Any]:
        """The reply's frames: its arena ranges read into this process, its raw frames as they
        came. Where every frame is in the arena, dense fields are read straight into the
        batch's rows (as bulk streams receive); else the ranges land in one buffer. The
        unit's hold ends once the read has, or failed."""
        assert reply.shm is not None
        ranges = [r for r in reply.shm if r]
        if not ranges:
            return raw
        try:
            placed = self._in_place(reply, positions, rows) if len(ranges) == len(reply.shm) else None
            if placed is not None:
                frames, local = placed
            else:
                sizes = [int(n) for _, n in ranges]
                buf = rows.pool.take(max(sum(sizes), 1))
                starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                views = iter([buf[int(a) : int(a) + n] for a, n in zip(starts, sizes)])
                rest = iter(raw)
                frames = [next(views) if r else next(rest) for r in reply.shm]
                local = [(_nixl.address_of(buf), buf.nbytes)]
            pieces = [
                (int(f.ctypes.data), self.base + int(r[0]), int(r[1])) for f, r in zip(frames, reply.shm) if r and r[1]
            ]
            await self._transfer("READ", pieces, local)
        finally:
            self._releases.release_soon(self.info.unit_id, reply.hold)
        return frames

    def _in_place(
        self, reply: Fetched, positions: np.ndarray, rows: BatchBuffers
    ) -> tuple[list[np.ndarray], list[tuple[int, int]]] | None:
        """Each frame's destination (rows of the batch where it can, else staging) and the
        buffers to register; None if a frame would need widening."""
        total = sum(int(n) for _, n in reply.shm or [])
        packed = [list(b.packed) if b.packed else None for b in reply.blocks]
        frames, targets = bulk_targets(positions, reply.blocks, rows, total)
        if not all(isinstance(t, memoryview) for t in targets):
            for block, was in zip(reply.blocks, packed):  # bulk_targets marks what it widens
                block.packed = was
            return None
        return frames, [(_nixl.address_of(t), t.nbytes) for t in targets]

    async def _transfer(self, op: str, pieces: list[tuple[int, int, int]], local: list[tuple[int, int]]) -> None:
        try:
            limit = self._timeout + sum(n for _, _, n in pieces) / TRANSIT_RATE  # as long as a socket's request
            await self.agent.transfer(op, self.remote, pieces, local, limit)
        except _nixl.TransferError as exc:
            raise _nixl.unavailable(self._where, exc) from exc
