"""Byte layout of a field block: how many bytes each sample has and where it sits.

Shared by storage units (which check what arrives) and clients (which read what comes
back). It needs numpy only, so servers start without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ._messages import FieldBlock, FieldSpec
from ._pack import PACKED, Narrowing, packable

# torch dtypes by name, with their item size, without importing torch.
TORCH_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}

def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a wire name, refusing object, structured and unknown dtypes."""
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"unknown numpy dtype {name!r}") from exc
    if dt.kind not in "biufcmM" or dt.fields is not None or dt.subdtype is not None:
        raise ProtocolError(f"numpy dtype {name!r} cannot travel as raw bytes")
    return dt

def itemsize(spec: FieldSpec) -> int:
    if spec.kind == "tensor":
        try:
            return TORCH_ITEMSIZE[spec.dtype]
        except KeyError:
            raise ProtocolError(f"unknown torch dtype {spec.dtype!r}") from None
    if spec.kind == "ndarray":
        return numpy_dtype(spec.dtype).itemsize
    if spec.kind == "object":
        return 1
    raise ProtocolError(f"unknown field kind {spec.kind!r}")

def check_spec(spec: FieldSpec) -> None:
    """Raise :class:`ProtocolError` unless ``spec`` describes something we can carry (its
    kind and layout are known names: decoding checked them)."""
    if spec.kind == "object" and spec.layout != "jagged":
        raise ProtocolError("object fields are jagged")
    itemsize(spec)
    if any(d < 0 for d in spec.shape) or spec.ndim < 0:
        raise ProtocolError(f"negative dimension in {spec}")

def int_dtype(spec: FieldSpec) -> np.dtype | None:
    """The numpy dtype of a packable integer field's values as readers get them, else None."""
    if spec.kind == "tensor":
        dt = np.dtype(spec.dtype) if spec.dtype in ("int16", "int32", "int64") else None
    elif spec.kind == "ndarray":
        dt = numpy_dtype(spec.dtype)
    else:
        dt = None
    return dt if dt is not None and packable(dt) else None

def packed_itemsizes(block: FieldBlock) -> np.ndarray | None:
    """Per frame, the item size its values travel in (``block.packed``, checked against the
    spec: narrower ints of an integer field); None when nothing is packed."""
    if block.packed is None:
        return None
    if len(block.packed) != len(block.counts):
        raise ProtocolError(
            f"field {block.name!r}: {len(block.packed)} packed types for {len(block.counts)} frame(s)"
        )
    wide = int_dtype(block.spec)
    if wide is None:
        raise ProtocolError(
            f"field {block.name!r}: {block.spec.kind} fields of dtype {block.spec.dtype!r} cannot be packed"
        )
    out = np.empty(len(block.packed), dtype=np.int64)
    for i, name in enumerate(block.packed):
        dt = PACKED.get(name) if name else wide
        if dt is None or dt.itemsize > wide.itemsize:
            raise ProtocolError(
                f"field {block.name!r}: frame {i} is packed as {name!r}, which is not a narrower "
                f"integer type than {block.spec.dtype!r}"
            )
        out[i] = dt.itemsize
    return out

def sample_sizes(block: FieldBlock) -> np.ndarray:
    """Bytes of each sample of ``block`` as it travels (int64), after checking the header is
    coherent; packed frames (``block.packed``) hold their samples' values narrower."""
    spec = block.spec
    check_spec(spec)
    if any(c < 0 for c in block.counts):
        raise ProtocolError(f"field {block.name!r}: negative sample count in a frame")
    n = sum(block.counts)
    packed = packed_itemsizes(block)
    items: int | np.ndarray = (
        itemsize(spec) if packed is None else np.repeat(packed, np.asarray(block.counts, dtype=np.int64))
    )
    if spec.kind == "object":
        if block.sizes is None or len(block.sizes) != n:
            raise ProtocolError(f"field {block.name!r}: object field needs {n} sample sizes")
        sizes = np.asarray(block.sizes, dtype=np.int64)
    elif spec.layout == "dense":  # dimensions were checked non-negative: so is every size
        row = math.prod(spec.shape) * itemsize(spec)
        if row >= 1 << 62:
            raise ProtocolError(f"field {block.name!r}: a sample of shape {list(spec.shape)} is {row} bytes")
        if packed is not None:
            return math.prod(spec.shape) * np.asarray(items)
        return np.full(n, row, dtype=np.int64)
    else:
        if block.shapes is None or len(block.shapes) != n * spec.ndim:
            raise ProtocolError(
                f"field {block.name!r}: jagged field needs {n} x {spec.ndim} shape entries"
            )
        shapes = np.asarray(block.shapes, dtype=np.int64).reshape(n, spec.ndim)
        sizes = np.prod(shapes, axis=1, dtype=np.int64) * items
    if n and sizes.min() < 0:
        raise ProtocolError(f"field {block.name!r}: negative sample size")
    return sizes

def frame_sizes(block: FieldBlock) -> list[int]:
    """Bytes of each frame of ``block`` (its samples back to back), from the header alone."""
    ends = np.concatenate(([0], np.cumsum(sample_sizes(block))))
    bounds = np.concatenate(([0], np.cumsum(np.asarray(block.counts, dtype=np.int64))))
    return (ends[bounds[1:]] - ends[bounds[:-1]]).tolist()

def split_lanes(sizes: Sequence[int], lanes: int) -> list[int]:
    """How many of the frames (in order) each of ``lanes`` parallel streams carries, the
    bytes as even as frame boundaries allow; lanes that would carry nothing are left out."""
    total = sum(sizes)
    counts, at, acc = [], 0, 0
    for i in range(1, lanes + 1):
        goal = total * i // lanes
        start = at
        while at < len(sizes) and (acc + sizes[at] <= goal or at == start or i == lanes):
            if i < lanes and acc >= goal:
                break
            acc += sizes[at]
            at += 1
        if at > start:
            counts.append(at - start)
    return counts

def frame_layout(block: FieldBlock, frames: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check ``frames`` against ``block``; return per-sample (frame index, offset, size)."""
    sizes = sample_sizes(block)
    if len(frames) != len(block.counts):
        raise ProtocolError(
            f"field {block.name!r}: header declares {len(block.counts)} frame(s), "
            f"{len(frames)} arrived"
        )
    if len(frames) == 1:  # the usual write: one frame per field, its samples back to back
        ends = np.cumsum(sizes)
        total = int(ends[-1]) if len(ends) else 0
        got = nbytes(frames[0])
        if got != total:
            raise ProtocolError(f"field {block.name!r}: frame 0 has {got} bytes, the header declares {total}")
        return np.zeros(len(sizes), dtype=np.int64), ends - sizes, sizes
    counts = np.asarray(block.counts, dtype=np.int64)
    frame_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    bounds = np.concatenate(([0], np.cumsum(counts)))
    frame_start = np.concatenate(([0], ends))[bounds[:-1]]
    frame_total = np.concatenate(([0], ends))[bounds[1:]] - frame_start
    for i, frame in enumerate(frames):
        got = nbytes(frame)
        if got != frame_total[i]:
            raise ProtocolError(
                f"field {block.name!r}: frame {i} has {got} bytes, the header declares "
                f"{int(frame_total[i])}"
            )
    offsets = starts - frame_start[frame_of] if len(frame_of) else starts
    return frame_of, offsets, sizes

def nbytes(frame: Any) -> int:
    if isinstance(frame, Narrowing):
        return frame.nbytes
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(buf).nbytes

def block_shapes(block: FieldBlock) -> np.ndarray:
    """Per-sample shapes ``[n, ndim]`` of a tensor block (dense blocks repeat their shape)."""
    n = sum(block.counts)
    if block.spec.layout == "dense":
        return np.tile(np.asarray(block.spec.shape, dtype=np.int64), (n, 1))
    return np.asarray(block.shapes or [], dtype=np.int64).reshape(n, block.spec.ndim)
