"""Memory a storage unit uses for the payload it holds, on each path.

    python benchmarks/memory.py [--sizes 1024,4096] [--out bench-results]

For each size: start one unit, put the workload batch (N payload bytes) over sockets or
through the unit's shared-memory arena, and read the unit's memory: resident set (RSS)
for socket writes, and RSS plus the arena pages in use (the memory file's allocated
blocks) for arena writes. Reports (memory - baseline) / S, where S is the bytes the unit
was sent (N, or less where integer fields were packed: socket writes, see tqueue/wire/_pack.py),
which the target keeps under 1.1 (no hidden copies kept); the same against N; and the memory
after the partition is cleared (retained for reuse up to ``retain_bytes``, returned beyond it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import tqueue
from benchmarks.workload import make_batch, nbytes


def rss(pid: int) -> int:
    """Resident anonymous and file pages; shared-memory pages are counted by arena_bytes."""
    total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                total += int(line.split()[1]) * 1024
    return total


def arena_bytes(pid: int) -> int:
    """Pages allocated in the unit's memfd arena (0 if it has none)."""
    fd_dir = f"/proc/{pid}/fd"
    seen: dict[tuple[int, int], int] = {}  # Python's mmap keeps a dup of the fd: count once
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:tqueue-arena"):
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


@dataclasses.dataclass
class Row:
    path: str
    size: int
    payload: int
    stored: int
    baseline: int
    holding: int
    cleared: int

    @property
    def ratio(self) -> float:
        """Memory held per byte the unit was sent: what "no hidden copies" is about."""
        return (self.holding - self.baseline) / self.stored

    @property
    def per_payload(self) -> float:
        return (self.holding - self.baseline) / self.payload


def measure(path: str, size: int, retain: int) -> Row:
    storage = {"retain_bytes": retain}
    with tqueue.LocalCluster(num_storage_units=1, storage=storage) as cluster:
        pid = cluster.pids[1]
        config = tqueue.ClientConfig(shm=path == "shm", shm_min_bytes=0)
        with tqueue.Client(cluster.address, config=config) as client:
            batch = make_batch(size)
            client.put("warm", make_batch(8))  # the unit's first write sets up its heap
            client.clear("warm")

            def used() -> int:
                return rss(pid) + arena_bytes(pid)

            base = used()
            sent = client.stats.wire_bytes
            client.put("p", batch)
            stored = client.stats.wire_bytes - sent
            holding = used()
            client.clear("p")
            cleared = used()
    return Row(path, size, nbytes(batch), stored, base, holding, cleared)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,4096")
    p.add_argument("--retain-bytes", type=int, default=0, help="unit's retain_bytes (default 0: return memory on clear)")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args(argv)
    rows = [measure(path, int(n), args.retain_bytes) for n in args.sizes.split(",") for path in ("socket", "shm")]
    lines = [
        "| path | samples | payload MB | sent to the unit MB | held / sent | held / payload | held MB | after clear MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.size} | {r.payload / 1e6:.0f} | {r.stored / 1e6:.0f} | {r.ratio:.3f} | "
            f"{r.per_payload:.3f} | {(r.holding - r.baseline) / 1e6:.0f} | {(r.cleared - r.baseline) / 1e6:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.md").write_text(text)
    (out / "memory.json").write_text(
        json.dumps([dataclasses.asdict(r) | {"ratio": r.ratio, "per_payload": r.per_payload} for r in rows], indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
