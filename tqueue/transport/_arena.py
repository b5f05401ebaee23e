"""The same-host path: a storage unit's shared-memory arena, and a client's mapping of it.

The unit's half, :class:`Arena`: one anonymous memory file (``memfd``) that the unit maps
once. It vanishes with the unit, so a crash leaves nothing in ``/dev/shm``. Memory is handed
out in *regions*, each with a reference count: one per stored piece that lives in it, one
per reader that still holds a zero-copy view (a *hold*), one per send in flight. A region
returns to the free list only when the count reaches zero, so bytes a reader is looking at
are never reused under it.

The client's half, :class:`ArenaMap`: a process on the unit's host maps the same file through
``/proc/<pid>/fd/<n>``. A producer copies payload straight into a region it was granted (one
copy, into pages that stay mapped, no socket), placing its pieces at :data:`PIECE_ALIGN`
inside it; a consumer reads in place. Views handed to the consumer keep the unit's hold on
those bytes: when the last tensor over them is collected, the hold is released and the unit
may reuse the range.

A client that cannot map the file (another host, another PID namespace) uses sockets for that
unit; the failure passes through the transport's boundary and is logged once.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._threads import copy_bytes
from ..errors import StorageUnitUnavailableError, UnavailableError
from ._boundary import Boundary, io_errors

log = logging.getLogger(__name__)

# Regions start and end on pages: a unit gives freed ones back to the OS whole (punch).
ALIGN = 4096
# A client's pieces start on cache lines inside a region: no piece shares a line with the
# one before it, and copies into it run at full width.
PIECE_ALIGN = 64
# madvise(2) (Linux 5.14+): map a range's pages into this process in one call, instead of one
# page fault each as a copy touches them. A writer maps pages that other writers filled before
# (the arena's pages stay allocated) at about 1 µs a fault here; one call per put saves most of
# that (docs/performance-history.md, "Arena leases")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
POPULATE_MIN_BYTES = 64 << 10  # smaller ranges fault their few pages

# fallocate(2) flags (linux/falloc.h): free the pages of a range, keep the file's size
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class Region:
    """A range of the arena handed out whole, with its reference count (see the module)."""


    __slots__ = ("offset", "length", "refs")

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length
        self.refs = 1

    @property
    def end(self) -> int:
        return self.offset + self.length


class Arena:
    """The unit's arena: regions handed out first-fit from a free list kept by offset, merged
    with their neighbours when they come back. Used from the unit's loop only."""

    def __init__(self, size: int, name: str = "tqueue-arena") -> None:
        self.size = (size // ALIGN) * ALIGN
        self.fd = os.memfd_create(name, 0)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.view = memoryview(self.mm)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), by offset
        self._regions: dict[int, Region] = {}
        self._punched = True  # nothing has been written yet
        self.used = 0
        self.touched = 0  # high-water mark of ranges handed out since the last punch
        # punches that handed pages back: a client that locked (registered) pages with a device
        # driver must register them again, since a punched page it locked is no longer the
        # arena's (the next write to that offset gets a fresh page; the locked one is orphaned)
        self.epoch = 0

    # --- allocation -----------------------------------------------------------------

    def alloc(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` (one reference), or None if the arena is full."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                region = self._regions[off] = Region(off, need)
                self.used += need
                self._punched = False
                self.touched = max(self.touched, off + need)
                return region
        return None

    def region_at(self, offset: int) -> Region | None:
        return self._regions.get(offset)

    def incref(self, region: Region) -> None:
        region.refs += 1

    def decref(self, region: Region) -> bool:
        """Drop a reference; True when that was the last one and the region is free again
        (its pages stay mapped until :meth:`punch`)."""
        region.refs -= 1
        if region.refs > 0:
            return False
        if region.refs < 0:
            log.error("arena region at %d released too often", region.offset)
            return False
        del self._regions[region.offset]
        self.used -= region.length
        self._give_back(region.offset, region.length)
        self._punched = False  # a punch before this left these pages alone
        return True

    def _give_back(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            i -= 1
            off, length = self._free[i][0], self._free[i][1] + length
            del self._free[i]
        if i < len(self._free) and off + length == self._free[i][0]:
            length += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (off, length))

    # --- memory ---------------------------------------------------------------------

    def anchor(self, offset: int, length: int, on_release: Callable[[], None]) -> Any:
        """A buffer over arena bytes whose collection calls ``on_release`` (in any thread)."""
        buf = (ctypes.c_uint8 * length).from_buffer(self.mm, offset)
        weakref.finalize(buf, on_release)
        return buf

    @property
    def free_touched(self) -> int:
        """Free bytes below the high-water mark: pages that may still be mapped."""
        return max(0, self.touched - self.used)

    def punch(self) -> int:
        """Hand the pages of free ranges back to the OS; return how many bytes."""
        if self._punched:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        freed = 0
        for off, length in self._free:
            if libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_long(off), ctypes.c_long(length)) == 0:
                freed += length
        self._punched = True
        self.touched = max((r.end for r in self._regions.values()), default=0)
        if freed:
            self.epoch += 1
        return freed

    def close(self) -> None:
        """Unmap, unless stored pieces or sends still use the memory (then the process's
        exit unmaps it; the memory file goes with the last mapping)."""
        try:
            self.view.release()
            self.mm.close()
        except BufferError:
            log.debug("arena still in use at close; left mapped until exit")
            return
        os.close(self.fd)


# --- the client's half -------------------------------------------------------------


class ArenaMap:
    """A unit's arena, mapped once for the life of the client; StorageUnitUnavailableError
    where it cannot be (see :func:`open_arena`)."""

    def __init__(self, path: str) -> None:
        with Boundary(f"cannot map the storage unit's arena {path}", io_errors(StorageUnitUnavailableError)):
            fd = os.open(path, os.O_RDWR)
            try:
                self.size = os.fstat(fd).st_size
                self.mm = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.path = path
        self.epoch = 0  # the unit's arena epoch last seen in a reply (see Arena.epoch)
        self._on_epoch: list[Callable[[], None]] = []
        self._populate = True

    def on_epoch(self, forget: Callable[[], None]) -> None:
        """Call ``forget`` each time the unit's arena epoch moves on: pages locked before it
        are no longer the arena's (a device driver's registrations must be made again)."""
        self._on_epoch.append(forget)

    def seen(self, epoch: int) -> None:
        """A reply of the unit carried ``epoch``; call it before using the ranges it names."""
        if epoch != self.epoch:
            self.epoch = epoch
            for forget in self._on_epoch:
                forget()

    def populate(self, offset: int, nbytes: int) -> None:
        """Map the pages of ``[offset, offset + nbytes)`` into this process for writing, in one
        call (a range the next fills will write). Where the kernel lacks it, never again."""
        if nbytes < POPULATE_MIN_BYTES or not self._populate:
            return
        lo = offset - offset % mmap.PAGESIZE
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE, lo, offset + nbytes - lo)
        except (OSError, ValueError) as exc:  # EINVAL before Linux 5.14: the faults it saves happen anyway
            self._populate = False
            log.debug("arena %s: no MADV_POPULATE_WRITE here (%s); pages fault in one by one", self.path, exc)

    def fill(self, offset: int, buffers: Sequence[Any]) -> int:
        """Copy ``buffers`` back to back from ``offset``; return the bytes copied."""
        at = offset
        for buf in buffers:
            src = np.frombuffer(buf, dtype=np.uint8)
            n = src.nbytes
            copy_bytes(self.array[at : at + n], src)
            at += n
        return at - offset

    def views(self, ranges: Sequence[Sequence[int]], on_release: Callable[[], None]) -> list[np.ndarray]:
        """Arrays over arena ``ranges``; ``on_release`` runs once none of them is referenced."""
        lo = min(r[0] for r in ranges)
        hi = max(r[0] + r[1] for r in ranges)
        anchor = (ctypes.c_uint8 * (hi - lo)).from_buffer(self.mm, lo)
        weakref.finalize(anchor, on_release)
        whole = np.frombuffer(anchor, dtype=np.uint8)  # a ctypes array is a buffer
        return [whole[off - lo : off - lo + length] for off, length in ranges]


def open_arena(path: str) -> ArenaMap | None:
    """Map a unit's arena, or None where this process cannot (another host or namespace)."""
    try:
        return ArenaMap(path)
    except UnavailableError as exc:
        log.info("%s; using sockets for that unit", exc)
        return None


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`PIECE_ALIGN`: where the next piece of a region starts."""
    return -(-n // PIECE_ALIGN) * PIECE_ALIGN
