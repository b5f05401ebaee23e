"""Give freed heap memory back to the operating system where the C library allows it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim() -> None:
    """Return free pages of the heap to the OS (glibc ``malloc_trim``); no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
