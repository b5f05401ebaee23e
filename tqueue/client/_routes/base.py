"""What every payload route is: how one storage unit's bytes travel to and from this client.

A route carries one put (:meth:`Route.store`) or one unit's share of a get
(:meth:`Route.fetch`) for one unit; :class:`~tqueue.client._connections.Connections` picks
it once per unit. The puts and gets never ask which route they hold. A route that cannot
carry a call (a put too small for a stream, a full arena, a stream that cannot be opened)
hands it to the inline route it holds.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..._memory import BufferPool
from ...wire import BatchMeta, FieldSpec, Store, Stored, UnitInfo
from ...wire._layout import itemsize
from .._assemble import Part
from .._encode import Encoded


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """One put as a route sees it: the encoded batch as the caller's values hold it, and
    how to narrow its integer fields for a socket (``narrow(defer)``; None when
    ``ClientConfig.pack_ints`` is off) and cut its frames into lanes of about equal cost.
    ``narrow_arena``: the same-host arena's narrowing, each field at one width: its jagged
    integer fields, and its dense ones only with ``ClientConfig.arena_pack_dense`` (by
    default they stay wide there, for readers to view in place)."""

    wide: Encoded
    narrow: Callable[[bool], Encoded] | None
    split: Callable[[list[int], int], list[int]]
    narrow_arena: Callable[[], Encoded] | None = None
    # give the put its samples' CRC-32Cs (ClientConfig.checksums): for bytes that cross a
    # socket; a same-host route calls it only where ClientConfig.arena_checksums is on
    checksum: Callable[[], None] = lambda: None


@dataclasses.dataclass(frozen=True)
class Sent:
    """What a route did with a put: the unit's reply, the bytes that crossed to the unit
    (after narrowing) and the payload bytes this process copied."""

    stored: Stored
    wire: int
    copied: int


class BatchBuffers:
    """The batch buffers of one get's dense fields, shared by its routes: one is taken from
    the pool the first time a route receives a field in place; assembly then fills the
    rows the other routes brought."""

    def __init__(self, meta: BatchMeta, pool: BufferPool) -> None:
        self.size = len(meta.indexes)
        self.schema = meta.schema
        self.pool = pool
        self.buffers: dict[str, np.ndarray] = {}

    def of(self, field: str) -> tuple[FieldSpec, np.ndarray] | None:
        """The field's spec and batch buffer, if it is a dense field of the meta with bytes."""
        spec = self.schema.get(field)
        if spec is None or spec.kind == "object" or spec.layout != "dense":
            return None
        buf = self.buffers.get(field)
        if buf is None:
            n = int(np.prod(spec.shape, dtype=np.int64)) * itemsize(spec) * self.size
            if not n:
                return None
            buf = self.buffers[field] = self.pool.take(n)
        return spec, buf


class Releases(Protocol):
    """Where an arena route queues the release of a hold once the caller dropped its last
    view of it (from any thread, after the get): the client's connections."""

    def release_soon(self, unit_id: int, hold: int) -> None: ...


class Route(abc.ABC):
    """How the bytes of one storage unit travel. Subclasses: inline frames, bulk streams,
    the same-host arena (and in tests, memory)."""

    # whether store() takes a put whose dense CUDA fields are still on their device
    # (Encoded.on_device); for the other routes the put copies them to the host first
    device_writes = False
    # whether its bytes stay on this host, in memory shared with the unit (no socket): checked
    # only where ClientConfig.arena_checksums is on
    local = False

    def __init__(self, info: UnitInfo) -> None:
        self.info = info

    @abc.abstractmethod
    async def store(self, put: Outgoing, msg: Store) -> Sent:
        """Send one put's payload and ``msg`` (its header, filled in here) to the unit."""

    def close(self) -> None:  # noqa: B027 - most routes hold nothing of their own
        """Let go of what the route holds of its own (a bulk route's idle streams)."""

    @abc.abstractmethod
    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str],
        rows: BatchBuffers,
    ) -> Part:
        """The unit's samples ``indexes`` (batch positions ``positions``) of ``fields``;
        a route that receives in place does so into ``rows``."""

    def lanes(self, meta: BatchMeta, fields: list[str], positions: np.ndarray) -> list[np.ndarray]:
        """The unit's samples cut into runs fetched at once (one, unless the route has lanes)."""
        return [positions]
