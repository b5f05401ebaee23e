"""Assembly, the mirror of encoding (tqueue/client/_encode.py): what storage units sent back
made into a :class:`~tqueue.client._batch.Batch`.

Each unit answers with field blocks and raw frames for the samples it holds (a
:class:`Part`, whichever route brought it). A dense field becomes one ``[B, ...]`` tensor:
with zero copies when one frame already holds the whole batch in order, or when the route
received the frames straight into the batch's rows, else with one copy into a pooled buffer.
A jagged field becomes per-sample views of the received frames (no copy), or on request one
padded tensor or one nested tensor (one copy). Object fields are decoded from MessagePack;
the tensor and array leaves of nested values (tqueue/client/_encode.py) are, by :func:`leaf`,
copied out of the frames, so they are writable and hold no frame or arena page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from .._memory import BufferPool
from .._threads import copy_bytes
from ..errors import InvalidArgumentError, ProtocolError
from ..wire import BatchMeta, FieldBlock, FieldSpec, _appends, _shared
from ..wire._layout import TORCH_ITEMSIZE, frame_layout, int_dtype, itemsize, nbytes, numpy_dtype, sample_sizes
from ..wire._messages import PackedType
from ..wire._pack import PACKED, widen, widen_all
from ._ask import Options
from ._batch import Batch
from ._encode import EXT_NDARRAY, EXT_TENSOR, LEAF_HEAD, MAX_DIMS, TORCH_DTYPES

_LEAF_DECODER = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...]])
_MAX_DIM = 1 << 62  # a larger dimension (in a leaf of no bytes) is no tensor torch can make


def leaf(code: int, data: memoryview) -> Any:
    """A tensor or array leaf of a nested object value, from its MessagePack extension (the
    decoder's ``ext_hook``): checked against its bytes before anything is allocated, then
    copied out of them."""
    if code not in (EXT_TENSOR, EXT_NDARRAY):
        raise ProtocolError(f"unknown MessagePack extension type {code} in an object value")
    if len(data) < LEAF_HEAD.size:
        raise ProtocolError(f"a tensor leaf of {len(data)} bytes has no header")
    (head,) = LEAF_HEAD.unpack_from(data)
    start = LEAF_HEAD.size + head
    if start > len(data):
        raise ProtocolError(f"a tensor leaf's header of {head} bytes overruns its {len(data)} bytes")
    try:
        dtype, shape = _LEAF_DECODER.decode(data[LEAF_HEAD.size : start])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"a tensor leaf's header is not [dtype, shape]: {exc}") from exc
    if len(shape) > MAX_DIMS or any(d < 0 or d >= _MAX_DIM for d in shape):
        raise ProtocolError(f"a tensor leaf of shape {list(shape)[:MAX_DIMS + 1]}: no such shape travels")
    if code == EXT_TENSOR:
        if dtype not in TORCH_DTYPES:
            raise ProtocolError(f"unknown torch dtype {dtype!r} in a tensor leaf")
        size = TORCH_ITEMSIZE[dtype]
    else:
        size = numpy_dtype(dtype).itemsize
    want = math.prod(shape) * size
    if want != len(data) - start:
        raise ProtocolError(
            f"a {dtype} leaf of shape {list(shape)} is {want} bytes; {len(data) - start} arrived"
        )
    if want == 0:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype]) if code == EXT_TENSOR else np.empty(shape, numpy_dtype(dtype))
    raw = np.frombuffer(data, np.uint8, offset=start).copy()
    if code == EXT_TENSOR:
        return torch.from_numpy(raw).view(TORCH_DTYPES[dtype]).view(shape)
    return raw.view(numpy_dtype(dtype)).reshape(shape)


_DECODER = msgspec.msgpack.Decoder(ext_hook=leaf)
_ARRAY32 = struct.Struct(">BI")  # MessagePack array 32 header


@dataclasses.dataclass
class Part:
    """One unit's answer: which batch positions it holds, its blocks and their frames."""

    positions: np.ndarray
    blocks: dict[str, tuple[FieldBlock, list[Any]]]
    wire: int = -1  # bytes received, where frames do not say (some were widened on arrival)
    widened: int = 0  # bytes written by widening packed frames on arrival
    unit: int = -1  # the unit it came from
    unchecked: list[str] = dataclasses.field(default_factory=list)  # dense packed fields checked once assembled


_INTS = {torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64"}
_TORCH = {name: t for t, name in _INTS.items()}
_INTEGER = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def _wanted(meta: BatchMeta, field: str, options: Options) -> str | None:
    """The integer dtype (a name) the reader asked ``field`` in (``Options.dtype``), checked."""
    want = (options.dtype or {}).get(field)
    if want is None:
        return None
    spec = meta.schema.get(field)
    if want not in _INTS:
        raise InvalidArgumentError(f"dtype= for field {field!r} is {want}: an integer dtype ({sorted(map(str, _INTS))})")
    if spec is None or spec.kind == "object" or spec.dtype not in _INTEGER:
        raise InvalidArgumentError(
            f"dtype= for field {field!r} of partition {meta.partition!r}: the field holds "
            f"{'objects' if spec is not None and spec.kind == 'object' else spec.dtype if spec else 'nothing'}, not integers"
        )
    return _INTS[want]


def narrowed(batch: Batch, options: Options) -> Batch:
    """``batch`` with the fields of ``options.dtype`` in those dtypes; a value that does not fit
    raises InvalidArgumentError naming its field, partition and sample."""
    if not options.dtype:
        return batch
    meta = batch.meta
    out: dict[str, Any] = {}
    for field in batch:
        name = _wanted(meta, field, options)
        value = batch[field]
        values = value if isinstance(value, list) else [value]
        if name is None or all(_dtype_of(v) == _TORCH[name] for v in values):
            continue
        info = torch.iinfo(_TORCH[name])
        for k, v in enumerate(values):
            t = torch.as_tensor(v)
            flat = t.values() if t.is_nested else t
            if not flat.numel() or (info.min <= int(flat.min()) and int(flat.max()) <= info.max):
                continue
            if isinstance(value, list):
                k = int(meta.indexes[k])
            elif not t.is_nested and t.dim() and t.shape[0] == len(meta.indexes):  # a row per sample
                rows = t.reshape(len(meta.indexes), -1)
                k = int(meta.indexes[int(torch.nonzero(((rows < info.min) | (rows > info.max)).any(1))[0, 0])])
            else:
                k = -1
            where = f"sample {k}" if k >= 0 else "a sample"
            raise InvalidArgumentError(
                f"field {field!r} of partition {meta.partition!r}: {where} holds a value outside {name} "
                f"[{info.min}, {info.max}]: read it in a wider dtype"
            )
        cast = [_cast(v, _TORCH[name]) for v in values]
        out[field] = cast if isinstance(value, list) else cast[0]
    return batch.replaced({f: out.get(f, batch[f]) for f in batch}) if out else batch


def _dtype_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value[:0]).dtype if value.dtype.kind in "iu" else None
    return None


def _cast(value: Any, want: torch.dtype) -> Any:
    if isinstance(value, np.ndarray):
        return value.astype(np.dtype(_INTS[want]))
    return value.to(want)


def expanded(part: Part) -> Part:
    """``part`` with each block of values shared by content (``value_of``) as one value per
    sample, each a view of the bytes that came once (tqueue/wire/_shared.py), and each block of
    samples appends grew (``rows_per_sample``) joined (tqueue/wire/_appends.py); what crossed
    is counted before."""
    if all(block.value_of is None and block.rows_per_sample is None for block, _ in part.blocks.values()):
        return part
    if part.wire < 0:
        part.wire = sum(nbytes(f) for _, frames in part.blocks.values() for f in frames)
    for name, (block, frames) in part.blocks.items():
        if block.value_of is not None:
            part.blocks[name] = _shared.expand(block, frames)
        elif block.rows_per_sample is not None:  # a sample appends grew: its rows joined, once
            part.blocks[name] = joined = _appends.joined(block, frames)
            part.widened += sum(nbytes(f) for f in joined[1])
    return part


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a batch's objects are decoded.

    Decoding thousands of dicts and strings allocates enough containers to set off a full
    collection, which walks every object of the process (about 100 ms in a trainer with
    torch loaded); the decoded values hold no cycles, so nothing is lost by waiting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass
class Pieces:
    """A field's bytes across units: per sample, which buffer, where, how big, what shape."""

    spec: FieldSpec
    positions: np.ndarray
    buffers: list[np.ndarray]
    buffer_of: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    shapes: np.ndarray | None
    counts: list[tuple[int, int]]  # per buffer: (first sample in positions order, count)
    packed: list[PackedType] = dataclasses.field(default_factory=list)  # per buffer (dense): "" or its narrow type


@dataclasses.dataclass(frozen=True)
class Tally:
    """A read's payload bytes: as the fields hold them (``logical``), as they crossed
    (``wire``, packed ones narrow) and copied in this process (``copied``)."""

    logical: int
    wire: int
    copied: int


def assemble(
    meta: BatchMeta,
    fields: Sequence[str],
    parts: Sequence[Part],
    options: Options,
    pool: BufferPool,
    rows: Mapping[str, np.ndarray] | None = None,
) -> tuple[Batch, Tally]:
    """The batch of ``fields`` from every unit's part, and its bytes.

    ``rows``: the dense fields' batch buffers that routes already received rows into."""
    rows = rows or {}
    received = logical = copied = 0
    for part in parts:
        for block, frames in part.blocks.values():
            got = [nbytes(f) for f in frames]
            received += sum(got) if part.wire < 0 else 0
            logical += sum(got) if not block.packed else _widened(block, got)
        received += max(part.wire, 0)
        copied += part.widened
    pads = pad_rows(meta)
    values: dict[str, Any] = {}
    lengths: dict[str, torch.Tensor] = {}
    with paused_gc():
        for field in fields:
            values[field], lens, n = assemble_field(meta, field, parts, options, pool, rows.get(field), pads)
            copied += n
            if lens is not None:
                lengths[field] = lens
    return Batch(meta, values, lengths, options), Tally(logical, received, copied)


def _widened(block: FieldBlock, sizes: list[int]) -> int:
    """Bytes of a block's frames (``sizes``) once packed ones are widened."""
    wide = int_dtype(block.spec)
    assert wide is not None and block.packed is not None  # checked when the batch was assembled
    return sum(n // PACKED[p].itemsize * wide.itemsize if p else n for p, n in zip(block.packed, sizes))


def assemble_field(
    meta: BatchMeta,
    field: str,
    parts: Sequence[Part],
    options: Options,
    pool: BufferPool,
    dest: np.ndarray | None = None,
    pads: np.ndarray | None = None,
) -> tuple[Any, torch.Tensor | None, int]:
    """One field's value for the batch, its per-sample lengths (jagged), bytes copied.

    ``dest``: the dense field's batch buffer, where some frames may already lie in place.
    ``pads``: the batch positions of pad rows (computed from the meta when not given)."""
    options.check()
    size = len(meta.indexes)
    spec = meta.schema[field]
    want = _wanted(meta, field, options)
    narrow = _packed_as(field, parts) if want is not None and spec.layout == "jagged" else None
    if narrow is not None and PACKED[narrow].itemsize <= _TORCH[want].itemsize:  # type: ignore[index]
        spec = msgspec.structs.replace(spec, dtype=narrow)  # read at the width it is held in: not widened
    else:
        narrow = None
    pieces = _gather(field, spec, parts, narrow)
    if spec.kind == "object":
        return _objects(pieces, size, pool), None, 0
    if pads is None:
        pads = pad_rows(meta)
    if spec.layout == "dense":
        value, n = _dense(pieces, size, pool, dest)
        if len(pads):
            value[torch.from_numpy(pads) if isinstance(value, torch.Tensor) else pads] = 0
        return value, None, n
    return _jagged(field, pieces, size, options, pool, pads)


def pad_rows(meta: BatchMeta) -> np.ndarray:
    """Batch positions of the pad rows of ``meta`` (index -1)."""
    if not meta.indexes:
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.asarray(meta.indexes, dtype=np.int64) < 0)


def dense_frames(
    field: str,
    block: FieldBlock,
    frames: list[Any],
    seen: int,
    buffers: list[np.ndarray],
    packed: list[PackedType],
    counts: list[tuple[int, int]],
) -> int:
    """Add a dense block's frames (checked against its header) to a field's pieces, its
    samples numbered from ``seen``; returns the number after them."""
    items = sample_sizes(block)  # checks ``packed``; bytes per sample of each frame
    at = 0
    for i, (frame, c) in enumerate(zip(frames, block.counts)):
        buf = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
        want = int(items[at]) * c if c else 0
        if buf.nbytes != want:
            raise ProtocolError(
                f"field {field!r}: frame {i} has {buf.nbytes} bytes, the header declares {want}"
            )
        buffers.append(buf)
        packed.append(block.packed[i] if block.packed else "")
        counts.append((seen, c))
        seen += c
        at += c
    if len(frames) != len(block.counts):
        raise ProtocolError(
            f"field {field!r}: header declares {len(block.counts)} frame(s), {len(frames)} arrived"
        )
    return seen


def _packed_as(field: str, parts: Sequence[Part]) -> str | None:
    """The one type every frame of ``field`` is packed in, across the parts (None: another case)."""
    kinds = {k for part in parts for k in (part.blocks[field][0].packed or [""])}
    return kinds.pop() if len(kinds) == 1 and "" not in kinds else None


def _gather(field: str, spec: FieldSpec, parts: Sequence[Part], narrow: str | None = None) -> Pieces:
    """A field's pieces across the parts. For a dense field only frames and positions (what
    :func:`_dense` reads); per-sample offsets, sizes and shapes otherwise. ``narrow``: every
    block's frames are packed at that width, which ``spec`` reads them in (nothing widened)."""
    positions, buffer_of, offsets, sizes, shapes = [], [], [], [], []
    buffers: list[np.ndarray] = []
    counts: list[tuple[int, int]] = []
    packed: list[PackedType] = []
    seen = 0
    dense_only = spec.kind != "object" and spec.layout == "dense"
    for part in parts:
        block, frames = part.blocks[field]
        if narrow is not None:
            block = msgspec.structs.replace(block, spec=msgspec.structs.replace(block.spec, dtype=narrow), packed=None)
        if block.spec.kind != spec.kind or block.spec.dtype != spec.dtype:
            raise ProtocolError(f"field {field!r}: a unit sent {block.spec}, the meta says {spec}")
        if dense_only and block.spec.layout == "dense" and tuple(block.spec.shape) == tuple(spec.shape):
            # a dense field is copied (or viewed) frame by frame: no per-sample layout needed
            # (a block kept jagged, of samples that all have the field's shape, takes the
            # general path below; _dense reads the same buffers, counts and positions)
            seen = dense_frames(field, block, frames, seen, buffers, packed, counts)
            positions.append(part.positions)
            continue
        if block.packed is not None:
            block, frames = unpack(block, frames)
        frame_of, offs, szs = frame_layout(block, frames)
        base = len(buffers)
        at = seen
        for frame, c in zip(frames, block.counts):
            buffers.append(np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8))
            counts.append((at, c))
            packed.append("")  # wide by now: one entry per buffer, as _dense zips them
            at += c
        positions.append(part.positions)
        buffer_of.append(frame_of + base)
        offsets.append(offs)
        sizes.append(szs)
        if spec.kind != "object":
            n = sum(block.counts)
            if block.spec.layout == "dense":
                shapes.append(np.tile(np.asarray(block.spec.shape, dtype=np.int64), (n, 1)))
            else:
                shapes.append(np.asarray(block.shapes, dtype=np.int64).reshape(n, block.spec.ndim))
        seen = at
    def cat(arrays: list[np.ndarray], width: int = 0) -> np.ndarray:
        if arrays:
            return np.concatenate(arrays)
        return np.zeros((0, width) if width else 0, dtype=np.int64)

    ndim = len(spec.shape) if spec.layout == "dense" else spec.ndim
    return Pieces(
        spec=spec,
        positions=cat(positions),
        buffers=buffers,
        buffer_of=cat(buffer_of),
        offsets=cat(offsets),
        sizes=cat(sizes),
        shapes=cat(shapes, ndim) if spec.kind != "object" else None,
        counts=counts,
        packed=packed,
    )


def unpack(block: FieldBlock, frames: Sequence[Any]) -> tuple[FieldBlock, list[Any]]:
    """``block``'s frames with packed values widened to the field's dtype (new buffers),
    and the block that describes them; for layouts :func:`_dense` does not widen in place."""
    frame_layout(block, frames)  # raises unless the header (with ``packed``) and the frames agree
    wide = int_dtype(block.spec)
    assert wide is not None  # frame_layout checked: only integer fields are packed
    out: list[Any] = []
    for name, frame in zip(block.packed or (), frames):
        buf = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
        if name:
            narrow = buf.view(PACKED[name])
            full = np.empty(len(narrow), wide)
            widen(full, narrow)
            buf = full.view(np.uint8)
        out.append(buf)
    # the same block but for ``packed`` (values shared by content, a sample's rows, checksums kept)
    return msgspec.structs.replace(block, packed=None), out


def _objects(p: Pieces, size: int, pool: BufferPool | None = None) -> list[Any]:
    """Decode object values: each run of samples that lie back to back in one buffer is
    read as one MessagePack array (one call, not one per sample)."""
    out: list[Any] = [None] * size
    n = len(p.positions)
    if n == 0:
        return out
    bo, off, sz = p.buffer_of, p.offsets, p.sizes
    brk = np.flatnonzero((bo[1:] != bo[:-1]) | (off[1:] != off[:-1] + sz[:-1])) + 1
    bounds = [0, *brk.tolist(), n]
    pos = p.positions.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        buf = p.buffers[int(bo[a])]
        start, end = int(off[a]), int(off[b - 1] + sz[b - 1])
        try:
            if b - a == 1:
                values = [_DECODER.decode(buf[start:end])]
            else:
                # a pooled buffer: already-mapped memory copies 4x faster than fresh pages
                packed = pool.take(5 + end - start) if pool is not None else np.empty(5 + end - start, np.uint8)
                packed[:5] = np.frombuffer(_ARRAY32.pack(0xDD, b - a), dtype=np.uint8)
                packed[5:] = buf[start:end]
                values = _DECODER.decode(packed)
        except (msgspec.DecodeError, ProtocolError, RecursionError):  # one by one, to name the sample
            values = None
        if values is None or len(values) != b - a:
            values = _one_by_one(p, pos, a, b)
        if np.all(np.diff(p.positions[a:b]) == 1):  # consecutive batch positions: one slice
            out[pos[a] : pos[a] + b - a] = values
            continue
        for k, v in zip(range(a, b), values):
            out[pos[k]] = v
    return out


def _one_by_one(p: Pieces, pos: list[int], a: int, b: int) -> list[Any]:
    """Each sample decoded alone, to name the one that is not valid MessagePack."""
    values = []
    for k in range(a, b):
        buf, off, n = p.buffers[int(p.buffer_of[k])], int(p.offsets[k]), int(p.sizes[k])
        try:
            values.append(_DECODER.decode(buf[off : off + n]))
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"object value for batch position {pos[k]} is not valid MessagePack") from exc
        except RecursionError:
            raise ProtocolError(
                f"object value for batch position {pos[k]} nests lists and maps too deep to decode"
            ) from None
        except ProtocolError as exc:
            raise ProtocolError(f"object value for batch position {pos[k]}: {exc}") from exc
    return values


def _empty(spec: FieldSpec, shape: tuple[int, ...]) -> Any:
    if spec.kind == "tensor":
        return torch.empty(shape, dtype=TORCH_DTYPES[spec.dtype])
    return np.empty(shape, dtype=numpy_dtype(spec.dtype))


def _zeros(spec: FieldSpec, shape: tuple[int, ...]) -> Any:
    if spec.kind == "tensor":
        return torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype])
    return np.zeros(shape, dtype=numpy_dtype(spec.dtype))


def _from_bytes(spec: FieldSpec, raw: np.ndarray, shape: tuple[int, ...]) -> Any:
    """A tensor or array over ``raw`` bytes without copying."""
    if spec.kind == "tensor":
        return torch.from_numpy(raw).view(TORCH_DTYPES[spec.dtype]).view(shape)
    return raw.view(numpy_dtype(spec.dtype)).reshape(shape)


def _dense(p: Pieces, size: int, pool: BufferPool, raw: np.ndarray | None = None) -> tuple[Any, int]:
    """Packed buffers are widened into the rows in the pass that would copy them."""
    row = tuple(p.spec.shape)
    elems = int(np.prod(row, dtype=np.int64))
    row_bytes = elems * itemsize(p.spec)
    shape = (size, *row)
    if row_bytes * size == 0:
        return _empty(p.spec, shape), 0
    plain = not any(p.packed)
    if plain and len(p.buffers) == 1 and np.array_equal(p.positions, np.arange(size)):
        return _from_bytes(p.spec, p.buffers[0], shape), 0
    if raw is None or raw.nbytes != size * row_bytes:
        raw = pool.take(size * row_bytes)
    base = raw.ctypes.data
    rows = raw.reshape(size, row_bytes)
    wide = None if plain else int_dtype(p.spec)
    widening: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, packed values), done together
    copied = 0
    wide_frames: list[PackedType] = [""] * len(p.buffers)
    for buf, narrow, (first, c) in zip(p.buffers, p.packed or wide_frames, p.counts):
        if c == 0:
            continue
        pos = p.positions[first : first + c]
        if pos[-1] - pos[0] == c - 1 and (c == 1 or np.all(np.diff(pos) == 1)):
            dst = raw[pos[0] * row_bytes : (pos[0] + c) * row_bytes]
            if narrow:
                assert wide is not None
                widening.append((dst.view(wide), buf.view(PACKED[narrow])))
            elif buf.ctypes.data == base + int(pos[0]) * row_bytes:
                continue  # received in place
            else:
                copy_bytes(dst, buf.reshape(-1))
        elif narrow:
            assert wide is not None
            raw.view(wide).reshape(size, elems)[pos] = buf.view(PACKED[narrow]).reshape(c, elems)
        else:
            rows[pos] = buf.reshape(c, row_bytes)
        copied += c * row_bytes
    widen_all(widening)
    return _from_bytes(p.spec, raw, shape), copied


def _jagged(
    field: str, p: Pieces, size: int, options: Options, pool: BufferPool, pads: np.ndarray
) -> tuple[Any, torch.Tensor | None, int]:
    assert p.shapes is not None
    shapes = np.zeros((size, p.shapes.shape[1]), dtype=np.int64)
    shapes[p.positions] = p.shapes
    if len(pads) and len(p.shapes):  # pad rows: no rows, the trailing dims of a real sample
        shapes[pads, 1:] = p.shapes[0, 1:]
    lengths = torch.from_numpy(shapes[:, 0].copy()) if shapes.shape[1] else None
    mode = options.mode(field)
    if mode == "list" or shapes.shape[1] == 0:
        views = _views(p, size, shapes)
        if shapes.shape[1] == 0 and mode != "list":
            return _stack(p.spec, views), None, size * itemsize(p.spec)
        return views, lengths, 0
    trail = shapes[:, 1:]
    if size and not np.all(trail == trail[0]):
        raise InvalidArgumentError(
            f"field {field!r}: samples differ beyond their first dimension "
            f"(e.g. {tuple(shapes[0])} and {tuple(shapes[np.flatnonzero(np.any(trail != trail[0], axis=1))[0]])}); "
            f"only jagged='list' can hold them"
        )
    if mode == "padded":
        out, n = _padded(p, shapes, size, options, pool)
        return out, lengths, n
    if p.spec.kind != "tensor":
        raise InvalidArgumentError(f"field {field!r} holds numpy arrays; jagged='nested' needs tensors")
    views = _views(p, size, shapes)
    total = int(shapes[:, 0].sum())
    nbytes = int(p.sizes.sum())
    values = _from_bytes(p.spec, pool.take(nbytes), (total, *(int(d) for d in trail[0]))) if size else _empty(p.spec, (0,))
    if views:
        torch.cat(views, out=values)
    offsets = torch.zeros(size + 1, dtype=torch.int64)
    torch.cumsum(torch.from_numpy(shapes[:, 0]), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets), lengths, nbytes


def _views(p: Pieces, size: int, shapes: np.ndarray) -> list[Any]:
    out: list[Any] = [None] * size
    if size > len(p.positions):  # pad rows: zero-filled, no rows of their own
        out = [_zeros(p.spec, tuple(row)) for row in shapes.tolist()]
    assert p.shapes is not None
    for k, (pos, buf, off, n) in enumerate(
        zip(p.positions.tolist(), p.buffer_of.tolist(), p.offsets.tolist(), p.sizes.tolist())
    ):
        shape = tuple(p.shapes[k].tolist())
        if n == 0:
            out[pos] = _empty(p.spec, shape)
        else:
            out[pos] = _from_bytes(p.spec, p.buffers[buf][off : off + n], shape)
    return out


def _stack(spec: FieldSpec, views: list[Any]) -> Any:
    if spec.kind == "tensor":
        return torch.stack(views) if views else _empty(spec, (0,))
    return np.stack(views) if views else _empty(spec, (0,))


def _padded(p: Pieces, shapes: np.ndarray, size: int, options: Options, pool: BufferPool) -> tuple[Any, int]:
    longest = int(shapes[:, 0].max()) if size else 0
    trail = tuple(int(d) for d in shapes[0, 1:]) if size else ()
    step = int(np.prod(trail, dtype=np.int64)) * itemsize(p.spec)
    raw = pool.take(size * longest * step)
    out = _from_bytes(p.spec, raw, (size, longest, *trail))
    if isinstance(out, torch.Tensor):
        out.fill_(options.pad_value)
    else:
        out.fill(options.pad_value)
    if size * longest * step == 0:
        return out, 0
    dest = torch.from_numpy(raw).view(size, longest * step)
    left = options.padding_side == "left"
    copied = 0
    for pos, buf, off, n in zip(p.positions.tolist(), p.buffer_of.tolist(), p.offsets.tolist(), p.sizes.tolist()):
        if n:
            at = longest * step - n if left else 0
            dest[pos, at : at + n].copy_(torch.from_numpy(p.buffers[buf][off : off + n]))
            copied += n
    return out, copied


