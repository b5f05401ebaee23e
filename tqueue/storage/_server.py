"""A storage unit: holds payload bytes for the partitions placed on it.

It registers with the controller, stores what clients send under a grant, commits each
write to the controller before answering (so what a put acknowledged is visible to the
next ``get_meta``), and serves any subset of fields and samples without copying.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from .. import _env, _memory, _transport
from .._wire import (
    PROTOCOL_VERSION,
    Commit,
    Drop,
    Fetch,
    Fetched,
    Hello,
    HelloReply,
    Ok,
    RegisterUnit,
    Store,
    Stored,
)
from ..config import StorageConfig
from ..errors import ControllerUnavailableError, ProtocolError, ProtocolVersionError
from ._store import Store as _Data

log = logging.getLogger(__name__)


class StorageUnit:
    """The unit server. Create inside a running loop, ``await start()``, then ``serve()``."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.host = config.host or _env.host()
        self._server = _transport.Server(
            config.bind, name="storage unit", max_header=config.max_header_bytes
        )
        self.address = self._server.address
        self.data = _Data()
        self.unit_id = -1
        self._controller: _transport.Peer | None = None
        self._trim: asyncio.TimerHandle | None = None
        s = self._server
        s.route(Hello, self._hello)
        s.route(Store, self._store)
        s.route(Fetch, self._fetch)
        s.route(Drop, self._drop)

    async def start(self) -> None:
        """Register with the controller; afterwards the unit receives placements."""
        self._controller = _transport.Peer(
            self.config.controller, name="controller", unavailable=ControllerUnavailableError
        )
        reply, _ = await self._controller.request(
            RegisterUnit(protocol=PROTOCOL_VERSION, address=self.address, host=self.host)
        )
        self.unit_id = reply.unit_id
        self._server.name = f"storage unit {self.unit_id}"
        log.info("storage unit %d serving at %s", self.unit_id, self.address)

    async def serve(self) -> None:
        await self._server.serve()

    async def close(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
        if self._controller is not None:
            await self._controller.close()
        await self._server.close()

    def _hello(self, ident: bytes, msg: Hello, bufs: list[Any]) -> HelloReply:
        if msg.protocol != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"peer speaks tqueue protocol {msg.protocol}, the storage unit speaks protocol "
                f"{PROTOCOL_VERSION}; upgrade the older side"
            )
        return HelloReply(protocol=PROTOCOL_VERSION, server="storage")

    async def _store(self, ident: bytes, msg: Store, frames: list[Any]) -> Stored:
        if self._trim is not None:
            self._schedule_trim()  # still busy: keep the freed pages for these writes
        if msg.indexes is None:
            indexes = np.arange(msg.start, msg.start + msg.count, dtype=np.int64)
        else:
            indexes = np.asarray(msg.indexes, dtype=np.int64)
            if len(indexes) != msg.count:
                raise ProtocolError(f"Store lists {len(indexes)} indexes for {msg.count} samples")
        rollback = self.data.write(msg.partition_uid, msg.partition, indexes, msg.blocks, frames)
        nbytes = sum(_frame_bytes(f) for f in frames)
        part = self.data.partitions[msg.partition_uid]
        assert self._controller is not None
        try:
            await self._controller.request(
                Commit(
                    grant_id=msg.grant_id,
                    unit_id=self.unit_id,
                    fields=[b.name for b in msg.blocks],
                    nbytes=nbytes,
                    partition_bytes=part.nbytes,
                    unit_bytes=self.data.nbytes,
                )
            )
        except BaseException:
            rollback()
            raise
        return Stored(nbytes=nbytes)

    def _fetch(self, ident: bytes, msg: Fetch, bufs: list[Any]) -> tuple[Fetched, list[Any]]:
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        blocks, frames = self.data.read(msg.partition_uid, msg.partition, indexes, msg.fields)
        return Fetched(blocks=blocks), frames

    def _drop(self, ident: bytes, msg: Drop, bufs: list[Any]) -> Ok:
        freed = self.data.drop(msg.partition_uid)
        if freed:
            self._schedule_trim()
            log.info("unit %d freed %d bytes of partition uid %d", self.unit_id, freed, msg.partition_uid)
        return Ok()


    def _schedule_trim(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        if self.config.trim_delay <= 0:
            _memory.trim()
        else:
            self._trim = asyncio.get_running_loop().call_later(self.config.trim_delay, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        _memory.trim()


def _frame_bytes(frame: Any) -> int:
    return len(frame.buffer) if hasattr(frame, "buffer") else len(frame)
