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


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
_tuned: list[int] = []


def keep_freed(retain: int) -> bool:
    """Let glibc keep up to ``retain`` bytes of freed heap mapped, instead of trimming.

    By default glibc trims the heap top beyond about twice its dynamic mmap threshold and
    maps big blocks afresh, so a process that receives a large batch, frees it and
    receives the next one faults every page in again (half the receive rate). Allocations
    below 32 MiB then come from the heap and freed memory stays warm for the next message.
    Process-wide; the first caller's ``retain`` wins. False where glibc is not in use.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    if not _tuned:
        retain = max(0, min(retain, (1 << 31) - 1))  # mallopt takes an int: at most 2 GiB
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, retain)
        _tuned.append(retain)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def heap_free() -> int:
    """Bytes glibc holds free in its heaps (mapped, reusable); 0 where unknown."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


def trim() -> None:
    """Return free pages of the heap to the OS (glibc ``malloc_trim``); no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
