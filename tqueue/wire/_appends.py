"""Samples grown by appends (``Store.append``): a unit keeps each appended run of rows as it
came and sends a sample as its rows (``FieldBlock.rows_per_sample``); the reader checks each
row's CRC-32C and joins them (:func:`joined`), once, into the sample's value. Needs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ._layout import block_shapes, frame_layout, int_dtype
from ._messages import FieldBlock, FieldSpec, PackedType
from ._pack import PACKED


def rows_per_sample(block: FieldBlock) -> np.ndarray | None:
    """``block.rows_per_sample`` as int64, checked against the block's rows; None without it."""
    if block.rows_per_sample is None:
        return None
    per = np.asarray(block.rows_per_sample, dtype=np.int64)
    if len(per) and int(per.min()) < 1 or int(per.sum()) != sum(block.counts):
        raise ProtocolError(
            f"field {block.name!r}: rows_per_sample lists {int(per.sum())} rows, the block carries {sum(block.counts)}"
        )
    return per


def joined(block: FieldBlock, frames: Sequence[Any]) -> tuple[FieldBlock, list[Any]]:
    """A block of samples made of rows as one value per sample, back to back in one new
    buffer (packed integers stay narrow where every row has one width; else widened)."""
    per = rows_per_sample(block)
    if per is None:
        return block, list(frames)
    frame_of, offsets, sizes = frame_layout(block, frames)
    views = [np.frombuffer(f.buffer if hasattr(f, "buffer") else f, dtype=np.uint8) for f in frames]
    kinds: set[PackedType] = set(block.packed or [""])
    wide = int_dtype(block.spec) if len(kinds) > 1 else None
    rows = []
    for f, o, z in zip(frame_of.tolist(), offsets.tolist(), sizes.tolist()):
        row = views[f][o : o + z]
        narrow: PackedType = block.packed[f] if block.packed else ""
        if wide is not None and narrow:
            row = np.frombuffer(row, dtype=PACKED[narrow]).astype(wide).view(np.uint8)
        rows.append(row)
    shapes = block_shapes(block)
    ends = np.cumsum(per)
    starts = ends - per
    if len(shapes) and shapes.shape[1] == 0:
        raise ProtocolError(f"field {block.name!r}: rows of zero-dimensional values cannot be joined")
    tails = shapes[:, 1:]
    if len(tails) and not all((tails[a:b] == tails[a]).all() for a, b in zip(starts.tolist(), ends.tolist())):
        raise ProtocolError(f"field {block.name!r}: a sample's rows differ past dim 0")
    joined_shapes = tails[starts].copy() if len(starts) else tails
    lengths = np.add.reduceat(shapes[:, 0], starts) if len(starts) else np.zeros(0, np.int64)
    out_shapes = np.concatenate([lengths[:, None], joined_shapes], axis=1)
    data = np.concatenate(rows) if rows else np.zeros(0, np.uint8)
    spec = block.spec
    if spec.layout == "dense":
        spec = FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", ndim=len(spec.shape))
    one: PackedType = next(iter(kinds)) if len(kinds) == 1 else ""
    out = FieldBlock(name=block.name, spec=spec, counts=[len(per)], shapes=out_shapes.reshape(-1).tolist(),
                     packed=[one] if one else None)
    return out, [memoryview(data)]
