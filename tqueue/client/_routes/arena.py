"""The arena route: a unit on this host shares its arena (tqueue/transport/_arena.py). A put
copies its fields into a range the unit allocates and sends only the header (a dense CUDA
field by DMA straight into the unit's pages, registered with the driver: one copy); a fetch
gets views of the unit's pages, held until the last view is dropped."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ...transport import _zmq
from ...transport._arena import ArenaMap, aligned
from ...wire import Alloc, Allocated, BatchMeta, Fetched, FieldBlock, Store, Stored, UnitInfo
from .._assemble import Part
from .._encode import Encoded
from .base import Outgoing, Releases, Route, Rows, Sent
from .inline import InlineRoute, fetch_msg, received


class DeviceWrites(Protocol):
    """Copies from a device into an arena (the client's device routes)."""

    def to_arena(self, arena: ArenaMap, offset: int, src: torch.Tensor) -> tuple[Any, int]:
        """Queue ``src``'s bytes into ``arena`` at ``offset``: (what to ``synchronize()``
        before they are read, bytes that went through host memory on the way)."""
        ...


class ArenaRoute(Route):
    """Puts of at least ``min_bytes`` go through the arena, smaller ones (and those a full
    arena refuses) inline; fetches ask for arena views."""

    device_writes = True

    def __init__(
        self, info: UnitInfo, peer: _zmq.Peer, arena: ArenaMap, releases: Releases, min_bytes: int,
        devices: DeviceWrites | None = None,
    ) -> None:
        super().__init__(info)
        self.peer = peer
        self.arena = arena
        self.inline = InlineRoute(info, peer)
        self._releases = releases
        self._min_bytes = min_bytes
        self._devices = devices

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        enc = put.wide  # no socket to cross: never narrowed
        if self._devices is None:
            enc.materialize()
        placed = await self._place(enc) if enc.nbytes >= self._min_bytes else None
        if placed is None:
            enc.materialize()
            return await self.inline.store(put, msg)
        (msg.blocks, msg.shm, msg.region), staged = placed
        stored, _ = await self.peer.request(msg, (), expect=Stored)
        host = sum(n for i, (_, n) in enumerate(msg.shm) if i not in enc.on_device)  # filled by the host
        return Sent(stored, enc.nbytes, enc.copied + host + staged)

    async def _place(self, enc: Encoded) -> tuple[tuple[list[FieldBlock], list[list[int]], int], int] | None:
        """Copy a write's payload into the unit's arena: one range per field; None when the
        arena is full (the socket still works). Fields still on a device are copied into it
        by DMA; the bytes that went through host memory instead are counted."""
        fields: list[tuple[FieldBlock, list[Any], int]] = []
        at = 0
        for i, (block, whole) in enumerate(zip(enc.blocks, enc.whole)):
            bufs = enc.buffers[at : at + len(block.counts)]
            at += len(block.counts)
            if i in enc.on_device:
                t = enc.on_device[i]
                fields.append((block, [], t.numel() * t.element_size()))
            else:
                fields.append((block, [whole] if whole is not None else bufs, sum(memoryview(b).nbytes for b in bufs)))
        reply, _ = await self.peer.request(Alloc(nbytes=sum(aligned(n) for _, _, n in fields)), expect=Allocated)
        if reply.offset < 0:
            return None
        self.arena.seen(reply.epoch)
        blocks, refs, off, staged, waits = [], [], reply.offset, 0, {}
        for i, (block, bufs, n) in enumerate(fields):
            if i in enc.on_device:
                assert self._devices is not None
                acc, went = self._devices.to_arena(self.arena, off, enc.on_device[i])
                waits[id(acc)], staged = acc, staged + went
            else:
                self.arena.fill(off, bufs)
            blocks.append(in_one_range(block))
            refs.append([off, n])
            off += aligned(n)
        for acc in waits.values():  # the unit reads these bytes once the Store arrives
            acc.synchronize()
        return (blocks, refs, reply.offset), staged

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str],
        rows: Rows,
    ) -> Part:
        reply, frames = await self.peer.request(fetch_msg(meta, indexes, fields, shm=True), expect=Fetched)
        if reply.shm is not None and not reply.bulk:
            self.arena.seen(reply.epoch)
            frames = self._resolve(reply, frames)
        return received(positions, reply, frames)

    def _resolve(self, reply: Fetched, raw: list[Any]) -> list[Any]:
        """Frames of a same-host reply: arena views (holding the unit's hold) and raw frames."""
        assert reply.shm is not None
        ranges = [r for r in reply.shm if r]
        if not ranges:
            return raw
        hold, unit_id, releases = reply.hold, self.info.unit_id, self._releases
        views = iter(self.arena.views(ranges, lambda: releases.release_soon(unit_id, hold)))
        frames = iter(raw)
        return [next(views) if r else next(frames) for r in reply.shm]


def in_one_range(block: FieldBlock) -> FieldBlock:
    """``block`` as a put through an arena range stores it: its samples back to back in one
    frame (the arena and NIXL routes)."""
    return FieldBlock(
        name=block.name, spec=block.spec, counts=[sum(block.counts)], shapes=block.shapes,
        sizes=block.sizes, packed=block.packed[:1] if block.packed else None,
    )
