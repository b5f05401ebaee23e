"""The NIXL route (``StorageConfig.nixl``, ``ClientConfig.nixl``) against the socket routes and
the same-host arena, on the workload batch, in one run:

    python benchmarks/nixl.py [--sizes 1024] [--repeats 7] [--out bench-results]

Each path runs in a process of its own (UCX reads ``UCX_TLS`` when an agent starts), with a
local cluster of one unit:

* ``socket``: the client's bulk TCP streams, the route between hosts without NIXL;
* ``arena``: the same-host arena (the unit's pages mapped by the client);
* ``nixl same host``: NIXL with UCX's default transports: cross-process memory reads;
* ``nixl tcp``: NIXL with ``UCX_TLS=tcp``, what a cluster without RDMA NICs gets;
* ``raw nixl tcp`` reads the unit's arena straight by its agent, without tqueue's messages (the
  engine's own rate here), in one piece and in 256 KiB segments.

GB/s count the batch's payload bytes; ``put`` is a put of the batch, ``get`` a ``get_data`` of
every field, medians over ``--repeats`` (each put's partition cleared untimed). Needs the
``nixl`` extra (prints a line and exits 0 without it). RDMA and GPU-direct figures need hosts
with such NICs and GPUs; none were lent to this work.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

PATHS = {  # name: (client config, storage config, UCX_TLS or None)
    "socket": ({"shm": False, "nixl": "off"}, {}, None),
    "arena": ({"shm": True}, {}, None),
    "nixl same host": ({"shm": False, "nixl": "on"}, {"nixl": True}, None),
    "nixl tcp": ({"shm": False, "nixl": "on"}, {"nixl": True}, "tcp"),
}


def run_path(name: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """In this process (started with the path's environment): the path's rows."""
    import tqueue
    from benchmarks.workload import fields, make_batch, nbytes

    client, storage, _ = PATHS[name]
    rows = []
    with tqueue.LocalCluster(1, storage=storage) as cluster:
        with tqueue.Client(cluster.address, config=tqueue.ClientConfig(**client)) as c:
            for size in sizes:
                batch = make_batch(size)
                total = nbytes(batch)
                puts, gets = [], []
                for k in range(repeats + 1):
                    part = f"p{size}-{k}"
                    t0 = time.perf_counter()
                    c.put(part, batch)
                    t1 = time.perf_counter()
                    got = c.get_data(part, fields(), size, task="t", timeout=120)
                    t2 = time.perf_counter()
                    del got
                    c.clear(part)
                    if k:  # the first warms both sides
                        puts.append(t1 - t0)
                        gets.append(t2 - t1)
                put_s, get_s = statistics.median(puts), statistics.median(gets)
                rows.append({"path": name, "samples": size, "bytes": total, "put_ms": put_s * 1e3, "get_ms": get_s * 1e3,
                             "put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9})
    return rows


def raw_tcp(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """NIXL's own READ rate over UCX's TCP, one agent reading another's registered buffer in
    one piece and in 256 KiB segments (this process; UCX_TLS=tcp)."""
    import asyncio

    import numpy as np

    from tqueue.transport import _nixl

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    owner, reader = _nixl.Agent("unit"), _nixl.Agent("client")
    try:
        owner.register(src.ctypes.data, nbytes)
        peer = reader.connect(owner.metadata())
        rows = []
        for segment in (nbytes, 256 << 10):
            pieces = [(dst.ctypes.data + at, src.ctypes.data + at, min(segment, nbytes - at)) for at in range(0, nbytes, segment)]
            runs = []
            for k in range(repeats + 1):
                t0 = time.perf_counter()
                asyncio.run(reader.transfer("READ", peer, pieces, [(dst.ctypes.data, nbytes)], 120))
                if k:
                    runs.append(time.perf_counter() - t0)
            assert np.array_equal(src, dst)
            s = statistics.median(runs)
            label = "one piece" if segment == nbytes else f"{segment >> 10} KiB segments"
            rows.append({"path": f"raw nixl tcp, {label}", "samples": 0, "bytes": nbytes, "put_ms": 0.0,
                         "get_ms": s * 1e3, "put_gbps": 0.0, "get_gbps": nbytes / s / 1e9})
        return rows
    finally:
        reader.close()
        owner.close()


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| path | samples | MB | put ms | put GB/s | get ms | get GB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        put = f"{r['put_ms']:.1f} | {r['put_gbps']:.2f}" if r["put_ms"] else "- | -"
        out.append(f"| {r['path']} | {r['samples'] or '-'} | {r['bytes'] / 1e6:.0f} | {put} | {r['get_ms']:.1f} | {r['get_gbps']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="bench-results")
    p.add_argument("--path", help=argparse.SUPPRESS)  # one path, in a child process
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.path:
        rows = raw_tcp(128 << 20, args.repeats) if args.path == "raw" else run_path(args.path, sizes, args.repeats)
        print(json.dumps(rows))
        return 0
    from tqueue.transport import _nixl

    if not _nixl.available():
        print("benchmarks/nixl.py: the nixl extra is not installed (pip install -e '.[nixl]'); nothing measured")
        return 0
    rows: list[dict[str, Any]] = []
    for name in [*PATHS, "raw"]:
        tls = "tcp" if name == "raw" else PATHS[name][2]
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        if tls:
            env["UCX_TLS"] = tls
        cmd = [sys.executable, __file__, "--path", name, "--sizes", args.sizes, "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True)
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    text = table(rows)
    print(text)
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "nixl.json").write_text(json.dumps(rows, indent=1))
    (outdir / "nixl.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
