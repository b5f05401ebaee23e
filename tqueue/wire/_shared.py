"""Values shared by content (``create_partition(dedup=[...])``): a field block that carries
each distinct value once, with the value each sample holds (``FieldBlock.value_of``).

A writer shrinks a block of such a field before it sends it (:func:`shrink`): values with
the same xxh3-64 digest, size and shape are compared byte for byte, and only those equal go
once. A unit stores each value once and points every sample holding it there (and at a value
it already stores for the partition: tqueue/storage/_store.py); a reply it sends carries each
value once per batch, and the reader expands it (:func:`expand`) into one value per sample,
each a view of the bytes that came (nothing is copied). Needs numpy and xxhash only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import ProtocolError
from ._layout import block_shapes, frame_layout
from ._messages import FieldBlock


def digest(data: memoryview) -> int:
    """The hash that tells which values may be equal; equal digests are then compared byte for
    byte (a test replaces this to force collisions)."""
    return xxhash.xxh3_64_intdigest(data)


def samples(block: FieldBlock) -> int:
    """How many samples ``block`` describes (its values or rows, for a block without
    ``value_of`` and ``rows_per_sample``)."""
    if block.rows_per_sample is not None:
        return len(block.rows_per_sample)
    return len(block.value_of) if block.value_of is not None else sum(block.counts)


def value_of(block: FieldBlock) -> np.ndarray | None:
    """``block.value_of`` as int64, checked: every entry names one of the block's values and
    every value is held by some sample; None for a block without it."""
    if block.value_of is None:
        return None
    values = sum(block.counts)
    held = np.asarray(block.value_of, dtype=np.int64)
    if len(held) and (int(held.min()) < 0 or int(held.max()) >= values):
        raise ProtocolError(f"field {block.name!r}: value_of names values outside the block's {values}")
    if values and (len(held) == 0 or not np.bincount(held, minlength=values).all()):
        raise ProtocolError(f"field {block.name!r}: the block carries values no sample holds")
    return held


def _views(frames: Sequence[Any]) -> list[memoryview]:
    return [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]


def equal(a: memoryview, b: memoryview) -> bool:
    """Byte for byte (the check behind every digest match)."""
    return len(a) == len(b) and np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


def shrink(block: FieldBlock, frames: Sequence[Any]) -> tuple[FieldBlock, list[Any], int]:
    """``block`` with each distinct value once and ``value_of``, its frames slices of
    ``frames`` (no copy), and the bytes left out. A block with no two equal values keeps its
    frames (with ``value_of`` naming each sample's own)."""
    frame_of, offsets, sizes = frame_layout(block, frames)
    n = len(sizes)
    views = _views(frames)
    shapes = block_shapes(block) if block.spec.kind != "object" else None
    seen: dict[tuple[int, int, tuple[int, ...]], list[int]] = {}
    own: list[int] = []  # the first sample of each value
    held = np.empty(n, dtype=np.int64)
    data = [views[int(f)][int(o) : int(o) + int(z)] for f, o, z in zip(frame_of, offsets, sizes)]
    for i in range(n):
        key = (digest(data[i]), int(sizes[i]), tuple(shapes[i].tolist()) if shapes is not None else ())
        candidates = seen.setdefault(key, [])
        match = next((v for v in candidates if equal(data[own[v]], data[i])), -1)
        if match < 0:
            match = len(own)
            own.append(i)
            candidates.append(match)
        held[i] = match
    if len(own) == n:
        out = FieldBlock(name=block.name, spec=block.spec, counts=list(block.counts), shapes=block.shapes,
                         sizes=block.sizes, packed=block.packed, crcs=block.crcs, value_of=held.tolist())
        return out, list(frames), 0
    pick = np.asarray(own, dtype=np.int64)
    out_frames, counts, packed = _runs(views, frame_of[pick], offsets[pick], sizes[pick], block.packed)
    out = FieldBlock(name=block.name, spec=block.spec, counts=counts, packed=packed, value_of=held.tolist())
    _take_rows(block, out, pick, shapes)
    return out, out_frames, int(sizes.sum() - sizes[pick].sum())


def expand(block: FieldBlock, frames: Sequence[Any]) -> tuple[FieldBlock, list[Any]]:
    """A block with ``value_of`` as one value per sample: each sample's bytes a view of its
    value's (nothing is copied); runs of samples back to back in one frame stay one frame."""
    held = value_of(block)
    if held is None:
        return block, list(frames)
    frame_of, offsets, sizes = frame_layout(block, frames)
    out_frames, counts, packed = _runs(_views(frames), frame_of[held], offsets[held], sizes[held], block.packed)
    out = FieldBlock(name=block.name, spec=block.spec, counts=counts, packed=packed)
    _take_rows(block, out, held, block_shapes(block) if block.spec.kind != "object" else None)
    return out, out_frames


def _take_rows(block: FieldBlock, out: FieldBlock, rows: np.ndarray, shapes: np.ndarray | None) -> None:
    """``out``'s per-sample header entries: ``block``'s of ``rows``."""
    if block.sizes is not None:
        out.sizes = np.asarray(block.sizes, dtype=np.int64)[rows].tolist()
    if block.shapes is not None and shapes is not None and block.spec.layout == "jagged":
        out.shapes = shapes[rows].reshape(-1).tolist()
    if block.crcs is not None:
        out.crcs = np.asarray(block.crcs, dtype=np.int64)[rows].tolist()


def _runs(
    views: list[memoryview], frame_of: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, packed: Sequence[Any] | None
) -> tuple[list[Any], list[int], list[Any] | None]:
    """Frames for samples laid out at (frame, offset, size), in order: one slice per stretch
    of them back to back in one frame; their counts and packed types."""
    n = len(sizes)
    if n == 0:
        return [], [], [] if packed is not None else None
    ends = offsets + sizes
    brk = np.flatnonzero((frame_of[1:] != frame_of[:-1]) | (offsets[1:] != ends[:-1])) + 1
    bounds = [0, *brk.tolist(), n]
    frames, counts, kinds = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        f = int(frame_of[a])
        frames.append(views[f][int(offsets[a]) : int(ends[b - 1])])
        counts.append(b - a)
        if packed is not None:
            kinds.append(packed[f])
    return frames, counts, kinds if packed is not None else None
