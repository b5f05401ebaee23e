"""The bulk route: a unit's payload over its bulk TCP streams (tqueue/transport/_bulk.py)
while the message goes on ZeroMQ. A put's frames are narrowed as they are written, on two
lanes when big; a fetch's dense frames are received straight into the batch's rows."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from ...config import ClientConfig
from ...errors import ProtocolError, UnavailableError
from ...transport import _bulk, _zmq
from ...wire import BatchMeta, Fetched, FieldBlock, Store, Stored, UnitInfo, _shared
from ...wire._layout import int_dtype, itemsize, nbytes, sample_sizes
from ...wire._pack import PACKED, Narrowing, Widening
from .._assemble import Part
from .._encode import Encoded
from .base import BatchBuffers, Outgoing, Route, Sent
from .inline import InlineRoute, fetch_msg, received

log = logging.getLogger(__name__)
LANE_GRACE: Final = 2.0  # fixed: seconds to wait for a unit's reason after it closed a put's stream


class BulkRoute(Route):
    """Puts of at least ``ClientConfig.bulk_put_min_bytes`` (as the caller's values hold
    them, before narrowing) and every fetch over the unit's bulk streams; what no stream can
    carry goes inline. The route keeps its unit's idle streams (``idle``): a stream whose
    bytes were all read or written goes back there, one in doubt is closed. Where the unit's
    listener cannot be reached, the route says so once and carries everything inline."""

    def __init__(self, info: UnitInfo, peer: _zmq.Peer, config: ClientConfig) -> None:
        super().__init__(info)
        self.peer = peer
        self.inline = InlineRoute(info, peer)
        self.config = config
        self.idle: list[_bulk.BulkStream] = []
        self.unreachable = False

    async def _stream(self) -> _bulk.BulkStream | None:
        """An idle stream, opened if none is; None if the unit's listener cannot be reached."""
        if self.idle:
            return self.idle.pop()
        if self.unreachable:
            return None
        try:
            return await _bulk.run_blocking(_bulk.BulkStream, self.info.bulk, self.config.request_timeout)
        except UnavailableError as exc:
            log.warning("%s; payload of unit %d goes over ZeroMQ instead", exc, self.info.unit_id)
            self.unreachable = True
            return None

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for st in idle:
            st.close()

    # --- puts ---------------------------------------------------------------------------

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        if put.wide.nbytes < self.config.bulk_put_min_bytes or self.unreachable:  # inline, narrowed once
            return await self.inline.store(put, msg)
        # big fields are narrowed as they are sent (frames in cache)
        enc = put.narrow(True) if put.narrow is not None else put.wide
        copied = enc.copied
        msg.blocks = enc.blocks
        try:
            stored = await self._write(msg, enc, put.split)
        except _bulk.FrameRefused:  # a value past the first ones' range: narrow knowing them all
            assert put.narrow is not None  # only narrowed frames are refused
            enc = put.narrow(False)
            msg.blocks, msg.bulk = enc.blocks, None
            stored = await self._write(msg, enc, put.split)
        if stored is not None:
            return Sent(stored, enc.nbytes, copied)
        if enc.deferred:  # no stream could be opened: inline after all
            assert put.narrow is not None
            enc = put.narrow(False)
        return await self.inline.send(enc, msg)

    async def _write(self, msg: Store, enc: Encoded, split: Callable[[list[int], int], list[int]]) -> Stored | None:
        """Send a put's frames over bulk streams (two lanes at once when big) while ``msg``
        goes on ZeroMQ: the unit's reply, or None if no stream could be opened."""
        lane_min = self.config.bulk_lane_min_bytes
        want = self.config.bulk_lanes if enc.nbytes >= lane_min * self.config.bulk_lanes else 1
        counts = split([b.cost if isinstance(b, Narrowing) else nbytes(b) for b in enc.buffers], max(1, want))
        streams: list[_bulk.BulkStream] = []
        for _ in counts:
            st = await self._stream()
            if st is None:
                break
            streams.append(st)
        if len(streams) < len(counts):
            self.idle.extend(streams)
            return None
        msg.bulk = [(st.token, n) for st, n in zip(streams, counts)]
        limit = self.config.request_timeout
        reply: asyncio.Future[Any] = asyncio.ensure_future(self.peer.request(msg, expect=Stored))
        writes: list[asyncio.Future[Any]] = []
        at = 0
        for st, n in zip(streams, counts):
            writes.append(asyncio.ensure_future(_bulk.run_blocking(st.write, enc.buffers[at : at + n], limit)))
            at += n
        try:
            await _settle(reply, writes)
        except BaseException:
            for st in streams:  # the unit may have left bytes unread: never reuse these
                st.close()
            for task in (reply, *writes):
                if not task.done():
                    task.cancel()
                task.add_done_callback(_consume)
            raise
        self.idle.extend(streams)
        stored: Stored = reply.result()[0]
        return stored

    # --- fetches ------------------------------------------------------------------------

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str], rows: BatchBuffers
    ) -> Part:
        stream = await self._stream()
        if stream is None:  # the listener cannot be reached: in frames this once
            return await self.inline.fetch(meta, positions, indexes, fields, rows)
        wire, widened = -1, 0
        try:
            reply, frames = await self.peer.request(
                fetch_msg(meta, indexes, fields, bulk=stream.token), expect=Fetched
            )
            if reply.bulk:
                if frames:
                    raise ProtocolError("a bulk reply to a fetch that asked for none, or with inline frames")
                frames, targets = bulk_targets(positions, reply.blocks, rows, reply.bulk)
                await _bulk.run_blocking(stream.read, targets, self.config.request_timeout)
                wire, widened = reply.bulk, sum(t.dst.nbytes for t in targets if isinstance(t, Widening))
        except BaseException:
            stream.close()  # bytes may be in flight: never read this stream again
            raise
        self.idle.append(stream)
        return received(positions, reply, frames, wire, widened)

    def lanes(self, meta: BatchMeta, fields: list[str], positions: np.ndarray) -> list[np.ndarray]:
        """Big fetches split into runs fetched at once over parallel streams.

        One TCP stream on loopback leaves both cores half idle (each side waits on the other's
        copy); two streams moved 1.3-3x the bytes of one here."""
        lanes = self.config.bulk_lanes
        if lanes <= 1 or len(positions) < 2 * lanes:
            return [positions]
        dense = 0
        for f in fields:
            spec = meta.schema[f]
            if spec.kind != "object" and spec.layout == "dense":
                dense += int(np.prod(spec.shape, dtype=np.int64)) * itemsize(spec)
        if dense * len(positions) < self.config.bulk_lane_min_bytes * lanes:
            return [positions]
        return np.array_split(positions, lanes)


async def _settle(reply: asyncio.Future[Any], writes: list[asyncio.Future[Any]]) -> None:
    """Wait for a bulk put's reply and writes; raise the unit's reason before a broken write's."""
    await asyncio.wait([reply, *writes], return_when=asyncio.FIRST_EXCEPTION)
    if reply.done() and reply.exception() is not None and not all(w.done() for w in writes):
        # a frame this side refused closes its stream, which the unit may report first
        # ("the peer closed the stream"): the writes say whether it was that
        await asyncio.wait(writes, timeout=LANE_GRACE)
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


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome (already reported another way)."""
    if not task.cancelled():
        task.exception()


def bulk_targets(
    positions: np.ndarray, blocks: Sequence[FieldBlock], rows: BatchBuffers, total: int
) -> tuple[list[np.ndarray], list[memoryview | Widening]]:
    """Where each frame of a bulk reply lands, and the buffers to receive into, in order.

    A dense frame whose samples are consecutive batch positions goes straight into those
    rows of the field's buffer in ``rows``; a packed one is widened into them as it
    arrives (a :class:`~tqueue.wire._pack.Widening`; its entry in ``block.packed`` becomes "",
    as the frame is then those rows, wide). Every other run of frames goes into one staging
    buffer, of which the frames are slices. ``total`` (the bytes the unit announced) must
    match the blocks."""
    frames: list[np.ndarray] = []
    targets: list[memoryview | Widening] = []
    staged: list[int] = []  # sizes of frames waiting for a staging buffer

    def stage() -> None:
        if not staged:
            return
        buf = rows.pool.take(sum(staged))
        targets.append(memoryview(buf))
        at = 0
        for n in staged:
            frames.append(buf[at : at + n])
            at += n
        staged.clear()

    got = 0
    for block in blocks:
        sizes = sample_sizes(block)
        ends = np.concatenate(([0], np.cumsum(sizes)))
        bounds = np.concatenate(([0], np.cumsum(np.asarray(block.counts, dtype=np.int64))))
        if _shared.samples(block) != len(positions):
            raise ProtocolError(
                f"field {block.name!r}: the unit sent {_shared.samples(block)} samples, {len(positions)} were asked"
            )
        # a block of values shared by content is expanded once verified: staged, not in the rows
        own = rows.of(block.name) if block.spec.layout == "dense" and block.value_of is None and block.rows_per_sample is None else None
        in_place = own is not None and tuple(block.spec.shape) == tuple(own[0].shape) and block.spec.dtype == own[0].dtype
        dest = own[1] if own is not None and in_place else None
        row = int(np.prod(block.spec.shape, dtype=np.int64)) * itemsize(block.spec) if in_place else 0
        wide = int_dtype(block.spec) if in_place and block.packed else None
        for i in range(len(block.counts)):
            a, b = int(bounds[i]), int(bounds[i + 1])
            n = int(ends[b] - ends[a])
            got += n
            pos = positions[a:b]
            if dest is not None and b > a and row and pos[-1] - pos[0] == b - a - 1:
                stage()
                view = dest[int(pos[0]) * row : (int(pos[-1]) + 1) * row]
                frames.append(view)
                narrow = block.packed[i] if block.packed else ""
                if narrow:  # sample_sizes checked the name and the width
                    assert wide is not None and block.packed is not None
                    targets.append(Widening(view.view(wide), PACKED[narrow]))
                    block.packed[i] = ""
                else:
                    targets.append(memoryview(view))
            else:
                staged.append(n)
    if got != total:
        raise ProtocolError(f"the unit announced {total} bulk bytes, its blocks describe {got}")
    stage()
    return frames, [t for t in targets if t.nbytes]
