"""Columnar payload store of a storage unit, free of IO.

Received frames are kept as they arrived: a write becomes, per field, a *piece* that holds
the frames and, per row, which frame and which byte range; each sample points at one row. A
frame is either a ZeroMQ frame or a range of the unit's shared-memory arena that a same-host
producer filled. Reads slice those frames (no copy) and coalesce consecutive samples into one
range. Only tiny runs, which ZeroMQ would copy anyway, are joined into one frame.

A write that appends (``Store.append``) adds, per sample, a row after those it has: the
sample's value is its rows in order (``Column.chains``, along dim 0), nothing stored is
copied, and a read sends the rows (``FieldBlock.rows_per_sample``), which the reader joins.

A field shared by content (its blocks carry ``value_of``, tqueue/wire/_shared.py) holds a row
per distinct value, which several samples point at. Once its write commits, each row equal to
one the partition already stores (same digest, then the same bytes) gives its samples to that
row instead, and a piece no sample points at any longer is freed: a value is stored once per
unit and partition, and freed with the last sample that holds it. A read sends each value
once (its block's ``value_of`` says which sample holds which).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, PartitionClearedError, ProtocolError, SchemaError
from ..transport._arena import Arena, Region
from ..wire import FieldBlock, FieldSpec, _shared
from ..wire._layout import block_shapes, frame_layout, nbytes
from ..wire._messages import PackedType

# Runs below this size are joined into one frame: ZeroMQ copies frames this small anyway.
SMALL_RUN = 1 << 16
JOIN_LIMIT = 4 << 20
# Sample indexes a unit accepts by default (StorageConfig.max_index): a column's index arrays
# cost 16 bytes per index up to the highest one written, so one message naming index 10**12
# must be refused, not allocated for.
MAX_INDEX = 1 << 26


def _named(indexes: np.ndarray, limit: int = 8) -> str:
    """Some of ``indexes`` for an error message (a message's cost, never its size)."""
    shown = ", ".join(str(int(i)) for i in indexes[:limit])
    return f"[{shown}{', ...' if len(indexes) > limit else ''}] ({len(indexes)} samples)"


# ZeroMQ receives small frames into shared batch buffers (8 KiB, ZMQ_IN_BATCH_SIZE) and a
# frame kept pins its whole buffer: a 64-byte put held 10 KB. Frames this small are copied.
COPY_BELOW = 8 << 10


def _kept(frame: Any) -> memoryview:
    """The view a piece keeps of a received frame (see COPY_BELOW)."""
    if hasattr(frame, "buffer"):  # a ZeroMQ frame
        return memoryview(frame.bytes) if len(frame) <= COPY_BELOW else frame.buffer
    return memoryview(frame)


_OBJECT = 16  # malloc's header on each Python object
_ENTRY = 112  # a piece's share of its column's dict and its id (measured: 10,000 pieces)


def _cost(piece: Piece, *, frames: bool) -> int:
    """Bytes a piece holds resident: its bookkeeping objects and, with ``frames``, its views
    and the buffers under them (a copied small frame: the bytes object; otherwise the
    payload; the same bytes the budget counts, even where they lie in the arena)."""
    spec = piece.spec  # decoded anew for every write
    parts: list[Any] = [piece, piece.frame_of, piece.offsets, piece.sizes, piece.frames, piece.arena, spec, spec.shape]
    if piece.shapes is not None:
        parts.append(piece.shapes)
    if piece.crcs is not None:
        parts.append(piece.crcs)
    held = sum(sys.getsizeof(x) + _OBJECT for x in parts) + _ENTRY
    if frames:
        for view in piece.frames:
            held += sys.getsizeof(view) + _OBJECT
            under = view.obj
            held += sys.getsizeof(under) + _OBJECT if isinstance(under, bytes) else view.nbytes
    return held


class Piece:
    __slots__ = (
        "spec", "frames", "arena", "region", "frame_of", "offsets", "sizes", "shapes", "live", "nbytes", "packed",
        "crcs", "cost", "keys",
    )

    def __init__(self, block: FieldBlock, frames: Sequence[Any], arena: Sequence[int], region: Region | None) -> None:
        self.frame_of, self.offsets, self.sizes = frame_layout(block, frames)
        self.spec = block.spec
        self.frames = [_kept(f) for f in frames]
        self.arena = list(arena)  # absolute arena offset of each frame, -1 if not in the arena
        self.region = region if any(a >= 0 for a in self.arena) else None
        self.shapes = None if block.spec.kind == "object" or block.spec.layout == "dense" else (
            block_shapes(block)
        )
        self.live = len(self.sizes)
        self.nbytes = sum(nbytes(f) for f in frames)
        self.packed = block.packed  # per frame: "" or the narrower int type its values are in
        self.crcs = checked_crcs(block, len(self.sizes))  # per row: the producer's CRC-32C, -1: none
        self.keys: list[tuple[Any, int]] | None = None  # a shared field's: (content key, row) in its column's index
        self.cost = _cost(self, frames=True)

    def row_bytes(self, row: int) -> memoryview:
        """The bytes of one row, as stored (a packed row narrow)."""
        a = int(self.offsets[row])
        return memoryview(self.frames[int(self.frame_of[row])]).cast("B")[a : a + int(self.sizes[row])]

    def content_key(self, row: int) -> tuple[int, int, str, tuple[int, ...]]:
        """What equal values share: digest, size, packed type and shape (bytes compared too)."""
        kind = self.packed[int(self.frame_of[row])] if self.packed else ""
        shape = tuple(self.shapes[row].tolist()) if self.shapes is not None else ()
        return _shared.digest(self.row_bytes(row)), int(self.sizes[row]), kind, shape

    def subset(self, rows: np.ndarray) -> Piece:
        """A piece over some of these rows, sharing the frames (for moving samples)."""
        sub = object.__new__(Piece)
        sub.spec, sub.frames, sub.arena, sub.region = self.spec, self.frames, self.arena, self.region
        sub.packed = self.packed
        sub.frame_of, sub.offsets, sub.sizes = self.frame_of[rows], self.offsets[rows], self.sizes[rows]
        sub.shapes = None if self.shapes is None else self.shapes[rows]
        sub.crcs = None if self.crcs is None else self.crcs[rows]
        sub.live = len(rows)
        sub.nbytes = int(sub.sizes.sum())
        sub.keys = None
        sub.cost = _cost(sub, frames=False) + sub.nbytes
        return sub


def checked_crcs(block: FieldBlock, n: int) -> np.ndarray | None:
    """A block's per-sample CRC-32Cs as a unit keeps them (int64, -1: none computed), after
    checking there is one per sample and each is a 32-bit value or -1."""
    if block.crcs is None:
        return None
    crcs = np.asarray(block.crcs, dtype=np.int64)
    if crcs.shape != (n,):
        raise ProtocolError(f"field {block.name!r}: {len(block.crcs)} checksums for {n} samples")
    if n and (int(crcs.min()) < -1 or int(crcs.max()) > 0xFFFFFFFF):
        raise ProtocolError(f"field {block.name!r}: a checksum outside [-1, 2**32)")
    return crcs


class Column:
    """Per sample index: the id of the piece holding it (0: none; ids start at 1) and its row
    there. Zero-filled arrays are mapped lazily, so a sample written at a high index costs
    the pages around it, not the whole range below it."""

    def __init__(self) -> None:
        self.piece_of = np.zeros(0, dtype=np.int64)
        self.row_of = np.zeros(0, dtype=np.int64)
        self.pieces: dict[int, Piece] = {}
        self.top = 0  # highest index written + 1
        # a field shared by content: its values by content key -> (piece id, row) holding it
        self.index: dict[Any, list[tuple[int, int]]] | None = None
        self.logical = 0  # a shared field's: bytes its samples hold (a value once per sample)
        # samples grown by appends: the (piece id, row) of each row after the first, in order
        self.chains: dict[int, list[tuple[int, int]]] = {}

    def rows(self, indexes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(piece ids, rows) of every row of the samples at ``indexes`` in order, and how many
        each sample has (None: one each)."""
        pids, rows = self.piece_of[indexes], self.row_of[indexes]
        if not self.chains:
            return pids, rows, None
        extra = [self.chains.get(i, ()) for i in indexes.tolist()]
        if not any(extra):
            return pids, rows, None
        out_p: list[int] = []
        out_r: list[int] = []
        for p, r, more in zip(pids.tolist(), rows.tolist(), extra):
            out_p.append(p)
            out_r.append(r)
            for mp, mr in more:
                out_p.append(mp)
                out_r.append(mr)
        counts = np.fromiter((1 + len(m) for m in extra), dtype=np.int64, count=len(extra))
        return np.asarray(out_p, dtype=np.int64), np.asarray(out_r, dtype=np.int64), counts

    def add(self, pid: int, piece: Piece) -> None:
        self.pieces[pid] = piece
        if self.index is not None and piece.keys:
            for key, row in piece.keys:
                self.index.setdefault(key, []).append((pid, row))

    def remove(self, pid: int) -> Piece:
        """Take a piece out (no sample points at it), and its values out of the index."""
        piece = self.pieces.pop(pid)
        if self.index is not None and piece.keys:
            for key, row in piece.keys:
                held = self.index.get(key)
                if held is not None:
                    held.remove((pid, row))
                    if not held:
                        del self.index[key]
        return piece

    def held_by(self, indexes: np.ndarray) -> int:
        """Bytes of the values the samples at ``indexes`` point at (each counted per sample)."""
        pids, rows = self.piece_of[indexes], self.row_of[indexes]
        total = 0
        for pid in np.unique(pids[pids > 0]).tolist():
            total += int(self.pieces[pid].sizes[rows[pids == pid]].sum())
        return total

    def ensure(self, size: int) -> None:
        self.top = max(self.top, size)
        if size <= len(self.piece_of):
            return
        cap = max(size, 2 * len(self.piece_of), 1024)
        piece_of = np.zeros(cap, dtype=np.int64)
        piece_of[: len(self.piece_of)] = self.piece_of
        row_of = np.zeros(cap, dtype=np.int64)
        row_of[: len(self.row_of)] = self.row_of
        self.piece_of, self.row_of = piece_of, row_of

    @property
    def held(self) -> int:
        """Bytes of the index arrays in use (those below the highest index written)."""
        return 16 * self.top


class PartitionData:
    def __init__(self, uid: int, name: str) -> None:
        self.uid = uid
        self.name = name
        self.columns: dict[str, Column] = {}
        self.nbytes = 0


@dataclasses.dataclass(slots=True)
class Installed:
    """An overwrite installed and not committed yet (an update, a completion), as a
    checkpoint's snapshot must see through it: per field (``pieces``), its new piece, and the
    samples it covers (``indexes``), with what they pointed to before (``befores``, per field:
    piece ids, 0 for nothing, rows and those pieces; None where none held anything).

    A write of new samples only (every put) leaves no record: recording each one kept about
    100 bytes per put resident on a unit (tests/faults/test_accounting.py). A snapshot may
    then hold new samples of a put the controller had not committed at its copy; the
    restore never serves them, as the controller's copy does not know them, and a later put
    of those indexes overwrites them."""

    uid: int
    pieces: list[tuple[str, Piece]]
    indexes: np.ndarray
    befores: list[tuple[np.ndarray, np.ndarray, dict[int, Piece]] | None]
    appended: frozenset[str] = frozenset()  # fields whose piece holds rows appended to the samples'
    chains: dict[str, dict[int, list[tuple[int, Piece]]]] = dataclasses.field(default_factory=dict)
    """Per field, the appended rows an overwrite took off its samples ((row, piece) each)."""

    def field(self, name: str) -> tuple[Piece, np.ndarray, tuple[np.ndarray, np.ndarray, dict[int, Piece]] | None] | None:
        for (field, piece), before in zip(self.pieces, self.befores):
            if field == name:
                return piece, self.indexes, before
        return None


@dataclasses.dataclass
class Pending:
    """An installed write, waiting for the controller's commit: ``commit()`` or ``rollback()``."""

    commit: Callable[[], None]
    rollback: Callable[[], None]


@dataclasses.dataclass
class ReadReply:
    """What a read sends: blocks; raw frames; per output frame an arena range or ``[]``
    (the next raw frame), when the reader maps the arena; the regions it holds."""

    blocks: list[FieldBlock]
    frames: list[Any]
    refs: list[list[int]] | None
    held: list[Region]


def _before(col: Column | None, indexes: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, Piece]] | None:
    """What ``indexes`` of a column point to: piece ids (0: none), rows, and those pieces;
    None where none of them held anything (new samples, the usual write)."""
    if col is None or not len(indexes) or int(indexes.min()) >= len(col.piece_of):
        return None
    inside = indexes[indexes < len(col.piece_of)]
    if not col.piece_of[inside].any():
        return None  # the column had grown past them, nothing written there yet
    pids = np.zeros(len(indexes), dtype=np.int64)
    rows = np.zeros(len(indexes), dtype=np.int64)
    inside = indexes < len(col.piece_of)
    pids[inside] = col.piece_of[indexes[inside]]
    rows[inside] = col.row_of[indexes[inside]]
    return pids, rows, {pid: col.pieces[pid] for pid in np.unique(pids[pids > 0]).tolist()}


class PayloadStore:
    """All partitions held by one unit.

    ``release_soon`` drops a region reference from any thread (a send of arena bytes ends
    in ZeroMQ's own thread); the server makes it thread-safe.
    """

    def __init__(
        self,
        arena: Arena | None = None,
        release_soon: Callable[[Region], None] | None = None,
        *,
        max_index: int = MAX_INDEX,
    ) -> None:
        self.max_index = max_index
        self.partitions: dict[int, PartitionData] = {}
        self.nbytes = 0  # payload held
        self.resident = 0  # what holding it costs: payload, bookkeeping, index arrays
        self.copied = 0
        self.arena = arena
        self._release_soon = release_soon
        self._piece_ids = itertools.count(1)  # 0: no piece
        self.installed: dict[int, Installed] = {}  # grant id -> a write of it not committed yet

    # --- writes ---------------------------------------------------------------------

    def write(
        self,
        uid: int,
        name: str,
        indexes: np.ndarray,
        blocks: Sequence[FieldBlock],
        frames: Sequence[Any],
        *,
        arena: Sequence[int] | None = None,
        region: Region | None = None,
        grant: int = 0,
        append: Collection[str] = (),
    ) -> Pending:
        """Install a write; pieces it overwrites stay until ``commit()``. ``grant``: the
        controller's grant it belongs to, remembered (``installed``) until commit or rollback.
        ``append``: fields whose rows go after each sample's (a sample without one: its first)."""
        if uid <= 0:
            raise ProtocolError(f"bad partition uid {uid}")
        self.check_indexes(name, indexes)
        span: slice | np.ndarray = slice(int(indexes[0]), int(indexes[-1]) + 1) if len(indexes) else indexes
        if len(indexes) > 1 and not np.all(np.diff(indexes) == 1):  # not a plain range
            span = indexes
            ordered = np.sort(indexes)
            if np.any(ordered[1:] == ordered[:-1]):
                raise InvalidArgumentError(f"partition {name!r}: a sample is written twice in one call")
        where = list(arena) if arena is not None else [-1] * len(frames)
        pieces = []
        at = 0
        rows_of: list[np.ndarray | None] = []  # per piece: the row each sample points at (None: its own)
        for block in blocks:
            if _shared.samples(block) != len(indexes):
                raise ProtocolError(
                    f"field {block.name!r}: {_shared.samples(block)} samples in the block, "
                    f"{len(indexes)} in the write"
                )
            take = frames[at : at + len(block.counts)]
            if len(take) != len(block.counts):
                raise ProtocolError(
                    f"field {block.name!r}: header declares {len(block.counts)} frame(s), "
                    f"{len(take)} arrived"
                )
            held = _shared.value_of(block)
            if block.name in append and (held is not None or block.spec.layout != "jagged" and block.spec.kind == "object"):
                raise ProtocolError(f"field {block.name!r}: an append of values shared by content or of objects")
            piece = Piece(block, take, where[at : at + len(block.counts)], region)
            if held is not None:
                piece.live = len(indexes)
            pieces.append((block.name, piece))
            rows_of.append(held)
            at += len(block.counts)
        if at != len(frames):
            raise ProtocolError(f"{len(frames) - at} frame(s) beyond what the header declares")
        part = self.partitions.get(uid)
        if part is None:
            part = self.partitions[uid] = PartitionData(uid, name)
        for _, piece in pieces:
            if piece.region is not None:
                assert self.arena is not None
                self.arena.incref(piece.region)
        own = np.arange(len(indexes), dtype=np.int64)
        top = int(indexes.max()) + 1 if len(indexes) else 0
        befores = [_before(part.columns.get(field), indexes) for field, _ in pieces] if grant else []
        chains: dict[str, dict[int, list[tuple[int, Piece]]]] = {}
        steps = [
            self._append(part, field, piece, indexes, top) if field in append else
            self._install(part, field, piece, span, own if held is None else held, top, shared=held is not None,
                          chains=chains.setdefault(field, {}))
            for (field, piece), held in zip(pieces, rows_of)
        ]
        if any(b is not None for b in befores):  # an overwrite: new samples need no record
            self.installed[grant] = Installed(
                uid, pieces, indexes, befores, frozenset(append), {f: c for f, c in chains.items() if c},
            )

        def commit() -> None:
            self.installed.pop(grant, None)
            for _, _, dead, _ in steps:
                for piece in dead:
                    self._free(piece)
            for (field, piece), held, (_, _, _, pid) in zip(pieces, rows_of, steps):
                if held is not None and self.partitions.get(uid) is part:
                    self._share(part, field, pid, piece, indexes)

        def rollback() -> None:
            self.installed.pop(grant, None)
            if self.partitions.get(uid) is not part:
                return  # dropped meanwhile: its pieces are already freed and accounted
            for undo, new, _, _ in reversed(steps):
                undo()
                self._free(new)
            if not any(col.pieces for col in part.columns.values()):
                self.resident -= sum(col.held for col in part.columns.values())
                del self.partitions[uid]

        return Pending(commit=commit, rollback=rollback)

    def check_indexes(self, name: str, indexes: np.ndarray) -> None:
        """Indexes a write or a move may target: none negative or beyond ``max_index``."""
        bad = indexes[(indexes < 0) | (indexes >= self.max_index)]
        if len(bad):
            raise InvalidArgumentError(
                f"partition {name!r}: sample indexes {_named(bad)} lie outside [0, {self.max_index}) "
                "(StorageConfig.max_index)"
            )

    def _install(
        self, part: PartitionData, field: str, piece: Piece, indexes: slice | np.ndarray, rows: np.ndarray, top: int,
        *, shared: bool = False, chains: dict[int, list[tuple[int, Piece]]] | None = None,
    ) -> tuple[Callable[[], None], Piece, list[Piece], int]:
        """Point the samples at ``indexes`` (a slice where they are a plain range: cheaper
        than fancy indexing) of ``field`` to ``piece``'s ``rows``; ``top`` = max index + 1.
        ``shared``: the field is shared by content (its values are indexed once committed).
        Rows appended to those samples go (into ``chains``: (row, piece) each, for a snapshot)."""
        col = part.columns.get(field)
        if col is None:
            col = part.columns[field] = Column()
        if shared and col.index is None:
            col.index = {}
        self._grow(col, top)
        pid = next(self._piece_ids)
        col.pieces[pid] = piece
        at = np.arange(indexes.start, indexes.stop) if isinstance(indexes, slice) else indexes
        held = (int(piece.sizes[rows].sum()) - col.held_by(at)) if col.index is not None else 0
        col.logical += held
        old_pieces = col.piece_of[indexes].copy()
        old_rows = col.row_of[indexes].copy()
        col.piece_of[indexes] = pid
        col.row_of[indexes] = rows
        self._account(part, piece, 1)
        released = []
        cut = {i: col.chains.pop(i) for i in at.tolist() if i in col.chains} if col.chains else {}
        for i, segs in cut.items():  # an overwrite replaces every row of an appended sample
            for old_pid, old_row in segs:
                old = col.pieces[old_pid]
                old.live -= 1
                released.append((old_pid, old, 1))
                if chains is not None:
                    chains.setdefault(i, []).append((old_row, old))
                if old.live == 0:
                    col.remove(old_pid)
                    self._account(part, old, -1)
        overwritten = old_pieces[old_pieces > 0]
        if len(overwritten):  # new samples (the usual write) replace nothing
            ids, counts = np.unique(overwritten, return_counts=True)
            replaced = zip(ids.tolist(), counts.tolist())
        else:
            replaced = zip((), ())
        for old_pid, count in replaced:
            old = col.pieces[old_pid]
            old.live -= count
            released.append((old_pid, old, count))
            if old.live == 0:
                col.remove(old_pid)
                self._account(part, old, -1)

        def undo() -> None:
            # only the samples still pointing at this write go back: a later write of the
            # same samples, not yet committed either, keeps what it installed
            ours = col.piece_of[at] == pid
            col.logical -= int(piece.sizes[col.row_of[at[ours]]].sum()) if col.index is not None else 0
            col.piece_of[at[ours]] = old_pieces[ours]
            col.row_of[at[ours]] = old_rows[ours]
            back = old_pieces[ours]
            ids, counts = np.unique(back[back > 0], return_counts=True)
            olds = {old_pid: old for old_pid, old, _ in released}
            mine = set(at[ours].tolist()) if cut else set()
            back_chains = {i: segs for i, segs in cut.items() if i in mine}  # their appended rows come back too
            counted = collections.Counter(old_pid for segs in back_chains.values() for old_pid, _ in segs)
            for old_pid, count in [*zip(ids.tolist(), counts.tolist()), *counted.items()]:
                old = olds[old_pid]
                if old.live == 0:
                    self._account(part, old, 1)
                    col.add(old_pid, old)
                old.live += count
            col.chains.update(back_chains)
            if col.index is not None:
                col.logical += col.held_by(at[ours])
            if pid in col.pieces:  # else overwritten whole: accounted off
                col.remove(pid)
                self._account(part, piece, -1)

        dead = {id(old): old for _, old, _ in released if old.live == 0}
        return undo, piece, list(dead.values()), pid

    def _append(
        self, part: PartitionData, field: str, piece: Piece, indexes: np.ndarray, top: int,
    ) -> tuple[Callable[[], None], Piece, list[Piece], int]:
        """Add ``piece``'s rows after the samples' rows of ``field`` (row ``k`` to the sample at
        ``indexes[k]``; a sample without the field gets it as its first row). Nothing stored
        moves or is copied; ``undo`` takes the rows off again."""
        col = part.columns.get(field)
        if col is None:
            col = part.columns[field] = Column()
        if col.index is not None:
            raise ProtocolError(f"field {field!r} is shared by content: it cannot be appended to")
        self._grow(col, top)
        pid = next(self._piece_ids)
        col.pieces[pid] = piece
        self._account(part, piece, 1)
        piece.live = len(indexes)
        first = col.piece_of[indexes] == 0
        col.piece_of[indexes[first]] = pid
        col.row_of[indexes[first]] = np.flatnonzero(first)
        for k in np.flatnonzero(~first).tolist():
            col.chains.setdefault(int(indexes[k]), []).append((pid, k))

        def undo() -> None:
            # only rows still last go: one a later append went after stays (as its samples do)
            for k, i in enumerate(indexes.tolist()):
                chain = col.chains.get(i)
                if chain and chain[-1] == (pid, k):
                    chain.pop()
                    if not chain:
                        del col.chains[i]
                    piece.live -= 1
                elif col.piece_of[i] == pid and col.row_of[i] == k and i not in col.chains:
                    col.piece_of[i] = 0
                    piece.live -= 1
            if piece.live == 0 and pid in col.pieces:
                col.remove(pid)
                self._account(part, piece, -1)

        return undo, piece, [], pid

    def _share(self, part: PartitionData, field: str, pid: int, piece: Piece, indexes: np.ndarray) -> None:
        """A committed write of a field shared by content: each of its rows equal to a value
        the partition stores already (same content key, then the same bytes) gives its samples
        to that value; the piece goes once none is left to it, else its rows join the index."""
        col = part.columns.get(field)
        if col is None or col.pieces.get(pid) is not piece or col.index is None:
            return  # overwritten or dropped before its commit
        mine = indexes[(indexes < len(col.piece_of))]
        mine = mine[col.piece_of[mine] == pid]
        rows = col.row_of[mine]
        keys: list[tuple[Any, int]] = []
        for row in np.unique(rows).tolist():
            key = piece.content_key(row)
            match = None
            for other_pid, other_row in col.index.get(key, ()):
                other = col.pieces[other_pid]
                if _shared.equal(other.row_bytes(other_row), piece.row_bytes(row)):
                    match = other_pid, other_row
                    break
            if match is None:
                keys.append((key, row))
                continue
            sel = mine[rows == row]
            col.piece_of[sel], col.row_of[sel] = match
            col.pieces[match[0]].live += len(sel)
            piece.live -= len(sel)
        if piece.live == 0:
            col.remove(pid)
            self._account(part, piece, -1)
            self._free(piece)
            return
        col.pieces.pop(pid)
        piece.keys = keys
        col.add(pid, piece)

    def _free(self, piece: Piece) -> None:
        if piece.region is not None and self.arena is not None:
            self.arena.decref(piece.region)
            piece.region = None

    def _account(self, part: PartitionData, piece: Piece, sign: int) -> None:
        part.nbytes += sign * piece.nbytes
        self.nbytes += sign * piece.nbytes
        self.resident += sign * piece.cost

    def _grow(self, col: Column, size: int) -> None:
        before = col.held
        col.ensure(size)
        self.resident += col.held - before

    def move(self, src_uid: int, dst_uid: int, dst_name: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Re-key samples from one partition to another without copying their bytes."""
        part = self.partitions.get(src_uid)
        if part is None:
            return
        self.check_indexes(dst_name, dst)
        target = self.partitions.get(dst_uid)
        if target is None:
            target = self.partitions[dst_uid] = PartitionData(dst_uid, dst_name)
        for field, col in part.columns.items():
            inside = (src >= 0) & (src < len(col.piece_of))
            s, d = src[inside], dst[inside]
            pids, rows = col.piece_of[s], col.row_of[s]
            have = pids > 0
            s, d, pids, rows = s[have], d[have], pids[have], rows[have]
            if not len(s):
                continue
            out = target.columns.get(field)
            if out is None:
                out = target.columns[field] = Column()
            self._grow(out, int(d.max()) + 1)
            if col.index is not None:
                moved = col.held_by(s)
                col.logical -= moved
                if out.index is None:
                    out.index = {}  # shared there too: a read sends a value once (moved values are not indexed)
                out.logical += moved
            for pid in np.unique(pids).tolist():
                piece = col.pieces[pid]
                sel = pids == pid
                kept, row_in = np.unique(rows[sel], return_inverse=True)  # a value several samples hold: once
                sub = piece.subset(kept)
                sub.live = int(sel.sum())
                if sub.region is not None and self.arena is not None:
                    self.arena.incref(sub.region)
                new = next(self._piece_ids)
                out.pieces[new] = sub
                out.piece_of[d[sel]] = new
                out.row_of[d[sel]] = row_in
                self._account(target, sub, 1)
                piece.live -= int(sel.sum())
                if piece.live == 0:
                    col.remove(pid)
                    self._account(part, piece, -1)
                    self._free(piece)
            for a, b in zip(s.tolist(), d.tolist()):  # appended rows move with their samples
                for pid, row in col.chains.pop(a, ()):
                    piece = col.pieces[pid]
                    sub = piece.subset(np.asarray([row], dtype=np.int64))
                    if sub.region is not None and self.arena is not None:
                        self.arena.incref(sub.region)
                    new = next(self._piece_ids)
                    out.pieces[new] = sub
                    out.chains.setdefault(b, []).append((new, 0))
                    self._account(target, sub, 1)
                    piece.live -= 1
                    if piece.live == 0:
                        col.remove(pid)
                        self._account(part, piece, -1)
                        self._free(piece)
            col.piece_of[s] = 0

    def drop_samples(self, uid: int, indexes: np.ndarray) -> int:
        """Free some samples' bytes (pieces go once no sample uses them); return bytes freed."""
        part = self.partitions.get(uid)
        if part is None:
            return 0
        before = part.nbytes
        for col in part.columns.values():
            inside = indexes[(indexes >= 0) & (indexes < len(col.piece_of))]
            pids = col.piece_of[inside]
            held = inside[pids > 0]
            if col.index is not None:
                col.logical -= col.held_by(held)
            if col.chains:  # appended rows go with their samples
                extra = [p for i in held.tolist() for p, _ in col.chains.pop(i, ())]
                held_pids = np.concatenate([col.piece_of[held], np.asarray(extra, dtype=np.int64)])
            else:
                held_pids = col.piece_of[held]
            ids, counts = np.unique(held_pids, return_counts=True)
            col.piece_of[held] = 0
            for pid, count in zip(ids.tolist(), counts.tolist()):
                piece = col.pieces[pid]
                piece.live -= count
                if piece.live == 0:
                    col.remove(pid)
                    self._account(part, piece, -1)
                    self._free(piece)
        return before - part.nbytes

    def drop(self, uid: int) -> int:
        part = self.partitions.pop(uid, None)
        if part is None:
            return 0
        for col in part.columns.values():
            for piece in col.pieces.values():
                self._free(piece)
                self.resident -= piece.cost
            self.resident -= col.held
        self.nbytes -= part.nbytes
        return part.nbytes

    def bytes_shared(self) -> int:
        """Bytes the samples of fields shared by content hold beyond what their values take
        (a value stored once, held by several samples)."""
        total = 0
        for part in self.partitions.values():
            for col in part.columns.values():
                if col.index is not None:
                    total += max(0, col.logical - sum(p.nbytes for p in col.pieces.values()))
        return total

    # --- reads ----------------------------------------------------------------------

    def read(self, uid: int, name: str, indexes: np.ndarray, fields: Sequence[str], *, shm: bool = False) -> ReadReply:
        """``fields`` of ``indexes`` in the order asked. With ``shm`` the reader maps the arena:
        arena bytes go as ranges, each region they lie in gets one reference (the hold)."""
        part = self.partitions.get(uid)
        if part is None:
            raise PartitionClearedError(f"partition {name!r} has no data on this unit (cleared?)")
        out = ReadReply(blocks=[], frames=[], refs=[] if shm else None, held=[])
        held: dict[int, Region] = {}
        for field in fields:
            block, runs = self._read_field(part, field, indexes)
            block.counts, block.packed = self._emit(runs, out, held, shm)
            out.blocks.append(block)
        for region in held.values():
            assert self.arena is not None
            self.arena.incref(region)
        out.held = list(held.values())
        return out

    def _read_field(
        self, part: PartitionData, field: str, indexes: np.ndarray
    ) -> tuple[FieldBlock, list[tuple[Piece, int, int, int, int]]]:
        """The field's block (counts left to :meth:`_emit`) and its runs: (piece, frame,
        start, end, samples) for each stretch of consecutive bytes of one frame."""
        col = part.columns.get(field)
        if len(indexes) == 0:
            raise InvalidArgumentError("a read needs at least one sample")
        if col is not None:
            # checked against what the column holds before any lookup: never grown for a read
            held = (indexes >= 0) & (indexes < len(col.piece_of))
            pids = np.zeros(len(indexes), dtype=np.int64)
            pids[held] = col.piece_of[indexes[held]]
        if col is None or not pids.all():
            bad = indexes if col is None else indexes[pids == 0]
            raise SchemaError(
                f"sample {int(bad[0])} of partition {part.name!r} has no field {field!r} on this unit "
                f"(samples without it: {_named(bad)})"
            )
        pids, rows, per_sample = col.rows(indexes)  # a sample appends grew: its rows, in order
        value_of: np.ndarray | None = None  # a field shared by content: the value each sample holds
        if col.index is not None:
            pairs = pids * (1 << 32) + rows
            _, firsts, which = np.unique(pairs, return_index=True, return_inverse=True)
            order = np.argsort(firsts, kind="stable")  # values in the order their first sample comes
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            value_of, pick = rank[which.reshape(-1)], firsts[order]
            pids, rows = pids[pick], rows[pick]
        n = len(pids)
        key = np.empty(n, dtype=np.int64)
        start = np.empty(n, dtype=np.int64)
        size = np.empty(n, dtype=np.int64)
        crcs: np.ndarray | None = None
        sources: list[tuple[Piece, int]] = []
        layouts = set()
        first = int(pids[0])
        single = bool((pids == first).all())  # the common case: one write holds them all
        unique = [first] if single else np.flatnonzero(np.bincount(pids)).tolist()
        for pid in unique:
            piece = col.pieces[pid]
            sel = slice(None) if single else pids == pid
            r = rows[sel]
            key[sel] = piece.frame_of[r] + len(sources)
            start[sel] = piece.offsets[r]
            size[sel] = piece.sizes[r]
            if piece.crcs is not None:
                if crcs is None:
                    crcs = np.full(n, -1, dtype=np.int64)
                crcs[sel] = piece.crcs[r]
            sources.extend((piece, i) for i in range(len(piece.frames)))
            layouts.add(tuple(piece.spec.shape) if piece.shapes is None else None)
        spec = col.pieces[unique[0]].spec
        block = FieldBlock(name=field, spec=spec, counts=[], crcs=None if crcs is None else crcs.tolist(),
                           value_of=None if value_of is None else value_of.tolist(),
                           rows_per_sample=None if per_sample is None else per_sample.tolist())
        if spec.kind == "object":
            block.sizes = size.tolist()
        elif len(layouts) == 1 and (shape := next(iter(layouts))) is not None:
            block.spec = FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="dense", shape=shape)
        else:
            ndim = spec.ndim if spec.layout == "jagged" else len(spec.shape)
            shapes = np.empty((n, ndim), dtype=np.int64)
            for pid in unique:
                piece = col.pieces[pid]
                sel = slice(None) if single else pids == pid
                shapes[sel] = piece.shapes[rows[sel]] if piece.shapes is not None else piece.spec.shape
            block.spec = FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", ndim=ndim)
            block.shapes = shapes.reshape(-1).tolist()
        end = start + size
        brk = np.flatnonzero((key[1:] != key[:-1]) | (start[1:] != end[:-1])) + 1
        bounds = np.concatenate(([0], brk, [n])).tolist()
        runs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            piece, frame = sources[int(key[a])]
            runs.append((piece, frame, int(start[a]), int(end[b - 1]), b - a))
        return block, runs

    def _emit(
        self, runs: list[tuple[Piece, int, int, int, int]], out: ReadReply, held: dict[int, Region], shm: bool
    ) -> tuple[list[int], list[PackedType] | None]:
        """Turn runs into frames (or arena ranges); return samples per output frame and,
        where some runs are packed, each output frame's packed type (runs of different
        types are never joined)."""
        counts: list[int] = []
        packed: list[PackedType] = []
        small: list[Any] = []
        pending = [0, 0]  # samples, bytes in ``small``
        kind: list[PackedType] = [""]  # packed type of ``small``

        def flush() -> None:
            if not small:
                return
            if len(small) > 1:
                out.frames.append(b"".join(small))
                self.copied += pending[1]
            else:
                out.frames.append(small[0])
            if out.refs is not None:
                out.refs.append([])
            counts.append(pending[0])
            packed.append(kind[0])
            small.clear()
            pending[:] = [0, 0]

        for piece, frame, a, b, count in runs:
            base = piece.arena[frame]
            narrow = piece.packed[frame] if piece.packed else ""
            if narrow != kind[0]:
                flush()
                kind[0] = narrow
            if base >= 0 and shm:
                flush()
                assert out.refs is not None and piece.region is not None
                out.refs.append([base + a, b - a])
                held[piece.region.offset] = piece.region
                counts.append(count)
                packed.append(narrow)
                continue
            if base >= 0:
                view = self._arena_view(piece.region, base + a, b - a)
            else:
                view = piece.frames[frame][a:b]
            if b - a < SMALL_RUN:
                small.append(view)
                pending[0] += count
                pending[1] += b - a
                if pending[1] >= JOIN_LIMIT:
                    flush()
                continue
            flush()
            out.frames.append(view)
            if out.refs is not None:
                out.refs.append([])
            counts.append(count)
            packed.append(narrow)
        flush()
        return counts, packed if any(packed) else None

    def _arena_view(self, region: Region | None, offset: int, length: int) -> Any:
        """Arena bytes for a send: the region is held until ZeroMQ lets go of the buffer."""
        assert self.arena is not None and region is not None and self._release_soon is not None
        self.arena.incref(region)
        release = self._release_soon
        return self.arena.anchor(offset, length, lambda: release(region))
