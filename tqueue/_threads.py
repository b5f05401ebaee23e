"""Threads owned by this process, and large memory copies on two of them.

Thread pools are per process: a forked child makes its own, since threads do not survive a fork.

Large copies run on two plain threads, without OpenMP. ``torch``'s ``copy_`` runs on its
intra-op OpenMP pool, whose threads spin for a while after every parallel region. Where several
client processes share a few cores (DP ranks of one host, producers beside them) that spinning
takes the CPU the others need: four consumers assembling from a unit's arena on 2 cores took
312-467 ms a get with torch's copy, 86 ms with this one. numpy copies with the GIL released, so
two Python threads copy two halves as fast as torch's two (136 MB: 15-17 ms, torch 19-23, one
thread 29) and nothing spins afterwards.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np

_POOLS: dict[str, tuple[int, concurrent.futures.ThreadPoolExecutor]] = {}
_LOCK = threading.Lock()


def pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool called ``name`` (threads named ``tqueue-<name>``), made on first use."""
    with _LOCK:
        held = _POOLS.get(name)
        if held is None or held[0] != os.getpid():
            held = _POOLS[name] = (os.getpid(), concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"tqueue-{name}"))
        return held[1]

SPLIT_MIN = 8 << 20  # smaller copies stay on the calling thread: a hand-off costs more
T = TypeVar("T")


def worth_splitting(nbytes: int) -> bool:
    """Whether a pass over ``nbytes`` pays for a second thread (one core alone does not reach
    the memory's bandwidth; below ``SPLIT_MIN`` the hand-off costs more)."""
    return nbytes >= SPLIT_MIN and (os.cpu_count() or 1) >= 2


def on_two_threads(lower: Callable[[], T], upper: Callable[[], T]) -> tuple[T, T]:
    """Run ``upper`` on the process's copy thread while ``lower`` runs on this one (both
    should release the GIL: numpy copies and the native passes do); their results."""
    pending = pool("copy", 1).submit(upper)
    try:
        first = lower()
    finally:
        second = pending.result()
    return first, second


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for two flat uint8 arrays of one size; halves in parallel when big."""
    n = dst.nbytes
    if not worth_splitting(n):
        np.copyto(dst, src)
        return
    half = (n // 2) & ~4095  # page-aligned halves: the threads do not share a page
    on_two_threads(lambda: np.copyto(dst[:half], src[:half]), lambda: np.copyto(dst[half:], src[half:]))
