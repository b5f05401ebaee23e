"""A storage unit's part of a checkpoint: its payload, written as Apache Arrow IPC files and
loaded back.

**Saving.** ``SaveUnit`` arrives on the controller's connection, after every drop and move
the controller sent before it took its own snapshot, and before any it sends after: so the
unit's snapshot holds every sample the controller's metadata calls committed. The snapshot is
taken on the unit's loop in one step and copies no payload: per field, which piece and row
holds each sample (two index arrays) and a reference to each piece (its frames are never
changed; a write or a drop replaces pieces, it does not alter them; arena ranges get a
reference until the file is written). That step is the only time the checkpoint holds the
unit's loop (``UnitSaved.pause``); the bytes are written by a thread while puts and gets go
on.

**The files.** One per field of a partition: ``unit-<id>/p<uid>-f<k>.arrow``, a record batch
per run of samples, columns ``index`` (int64), ``value`` (large_binary: each sample's bytes as
the unit holds them, objects as MessagePack), for tensor and ndarray fields ``shape``
(fixed-size list of int64), and ``crc`` (int64: each sample's CRC-32C as its producer computed
it, -1 for none; a restored unit keeps them, so readers check the restored bytes as any
others). The schema's metadata ``tqueue`` is JSON: the format, its version, the partition, its
uid, the field and its spec, and ``shared`` for a field shared by content. pyarrow alone reads
them.

**Packed integers** (version 3). Integers the unit holds narrower than the field's dtype
(``FieldBlock.packed``: a routed expert id in one byte, not four) stay so in the file: a
column ``packed`` (dictionary of int8 to string, present where some piece is packed) names
per row the type its value is in, ``""`` for the field's own dtype (``int8``, ``uint8``,
``int16``, ``int32``: ``numpy.frombuffer(value, packed or spec.dtype).astype(spec.dtype)`` is
the sample). The CRC-32C is still that of the wide values, as readers get them back (so a
flipped bit in a narrow value fails it at the read after a restore). The load stores each
value in its type again: the unit holds what it held before the save. A record batch's
custom metadata ``tqueue``, ``{"piece": k}``, says which piece of the unit its rows came from
(one batch per frame of it, cut at BATCH_BYTES): consecutive batches of one piece load as one
write, one piece again with those frames. A name that is not a packed type, one not
narrower than the field's dtype (or any in a field that is not an integer one), a value whose
size is not its shape's values in its type (not a whole number of them, or another count; in
a file of any version), a
``packed`` column in an older file or of another type: refused, naming the file, field,
partition and sample (``DataCorruptionError`` for a row, ``InvalidArgumentError`` for a
column). A sample appends grew is joined in the type of its rows, where all share one, else
the narrowest all its values fit. Files of versions 1 and 2 (integers widened, no ``packed``)
load wide, as they were written.

**Values shared by content** (version 2). Such a file holds each distinct value once (equal
values found as the store finds them: xxh3-64 digest, size and shape, then the bytes; packed
integers compared widened: a value held narrow and wide is one, written in its narrowest
form), across the unit's pieces, and a column ``ref`` (int64): -1 for the row that carries
its value, else the row of the same record batch that does (a row before it, carrying one);
a row that refers carries no bytes (an empty ``value``) but its own index, shape and
CRC-32C, and its value's packed type. A value's holders are never split between record
batches, so each batch is read alone (``value.take(where(ref < 0, arange(n), ref))`` gives
every sample's bytes). The load puts each batch back as one write of its values with the
sample that holds each (``FieldBlock.value_of``): every value stored once again, shared by
its holders. A reference to a row that is not there or carries no value, a referring row
with bytes of its own or another shape or packed type, or a CRC-32C that differs from its
value's is refused (``DataCorruptionError`` naming the field, the partition, the sample and
the file). Version 1 files (each sample's bytes in its own row, shared fields too) are read
as before, their equal values found again per batch. The unit's folder is new (the
controller made the generation's folder), each file is created with ``O_EXCL`` and no link
followed, and its CRC-32C (of the whole file, computed as it is written) goes into its
``UnitFile``.

**Loading.** ``LoadUnit`` names files; a thread opens each inside the generation's folder
(no link followed; under a checkpoint root, the folder must lie under it), checks its size
and CRC-32C before reading a byte of it as Arrow (a mismatch: ``DataCorruptionError`` naming
the file, field, partition and unit), checks every index against ``max_index``, and copies
each batch into buffers of its own (the files stay closed, so a later checkpoint may delete
them). Only once every file is read does the loop install each batch as a write, committed
at once (the controller restores the metadata that makes them visible), under the partition
uid ``LoadUnit.uids`` gives the file's (a checkpoint loaded into a live cluster is given
uids of its own there); an install that fails drops every partition of the load again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from .. import _threads
from ..errors import InvalidArgumentError
from ..transport._arena import Arena, Region
from ..wire import LoadUnit, SaveUnit, UnitLoaded, UnitSaved, _durable
from ._payload_files import ColumnSnapshot, read_all, write_all
from ._store import PayloadStore, Piece


class UnitCheckpoints:
    """Saves and loads the payload of ``store``; ``decref`` lets go of an arena region."""

    def __init__(
        self, store: PayloadStore, arena: Arena | None, decref: Callable[[Region], None], *, root: str = "",
        auth: bool = False,
    ) -> None:
        if auth and not root:
            raise InvalidArgumentError(
                "storage unit: with authentication on (auth_dir) a checkpoint root is required: set checkpoint_root "
                "(--checkpoint-root) to the folder checkpoints may be written to and loaded from"
            )
        self.root = root
        self.store = store
        self.arena = arena
        self._decref = decref
        self._running: set[asyncio.Future[Any]] = set()

    # --- saving ---------------------------------------------------------------------

    def save(self, msg: SaveUnit) -> Awaitable[UnitSaved]:
        """Take the snapshot now (in the handler's own step), write it in the background."""
        place = _durable.confined(msg.directory, self.root)
        started = time.perf_counter()
        columns = self.snapshot(msg.partitions, msg.exclude)
        regions = {p.region.offset: p.region for c in columns for p in c.pieces.values() if p.region is not None}
        for region in regions.values():
            assert self.arena is not None
            self.arena.incref(region)  # its pages stay ours until the file is written
        pause = time.perf_counter() - started
        return self._write(place, msg, columns, list(regions.values()), pause)

    def snapshot(self, uids: Sequence[int], exclude: Sequence[int] = ()) -> list[ColumnSnapshot]:
        """Which piece and row hold each sample of every field of ``uids`` (copies of the
        index arrays, references to the pieces: no payload is copied). Writes of the grants
        in ``exclude`` that are installed and not committed are seen through: their samples
        as they were before them."""
        hidden = [self.store.installed[g] for g in exclude if g in self.store.installed]
        out = []
        for uid in uids:
            part = self.store.partitions.get(uid)
            if part is None:
                continue
            for field, col in part.columns.items():
                held = col.piece_of[: col.top]
                indexes = np.flatnonzero(held > 0)
                pids = held[indexes]
                rows = col.row_of[indexes]
                pieces = dict(col.pieces)  # each one holds a sample (no sort of a million piece ids)
                chains = {i: [(r, col.pieces[p]) for p, r in segs] for i, segs in col.chains.items()}
                for write in hidden:
                    mine = write.field(field) if write.uid == uid else None
                    if mine is None:
                        continue
                    if field in write.appended:  # its rows are not the samples' yet
                        chains = {i: [(r, q) for r, q in segs if q is not mine[0]] for i, segs in chains.items()}
                    chains.update(write.chains.get(field, {}))  # an overwrite: the rows it took off come back
                    indexes, pids, rows = _before_write(mine, indexes, pids, rows, pieces)
                if len(indexes):
                    kept = set(indexes.tolist())
                    chains = {i: segs for i, segs in chains.items() if segs and i in kept}
                    out.append(ColumnSnapshot(uid, part.name, field, indexes, pids, rows, pieces, shared=col.index is not None,
                                       chains=chains))
        return out

    async def _write(
        self, place: _durable.Place, msg: SaveUnit, columns: list[ColumnSnapshot], regions: list[Region], pause: float
    ) -> UnitSaved:
        folder = f"unit-{msg.unit}"
        try:
            files = await self._in_thread(write_all, place, folder, columns)
        finally:
            for region in regions:
                self._decref(region)
        return UnitSaved(files=files, pause=pause)

    # --- loading --------------------------------------------------------------------

    def load(self, msg: LoadUnit) -> Awaitable[UnitLoaded]:
        return self._load(_durable.confined(msg.directory, self.root), msg)

    async def _load(self, place: _durable.Place, msg: LoadUnit) -> UnitLoaded:
        loaded = await self._in_thread(read_all, place, msg.files, self.store.max_index)
        uids = {msg.uids.get(f.partition_uid, f.partition_uid) for f in msg.files}
        try:
            for old, name, indexes, block, frames in loaded:
                self.store.write(msg.uids.get(old, old), name, indexes, [block], frames).commit()
        except BaseException:
            for uid in uids:  # uids of the load alone: none of them held anything here before
                self.store.drop(uid)
            raise
        parts = self.store.partitions
        return UnitLoaded(
            partition_bytes={uid: parts[uid].nbytes for uid in uids if uid in parts}, unit_bytes=self.store.resident
        )

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        fut = asyncio.get_running_loop().run_in_executor(_threads.pool("checkpoint", 1), fn, *args)
        self._running.add(fut)
        try:
            return await fut
        finally:
            self._running.discard(fut)

    async def close(self) -> None:
        """Wait for a file being written or read (it may read arena pages: the arena is
        unmapped after this)."""
        if self._running:
            await asyncio.wait(list(self._running))


def _before_write(
    write: tuple[Piece, np.ndarray, tuple[np.ndarray, np.ndarray, dict[int, Piece]] | None],
    indexes: np.ndarray, pids: np.ndarray, rows: np.ndarray, pieces: dict[int, Piece],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The snapshot's samples with an uncommitted write undone: those still pointing at its
    piece point where they did before it (or are left out, where nothing was there)."""
    piece, at, before = write
    mine = [pid for pid, p in pieces.items() if p is piece]
    if not mine:
        return indexes, pids, rows  # overwritten since, or never installed here
    sel = pids == mine[0]
    del pieces[mine[0]]
    if before is None:  # new samples: left out
        keep = ~sel
        return indexes[keep], pids[keep], rows[keep]
    old_pids, old_rows, olds = before
    order = np.argsort(at, kind="stable")
    where = order[np.searchsorted(at[order], indexes[sel])]
    pids, rows = pids.copy(), rows.copy()
    pids[sel], rows[sel] = old_pids[where], old_rows[where]
    pieces.update(olds)
    keep = pids > 0
    return indexes[keep], pids[keep], rows[keep]
