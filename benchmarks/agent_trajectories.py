"""Long multi-turn agent trajectories built turn by turn with appends: what a unit holds and
what each turn costs, against rewriting the whole sample every turn.

    python benchmarks/agent_trajectories.py [--samples 64] [--tokens 131072] [--turns 16]
                                            [--layers 48] [--top-k 8] [--experts 128] [--shm]
                                            [--heartbeat 1] [--out DIR]

Each of ``--samples`` trajectories of ``--tokens`` tokens grows in ``--turns`` turns of equal
length, assistant turns (loss mask 1, the policy version of the turn) and tool turns (loss mask
0) by turns; each turn appends its ``response_ids`` (int32), ``loss_mask`` (int8) and
``routed_experts`` (int32 ``[tokens, layers, top_k]``, expert ids under ``--experts``) to the
sample with ``rollouts.complete(..., append=[...])``: the first turn is a partial put, the last
finishes the samples. A producer writes one turn of every sample a call, to a LocalCluster of
one storage unit (real processes); then a reader reads every sample back and checks its bytes
and its per-token versions exactly, ``--read`` samples a read.

Reported: the unit's stored bytes (``status()``) and resident memory's growth after the first,
middle and last turns; per turn, the wall time and the bytes sent (``ClientStats.wire_bytes``)
(medians of the first and of the last half of the turns: an append's cost does not grow with
what is stored); the bytes rewriting whole samples at every turn would have sent (at the
width the turns crossed at); the read's time.
``--shm`` writes through the same-host arena instead of sockets. The unit's bytes are read from
``status()`` once two of its heartbeats came after the turn: ``--heartbeat`` (the cluster's
interval, s; tqueue's default 1) shortens that wait, as the smoke tests do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import tqueue
from benchmarks.routed_experts import rss
from benchmarks.shared_values import _settled, _unit_bytes
from tqueue.config import HEARTBEAT_INTERVAL

FIELDS = ["response_ids", "loss_mask", "routed_experts"]


def turn_of(sample: int, turn: int, n: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(sample * 1000 + turn)
    return {
        "response_ids": torch.randint(0, 150_000, (n,), generator=g, dtype=torch.int32),
        "loss_mask": torch.full((n,), int(turn % 2 == 0), dtype=torch.int8),  # even turns: the assistant's
        "routed_experts": torch.randint(0, args.experts, (n, args.layers, args.top_k), generator=g, dtype=torch.int32),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.tokens // args.turns
    tokens = n * args.turns
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0) if args.shm else tqueue.ClientConfig(shm=False)
    out: dict[str, Any] = {
        "samples": args.samples, "tokens": tokens, "turns": args.turns, "route": "arena" if args.shm else "sockets",
        "ids": args.samples * tokens * args.layers * args.top_k,
    }
    per_turn: list[dict[str, float]] = []
    with (
        tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": args.heartbeat}) as cluster,
        tqueue.Client(cluster.address, config=config) as producer,
    ):
        unit = cluster.pids[1]
        base = rss(unit)
        meta = None
        for t in range(args.turns):
            cols: dict[str, list[torch.Tensor]] = {f: [] for f in FIELDS}
            for s in range(args.samples):
                for f, v in turn_of(s, t, n, args).items():
                    cols[f].append(v)
            version = t // 2  # the weights of the assistant turn, and of the tool turn after it
            sent, t0 = producer.stats.wire_bytes, time.perf_counter()
            if meta is None:
                meta = producer.put("agent", cols, version=version, partial=True)
            else:
                producer.rollouts.complete(meta, cols, version=version, first_token=t * n, append=FIELDS,
                                           finished=t == args.turns - 1)
            took = time.perf_counter() - t0
            del cols
            row = {"turn": t, "s": took, "wire_bytes": producer.stats.wire_bytes - sent}
            if t in (0, args.turns // 2, args.turns - 1):
                st = _settled(producer)
                row.update(unit_bytes=_unit_bytes(st), rss_growth=rss(unit) - base)
            per_turn.append(row)
        with tqueue.Client(cluster.address, config=config) as reader:
            leased = reader.get_meta("agent", FIELDS, args.samples, task="train", timeout=120)
            exact, took = True, 0.0
            for at in range(0, len(leased), args.read):  # as a trainer reads: a few samples at a time
                t0 = time.perf_counter()
                batch = reader.get_data(leased.select(range(at, min(at + args.read, len(leased)))),
                                        dtype={"routed_experts": torch.uint8})  # kept at one byte an id
                took += time.perf_counter() - t0
                versions = batch.token_versions("response_ids")
                for k, i in enumerate(batch.meta.indexes):
                    s = meta.indexes.index(i)
                    for f in FIELDS:
                        want = torch.cat([turn_of(s, t, n, args)[f] for t in range(args.turns)])
                        exact &= torch.equal(batch[f][k], want.to(batch[f][k].dtype))
                    exact &= torch.equal(versions[k], torch.arange(tokens) // n // 2)  # each turn's version
                del batch
            out["read_s"] = took
            out["read_back_exact"] = bool(exact)
    half = args.turns // 2
    sample_bytes = n * (4 + 1 + args.layers * args.top_k * 4)  # a turn of one sample, as the engine hands it over
    out.update(
        per_turn=per_turn,
        turn_s_first_half=statistics.median(r["s"] for r in per_turn[1:half]) if half > 1 else per_turn[0]["s"],
        turn_s_last_half=statistics.median(r["s"] for r in per_turn[half:]),
        turn_wire_first_half=statistics.median(r["wire_bytes"] for r in per_turn[1:half]) if half > 1 else per_turn[0]["wire_bytes"],
        turn_wire_last_half=statistics.median(r["wire_bytes"] for r in per_turn[half:]),
        turn_engine_bytes=args.samples * sample_bytes,
        appends_wire_total=sum(r["wire_bytes"] for r in per_turn),
        # each turn sending the whole sample so far, at the width its turns crossed at
        rewrite_wire_total=sum(itertools.accumulate(r["wire_bytes"] for r in per_turn)),
        unit_bytes=per_turn[-1]["unit_bytes"], rss_growth=per_turn[-1]["rss_growth"],
    )
    out["unit_bytes_per_id"] = out["unit_bytes"] / out["ids"]
    return out


def table(r: dict[str, Any]) -> str:
    mb = 1e6
    marks = [p for p in r["per_turn"] if "unit_bytes" in p]
    return "\n".join([
        f"{r['samples']} samples of {r['tokens']} tokens in {r['turns']} turns; route: {r['route']}; read back exactly: "
        f"{r['read_back_exact']}",
        "",
        "| after turn | unit stores | unit's resident growth |",
        "|---:|---:|---:|",
        *(f"| {p['turn'] + 1} | {p['unit_bytes'] / mb:.0f} MB | {p['rss_growth'] / mb:.0f} MB |" for p in marks),
        "",
        "| a turn of every sample | first half (median) | last half (median) |",
        "|---|---:|---:|",
        f"| wall time | {r['turn_s_first_half']:.2f} s | {r['turn_s_last_half']:.2f} s |",
        f"| bytes sent | {r['turn_wire_first_half'] / mb:.0f} MB | {r['turn_wire_last_half'] / mb:.0f} MB |",
        "",
        f"a turn as the engine hands it over: {r['turn_engine_bytes'] / mb:.0f} MB; all turns sent "
        f"{r['appends_wire_total'] / mb:.0f} MB, rewriting whole samples each turn would send "
        f"{r['rewrite_wire_total'] / mb:.0f} MB; the unit holds {r['unit_bytes_per_id']:.2f} bytes an expert id; "
        f"the read took {r['read_s']:.2f} s",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--read", type=int, default=8, help="samples a read")
    p.add_argument("--shm", action="store_true", help="write through the same-host arena")
    p.add_argument("--heartbeat", type=float, default=HEARTBEAT_INTERVAL,
                   help="the cluster's heartbeat interval, s (tqueue's default: 1); status() is read after two")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write agent_trajectories.json there")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "agent_trajectories.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
