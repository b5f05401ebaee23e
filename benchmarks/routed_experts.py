"""Routed experts (routing replay, R3) of one training step: tqueue's jagged, packed storage
against the dense table the trainers build.

    python benchmarks/routed_experts.py [--samples 512] [--layers 48] [--top-k 8] [--experts 128]
                                        [--median 4096] [--max 32768] [--put 32] [--cap 65536]
                                        [--data-parallel 2] [--shm] [--out DIR]

The step: ``--samples`` sequences with long-tailed lengths (log-normal, median ``--median``
tokens, clipped to ``--max``), seeded, each with its routed experts as the rollout bridges put
them: one int32 ``[length, layers, top_k]`` tensor a sample, expert ids under ``--experts``.
A producer puts them ``--put`` samples at a time to a LocalCluster of one storage unit (real
processes); then each of ``--data-parallel`` trainer ranks reads its share of the step with
micro-batches of at most ``--cap`` tokens and assembles each one ``form="packed"`` (the
``[T, layers, top_k]`` rows megatron-core's packed sequences take).

Reported, per id and in all: the ids; what the engine hands over (4 bytes an id); the dense
``[batch, max_len, layers, top_k]`` int32 table of verl and NeMo-RL (its bytes are counted, not
allocated); the bytes the unit holds (``status()``) and its resident memory's growth; the
bytes that crossed to the unit and back to the ranks (``ClientStats.wire_bytes``); the put's
and the reads' wall time, and the packed assembly's time per micro-batch (medians).
``--shm`` puts through the same-host arena instead of sockets.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import torch

import tqueue


def lengths(n: int, median: int, longest: int, seed: int = 0) -> np.ndarray:
    """``n`` sequence lengths, log-normal around ``median``, clipped to [16, ``longest``]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), 0.8, n), 16, longest).astype(np.int64)


def experts_of(length: int, layers: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, experts, (length, layers, top_k), generator=g, dtype=torch.int32)


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    lens = lengths(args.samples, args.median, args.max)
    ids = int(lens.sum()) * args.layers * args.top_k
    dense = args.samples * int(lens.max()) * args.layers * args.top_k * 4
    config = tqueue.ClientConfig(shm=args.shm, shm_min_bytes=0) if args.shm else tqueue.ClientConfig(shm=False)
    out: dict[str, Any] = {
        "samples": args.samples, "tokens": int(lens.sum()), "median": int(np.median(lens)), "longest": int(lens.max()),
        "ids": ids, "engine_bytes": ids * 4, "dense_table_bytes": dense, "route": "arena" if args.shm else "sockets",
    }
    with tqueue.LocalCluster(num_storage_units=1) as cluster, tqueue.Client(cluster.address, config=config) as producer:
        unit = cluster.pids[1]
        before = rss(unit)
        t0 = time.perf_counter()
        for first in range(0, args.samples, args.put):
            rows = [experts_of(int(n), args.layers, args.top_k, args.experts, first + i)
                    for i, n in enumerate(lens[first : first + args.put])]
            producer.put("step", {"routed_experts": rows})
        out["put_s"] = time.perf_counter() - t0
        out["put_wire_bytes"] = producer.stats.wire_bytes
        out["unit_bytes"] = next(p.nbytes for p in producer.status().partitions if p.name == "step")
        out["unit_rss_growth"] = rss(unit) - before
        producer.seal("step")
        reads, packs, got_wire, got_ids = [], [], 0, 0
        share = args.samples // args.data_parallel
        for rank in range(args.data_parallel):
            with tqueue.Client(cluster.address, config=config) as trainer:
                t0 = time.perf_counter()
                batch = trainer.get_data(
                    "step", ["routed_experts"], share, task="train", timeout=60,
                    data_parallel=tqueue.DataParallel(rank, args.data_parallel),
                    micro_batches=tqueue.MicroBatches(max_tokens=args.cap),
                )
                reads.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                micro = batch.micro_batches(["routed_experts"], form="packed")
                packs.append((time.perf_counter() - t0) / len(micro))
                got_ids += sum(mb["routed_experts"].numel() for mb in micro)
                got_wire += trainer.stats.wire_bytes
        assert got_ids == ids, f"the ranks read {got_ids} ids of {ids}"
        out["read_s"] = statistics.median(reads)
        out["get_wire_bytes"] = got_wire
        out["packed_mb_s"] = statistics.median(packs)
    out["bytes_per_id_unit"] = out["unit_bytes"] / ids
    out["bytes_per_id_put_wire"] = out["put_wire_bytes"] / ids
    out["bytes_per_id_get_wire"] = out["get_wire_bytes"] / ids
    out["dense_over_unit"] = dense / out["unit_bytes"]
    return out


def table(r: dict[str, Any]) -> str:
    gb = 1e9
    return "\n".join([
        f"{r['samples']} samples, {r['tokens']} tokens (median {r['median']}, longest {r['longest']}), {r['ids']} expert ids; route: {r['route']}",
        "",
        "| layout | bytes | bytes an id |",
        "|---|---:|---:|",
        f"| dense [batch, max_len, layers, top_k] int32 (verl, NeMo-RL) | {r['dense_table_bytes'] / gb:.2f} GB | {r['dense_table_bytes'] / r['ids']:.2f} |",
        f"| as the engine hands them over (int32, jagged) | {r['engine_bytes'] / gb:.2f} GB | 4.00 |",
        f"| tqueue: held by the unit | {r['unit_bytes'] / gb:.3f} GB | {r['bytes_per_id_unit']:.2f} |",
        f"| tqueue: the unit's resident growth | {r['unit_rss_growth'] / gb:.3f} GB | {r['unit_rss_growth'] / r['ids']:.2f} |",
        f"| tqueue: sent to the unit | {r['put_wire_bytes'] / gb:.3f} GB | {r['bytes_per_id_put_wire']:.2f} |",
        f"| tqueue: sent to the ranks | {r['get_wire_bytes'] / gb:.3f} GB | {r['bytes_per_id_get_wire']:.2f} |",
        "",
        f"dense table / unit: {r['dense_over_unit']:.1f}x; put {r['put_s']:.2f} s, a rank's read {r['read_s']:.2f} s "
        f"(median), a packed micro-batch {r['packed_mb_s'] * 1e3:.1f} ms (a rank's mean, median of the ranks)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--median", type=int, default=4096)
    p.add_argument("--max", type=int, default=32768)
    p.add_argument("--put", type=int, default=32, help="samples a put")
    p.add_argument("--cap", type=int, default=65536, help="tokens a micro-batch")
    p.add_argument("--data-parallel", type=int, default=2)
    p.add_argument("--shm", action="store_true", help="put through the same-host arena")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write results.json there")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routed_experts.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
