"""CRC-32C of payload bytes: computed once by the producer, kept by the unit, checked by the
reader as the bytes arrive and by a checkpoint's load.

``crc32c`` (the PyPI package) runs the CPU's CRC instructions (SSE4.2, ARMv8) at 10+ GB/s a
core and releases the GIL; it takes any buffer (bytes, memoryview, numpy, a ZeroMQ frame).
:func:`ranges` takes many ranges of one buffer (a batch's samples) in one call of
``tqueue.wire._native_crc`` (native/crc.c) where it is built and the CPU has SSE4.2: per call,
the package costs more than a 16 KB sample's CRC itself. Without it, one call per range.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from crc32c import crc32c as _crc32c

try:
    import tqueue.wire._native_crc as _native_crc

    if not _native_crc.hardware():
        _native_crc = None
except ImportError:  # built without a C compiler: one call per range
    _native_crc = None

__all__ = ["crc", "extend", "ranges"]


def crc(data: Any) -> int:
    """The CRC-32C of ``data``'s bytes (any buffer; a non-contiguous view is an error)."""
    return _crc32c(data)


def extend(value: int, data: Any) -> int:
    """The CRC-32C of the bytes that gave ``value`` followed by ``data``'s."""
    return _crc32c(data, value=value)


def ranges(buf: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The CRC-32C (int64) of each range ``buf[offsets[i] : offsets[i] + sizes[i]]`` of the
    flat uint8 array ``buf``."""
    out = np.empty(len(offsets), dtype=np.int64)
    if not len(out):
        return out
    if _native_crc is not None:
        _native_crc.crc_ranges(
            buf, np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(sizes, dtype=np.int64), out
        )
        return out
    out[:] = [_crc32c(buf[o : o + s]) for o, s in zip(offsets.tolist(), sizes.tolist())]
    return out
