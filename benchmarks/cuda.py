"""Rollout workers that put CUDA tensors, trainers that move what they get to the GPU.

    python benchmarks/cuda.py [--size 1024] [--field-mib 0] [--repeats 7] [--out bench-results]

Needs a CUDA device (prints a line and exits 0 without one). On the workload batch with its
tensor fields on the GPU, medians over ``--repeats``:

* the floor of each crossing: device to host into fresh pageable memory (what ``.cpu()``
  does), into reused pinned memory, and host to device from each;
* tqueue's put of the CUDA batch (sockets, and the same-host arena), and its share spent
  crossing to the host;
* tqueue's get followed by ``.to("cuda", non_blocking=True)`` of every tensor field, with
  batches in pageable memory and with ``ClientConfig.pin_memory``;
* tqueue's get onto the GPU by its device route (``get_data(device="cuda")``: from a
  registered arena or pinned buffers, in chunks), and the whole round trip (a CUDA put, then
  that get) against its floor: pinned device to host plus host to device of the same bytes
  in one process. Each row says how far it is from that floor (the target is 0.5x for the
  same host at 1 GiB and 4 GiB: ``--size 1024 --field-mib 1`` and ``--size 256 --field-mib 16``,
  the batches of ../shared/gpu/gpu_checks.py).

GB/s count the tensor fields' bytes only (the prompts and metadata stay on the host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import tqueue
from benchmarks.workload import TENSOR_FIELDS, make_batch


def timed(
    fn: Callable[[], Any], repeats: int, after: Callable[[], Any] = lambda: None
) -> tuple[float, float, float]:
    """Median, min and max seconds of ``fn`` (the GPU synchronized after each call); ``after``
    runs untimed after each call (a put's partition cleared, so that the arena never fills)."""
    fn()
    torch.cuda.synchronize()
    after()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
        after()
    return statistics.median(runs), min(runs), max(runs)


def run(size: int, repeats: int, field_mib: int = 0) -> list[dict[str, Any]]:
    """The rows, on the workload batch of ``size`` samples, or with ``field_mib`` on one bf16
    field of that many MiB per sample (the batches of ../shared/gpu/gpu_checks.py)."""
    if field_mib:
        host: dict[str, Any] = {"x": torch.randn(size, field_mib << 19).to(torch.bfloat16)}
    else:
        host = make_batch(size)
    names = [k for k, v in host.items() if isinstance(v, torch.Tensor)] if field_mib else TENSOR_FIELDS
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in host.items()}
    tensors = {k: dev[k] for k in names}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in tensors.items()}
    rows: list[dict[str, Any]] = []

    def row(what: str, copies: str, stats: tuple[float, float, float]) -> None:
        med, lo, hi = stats
        rows.append({"what": what, "copies": copies, "ms": med * 1e3, "min_ms": lo * 1e3,
                     "max_ms": hi * 1e3, "gbps": nbytes / med / 1e9})

    row("device to host, fresh pageable (.cpu())", "1 DMA + driver staging",
        timed(lambda: [t.cpu() for t in tensors.values()], repeats))
    row("device to host, reused pinned", "1 DMA",
        timed(lambda: [pinned[k].copy_(t, non_blocking=True) for k, t in tensors.items()], repeats))
    kept = {k: t.cpu() for k, t in tensors.items()}
    row("host to device, from pageable", "1 DMA + driver staging",
        timed(lambda: [t.to("cuda") for t in kept.values()], repeats))
    row("host to device, from pinned", "1 DMA",
        timed(lambda: [t.to("cuda", non_blocking=True) for t in pinned.values()], repeats))

    def floor() -> None:
        for k, t in tensors.items():
            pinned[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        for t in pinned.values():
            t.to("cuda", non_blocking=True)

    row("floor: round trip, pinned device to host + host to device", "2 DMA", timed(floor, repeats))

    with tqueue.LocalCluster(num_storage_units=2) as cluster:
        for transport in ("tcp", "tcp, pin_memory", "shm"):
            config = dataclasses.replace(
                tqueue.ClientConfig(), shm=transport == "shm", pin_memory=transport.endswith("pin_memory")
            )
            with tqueue.Client(cluster.address, config=config) as client:
                prefix = transport.replace(", ", "-")
                put, clear = _putter(client, prefix, dev)
                row(f"tqueue put of the CUDA batch ({transport})", "device to host once, then as CPU tensors",
                    timed(put, repeats, clear))
                client.put(f"{prefix}-last", dev)
                row(f"tqueue get, then .to('cuda') ({transport})", "as CPU tensors, then host to device",
                    timed(_getter(client, f"{prefix}-last", list(host), names, size), repeats))
                row(f"tqueue get_data(device='cuda') ({transport})", "page-locked host to device, in chunks",
                    timed(_getter(client, f"{prefix}-last", list(host), names, size, device="cuda"), repeats))
                row(f"tqueue round trip: CUDA put, get_data(device='cuda') ({transport})", "put, then the device route",
                    timed(_round_trip(client, prefix, dev, size), repeats))
    ref = next(r for r in rows if r["what"].startswith("floor"))
    for r in rows:
        r["of_floor"] = r["gbps"] / ref["gbps"]
    return rows


def _putter(client: Any, prefix: str, batch: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
    """A put to a new partition each time, and the clear of the last one."""
    names = iter(range(1 << 30))
    last: list[str] = []

    def put() -> None:
        last[:] = [f"{prefix}-{next(names)}"]
        client.put(last[0], batch)

    return put, lambda: client.clear(last[0])


def _getter(
    client: Any, partition: str, every: list[str], tensors: list[str], size: int, device: str | None = None
) -> Callable[[], None]:
    tasks = iter(range(1 << 30))

    def get() -> None:  # a new task each time (one of its own per getter): the same samples again
        meta = client.get_meta(partition, every, size, task=f"{device or 'host'}-{next(tasks)}", timeout=60)
        batch = client.get_data(meta, device=device)
        if device is None:
            for k in tensors:
                batch[k].to("cuda", non_blocking=True)

    return get


def _round_trip(client: Any, prefix: str, batch: dict[str, Any], size: int) -> Callable[[], None]:
    names = iter(range(1 << 30))

    def trip() -> None:
        partition = f"{prefix}-trip-{next(names)}"
        client.put(partition, batch)
        client.get_data(partition, list(batch), size, task="t", device="cuda", timeout=60)
        client.clear(partition)

    return trip


def markdown(rows: list[dict[str, Any]], size: int, device: str) -> str:
    lines = [f"CUDA paths, {size} samples ({device}); GB/s of the tensor fields' bytes", "",
             "| path | copies | ms (min-max) | GB/s | of the round-trip floor |", "|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['copies']} | {r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f}) "
                     f"| {r['gbps']:.2f} | {r['of_floor']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--field-mib", type=int, default=0, help="one bf16 field of this many MiB per sample")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="bench-results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    device = torch.cuda.get_device_name()
    rows = run(args.size, args.repeats, args.field_mib)
    text = markdown(rows, args.size, device)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda.md").write_text(text + "\n")
    (out / "cuda.json").write_text(json.dumps({"size": args.size, "device": device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
