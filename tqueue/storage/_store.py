"""Columnar payload store of a storage unit, free of IO.

Received frames are kept as they arrived: a write becomes, per field, a *piece* that holds
the frames and, per sample, which frame and which byte range. Reads slice those frames
(memoryviews, no copy) and coalesce consecutive samples into one range. Only tiny runs,
which ZeroMQ would copy anyway, are joined into one frame.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import numpy as np

from .._layout import block_shapes, frame_layout, nbytes
from .._wire import FieldBlock, FieldSpec
from ..errors import InvalidArgumentError, ProtocolError, SchemaError

# Runs below this size are joined into one frame: ZeroMQ copies frames this small anyway.
SMALL_RUN = 1 << 16
JOIN_LIMIT = 4 << 20


class Piece:
    __slots__ = ("spec", "frames", "frame_of", "offsets", "sizes", "shapes", "live", "nbytes")

    def __init__(self, block: FieldBlock, frames: Sequence[Any]) -> None:
        self.frame_of, self.offsets, self.sizes = frame_layout(block, frames)
        self.spec = block.spec
        self.frames = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        self.shapes = None if block.spec.kind == "object" or block.spec.layout == "dense" else (
            block_shapes(block)
        )
        self.live = len(self.sizes)
        self.nbytes = sum(nbytes(f) for f in frames)


class Column:
    def __init__(self) -> None:
        self.piece_of = np.full(0, -1, dtype=np.int64)
        self.row_of = np.zeros(0, dtype=np.int64)
        self.pieces: dict[int, Piece] = {}

    def ensure(self, size: int) -> None:
        if size <= len(self.piece_of):
            return
        cap = max(size, 2 * len(self.piece_of), 1024)
        piece_of = np.full(cap, -1, dtype=np.int64)
        piece_of[: len(self.piece_of)] = self.piece_of
        row_of = np.zeros(cap, dtype=np.int64)
        row_of[: len(self.row_of)] = self.row_of
        self.piece_of, self.row_of = piece_of, row_of


class PartitionData:
    def __init__(self, uid: int, name: str) -> None:
        self.uid = uid
        self.name = name
        self.columns: dict[str, Column] = {}
        self.nbytes = 0


class Store:
    """All partitions held by one unit."""

    def __init__(self) -> None:
        self.partitions: dict[int, PartitionData] = {}
        self.nbytes = 0
        self.copied = 0
        self._piece_ids = itertools.count()

    def write(
        self,
        uid: int,
        name: str,
        indexes: np.ndarray,
        blocks: Sequence[FieldBlock],
        frames: Sequence[Any],
    ) -> Callable[[], None]:
        """Install a write; return the function that undoes it (if the commit fails)."""
        if uid <= 0:
            raise ProtocolError(f"bad partition uid {uid}")
        if len(indexes) and indexes.min() < 0:
            raise ProtocolError("negative sample index")
        if len(np.unique(indexes)) != len(indexes):
            raise InvalidArgumentError(f"partition {name!r}: a sample is written twice in one call")
        pieces = []
        at = 0
        for block in blocks:
            if sum(block.counts) != len(indexes):
                raise ProtocolError(
                    f"field {block.name!r}: {sum(block.counts)} samples in the block, "
                    f"{len(indexes)} in the write"
                )
            take = frames[at : at + len(block.counts)]
            if len(take) != len(block.counts):
                raise ProtocolError(
                    f"field {block.name!r}: header declares {len(block.counts)} frame(s), "
                    f"{len(take)} arrived"
                )
            pieces.append((block.name, Piece(block, take)))
            at += len(block.counts)
        if at != len(frames):
            raise ProtocolError(f"{len(frames) - at} frame(s) beyond what the header declares")
        part = self.partitions.get(uid)
        if part is None:
            part = self.partitions[uid] = PartitionData(uid, name)
        undo = [self._install(part, field, piece, indexes) for field, piece in pieces]

        def rollback() -> None:
            if self.partitions.get(uid) is not part:
                return  # dropped meanwhile: its bytes are already gone and accounted
            for step in reversed(undo):
                step()
            if not any(col.pieces for col in part.columns.values()):
                del self.partitions[uid]

        return rollback

    def _install(
        self, part: PartitionData, field: str, piece: Piece, indexes: np.ndarray
    ) -> Callable[[], None]:
        col = part.columns.get(field)
        if col is None:
            col = part.columns[field] = Column()
        col.ensure(int(indexes.max()) + 1 if len(indexes) else 0)
        pid = next(self._piece_ids)
        col.pieces[pid] = piece
        old_pieces = col.piece_of[indexes].copy()
        old_rows = col.row_of[indexes].copy()
        col.piece_of[indexes] = pid
        col.row_of[indexes] = np.arange(len(indexes))
        self._account(part, piece.nbytes)
        released = self._release(part, col, old_pieces)

        def undo() -> None:
            col.piece_of[indexes] = old_pieces
            col.row_of[indexes] = old_rows
            for old_pid, old_piece, count in released:
                col.pieces[old_pid] = old_piece
                old_piece.live += count
                if old_piece.live == count:
                    self._account(part, old_piece.nbytes)
            del col.pieces[pid]
            self._account(part, -piece.nbytes)

        return undo

    def _release(
        self, part: PartitionData, col: Column, old_pieces: np.ndarray
    ) -> list[tuple[int, Piece, int]]:
        """Drop samples' references to the pieces they were overwritten from."""
        released = []
        ids, counts = np.unique(old_pieces[old_pieces >= 0], return_counts=True)
        for old_pid, count in zip(ids.tolist(), counts.tolist()):
            old = col.pieces[old_pid]
            old.live -= count
            released.append((old_pid, old, count))
            if old.live == 0:
                del col.pieces[old_pid]
                self._account(part, -old.nbytes)
        return released

    def _account(self, part: PartitionData, delta: int) -> None:
        part.nbytes += delta
        self.nbytes += delta

    def drop(self, uid: int) -> int:
        part = self.partitions.pop(uid, None)
        if part is None:
            return 0
        self.nbytes -= part.nbytes
        return part.nbytes

    def read(
        self, uid: int, name: str, indexes: np.ndarray, fields: Sequence[str]
    ) -> tuple[list[FieldBlock], list[Any]]:
        """Blocks and frames for ``fields`` of ``indexes``, in the order asked."""
        part = self.partitions.get(uid)
        if part is None:
            raise SchemaError(f"partition {name!r} has no data on this unit")
        blocks: list[FieldBlock] = []
        frames: list[Any] = []
        for field in fields:
            block, out = self._read_field(part, field, indexes)
            blocks.append(block)
            frames.extend(out)
        return blocks, frames

    def _read_field(
        self, part: PartitionData, field: str, indexes: np.ndarray
    ) -> tuple[FieldBlock, list[Any]]:
        col = part.columns.get(field)
        if len(indexes) == 0:
            raise InvalidArgumentError("a read needs at least one sample")
        if col is not None:
            col.ensure(int(indexes.max()) + 1)
            pids = col.piece_of[indexes]
        if col is None or (pids < 0).any():
            bad = indexes[0] if col is None else indexes[pids < 0][0]
            raise SchemaError(
                f"sample {int(bad)} of partition {part.name!r} has no field {field!r} on this unit"
            )
        rows = col.row_of[indexes]
        n = len(indexes)
        key = np.empty(n, dtype=np.int64)
        start = np.empty(n, dtype=np.int64)
        size = np.empty(n, dtype=np.int64)
        views: dict[int, Any] = {}
        shapes: np.ndarray | None = None
        dense_shapes = set()
        first: Piece | None = None
        for pid in np.unique(pids).tolist():
            piece = col.pieces[pid]
            first = first or piece
            sel = pids == pid
            r = rows[sel]
            base = len(views)
            for i, frame in enumerate(piece.frames):
                views[base + i] = frame
            key[sel] = piece.frame_of[r] + base
            start[sel] = piece.offsets[r]
            size[sel] = piece.sizes[r]
            if piece.spec.kind != "object":
                if piece.shapes is None:
                    dense_shapes.add(tuple(piece.spec.shape))
                else:
                    dense_shapes.add(None)
        assert first is not None
        spec = first.spec
        block_shapes_out: list[int] | None = None
        sizes_out: list[int] | None = None
        if spec.kind == "object":
            sizes_out = size.tolist()
        elif len(dense_shapes) == 1 and None not in dense_shapes:
            spec = FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="dense", shape=next(iter(dense_shapes)))
        else:
            ndim = spec.ndim if spec.layout == "jagged" else len(spec.shape)
            shapes = np.empty((n, ndim), dtype=np.int64)
            for pid in np.unique(pids).tolist():
                piece = col.pieces[pid]
                sel = pids == pid
                shapes[sel] = piece.shapes[rows[sel]] if piece.shapes is not None else piece.spec.shape
            spec = FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", ndim=ndim)
            block_shapes_out = shapes.reshape(-1).tolist()
        counts, out = self._runs(key, start, size, views)
        return FieldBlock(name=field, spec=spec, counts=counts, shapes=block_shapes_out, sizes=sizes_out), out

    def _runs(
        self, key: np.ndarray, start: np.ndarray, size: np.ndarray, views: dict[int, Any]
    ) -> tuple[list[int], list[Any]]:
        """Coalesce consecutive byte ranges into frames; join tiny neighbours."""
        if len(key) == 0:
            return [], []
        end = start + size
        brk = np.flatnonzero((key[1:] != key[:-1]) | (start[1:] != end[:-1])) + 1
        bounds = np.concatenate(([0], brk, [len(key)])).tolist()
        counts: list[int] = []
        out: list[Any] = []
        small: list[Any] = []
        pending = [0, 0]  # samples, bytes in ``small``

        def flush() -> None:
            if not small:
                return
            if len(small) > 1:
                out.append(b"".join(small))
                self.copied += pending[1]
            else:
                out.append(small[0])
            counts.append(pending[0])
            small.clear()
            pending[:] = [0, 0]

        for a, b in zip(bounds[:-1], bounds[1:]):
            view = views[int(key[a])][int(start[a]) : int(end[b - 1])]
            if len(view) < SMALL_RUN:
                small.append(view)
                pending[0] += b - a
                pending[1] += len(view)
                if pending[1] >= JOIN_LIMIT:
                    flush()
                continue
            flush()
            out.append(view)
            counts.append(b - a)
        flush()
        return counts, out
