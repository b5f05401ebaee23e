"""What a server process holds, read from /proc: resident bytes, open fds, threads."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one


def until(condition: Callable[[], bool], timeout: float, what: str, *, every: float = 0.05) -> None:
    """Wait, up to ``timeout`` s, for what a server reports (its ``status()``) to satisfy
    ``condition``; it is asked again every ``every`` s. For states that only a server's own
    clock brings about (a heartbeat missed, a session ended), which no call waits for."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.1f} s: {what}")
        pause.wait(every)
