"""Host memory: recycled buffers, and freed heap given back to the operating system.

Recycled buffers (:class:`BufferPool`): where clients assemble batches and units receive bulk puts.

Copying into fresh memory costs page faults (about 1.3-2.7 GB/s here) while copying into
memory that is already mapped runs at 8 GB/s with torch's two-thread copy. A batch's tensors
are views of a pooled buffer; when the last of them is garbage collected the buffer goes back
to the pool, so steady-state training copies into warm memory.

Giving back: where the C library allows it, freed heap returns to the OS (``trim``).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import sys
import threading
import weakref

import numpy as np


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

MiB = 1 << 20
MIN_POOLED = 1 * MiB  # smaller buffers are cheap to allocate and not worth tracking
GRAIN = 1 * MiB


class BufferPool:
    """Idle buffers, best fit first; at most ``max_idle_bytes`` kept idle."""

    def __init__(self, max_idle_bytes: int, *, pinned: bool = False) -> None:
        """``pinned``: page-locked memory (torch's CUDA host allocator), which copies to a
        GPU run from by DMA at full speed; needs CUDA."""
        self.max_idle_bytes = max_idle_bytes
        self.pinned = pinned
        self._idle: list[tuple[int, int, np.ndarray]] = []  # (capacity, id, buffer)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``; back to the pool when it is collected."""
        if nbytes < MIN_POOLED or self.max_idle_bytes <= 0:
            return self._alloc(nbytes)
        buf = None
        with self._lock:
            i = bisect.bisect_left(self._idle, (nbytes, -1))
            # best fit, but do not hand out a buffer more than 1.5x the request
            if i < len(self._idle) and self._idle[i][0] <= nbytes + nbytes // 2:
                cap, _, buf = self._idle.pop(i)
                self._idle_bytes -= cap
                self.reused += 1
        if buf is None:
            buf = self._alloc(-(-nbytes // GRAIN) * GRAIN)
            self.allocated += 1
        # The buffer returns when the last array over it is collected. numpy points every
        # slice of an array at the object that exports its memory, skipping arrays between:
        # so that object must carry the finalizer (a slice of ``buf[:n]`` would not keep
        # ``buf[:n]`` alive, and the buffer would be reused under it).
        owner = (ctypes.c_uint8 * nbytes).from_buffer(buf)
        weakref.finalize(owner, self._give_back, buf)
        return np.frombuffer(owner, dtype=np.uint8)

    def _alloc(self, nbytes: int) -> np.ndarray:
        if not self.pinned:
            return np.empty(nbytes, dtype=np.uint8)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + buf.nbytes > self.max_idle_bytes:
                return  # dropped: numpy frees it
            bisect.insort(self._idle, (buf.nbytes, id(buf), buf))
            self._idle_bytes += buf.nbytes

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
