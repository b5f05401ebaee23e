"""The inline route: a unit's payload as ZeroMQ frames beside the message on the unit's
peer. Every unit can take it; the other routes hand it what they cannot carry."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ProtocolError
from ...transport import _zmq
from ...wire import BatchMeta, Fetch, Fetched, Store, Stored, UnitInfo
from .._assemble import Part
from .._encode import Encoded
from .base import BatchBuffers, Outgoing, Route, Sent


class InlineRoute(Route):
    """Frames on the unit's ZeroMQ peer, integers narrowed first (fewer bytes to send)."""

    def __init__(self, info: UnitInfo, peer: _zmq.Peer) -> None:
        super().__init__(info)
        self.peer = peer

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        return await self.send(put.narrow(False) if put.narrow is not None else put.wide, msg)

    async def send(self, enc: Encoded, msg: Store) -> Sent:
        """Send ``enc`` as it is (narrowed or not, never deferred) with ``msg``."""
        msg.blocks = enc.blocks
        stored, _ = await self.peer.request(msg, enc.buffers, expect=Stored)
        return Sent(stored, enc.nbytes, enc.copied)

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str],
        rows: BatchBuffers,
    ) -> Part:
        reply, frames = await self.peer.request(fetch_msg(meta, indexes, fields), expect=Fetched)
        return received(positions, reply, frames)


def fetch_msg(meta: BatchMeta, indexes: list[int], fields: list[str], *, shm: bool = False, bulk: int = 0) -> Fetch:
    return Fetch(
        partition=meta.partition, partition_uid=meta.partition_uid, indexes=indexes, fields=fields,
        shm=shm, bulk=bulk,
    )


def received(positions: np.ndarray, reply: Fetched, frames: list[Any], wire: int = -1, widened: int = 0) -> Part:
    """A unit's answer as a :class:`Part`: each block with its run of ``frames``."""
    if reply.bulk and wire < 0:
        raise ProtocolError("a bulk reply to a fetch that asked for none, or with inline frames")
    blocks, at = {}, 0
    for block in reply.blocks:
        blocks[block.name] = (block, frames[at : at + len(block.counts)])
        at += len(block.counts)
    return Part(positions=positions, blocks=blocks, wire=wire, widened=widened)
