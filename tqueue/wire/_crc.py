"""CRC-32C of payload bytes: computed once by the producer, kept by the unit, checked by the
reader as the bytes arrive and by a checkpoint's load.

``crc32c`` (the PyPI package) runs the CPU's CRC instructions (SSE4.2, ARMv8) at 10+ GB/s a
core and releases the GIL; it takes any buffer (bytes, memoryview, numpy, a ZeroMQ frame).
"""

from __future__ import annotations

from typing import Any

from crc32c import crc32c as _crc32c

__all__ = ["crc", "extend"]


def crc(data: Any) -> int:
    """The CRC-32C of ``data``'s bytes (any buffer; a non-contiguous view is an error)."""
    return _crc32c(data)


def extend(value: int, data: Any) -> int:
    """The CRC-32C of the bytes that gave ``value`` followed by ``data``'s."""
    return _crc32c(data, value=value)
