"""The arena route: a unit on this host shares its arena (tqueue/transport/_arena.py). A put
copies its fields into a range the unit allocates and sends only the header (a dense CUDA
field by DMA straight into the unit's pages, registered with the driver: one copy); a fetch
gets views of the unit's pages, held until the last view is dropped."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import numpy as np
import torch

from ...transport import _zmq
from ...transport._arena import ArenaMap, aligned
from ...wire import Alloc, Allocated, BatchMeta, Fetched, FieldBlock, Store, Stored, UnitInfo
from .._assemble import Part
from .._encode import Encoded
from .base import BatchBuffers, Outgoing, Releases, Route, Sent
from .inline import InlineRoute, fetch_msg, received


class DeviceWrites(Protocol):
    """Copies from a device into an arena (the client's device routes)."""

    def to_arena(self, arena: ArenaMap, offset: int, src: torch.Tensor) -> tuple[Any, int]:
        """Queue ``src``'s bytes into ``arena`` at ``offset``: (what to ``synchronize()``
        before they are read, bytes that went through host memory on the way)."""
        ...


class Lease:
    """An arena region this writer keeps for several puts (``Store.keep``), cut front to
    back: ``at`` is where the next put goes. ``stores``: Stores into it not yet answered;
    ``retired``: no put goes into it any more, and once those are answered the next Store
    tells the unit (``Store.release``, with the allocation's token: a release that arrives
    after the region lapsed and went to a new allocation leaves that one alone). A release
    that never arrives (the unit was unreachable) costs the region until its ``ttl`` lapses."""

    __slots__ = ("offset", "token", "end", "at", "ttl", "used", "stores", "retired")

    def __init__(self, reply: Allocated, nbytes: int, now: float) -> None:
        self.offset = self.at = reply.offset
        self.token = reply.token
        self.end = reply.offset + (reply.length or nbytes)
        self.ttl = reply.ttl
        self.used = now
        self.stores = 0
        self.retired = False

    def take(self, nbytes: int, now: float) -> int | None:
        """Where a put of ``nbytes`` goes; None: it does not fit, or the unit may have let the
        region go (unused for half of its ``ttl``: the unit's clock starts later than this one)."""
        if self.retired or self.end - self.at < nbytes or now - self.used >= self.ttl / 2:
            return None
        at, self.at, self.used = self.at, self.at + nbytes, now
        self.stores += 1
        return at


class ArenaRoute(Route):
    """Puts of at least ``min_bytes`` go through the arena, smaller ones (and those a full
    arena refuses) inline; fetches ask for arena views. A put of up to half of
    ``lease_bytes`` goes into a range this route keeps (a :class:`Lease` of eight times the
    put, at most ``lease_bytes``), so that most puts skip the ``Alloc`` round trip."""

    device_writes = True
    local = True

    def __init__(
        self, info: UnitInfo, peer: _zmq.Peer, arena: ArenaMap, releases: Releases, min_bytes: int,
        devices: DeviceWrites | None = None, lease_bytes: int = 0,
    ) -> None:
        super().__init__(info)
        self.peer = peer
        self.arena = arena
        self.inline = InlineRoute(info, peer)
        self._releases = releases
        self._min_bytes = min_bytes
        self._devices = devices
        self._lease_bytes = lease_bytes
        self.lease: Lease | None = None
        self._ended: list[list[int]] = []  # leases to release with the next Store: [offset, token]
        self._leasing: asyncio.Future[bool] | None = None  # a lease asked for, not yet given

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        enc = put.wide
        if self._devices is None:
            enc.materialize()
        if put.narrow_arena is not None and not enc.on_device:
            # jagged integer fields (routed experts) are held narrow in the arena too: a half
            # to an eighth of their bytes. Dense ones stay wide unless arena_pack_dense, for
            # readers to view in place: narrow, each read widens them (docs/performance.md)
            enc = put.narrow_arena()
        placed = await self._place(enc) if enc.nbytes >= self._min_bytes else None
        if placed is None:
            enc.materialize()
            put.checksum()  # over the socket after all
            return await self.inline.store(put, msg)
        (msg.blocks, msg.shm, msg.region), staged, lease = placed
        msg.keep = lease is not None
        if self._ended:
            msg.release, self._ended = self._ended, []
        try:
            stored, _ = await self.peer.request(msg, (), expect=Stored)
        except BaseException:
            if lease is not None:  # the unit may have let it go: not put into again
                self._retire(lease)
            raise
        finally:
            if lease is not None:
                self._stored(lease)
        host = sum(n for i, (_, n) in enumerate(msg.shm) if i not in enc.on_device)  # filled by the host
        return Sent(stored, enc.nbytes, enc.copied + host + staged)

    def _stored(self, lease: Lease) -> None:
        """A Store into ``lease`` was answered (or never went)."""
        lease.stores -= 1
        if lease.retired and not lease.stores:
            self._ended.append([lease.offset, lease.token])

    def _retire(self, lease: Lease) -> None:
        if lease.retired:
            return
        lease.retired = True
        if self.lease is lease:
            self.lease = None
        if not lease.stores:
            self._ended.append([lease.offset, lease.token])

    async def _range(self, nbytes: int) -> tuple[int, int, Lease | None] | None:
        """Where a put of ``nbytes`` goes: (its offset, the region's, the lease it is cut
        from); None when the arena is full. One lease is asked for at a time: the puts that
        find the lease full while one is asked for wait for it."""
        loop = asyncio.get_running_loop()
        while 0 < nbytes <= self._lease_bytes // 2:  # a bigger put leaves the lease alone
            if self.lease is not None:
                at = self.lease.take(nbytes, loop.time())
                if at is not None:
                    return at, self.lease.offset, self.lease
                self._retire(self.lease)
            if self._leasing is not None:
                if await asyncio.shield(self._leasing):
                    continue
                break  # no room for a lease: perhaps for this put alone
            if not await self._new_lease(nbytes):
                break
        reply, _ = await self.peer.request(Alloc(nbytes=nbytes), expect=Allocated)
        if reply.offset < 0:
            return None
        self.arena.seen(reply.epoch)
        return reply.offset, reply.offset, None

    async def _new_lease(self, nbytes: int) -> bool:
        """Ask the unit for a lease fit for puts of ``nbytes``; whether it gave one."""
        loop = asyncio.get_running_loop()
        self._leasing = asking = loop.create_future()
        got = False
        try:
            size = min(self._lease_bytes, 8 * nbytes)
            reply, _ = await self.peer.request(Alloc(nbytes=size), expect=Allocated)
            if reply.offset >= 0 and reply.ttl > 0:
                self.arena.seen(reply.epoch)
                if self.lease is not None:
                    self._retire(self.lease)
                self.lease, got = Lease(reply, size, loop.time()), True
            elif reply.offset >= 0:  # a unit that keeps nothing: the range is this put's alone
                self._ended.append([reply.offset, reply.token])
            return got
        finally:
            self._leasing = None
            asking.set_result(got)

    async def _place(self, enc: Encoded) -> tuple[tuple[list[FieldBlock], list[list[int]], int], int, Lease | None] | None:
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
        total = sum(aligned(n) for _, _, n in fields)
        got = await self._range(total)
        if got is None:
            return None
        start, region, lease = got
        try:
            if not enc.on_device:  # the copies below touch each page of the range (a device's DMA does not fault here)
                self.arena.populate(start, total)
            blocks, refs, off, staged, waits = [], [], start, 0, {}
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
        except BaseException:  # no Store goes: the range taken from the lease stays unused
            if lease is not None:
                self._stored(lease)
            raise
        return (blocks, refs, region), staged, lease

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str],
        rows: BatchBuffers,
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
        sizes=block.sizes, packed=block.packed[:1] if block.packed else None, crcs=block.crcs, value_of=block.value_of,
    )
