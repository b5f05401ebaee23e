"""What a server process holds, read from /proc: resident bytes, open fds, threads."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any


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


def flip_in_memory(pid: int, marker: bytes, at: int = 0) -> int:
    """Flip the lowest bit of the byte ``at`` bytes past each copy of ``marker`` in the
    writable memory of process ``pid`` (through /proc/PID/mem, as the tests' own user: the
    process is the test's child), and in the shared memory files it maps (its arena, read
    extent by extent through /proc/PID/fd); the number of copies flipped. Bit rot, for real."""
    flipped = 0
    with open(f"/proc/{pid}/maps") as f:
        regions = [line.split() for line in f]
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for fields in regions:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5] if len(fields) > 5 else ""
            if "rw" not in fields[1] or name.startswith(("[vvar]", "[vsyscall]", "[vdso]", "/memfd:")):
                continue
            flipped += _flip(mem, [(lo, hi)], marker, at)
    seen = set()  # a file open twice is flipped once (twice would flip the bit back)
    for path in memfds(pid):
        with open(path, "r+b", buffering=0) as shared:
            inode = os.fstat(shared.fileno()).st_ino
            if inode not in seen:
                seen.add(inode)
                flipped += _flip(shared, _extents(shared.fileno()), marker, at)
    return flipped


def memfds(pid: int, prefix: str = "/memfd:") -> list[str]:
    """The /proc paths of the process's open memory files whose names start with ``prefix``."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            out.append(f"/proc/{pid}/fd/{fd}")
    return out


def _extents(fd: int) -> list[tuple[int, int]]:
    """The ranges of a sparse file that hold data (SEEK_DATA / SEEK_HOLE)."""
    out, end, at = [], os.fstat(fd).st_size, 0
    while at < end:
        try:
            lo = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:
            break  # no data past ``at``
        hi = os.lseek(fd, lo, os.SEEK_HOLE)
        out.append((lo, hi))
        at = hi
    return out


def _flip(f: Any, ranges: list[tuple[int, int]], marker: bytes, at: int) -> int:
    flipped = 0
    step = 64 << 20
    for lo, hi in ranges:
        for start in range(lo, hi, step):
            end = min(hi, start + step + len(marker) + at)
            try:
                f.seek(start)
                chunk = f.read(end - start)
            except OSError:
                break  # unreadable (a guard page): the rest of the range too
            found = chunk.find(marker)
            while found >= 0:
                if found < step or start + step >= hi:  # a copy starting in the overlap is the next chunk's
                    f.seek(start + found + at)
                    byte = f.read(1)
                    f.seek(start + found + at)
                    f.write(bytes([byte[0] ^ 1]))
                    flipped += 1
                found = chunk.find(marker, found + 1)
    return flipped
