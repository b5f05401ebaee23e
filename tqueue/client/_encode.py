"""Turn what a producer passes to ``put`` into field blocks and zero-copy buffers.

Accepted per field: a tensor or numpy array whose first dimension is the sample axis
(dense), a list of per-sample tensors or arrays (jagged: shapes may differ), or a list of
plain values (object: str, bytes, int, float, bool, None, and lists/dicts of these). An
object value may also hold tensors and arrays as leaves (a nested value, :func:`tree`).
Everything is checked before anything is sent; a value the wire cannot carry is a
:class:`~tqueue.errors.FieldTypeError` naming field, partition, sample and type.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from ..errors import FieldTypeError, InvalidArgumentError, SchemaError
from ..wire import FieldBlock, FieldSpec, _shared
from ..wire._layout import TORCH_ITEMSIZE, block_shapes, int_dtype
from ..wire._messages import FieldKind, PackedType
from ..wire._pack import MIN_BYTES, PACKED, PROBE, Narrowing, guess, narrow, packable, width_of

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in TORCH_ITEMSIZE if hasattr(torch, name)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}

# A sample at least this big gets a frame of its own, sent without copying.
OWN_FRAME = 1 << 16

_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})
_KEYS = frozenset({str, int})
_ENCODER = msgspec.msgpack.Encoder()

# Nested values: an object value whose lists and dicts hold tensors or arrays (an image's
# ``{"pixel_values": ..., "image_grid_thw": ...}``) stays an object value, the same
# per-sample bytes, so every route, unit and checkpoint carries it unchanged. Each tensor
# or array leaf is a MessagePack extension (EXT_TENSOR, EXT_NDARRAY) whose data is the byte
# count of a MessagePack ``[dtype, shape]`` header (LEAF_HEAD), that header, then the leaf's
# raw bytes; readers get them back through the decoder's extension hook (client/_assemble.py).
# Values without such leaves keep their plain encoding; only values with them are walked.
MAX_NESTING = 100  # lists and dicts an object value may have around one another (FieldTypeError past it)
MAX_DEPTH = 8  # lists and dicts a nested value may have around one another
MAX_DIMS = 64  # dimensions of a leaf (torch's own limit)
EXT_TENSOR = 1
EXT_NDARRAY = 2
LEAF_HEAD = struct.Struct("<H")


@dataclasses.dataclass
class Encoded:
    count: int
    blocks: list[FieldBlock]
    buffers: list[Any]
    nbytes: int = 0
    copied: int = 0
    # per block, the field's bytes as one buffer where they are contiguous (dense fields):
    # the same-host path copies that in one go instead of frame by frame
    whole: list[Any] = dataclasses.field(default_factory=list)
    # some buffers are Narrowing frames (pack(defer=True)): only a bulk stream can send them
    deferred: bool = False
    # CUDA devices whose copies to the host encode() waits for before it returns
    cuda_devices: set[Any] = dataclasses.field(default_factory=set)
    # encode(defer_device=True): block index -> a dense CUDA field still on its device, whose
    # frames (and ``whole``) are None until materialize() copies it to the host; the arena
    # route copies it straight into the unit's pages instead
    on_device: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    defer_device: bool = False
    # bytes of values shared by content that :func:`share` left out (sent once, held by more samples)
    shared: int = 0

    def materialize(self) -> None:
        """Copy the fields still on a device to pinned host memory (as encode does without
        ``defer_device``), so that every frame is host bytes; nothing to do when none is."""
        if not self.on_device:
            return
        starts = np.cumsum([0] + [len(b.counts) for b in self.blocks])
        try:
            for i, t in self.on_device.items():
                buf = memoryview(_from_cuda(t, self).reshape(-1).view(torch.uint8).numpy())
                frames: list[Any] = []
                _chunks(buf, self.count, _NO_CHUNK, frames, self.blocks[i].counts)
                self.buffers[starts[i] : starts[i + 1]] = frames
                self.whole[i] = buf
        finally:
            for device in self.cuda_devices:
                torch.cuda.current_stream(device).synchronize()
        self.on_device = {}

    def grant_blocks(self) -> list[FieldBlock]:
        """The blocks as the controller needs them: specs and each sample's shape, not frame layout."""
        return [FieldBlock(name=b.name, spec=b.spec, counts=[], shapes=_sample_shapes(b)) for b in self.blocks]


def _sample_shapes(block: FieldBlock) -> list[int] | None:
    """A block's per-sample shapes (a block of values shared by content lists its values')."""
    if block.value_of is None or block.shapes is None or block.spec.layout != "jagged":
        return block.shapes
    return block_shapes(block)[np.asarray(block.value_of, dtype=np.int64)].reshape(-1).tolist()


def share(enc: Encoded, fields: Collection[str]) -> None:
    """Send each distinct value of ``fields`` (shared by content) once: their blocks get
    ``value_of`` and only the frames of their first samples (slices, no copy)."""
    todo = [i for i, b in enumerate(enc.blocks) if b.name in fields and b.value_of is None]
    if not todo:
        return
    if any(i in enc.on_device for i in todo):
        enc.materialize()
    starts = np.cumsum([0] + [len(b.counts) for b in enc.blocks]).tolist()
    buffers: list[Any] = []
    for i, block in enumerate(enc.blocks):
        frames = enc.buffers[starts[i] : starts[i + 1]]
        if i in todo:
            enc.blocks[i], frames, left = _shared.shrink(block, frames)
            if left:
                enc.whole[i] = None  # the values sent are no longer the field's bytes in one buffer
                enc.nbytes -= left
                enc.shared += left
        buffers.extend(frames)
    enc.buffers = buffers


def join(partition: str, encs: Sequence[Encoded]) -> Encoded:
    """One put of several encoded puts of the same fields and specs, their samples in order:
    each field's frames one after the other (no byte is copied; every frame keeps its own
    layout, as a put's chunks do)."""
    first = encs[0]
    blocks: list[FieldBlock] = []
    buffers: list[Any] = []
    starts = [np.cumsum([0] + [len(b.counts) for b in e.blocks]).tolist() for e in encs]
    for i, block in enumerate(first.blocks):
        parts = [e.blocks[i] for e in encs]
        if any(p.name != block.name or p.spec != block.spec for p in parts):
            raise SchemaError(f"field {block.name!r} of partition {partition!r}: puts of other fields or specs cannot go as one")
        packed: list[PackedType] | None = None
        if any(p.packed is not None for p in parts):
            wide: list[PackedType] = [""]
            packed = [k for p in parts for k in (p.packed if p.packed is not None else wide * len(p.counts))]
        blocks.append(
            FieldBlock(
                name=block.name,
                spec=block.spec,
                counts=[c for p in parts for c in p.counts],
                shapes=None if block.shapes is None else [d for p in parts for d in p.shapes or ()],
                sizes=None if block.sizes is None else [z for p in parts for z in p.sizes or ()],
                packed=packed,
                crcs=[c for p in parts for c in p.crcs or ()] if all(p.crcs is not None for p in parts) else None,
            )
        )
        for e, at in zip(encs, starts):
            buffers.extend(e.buffers[at[i] : at[i + 1]])
    return Encoded(
        count=sum(e.count for e in encs),
        blocks=blocks,
        buffers=buffers,
        nbytes=sum(e.nbytes for e in encs),
        copied=sum(e.copied for e in encs),
        whole=[None] * len(blocks),
        deferred=any(e.deferred for e in encs),
    )


class _Ctx:
    def __init__(self, partition: str, field: str) -> None:
        self.partition = partition
        self.field = field

    def where(self, sample: int | None = None) -> str:
        at = f"field {self.field!r} of partition {self.partition!r}"
        return at if sample is None else f"sample {sample} of {at}"


def columns(data: Any, partition: str) -> dict[str, Any]:
    """Column form of ``data``: a mapping of field to per-sample values, or a list of rows."""
    if isinstance(data, Mapping):
        return {_field_name(k, partition): v for k, v in data.items()}
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, Mapping) for r in data):
        names: dict[str, None] = {}
        for row in data:
            names.update(dict.fromkeys(row))
        cols: dict[str, Any] = {}
        for name in names:
            values = []
            for i, row in enumerate(data):
                if name not in row:
                    raise SchemaError(
                        f"field {name!r} is missing from sample {i} of the put to partition "
                        f"{partition!r} (present in other samples)"
                    )
                values.append(row[name])
            cols[_field_name(name, partition)] = values
        return cols
    raise FieldTypeError(
        f"put to partition {partition!r} takes a mapping of field name to per-sample values "
        f"or a list of per-sample mappings; got {type(data).__name__}"
    )


def _field_name(name: Any, partition: str) -> str:
    if not isinstance(name, str) or not name:
        raise FieldTypeError(f"field names are non-empty strings; got {name!r} in partition {partition!r}")
    return name


def sample_count(data: Any, partition: str) -> tuple[dict[str, Any], int]:
    """Column form of ``data`` and its number of samples, checked to agree across fields."""
    cols = columns(data, partition)
    if not cols:
        raise InvalidArgumentError(f"put to partition {partition!r} has no fields")
    counts = {name: _count(value, _Ctx(partition, name)) for name, value in cols.items()}
    distinct = set(counts.values())
    if len(distinct) > 1:
        raise SchemaError(
            f"fields of one write to partition {partition!r} have different sample counts: "
            + ", ".join(f"{k!r}: {v}" for k, v in counts.items())
        )
    n = distinct.pop()
    if n == 0:
        raise InvalidArgumentError(f"put to partition {partition!r} has no samples")
    return cols, n


def encode(
    data: Any, *, partition: str, chunk_bytes: int, count: int | None = None, defer_device: bool = False
) -> Encoded:
    """``data`` as blocks and frames. ``defer_device``: dense CUDA fields stay on their device
    until :meth:`Encoded.materialize` (or the arena route) copies them."""
    cols, n = sample_count(data, partition)
    if count is not None and n != count:
        raise SchemaError(
            f"the write to partition {partition!r} has {n} samples, its meta has {count}"
        )
    out = Encoded(count=n, blocks=[], buffers=[], defer_device=defer_device)
    try:
        for name, value in cols.items():
            _encode_field(value, _Ctx(partition, name), chunk_bytes, out)
    finally:
        for device in out.cuda_devices:  # copies to the host queued by _from_cuda
            torch.cuda.current_stream(device).synchronize()
    return out


def _count(value: Any, ctx: _Ctx) -> int:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return value.size(0)
        if value.dim() == 0:
            raise SchemaError(
                f"{ctx.where()} is a 0-d tensor; a field needs a sample dimension "
                f"(put per-sample scalars as a tensor of shape [N])"
            )
        return value.shape[0]
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise SchemaError(f"{ctx.where()} is a 0-d array; a field needs a sample dimension")
        return value.shape[0]
    if isinstance(value, (list, tuple)):
        return len(value)
    raise FieldTypeError(
        f"{ctx.where()}: expected per-sample values (a tensor or array with a sample "
        f"dimension, or a list), got {type(value).__name__}"
    )


def _encode_field(value: Any, ctx: _Ctx, chunk: int, out: Encoded) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            _jagged(list(value.unbind()), ctx, chunk, out, "tensor")
        elif out.defer_device and value.device.type == "cuda":
            _dense_on_device(value, ctx, chunk, out)
        else:
            _dense(*_tensor_bytes(value, ctx, None, out), ctx, chunk, out, "tensor")
    elif isinstance(value, np.ndarray):
        if value.dtype.kind in "OUS":
            _objects(value.tolist(), ctx, chunk, out)
        else:
            _dense(*_array_bytes(value, ctx), ctx, chunk, out, "ndarray")
    elif value and all(isinstance(v, torch.Tensor) for v in value):
        _jagged(value, ctx, chunk, out, "tensor")
    elif value and all(isinstance(v, np.ndarray) and v.dtype.kind not in "OUS" for v in value):
        _jagged(value, ctx, chunk, out, "ndarray")
    else:
        _objects(value, ctx, chunk, out)


def _tensor_bytes(
    t: torch.Tensor, ctx: _Ctx, sample: int | None = None, out: Encoded | None = None
) -> tuple[memoryview, str, tuple[int, ...], int]:
    """The raw bytes of ``t`` (no copy when it is a contiguous CPU tensor), dtype, shape, copies.

    A CUDA tensor's bytes are copied to the host without waiting (see :func:`_from_cuda`):
    they are there once :func:`encode` returns, or, without ``out``, at once."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout != torch.strided:
        raise FieldTypeError(
            f"{ctx.where(sample)}: tensors of dtype {t.dtype} and layout {t.layout} cannot travel"
        )
    copied = 0
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cuda":
        t = _from_cuda(t, out)
        copied += nbytes
    elif t.device.type != "cpu":
        t = t.cpu()
        copied += nbytes
    t, passes = _plain_layout(t)
    copied += passes * nbytes
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()), name, tuple(t.shape), copied


_unpinned = False  # pinned memory was refused once: this process copies with .cpu()


def _from_cuda(t: torch.Tensor, out: Encoded | None) -> torch.Tensor:
    """``t`` copied into pinned host memory, queued on its device's current stream.

    ``.cpu()`` copies into fresh pageable memory: 2 GB/s on an H100 host, where a copy
    into pinned memory runs at 54 GB/s (benchmarks/cuda.py). torch caches freed pinned
    blocks, so a producer's next put reuses them. The layout is made contiguous on the
    device first (one copy in device memory, then one crossing). ``out`` collects the
    devices to wait for before any byte is read; without it this waits here. Where pinned
    memory cannot be had (a memlock limit, a driver that refuses), ``.cpu()`` it is."""
    global _unpinned
    t, _ = _plain_layout(t)  # in device memory: not a host copy
    if not _unpinned:
        try:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError as exc:
            _unpinned = True
            log.warning("no pinned host memory (%s); CUDA tensors are copied to pageable memory, more slowly", exc)
        else:
            host.copy_(t, non_blocking=True)
            if out is None:
                torch.cuda.current_stream(t.device).synchronize()
            else:
                out.cuda_devices.add(t.device)
            return host
    return t.cpu()


def _plain_layout(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` with no conjugate or negative bit, contiguous; and how many copies that made."""
    passes = 0
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
        passes += 1
    if not t.is_contiguous():
        t = t.contiguous()
        passes += 1
    return t, passes


def _array_bytes(
    a: np.ndarray, ctx: _Ctx, sample: int | None = None, out: Encoded | None = None
) -> tuple[memoryview, str, tuple[int, ...], int]:
    if a.dtype.kind not in "biufcmM" or a.dtype.fields is not None:
        raise FieldTypeError(f"{ctx.where(sample)}: numpy arrays of dtype {a.dtype} cannot travel")
    copied = 0
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
        copied += a.nbytes
    return memoryview(a.reshape(-1).view(np.uint8)), a.dtype.str, tuple(a.shape), copied


def _dense(buf: memoryview, dtype: str, shape: tuple[int, ...], copied: int, ctx: _Ctx, chunk: int, out: Encoded, kind: FieldKind) -> None:
    spec = FieldSpec(kind=kind, dtype=dtype, layout="dense", shape=shape[1:])
    out.blocks.append(FieldBlock(name=ctx.field, spec=spec, counts=_chunks(buf, shape[0], chunk, out.buffers)))
    out.whole.append(buf)
    out.nbytes += buf.nbytes
    out.copied += copied


def _dense_on_device(t: torch.Tensor, ctx: _Ctx, chunk: int, out: Encoded) -> None:
    """A dense CUDA field left on its device: its block and frame count now, its bytes later."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout != torch.strided:
        raise FieldTypeError(f"{ctx.where()}: tensors of dtype {t.dtype} and layout {t.layout} cannot travel")
    t, passes = _plain_layout(t.detach())  # in device memory: not a host copy
    nbytes = t.numel() * t.element_size()
    spec = FieldSpec(kind="tensor", dtype=name, layout="dense", shape=tuple(t.shape[1:]))
    runs = _row_runs(t.shape[0], nbytes // t.shape[0] if t.shape[0] else 0, chunk)
    out.on_device[len(out.blocks)] = t
    out.blocks.append(FieldBlock(name=ctx.field, spec=spec, counts=[b - a for a, b in runs]))
    out.buffers.extend([None] * len(runs))
    out.whole.append(None)
    out.nbytes += nbytes
    out.copied += nbytes  # it crosses to the host once, whichever way


def _row_runs(n: int, row_bytes: int, chunk: int) -> list[tuple[int, int]]:
    """``n`` rows of ``row_bytes`` cut into runs ``[a, b)`` of at most ``chunk`` bytes (at
    least one row each): the frames of a dense field."""
    per = max(1, chunk // row_bytes) if row_bytes else n
    return [(a, min(n, a + per)) for a in range(0, n, per)]


_NO_CHUNK = 0  # _chunks with ``counts`` given: the rows per frame are known


def _chunks(buf: memoryview, n: int, chunk: int, into: list[Any], counts: list[int] | None = None) -> list[int]:
    """Cut the ``n`` equal rows of ``buf`` into frames of at most ``chunk`` bytes (or of
    ``counts`` rows each), appended to ``into``; returns the rows in each."""
    row_bytes = buf.nbytes // n if n else 0
    if counts is None:
        runs = _row_runs(n, row_bytes, chunk)
    else:
        ends = np.cumsum(counts).tolist()
        runs = list(zip([0, *ends[:-1]], ends))
    into.extend(buf[a * row_bytes : b * row_bytes] for a, b in runs)
    return [b - a for a, b in runs]


def pack(
    enc: Encoded, chunk: int, take: Callable[[int], np.ndarray] | None = None, *, defer: bool = False,
    dense: bool = True, one_width: bool = False,
) -> Encoded:
    """``enc`` with each integer field whose values all fit a narrower type
    sent in that type (tqueue/wire/_pack.py): for writes that cross a socket, where fewer bytes
    cost less than the pass that narrows them. ``enc`` itself where nothing narrows.
    ``take(nbytes)``: where big narrow buffers come from (the client's pool).

    ``defer``: big fields become :class:`~tqueue.wire._pack.Narrowing` frames in the type their
    first values fit, narrowed and checked only as a bulk stream sends them (which raises
    :class:`~tqueue.transport._bulk.FrameRefused` where the guess was wrong: pack again without ``defer``).
    ``dense`` false: dense fields stay wide (the same-host arena's readers view them in place;
    a jagged field's readers copy it anyway to pad or pack its samples). ``one_width``: each
    jagged field goes at one width (an arena range holds a field as one frame)."""
    out = Encoded(count=enc.count, blocks=[], buffers=[], copied=enc.copied)
    at = 0
    for block, whole in zip(enc.blocks, enc.whole):
        frames = enc.buffers[at : at + len(block.counts)]
        at += len(block.counts)
        if whole is None and block.spec.layout == "jagged" and _jagged_ints(block, frames, take, out, one_width):
            continue
        wide = int_dtype(block.spec) if whole is not None and dense else None
        values = np.frombuffer(whole, dtype=wide) if wide is not None else None
        if defer and values is not None and _deferred(values, block, enc.count, chunk, out):
            continue
        narrowed = narrow(values, take) if values is not None else None
        if narrowed is None:
            out.blocks.append(block)
            out.buffers.extend(frames)
            out.whole.append(whole)
            out.nbytes += sum(memoryview(f).nbytes for f in frames)
            continue
        packed, name = narrowed
        buf = memoryview(packed.view(np.uint8))
        counts = _chunks(buf, enc.count, chunk, out.buffers)
        out.blocks.append(
            FieldBlock(name=block.name, spec=block.spec, counts=counts, packed=[name] * len(counts), crcs=block.crcs)
        )
        out.whole.append(buf)
        out.nbytes += buf.nbytes
        out.copied += buf.nbytes  # the narrow values were written once: a copy
    return out if out.copied > enc.copied else enc


def _jagged_ints(
    block: FieldBlock, frames: Sequence[Any], take: Callable[[int], np.ndarray] | None, out: Encoded, one_width: bool,
) -> bool:
    """Append a jagged integer field's frames to ``out``, each one whose values all fit a
    narrower type in that type (a frame holds whole samples: each sample travels at one
    width), or with ``one_width`` all of them in the type every value fits; False,
    appending nothing, where nothing narrows."""
    wide = int_dtype(block.spec)
    if wide is None or block.packed is not None or not all(isinstance(f, (bytes, memoryview)) for f in frames):
        return False  # (frames still on a device are not narrowed here)
    frames = [memoryview(f) for f in frames]
    if any(f.nbytes % wide.itemsize for f in frames):
        return False
    values = [np.frombuffer(f, dtype=wide) for f in frames]
    if one_width:
        name = width_of(values) if sum(v.nbytes for v in values) >= MIN_BYTES else ""
        if not name:
            return False
        narrowed: list[tuple[np.ndarray, PackedType] | None] = [(v.astype(PACKED[name]), name) for v in values]
    else:
        narrowed = [narrow(v, take) for v in values]
    if not any(narrowed):
        return False
    packed: list[PackedType] = []
    for frame, got in zip(frames, narrowed):
        width: PackedType = ""
        if got is None:
            buf = frame
        else:
            buf, width = memoryview(got[0].view(np.uint8)), got[1]
            out.copied += buf.nbytes  # the narrow values were written once: a copy
        out.buffers.append(buf)
        out.nbytes += buf.nbytes
        packed.append(width)
    out.blocks.append(msgspec.structs.replace(block, packed=packed))
    out.whole.append(None)
    return True


def _deferred(values: np.ndarray, block: FieldBlock, n: int, chunk: int, out: Encoded) -> bool:
    """Append ``values`` (a dense field of ``n`` rows) to ``out`` as frames narrowed when
    sent, if it is big and its first values fit a narrower type; False otherwise."""
    if len(values) <= PROBE or not packable(values.dtype):
        return False
    name = guess(values)
    if not name:
        return False
    dtype = PACKED[name]
    per_row = len(values) // n
    runs = _row_runs(n, per_row * dtype.itemsize, chunk)
    out.buffers.extend(Narrowing(values[a * per_row : b * per_row], dtype) for a, b in runs)
    counts = [b - a for a, b in runs]
    out.deferred = True
    out.blocks.append(
        FieldBlock(name=block.name, spec=block.spec, counts=counts, packed=[name] * len(counts), crcs=block.crcs)
    )
    out.whole.append(None)
    nbytes = len(values) * dtype.itemsize
    out.nbytes += nbytes
    out.copied += nbytes  # written once, into a cached buffer the stream sends from
    return True


def _jagged(values: Sequence[Any], ctx: _Ctx, chunk: int, out: Encoded, kind: FieldKind) -> None:
    grab: Callable[..., tuple[memoryview, str, tuple[int, ...], int]] = (
        _tensor_bytes if kind == "tensor" else _array_bytes
    )
    shapes: list[int] = []
    bufs = []
    dtype0, ndim0 = None, None
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor if kind == "tensor" else np.ndarray):
            raise FieldTypeError(f"{ctx.where(i)} is a {type(v).__name__}; the other samples are {kind}s")
        buf, dtype, shape, copied = grab(v, ctx, i, out)
        if dtype0 is None:
            dtype0, ndim0 = dtype, len(shape)
        elif dtype != dtype0:
            raise SchemaError(f"{ctx.where(i)} has dtype {dtype}; sample 0 has {dtype0}")
        elif len(shape) != ndim0:
            raise SchemaError(
                f"{ctx.where(i)} has {len(shape)} dimensions {shape}; sample 0 has {ndim0}"
            )
        shapes.extend(shape)
        bufs.append(buf)
        out.copied += copied
    counts = _pack(bufs, chunk, out)
    spec = FieldSpec(kind=kind, dtype=dtype0 or "", layout="jagged", ndim=ndim0 or 0)
    out.blocks.append(FieldBlock(name=ctx.field, spec=spec, counts=counts, shapes=shapes))
    out.whole.append(None)


def _pack(bufs: Sequence[memoryview], chunk: int, out: Encoded) -> list[int]:
    """Frames for per-sample buffers: big ones alone (no copy), small ones joined."""
    counts: list[int] = []
    small: list[memoryview] = []
    small_bytes = 0

    def flush() -> None:
        nonlocal small_bytes
        if small:
            out.buffers.append(b"".join(small) if len(small) > 1 else small[0])
            out.copied += small_bytes if len(small) > 1 else 0
            counts.append(len(small))
            small.clear()
            small_bytes = 0

    for buf in bufs:
        out.nbytes += buf.nbytes
        if buf.nbytes >= OWN_FRAME:
            flush()
            out.buffers.append(buf)
            counts.append(1)
            continue
        small.append(buf)
        small_bytes += buf.nbytes
        if small_bytes >= chunk:
            flush()
    flush()
    return counts


def _objects(values: Sequence[Any], ctx: _Ctx, chunk: int, out: Encoded) -> None:
    sizes: list[int] = []
    counts: list[int] = []
    buf = bytearray()
    in_buf = 0
    for i, v in enumerate(values):
        try:
            odd = _not_plain(v)
        except _TooDeep:
            raise FieldTypeError(
                f"{ctx.where(i)}: lists and dicts nested deeper than {MAX_NESTING}; an object value may nest at "
                f"most {MAX_NESTING} deep"
            ) from None
        if odd is not None:
            v = tree(v, ctx, i, out)  # tensor or array leaves; raises for anything else
        before = len(buf)
        try:
            _ENCODER.encode_into(v, buf, -1)
        except OverflowError as exc:
            raise FieldTypeError(f"{ctx.where(i)}: {exc} (integers must fit in 64 bits)") from exc
        sizes.append(len(buf) - before)
        in_buf += 1
        if len(buf) >= chunk:
            out.buffers.append(buf)
            counts.append(in_buf)
            buf, in_buf = bytearray(), 0
    if in_buf:
        out.buffers.append(buf)
        counts.append(in_buf)
    spec = FieldSpec(kind="object", layout="jagged")
    out.blocks.append(FieldBlock(name=ctx.field, spec=spec, counts=counts, sizes=sizes))
    out.whole.append(None)
    out.nbytes += sum(sizes)
    out.copied += sum(sizes)


class _TooDeep(Exception):
    """A plain value nested past MAX_NESTING (turned into the field's FieldTypeError)."""


def _not_plain(v: Any, depth: int = 0) -> type | None:
    """The first type in ``v`` that is not a plain value, or None. Scalars inside lists and
    dicts are checked inline: metadata dicts of scalars are the common case. Raises
    :class:`_TooDeep` for lists and dicts nested past :data:`MAX_NESTING`."""
    t = type(v)
    if t in _PLAIN:
        return None
    if depth == MAX_NESTING and (t is list or t is dict):
        raise _TooDeep
    if t is list:
        for x in v:
            if type(x) not in _PLAIN:
                bad = _not_plain(x, depth + 1)
                if bad is not None:
                    return bad
        return None
    if t is dict:
        for k, x in v.items():
            if type(k) not in _KEYS:
                return type(k)
            if type(x) not in _PLAIN:
                bad = _not_plain(x, depth + 1)
                if bad is not None:
                    return bad
        return None
    return t


def tree(v: Any, ctx: _Ctx, sample: int, out: Encoded, path: tuple[Any, ...] = ()) -> Any:
    """``v`` (a sample's value, or the part of it at ``path``) with each tensor and array
    leaf made a MessagePack extension (its bytes copied into it, counted in ``out.copied``,
    before they are copied once more with the sample's MessagePack); a
    :class:`FieldTypeError` names the field, sample and path of anything else that is not a
    plain value, and of lists or dicts nested past :data:`MAX_DEPTH`."""
    t = type(v)
    if t in _PLAIN:
        return v
    if t is list or t is dict:
        if len(path) == MAX_DEPTH:
            raise FieldTypeError(
                f"{ctx.where(sample)} nests lists and dicts deeper than {MAX_DEPTH}{_at(path)}; "
                f"a value that holds tensors or arrays may nest at most {MAX_DEPTH} deep"
            )
        if t is list:
            return [x if type(x) in _PLAIN else tree(x, ctx, sample, out, (*path, k)) for k, x in enumerate(v)]
        items = {}
        for k, x in v.items():
            if type(k) not in _KEYS:
                raise FieldTypeError(
                    f"{ctx.where(sample)} has a key of type {_qualname(type(k))}{_at(path)}; "
                    f"dict keys are str or int"
                )
            items[k] = x if type(x) in _PLAIN else tree(x, ctx, sample, out, (*path, k))
        return items
    if isinstance(v, torch.Tensor):
        if v.is_nested or v.layout != torch.strided or v.dtype not in DTYPE_NAMES:
            raise FieldTypeError(
                f"{ctx.where(sample)} holds a tensor of dtype {v.dtype} and layout {v.layout}"
                f"{_at(path)}, which cannot travel"
            )
        buf, dtype, shape, copied = _tensor_bytes(v, ctx, sample)  # a CUDA tensor: copied here
        out.copied += copied + buf.nbytes
        return _leaf(EXT_TENSOR, dtype, shape, buf, ctx, sample, path)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biufcmM" or v.dtype.fields is not None:
            raise FieldTypeError(
                f"{ctx.where(sample)} holds a numpy array of dtype {v.dtype}{_at(path)}, "
                f"which cannot travel (numeric and datetime arrays can)"
            )
        buf, dtype, shape, copied = _array_bytes(v, ctx, sample)
        out.copied += copied + buf.nbytes
        return _leaf(EXT_NDARRAY, dtype, shape, buf, ctx, sample, path)
    raise FieldTypeError(
        f"{ctx.where(sample)} holds a value of type {_qualname(t)}{_at(path)}, which the "
        f"wire cannot carry; plain values are str, bytes, int, float, bool, None and lists/dicts "
        f"of these, with tensors and numpy arrays as leaves"
    )


def _leaf(
    code: int, dtype: str, shape: tuple[int, ...], raw: memoryview, ctx: _Ctx, sample: int, path: tuple[Any, ...]
) -> msgspec.msgpack.Ext:
    head = _ENCODER.encode((dtype, shape))
    at = LEAF_HEAD.size + len(head)
    if at + raw.nbytes >= 1 << 32:
        raise FieldTypeError(
            f"{ctx.where(sample)} holds a leaf of {raw.nbytes} bytes{_at(path)}; the leaves of a "
            f"nested value are under 4 GiB each (put it as a field of its own)"
        )
    return msgspec.msgpack.Ext(code, b"".join((LEAF_HEAD.pack(len(head)), head, raw)))


def _at(path: tuple[Any, ...]) -> str:
    """Where in a sample's value: `` at ['pixel_values'][2]``, nothing for the value itself."""
    return " at " + "".join(f"[{k!r}]" for k in path) if path else ""


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"
