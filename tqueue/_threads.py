"""Thread pools owned by this process (a forked child makes its own: threads do not survive a fork)."""

from __future__ import annotations

import concurrent.futures
import os
import threading

_POOLS: dict[str, tuple[int, concurrent.futures.ThreadPoolExecutor]] = {}
_LOCK = threading.Lock()


def pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool called ``name`` (threads named ``tqueue-<name>``), made on first use."""
    with _LOCK:
        held = _POOLS.get(name)
        if held is None or held[0] != os.getpid():
            held = _POOLS[name] = (os.getpid(), concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"tqueue-{name}"))
        return held[1]
