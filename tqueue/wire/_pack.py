"""Integer fields travel and are stored in the narrowest type their values fit.

RL batches are mostly int64 tensors whose values are small: token ids below the vocabulary
size (int32), attention masks of 0 and 1 (int8), position ids below the sequence length
(int16), routed experts below 256 (uint8). A producer's client checks each integer field of a
write (a dense one whole, a jagged one frame by frame: a frame holds whole samples) and, where
all its values fit a narrower type (int8, uint8 for values from 0 to 255, int16, int32), sends
that instead (:func:`narrow`); the unit stores the
narrow bytes as they came, and a reader's client widens them back into the batch's tensor
of the field's own dtype (:func:`widen`), in the pass that would have copied them anyway.
Readers see exactly the values and dtype that were put. The wire marks it per frame
(``FieldBlock.packed``), so one field may hold writes of different widths.

Fewer bytes cross every socket and sit in every unit: the realistic batch of
benchmarks/workload.py shrinks from 133 KB to 54 KB a sample. The check and the narrowing are
one pass over the field (``tqueue.wire._native_pack``, native/pack.c; numpy where it is not
built). ``ClientConfig.pack_ints`` (``TQUEUE_PACK_INTS=0``) turns it off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .._threads import on_two_threads, worth_splitting
from ._messages import PackedType

try:
    import tqueue.wire._native_pack as _native_pack
except ImportError:  # no compiler at install time, or the build failed: numpy
    _native_pack = None

# the types a field may be packed into, narrowest first
PACKED: dict[PackedType, np.dtype] = {
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
}
MIN_BYTES = 4096  # smaller fields are not worth a check
PROBE = 1 << 16  # values looked at to guess the width before the one-pass narrowing


def packable(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` can be packed: native-order signed ints of 2-8 bytes
    (what they are packed into may be unsigned: uint8)."""
    return dtype.kind == "i" and dtype.itemsize > 1 and dtype.isnative


_BOUNDS = [(name, dt.itemsize, int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for name, dt in PACKED.items()]


def _width_for(lo: int, hi: int, itemsize: int) -> PackedType:
    """The narrowest packed type holding ``[lo, hi]`` below ``itemsize``, or ""."""
    for name, size, least, most in _BOUNDS:
        if size >= itemsize:
            break
        if least <= lo and hi <= most:
            return name
    return ""


def narrow(values: np.ndarray, take: Callable[[int], np.ndarray] | None = None) -> tuple[np.ndarray, PackedType] | None:
    """``values`` (a flat, contiguous array of a :func:`packable` dtype) in the narrowest
    type all of them fit, and its name; None where none narrower fits (or too few bytes).
    ``take(nbytes)`` gives the buffer for big results (a pool of warm memory: fresh pages
    cost more than the narrowing itself)."""
    if values.nbytes < MIN_BYTES or not packable(values.dtype):
        return None
    size = values.dtype.itemsize
    if len(values) <= PROBE:  # small: the exact range, then numpy's cast (faster on cached data)
        name = _width_for(int(values.min()), int(values.max()), size)
        return (values.astype(PACKED[name]), name) if name else None
    name = guess(values)
    if not name:  # some values already need the full width
        return None
    if _native_pack is not None:
        out = _empty(len(values), PACKED[name], take)
        if _halves(_native_narrow, values, size, out, out.itemsize):
            return out, name
    # no native module, or a value beyond the probe's range: the whole range, then the cast
    name = _width_for(int(values.min()), int(values.max()), size)
    if not name:
        return None
    out = _empty(len(values), PACKED[name], take)
    np.copyto(out, values, casting="unsafe")  # every value fits: nothing is lost
    return out, name


def width_of(parts: Sequence[np.ndarray]) -> PackedType:
    """The packed type every value of ``parts`` (flat arrays of one :func:`packable` dtype)
    fits, or "" (none narrower than theirs, or no values)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return ""
    lo, hi = min(int(p.min()) for p in parts), max(int(p.max()) for p in parts)
    return _width_for(lo, hi, parts[0].dtype.itemsize)


def guess(values: np.ndarray) -> PackedType:
    """The packed type the first ``PROBE`` values of ``values`` fit, or "": a guess for the
    whole field, which the narrowing pass then checks value by value."""
    probe = values[:PROBE]
    return _width_for(int(probe.min()), int(probe.max()), values.dtype.itemsize) if len(probe) else ""


class Narrowing:
    """A frame that is narrowed as it is sent: ``src`` (flat values of a :func:`packable`
    dtype) in the packed type ``dtype``, which :func:`guess` chose before every value was
    looked at. A bulk stream's ``Produced`` frame (tqueue/transport/_bulk.py): the sender
    narrows into a small buffer that stays in the CPU's cache and sends it from there, so the
    narrow bytes are never written to memory and read back; where a value does not fit, the
    stream refuses the frame and the write is sent again with the widths of the whole range."""

    __slots__ = ("src", "dtype", "nbytes")

    def __init__(self, src: np.ndarray, dtype: np.dtype) -> None:
        self.src = src
        self.dtype = dtype
        self.nbytes = len(src) * dtype.itemsize

    @property
    def cost(self) -> int:
        """What sending this frame costs, in bytes sent as they are: lanes are balanced by
        it. Reading the wide values costs about half as much as sending the narrow ones
        (measured here: with lanes split by bytes sent, the lane of narrowed frames took
        1.3-1.5x as long as the other; split by this, the two end within 1-5 ms)."""
        return self.nbytes + self.src.nbytes // 2

    def produce(self, out: np.ndarray) -> bool:
        """Write the narrow values into ``out`` (bytes, ``nbytes`` long); false where one
        does not fit (``out`` then holds garbage)."""
        dst = out.view(self.dtype)
        if _native_pack is not None:
            fits = _native_narrow(self.src, self.src.dtype.itemsize, dst, self.dtype.itemsize)
        else:
            bounds = np.iinfo(self.dtype)
            fits = bool(self.src.min() >= bounds.min and self.src.max() <= bounds.max)
            if fits:
                np.copyto(dst, self.src, casting="unsafe")
        return bool(fits)


class Widening:
    """Where a packed frame received on a bulk stream goes: widened into ``dst`` (the batch
    rows, of the field's own dtype) straight from the small buffer it was received into,
    while it is in the CPU's cache (a bulk stream's ``Consumed`` frame,
    tqueue/transport/_bulk.py). ``nbytes``: the packed bytes."""

    __slots__ = ("dst", "dtype", "nbytes")

    def __init__(self, dst: np.ndarray, dtype: np.dtype) -> None:
        self.dst = dst
        self.dtype = dtype
        self.nbytes = len(dst) * dtype.itemsize

    def consume(self, got: np.ndarray) -> None:
        """Widen ``got`` (the frame's packed bytes) into the rows."""
        np.copyto(self.dst, got.view(self.dtype), casting="safe")


def _native_narrow(src: np.ndarray, size: int, dst: np.ndarray, width: int) -> bool:
    """The native one-pass narrowing into ``dst``'s type (signed, or unsigned: uint8)."""
    assert _native_pack is not None
    return bool(_native_pack.narrow_into(src, size, dst, width, dst.dtype.kind == "u"))


def _empty(n: int, dtype: np.dtype, take: Callable[[int], np.ndarray] | None) -> np.ndarray:
    return take(n * dtype.itemsize).view(dtype) if take is not None else np.empty(n, dtype)


def widen(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src``, ``src`` packed: flat typed arrays of one length."""
    _halves(_copy_safe, src, 0, dst, 0)


def widen_all(jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """:func:`widen` for each ``(dst, src)``; many frames (a field arrives in frames of
    about a MiB) are shared out between two threads, each thread taking a run of them."""
    total = sum(dst.nbytes for dst, _ in jobs)
    if len(jobs) < 4 or not worth_splitting(total):
        for dst, src in jobs:
            widen(dst, src)
        return
    acc, cut = 0, len(jobs)
    for i, (dst, _) in enumerate(jobs):
        acc += dst.nbytes
        if 2 * acc >= total:
            cut = i + 1
            break
    on_two_threads(lambda: _widen_each(jobs[:cut]), lambda: _widen_each(jobs[cut:]))


def _widen_each(jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in jobs:
        np.copyto(dst, src, casting="safe")


def _copy_safe(src: np.ndarray, _: int, dst: np.ndarray, __: int) -> bool:
    np.copyto(dst, src, casting="safe")
    return True


def _halves(fn: Callable[[np.ndarray, int, np.ndarray, int], bool], src: np.ndarray, a: int, dst: np.ndarray, b: int) -> bool:
    """``fn(src, a, dst, b)`` over flat arrays of one length, as two halves on two threads
    when big; true when both halves are."""
    if not worth_splitting(max(src.nbytes, dst.nbytes)):
        return fn(src, a, dst, b)
    half = len(src) // 2
    lower, upper = on_two_threads(lambda: fn(src[:half], a, dst[:half], b), lambda: fn(src[half:], a, dst[half:], b))
    return bool(lower and upper)
