"""``tqueue demo``: a simulated GRPO data flow on the embedded local cluster.

Producer processes play inference engines: for each prompt they "generate" a group of
responses of random lengths and put the group (prompt ids, response ids, log-probs, the
prompt text and a metadata dict), tagged with its prompt uid and the policy version, to the
partition of the current step. They may run at most one step ahead of the trainer (the
staleness bound); beyond that their puts wait. Consumer processes play data-parallel ranks:
each takes its token-balanced share of whole groups of every step, in micro-batches, checks
it and acks; rank 0 then advances the trainer's version. The launcher seals each step once
all its groups are in; a sealed step frees itself when the trainer has consumed it. Progress
shows as reports arrive; a summary table ends the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any, cast

FIELDS = ["prompt_ids", "response_ids", "log_probs", "prompt", "meta"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--producers", type=int, default=3, help="producer processes (default 3)")
    p.add_argument("--consumers", type=int, default=2, help="consumer processes, one per DP rank (default 2)")
    p.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (default 8)")
    p.add_argument("--max-response", type=int, default=2048, help="longest response in tokens")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch (default 16384)")
    p.add_argument("--quick", action="store_true", help="a small run (CI)")
    e = p.add_argument_group("with a real engine (tqueue/bridges/demo.py)")
    e.add_argument("--engine", choices=["vllm"], help="generate with a real engine (needs the extra: pip install 'tqueue[vllm]')")
    e.add_argument("--engine-groups", type=int, default=4, help="prompts the trainer needs per step (default 4)")
    e.add_argument("--engine-group-size", type=int, default=4, help="samples per prompt (default 4)")
    e.add_argument("--over", type=float, default=1.5, help="over-sampling: prompts asked per prompt needed (default 1.5)")
    e.add_argument("--trainer", choices=["megatron"], help="train with megatron-core DP ranks on gloo (pip install 'tqueue[megatron]')")


@dataclasses.dataclass(frozen=True)
class Plan:
    address: str
    steps: int
    prompts: int
    group_size: int
    producers: int
    consumers: int
    units: int
    max_response: int
    max_tokens: int

    @property
    def per_step(self) -> int:
        return self.prompts * self.group_size


def _producer(plan: Plan, rank: int, out: Connection) -> None:
    import torch

    from .client import Client

    g = torch.Generator().manual_seed(1234 + rank)
    with Client(plan.address) as client:
        for step in range(plan.steps):
            for prompt in range(rank, plan.prompts, plan.producers):
                uid = f"s{step}-p{prompt}"
                n = plan.group_size
                plen = int(torch.randint(128, 1024, (1,), generator=g))
                lens = torch.randint(16, plan.max_response, (n,), generator=g).tolist()
                prompt_ids = torch.randint(0, 150_000, (plen,), generator=g)
                started = time.perf_counter()
                client.put(
                    f"train/step-{step}",
                    {
                        "prompt_ids": [prompt_ids] * n,
                        "response_ids": [torch.randint(0, 150_000, (k,), generator=g) for k in lens],
                        "log_probs": [-torch.rand(k, generator=g) for k in lens],
                        "prompt": [f"<prompt {uid}> " + "lorem ipsum " * 170] * n,
                        "meta": [{"uid": uid, "sample": i, "finish_reason": "stop", "step": step} for i in range(n)],
                    },
                    groups=uid,
                    version=step,
                    timeout=600,  # the staleness bound may hold it until the trainer advances
                )
                _send(out, {"kind": "put", "step": step, "samples": n, "seconds": time.perf_counter() - started})
        _send(out, {"kind": "done", "copied": client.stats.copied_bytes, "put_bytes": client.stats.put_bytes})


def _consumer(plan: Plan, rank: int, out: Connection) -> None:
    import torch

    from .client import Client

    share = plan.per_step // plan.consumers
    got = 0
    with Client(plan.address) as client:
        for step in range(plan.steps):
            partition = f"train/step-{step}"
            t0 = time.perf_counter()
            meta = client.get_meta(
                partition,
                FIELDS,
                share,
                task="actor_train",
                timeout=300,
                policy="groups",
                dp_rank=rank,
                dp_size=plan.consumers,
                max_tokens_per_micro_batch=plan.max_tokens,
            )
            t1 = time.perf_counter()
            batch = client.get_data(meta, jagged={"response_ids": "padded", "log_probs": "padded"})
            t2 = time.perf_counter()
            # the fields of one sample belong together, and to its group
            if not torch.equal(batch.lengths("response_ids"), batch.lengths("log_probs")):
                raise AssertionError("response_ids and log_probs of a sample differ in length")
            for i, m in enumerate(batch["meta"]):
                if meta.groups is None or meta.groups[i] != m["uid"] or not batch["prompt"][i].startswith(f"<prompt {m['uid']}>"):
                    raise AssertionError(f"sample {meta.indexes[i]}: fields of different samples mixed up")
            groups = list(meta.groups or [])
            if any(groups.count(g) != plan.group_size for g in set(groups)):
                raise AssertionError("a GRPO group arrived incomplete")
            tokens = int(batch.lengths("prompt_ids").sum() + batch.lengths("response_ids").sum())
            client.ack(meta)
            if rank == 0:
                client.set_version(step + 1)  # the trainer moves on: producers may too
            _send(out, {"kind": "get", "step": step, "samples": len(meta), "wait": t1 - t0, "fetch": t2 - t1,
                        "bytes": client.stats.get_bytes - got, "tokens": tokens, "micro": meta.num_microbatches})
            got = client.stats.get_bytes
        _send(out, {"kind": "done", "copied": client.stats.copied_bytes})


def _send(out: Connection, msg: dict[str, Any]) -> None:
    out.send_bytes(json.dumps(msg).encode())


class _Progress:
    def __init__(self, total: int, stream: Any) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.done = 0
        self.last_tenth = -1
        self.started = time.perf_counter()

    def update(self, done: int, delivered: int) -> None:
        self.done = done
        frac = done / self.total if self.total else 1.0
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        line = (
            f"[{'#' * int(30 * frac):<30}] {100 * frac:5.1f}%  {done}/{self.total} samples  "
            f"{done / elapsed:8.0f} samples/s  {delivered / elapsed / 1e9:5.2f} GB/s"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif int(frac * 10) != self.last_tenth:
            self.last_tenth = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_demo(args: argparse.Namespace) -> int:
    from .client import Client
    from .launch import LocalCluster

    if args.quick:
        args.producers, args.consumers, args.steps, args.prompts, args.group_size = 2, 2, 2, 8, 4
        args.max_response = min(args.max_response, 512)
    if args.prompts % args.consumers:
        print(f"tqueue demo: --prompts ({args.prompts}) must be a multiple of --consumers ({args.consumers}): "
              "every DP rank takes whole groups", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    with LocalCluster(num_storage_units=args.units) as cluster:
        plan = Plan(
            address=cluster.address,
            steps=args.steps,
            prompts=args.prompts,
            group_size=args.group_size,
            producers=args.producers,
            consumers=args.consumers,
            units=args.units,
            max_response=args.max_response,
            max_tokens=args.max_tokens,
        )
        print(
            f"tqueue demo: {plan.producers} producers -> {plan.units} "
            f"storage units -> {plan.consumers} DP ranks; {plan.steps} steps x {plan.prompts} prompts x "
            f"{plan.group_size} responses; controller at {cluster.address}",
            flush=True,
        )
        with Client(cluster.address) as admin:
            for step in range(plan.steps):
                admin.create_partition(f"train/step-{step}", group_size=plan.group_size, tasks=["actor_train"])
            admin.set_staleness(max_staleness=1, batch_size=plan.per_step)
        pipes: dict[Connection, str] = {}
        procs = []
        for role, target, count in (("producer", _producer, plan.producers), ("consumer", _consumer, plan.consumers)):
            for rank in range(count):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=target, args=(plan, rank, send), name=f"{role}-{rank}", daemon=True)
                proc.start()
                send.close()
                pipes[recv] = role
                procs.append(proc)
        result = _watch(plan, pipes, procs, cluster.address)
        for proc in procs:
            proc.join(timeout=30)
        with Client(cluster.address) as client:
            left = [p.name for p in client.status().partitions]
            result["left"] = left
            for name in left:
                client.clear(name)
    _summary(plan, result)
    return 0 if result["ok"] else 1


def _watch(plan: Plan, pipes: dict[Connection, str], procs: list[Any], address: str) -> dict[str, Any]:
    from .client import Client

    total = plan.per_step * plan.steps
    progress = _Progress(total, sys.stderr)
    waits: list[float] = []
    fetches: list[float] = []
    puts: list[float] = []
    consumed = 0
    per_step = [0] * plan.steps
    put_per_step = [0] * plan.steps
    tokens: dict[int, list[int]] = {}
    micro: set[int] = set()
    last = 0.0
    copied = 0
    delivered = 0
    put_bytes = 0
    first: float | None = None  # from the first report: process start-up is not data plane time
    live = dict(pipes)
    ok = True
    with Client(address) as client:
        while live:
            ready = wait(list(live), timeout=600)
            if not ready:
                print("demo: no progress for 600 s; giving up", file=sys.stderr)
                ok = False
                break
            for conn in cast("list[Connection]", ready):  # wait() returns what it was given
                try:
                    msg = json.loads(conn.recv_bytes())
                except EOFError:
                    live.pop(conn)
                    continue
                if first is None:
                    first = time.perf_counter() - msg.get("seconds", 0.0)
                    progress.started = first
                last = time.perf_counter()
                if msg["kind"] == "put":
                    puts.append(msg["seconds"])
                    put_per_step[msg["step"]] += msg["samples"]
                    if put_per_step[msg["step"]] == plan.per_step:
                        client.seal(f"train/step-{msg['step']}")  # frees itself once consumed
                elif msg["kind"] == "get":
                    waits.append(msg["wait"])
                    fetches.append(msg["fetch"])
                    consumed += msg["samples"]
                    delivered += msg["bytes"]
                    per_step[msg["step"]] += msg["samples"]
                    tokens.setdefault(msg["step"], []).append(msg["tokens"])
                    micro.add(msg["micro"])
                    progress.update(consumed, delivered)
                elif msg["kind"] == "done":
                    copied += msg["copied"]
                    put_bytes += msg.get("put_bytes", 0)
    progress.close()
    elapsed = last - first if first is not None else float("nan")
    ok = ok and consumed == total and all(p.exitcode in (0, None) for p in procs)
    return {
        "ok": ok,
        "elapsed": elapsed,
        "consumed": consumed,
        "delivered": delivered,
        "put_bytes": put_bytes,
        "copied": copied,
        "waits": waits,
        "fetches": fetches,
        "puts": puts,
        "imbalance": statistics.median(max(t) / max(min(t), 1) for t in tokens.values()) if tokens else float("nan"),
        "micro": sorted(micro),
    }


def _summary(plan: Plan, r: dict[str, Any]) -> None:
    el = r["elapsed"]
    rows = [
        ("samples consumed", f"{r['consumed']} of {plan.per_step * plan.steps}"),
        ("data plane time (first put to last ack)", f"{el:.2f} s"),
        ("samples/s", f"{r['consumed'] / el:,.0f}"),
        ("payload delivered", f"{r['delivered'] / 1e6:,.1f} MB"),
        ("GB/s delivered", f"{r['delivered'] / el / 1e9:.3f}"),
        ("put latency p50 / p99", f"{1e3 * _pct(r['puts'], .5):.2f} / {1e3 * _pct(r['puts'], .99):.2f} ms"),
        ("get_meta wait p50 / p99", f"{1e3 * _pct(r['waits'], .5):.2f} / {1e3 * _pct(r['waits'], .99):.2f} ms"),
        ("get_data p50 / p99", f"{1e3 * _pct(r['fetches'], .5):.2f} / {1e3 * _pct(r['fetches'], .99):.2f} ms"),
        ("bytes copied per byte delivered", f"{r['copied'] / max(r['delivered'], 1):.2f}"),
        ("DP token imbalance (max/min rank, median step)", f"{r['imbalance']:.3f}"),
        ("micro-batches per rank (equal across ranks; by step)", ", ".join(map(str, r["micro"]))),
        ("steps left unfreed at the end", str(len(r.get("left", [])))),
        ("result", "OK" if r["ok"] else "FAILED"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\n| {'metric':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    print(
        "\nCopies counted are those tqueue makes in user space (packing small samples on put, "
        "padding on get); socket copies by the kernel are not counted."
    )
    sys.stdout.flush()
