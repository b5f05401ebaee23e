"""Soak: many producers and consumers on one local cluster, every byte checked on arrival.

    python benchmarks/soak.py [--producers 64] [--consumers 16] [--seconds 60]
                              [--processes 4] [--units 2] [--rows 1024]

Producers (``--producers`` async clients, each its own session, spread over
``--processes`` worker processes) put 4 samples at a time for ``--seconds``: each sample is
``--rows`` float32 values drawn from a generator seeded by (producer, sequence, sample), with
its id and the CRC-32 of its bytes as fields. Consumers (``--consumers`` async clients over
``--processes // 2 or 1`` more processes) lease 4 samples at a time, recompute each CRC from
the bytes received and compare it with the one put, check the bytes against the generator
too, and ack. At the end every sample acknowledged to a producer must have been consumed
exactly once: none lost, none twice. Prints put and get latency (p50, p99), samples/s, MB/s
and the bytes verified; exits non-zero on any mismatch. ``run()`` is what the test calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``tqueue`` of this tree importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import tqueue

SAMPLES_PER_PUT = 4
PARTITION = "soak"


def payload(producer: int, seq: int, rows: int) -> torch.Tensor:
    """The samples of one put, reproducible from its ids."""
    gen = torch.Generator().manual_seed((producer << 32) | seq)
    return torch.rand(SAMPLES_PER_PUT, rows, generator=gen)


async def produce(address: str, producer: int, rows: int, until: float, lat: list[float]) -> list[int]:
    """Put until ``until``; the sequence numbers whose put was acknowledged."""
    done = []
    async with tqueue.AsyncClient(address) as client:
        seq = 0
        while time.monotonic() < until:
            x = payload(producer, seq, rows)
            crc = torch.tensor([zlib.crc32(row.numpy().tobytes()) for row in x], dtype=torch.int64)
            ids = torch.tensor([[producer, seq, j] for j in range(SAMPLES_PER_PUT)], dtype=torch.int64)
            t0 = time.perf_counter()
            await client.put(PARTITION, {"x": x, "id": ids, "crc": crc})
            lat.append(time.perf_counter() - t0)
            done.append(seq)
            seq += 1
    return done


async def consume(address: str, rows: int, stop: pathlib.Path, lat: list[float], seen: list[list[int]]) -> int:
    """Lease, verify and ack until the producers are done and nothing is left; bytes checked."""
    checked = 0
    async with tqueue.AsyncClient(address) as client:
        while True:
            t0 = time.perf_counter()
            try:
                meta = await client.get_meta(PARTITION, ["x", "id", "crc"], SAMPLES_PER_PUT, task="train", timeout=2.0)
            except tqueue.WaitTimeoutError:
                if stop.exists():
                    return checked
                continue
            batch = await client.get_data(meta)
            lat.append(time.perf_counter() - t0)
            for row, ident, crc in zip(batch["x"], batch["id"].tolist(), batch["crc"].tolist()):
                data = row.numpy().tobytes()
                if zlib.crc32(data) != crc:
                    raise AssertionError(f"sample {ident}: CRC {zlib.crc32(data):#x}, put with {crc:#x}")
                if not torch.equal(row, payload(ident[0], ident[1], rows)[ident[2]]):
                    raise AssertionError(f"sample {ident}: bytes differ from what was put")
                checked += len(data)
                seen.append(ident)
            await client.ack(meta)


def worker(role: str, address: str, first: int, count: int, rows: int, seconds: float, stop: str) -> dict[str, Any]:
    lat: list[float] = []

    async def main() -> dict[str, Any]:
        if role == "producer":
            until = time.monotonic() + seconds
            done = await asyncio.gather(*(produce(address, first + i, rows, until, lat) for i in range(count)))
            return {"put": {str(first + i): seqs for i, seqs in enumerate(done)}, "lat": lat}
        seen: list[list[int]] = []
        checked = await asyncio.gather(*(consume(address, rows, pathlib.Path(stop), lat, seen) for _ in range(count)))
        return {"seen": seen, "checked": sum(checked), "lat": lat}

    return asyncio.run(main())


def _spread(total: int, parts: int) -> list[tuple[int, int]]:
    """(first, count) of ``total`` clients over ``parts`` processes."""
    out, first = [], 0
    for i in range(parts):
        count = total // parts + (1 if i < total % parts else 0)
        if count:
            out.append((first, count))
        first += count
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    *, producers: int = 64, consumers: int = 16, seconds: float = 60.0, processes: int = 4, units: int = 2,
    rows: int = 1024, address: str | None = None,
) -> dict[str, Any]:
    """Run the soak (on a fresh local cluster unless ``address``); the figures, checked."""
    if address is None:
        with tqueue.LocalCluster(num_storage_units=units) as cluster:
            return run(producers=producers, consumers=consumers, seconds=seconds, processes=processes,
                       units=units, rows=rows, address=cluster.address)
    with tempfile.TemporaryDirectory() as tmp:
        stop = pathlib.Path(tmp) / "producers-done"
        script = pathlib.Path(__file__).resolve()
        env = {**os.environ, "PYTHONPATH": str(script.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}

        def spawn(role: str, first: int, count: int) -> subprocess.Popen[bytes]:
            args = [role, address, str(first), str(count), str(rows), str(seconds), str(stop)]
            return subprocess.Popen([sys.executable, str(script), "--worker", *args], stdout=subprocess.PIPE, env=env)

        t0 = time.monotonic()
        prods = [spawn("producer", f, n) for f, n in _spread(producers, processes)]
        cons = [spawn("consumer", f, n) for f, n in _spread(consumers, max(1, processes // 2))]
        try:
            put_out = [json.loads(p.communicate(timeout=seconds + 600)[0]) for p in prods]
            if any(p.returncode for p in prods):
                raise AssertionError("a producer process failed")
            stop.touch()
            con_out = [json.loads(c.communicate(timeout=600)[0]) for c in cons]
            if any(c.returncode for c in cons):
                raise AssertionError("a consumer process failed")
        finally:
            for proc in prods + cons:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        wall = time.monotonic() - t0
    put = {(int(p), s, j) for out in put_out for p, seqs in out["put"].items() for s in seqs for j in range(SAMPLES_PER_PUT)}
    seen = [tuple(i) for out in con_out for i in out["seen"]]
    twice = len(seen) - len(set(seen))
    lost = put - set(seen)
    stray = set(seen) - put
    put_lat = [x for out in put_out for x in out["lat"]]
    get_lat = [x for out in con_out for x in out["lat"]]
    checked = sum(out["checked"] for out in con_out)
    result = {
        "producers": producers, "consumers": consumers, "seconds": seconds, "wall_s": round(wall, 1),
        "samples": len(put), "consumed": len(seen), "lost": len(lost), "twice": twice, "stray": len(stray),
        "bytes_verified": checked, "samples_per_s": round(len(seen) / wall, 1), "MB_per_s": round(checked / wall / 1e6, 2),
        "put_p50_ms": round(_pct(put_lat, 0.5) * 1e3, 2), "put_p99_ms": round(_pct(put_lat, 0.99) * 1e3, 2),
        "get_p50_ms": round(_pct(get_lat, 0.5) * 1e3, 2), "get_p99_ms": round(_pct(get_lat, 0.99) * 1e3, 2),
        "put_mean_ms": round(statistics.fmean(put_lat) * 1e3, 2) if put_lat else None,
    }
    if lost or twice or stray:
        raise AssertionError(f"soak: {len(lost)} samples lost, {twice} consumed twice, {len(stray)} never put: {result}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        role, address, first, count, rows, seconds, stop = argv[1:]
        out = worker(role, address, int(first), int(count), int(rows), float(seconds), stop)
        sys.stdout.write(json.dumps(out))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producers", type=int, default=64)
    p.add_argument("--consumers", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--units", type=int, default=2)
    p.add_argument("--rows", type=int, default=1024)
    args = p.parse_args(argv)
    result = run(producers=args.producers, consumers=args.consumers, seconds=args.seconds,
                 processes=args.processes, units=args.units, rows=args.rows)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
