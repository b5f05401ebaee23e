"""The same-host path: a storage unit's arena mapped into this process.

A producer on the unit's host copies payload straight into the arena (one copy, into pages
that stay mapped, no socket); a consumer reads it in place. Views handed to the consumer
keep the unit's *hold* on those bytes: when the last tensor over them is collected, the
hold is released and the unit may reuse the range.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from .._copy import copy_bytes

log = logging.getLogger(__name__)

ALIGN = 64


class ArenaMap:
    """A unit's arena, mapped once for the life of the client."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.path = path

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
        whole = np.frombuffer(anchor, dtype=np.uint8)
        return [whole[off - lo : off - lo + length] for off, length in ranges]


def open_arena(path: str) -> ArenaMap | None:
    """Map a unit's arena, or None where this process cannot (another host or namespace)."""
    try:
        return ArenaMap(path)
    except OSError as exc:
        log.info("cannot map arena %s (%s); using sockets for that unit", path, exc)
        return None


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
