"""``tqueue demo --engine vllm``: the main job with a real inference engine.

A real vLLM engine (its CPU build; a tiny random Llama made on the spot, nothing from a hub)
generates GRPO groups through the rollout driver into one partition per step, over-sampling:
each step asks for ``--over`` times the samples the trainer needs, seals itself at the target,
and the surplus still running is aborted on the engine and kept as partial rollouts that the
next step resumes. A trainer (here a stand-in that reads, checks and acks each step) advances
the weight version after every step; the engine is told, so the tokens it produces carry the
version, and the staleness bound holds the engine back when it runs too far ahead. The
summary shows, per step, what was stored, aborted and resumed, and the versions the trainer
saw.

The summary table alone goes to stdout. A line per trained step goes to stderr, as do the
engine's logs: its warnings, or with ``--verbose`` its INFO lines and loading bars.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tempfile
import time
import warnings
import weakref
from typing import Any

from .._extras import require

ENGINES = ("vllm",)
SHUTDOWN_S = 30  # the engine processes' time to exit before vLLM kills them (its default, 5 s, is short here)
# megatron-core's notice on import, in every rank, that it falls back from Transformer Engine and Apex
MEGATRON_FALLBACK = "Transformer Engine and Apex are not installed"


def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    """The flags of the engine demo that only it reads, for ``tqueue demo``'s parser (its
    group for ``--engine``): ``--verbose``."""
    group.add_argument("--verbose", action="store_true",
                       help="with --engine: show the engine's own logs (vLLM's INFO lines, its loading bars) on stderr; "
                            "without it, only its warnings")


def _engine_environment(scratch: str, *, verbose: bool) -> None:
    """vLLM's settings, read when it is imported, in this process and in the engine processes
    it starts: offline, a 1 GiB KV cache, temporary files in this run's folder, logs on stderr
    (stdout is the table's), at WARNING unless ``verbose``; without ``verbose``, no loading
    bars and no megatron-core fallback notices either. Settings already in the environment
    win, except that ``verbose`` asks for INFO."""
    env = {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": scratch,
        "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if verbose:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    else:
        env["TQDM_DISABLE"] = "1"  # the loading bars of transformers and vLLM
        env["PYTHONWARNINGS"] = f"ignore:{MEGATRON_FALLBACK}"  # the ranks' interpreters
        warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK)  # this one
    for key, value in env.items():
        os.environ.setdefault(key, value)


DP_RANKS = 2


async def _megatron_trainer(address: str, driver: Any, steps: int, per_step: int) -> list[dict[str, Any]]:
    """The trainer as megatron-core data-parallel ranks (processes on gloo), each reading its
    share of every step through StepReader and taking a stand-in training step; rank 0
    advances the trainer's version, and the engine is told (the weights are 'published')."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pipes, procs = [], []
    for rank in range(DP_RANKS):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_megatron_rank, args=(rank, DP_RANKS, port, address, steps, per_step // DP_RANKS, theirs))
        proc.start()
        theirs.close()
        pipes.append(mine)
        procs.append(proc)
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        for k in range(steps):
            started = time.monotonic()
            got = [await loop.run_in_executor(None, p.recv) for p in pipes]  # each rank's report of step k
            await driver.set_version(k + 1)  # rank 0 set the trainer's version; the engine now runs it
            lo = min(g["lo"] for g in got)
            seen.append({"step": k, "samples": sum(g["samples"] for g in got), "versions": (lo, max(g["hi"] for g in got)),
                         "mixed": sum(g["mixed"] for g in got), "staleness": k - lo, "wait": time.monotonic() - started,
                         "ok": all(g["ok"] for g in got) and len({g["micro"] for g in got}) == 1,
                         "micro": got[0]["micro"], "loss": got[0]["loss"]})
            _progress(seen[-1], steps, began)
    finally:
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return seen


def _megatron_rank(rank: int, world: int, port: int, address: str, steps: int, batch: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from ..bridges.megatron import StepReader
    from ..client import Client

    ps = require("megatron.core.parallel_state", "megatron", by="tqueue demo --trainer megatron")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        with Client(address) as client:
            reader = StepReader(client, mode="each")
            for k in range(steps):
                step = reader.read(f"rl/step-{k}", ["response_ids", "response_logprobs", "loss_mask"], batch,
                                   max_tokens_per_micro_batch=512, timeout=600)
                loss = torch.zeros(1)
                for mb in step.micro_batches:  # a stand-in training step: the policy-gradient loss's shape
                    mask = mb["loss_mask"].float()
                    loss += -(mb["response_logprobs"] * mask).sum() / mask.sum().clamp(min=1)
                dist.all_reduce(loss, group=ps.get_data_parallel_group())  # as gradients are reduced
                meta = step.meta
                versions_lo = [v for v in (meta.versions or []) if v >= 0]
                versions_hi = [v for v in (meta.versions_max or []) if v >= 0]
                ok = all(len(a) == len(b) for a, b in zip(step.fields["response_ids"], step.fields["response_logprobs"]))
                reader.done(step)
                if rank == 0:
                    client.set_version(k + 1)
                out.send({"samples": len(meta), "lo": min(versions_lo, default=0), "hi": max(versions_hi, default=0),
                          "mixed": sum(1 for a, b in zip(meta.versions or [], meta.versions_max or []) if a != b),
                          "micro": meta.num_microbatches, "loss": float(loss), "ok": ok})
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_engine_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code. The table goes to stdout; the engine's
    logs, and a line per step, to stderr."""
    if args.engine not in ENGINES:
        print(f"tqueue demo: --engine is one of {list(ENGINES)}, got {args.engine!r}", file=sys.stderr)
        return 2
    steps = args.steps  # tqueue demo has resolved it (2 with --quick, unless --steps says otherwise)
    verbose = bool(args.verbose)
    with tempfile.TemporaryDirectory(prefix="tqueue-demo-") as scratch:
        _engine_environment(scratch, verbose=verbose)
        require("vllm", "vllm", by="tqueue demo --engine vllm")
        if args.trainer == "megatron":
            require("megatron.core.parallel_state", "megatron", by="tqueue demo --trainer megatron")
        # vLLM keeps alive the frame that first imports its engine arguments, and the frames that
        # called it: that is this one, which holds no engine
        require("vllm.engine.arg_utils", "vllm", by="tqueue demo --engine vllm")
        from .tiny_model import make

        model = make(os.path.join(scratch, "tiny-llama"))
        rows = asyncio.run(_with_engine(str(model), verbose=verbose, steps=steps, groups=args.engine_groups,
                                        n=args.engine_group_size, over=args.over, trainer_kind=args.trainer or ""))
    _print(rows)
    return 0 if all(r["ok"] for r in rows) else 1


async def _with_engine(model: str, *, verbose: bool, **run: Any) -> list[dict[str, Any]]:
    """Start the engine, run, and shut it down, all in this loop: ``AsyncLLM.shutdown`` stops
    the engine processes and cancels the engine's output handler, a task of this loop.

    Only this frame holds the engine (the run gets a proxy), and it lets go once the engine is
    shut down, so that the engine goes now: ``AsyncLLM.__del__`` shuts down again, which at
    interpreter exit would find vLLM's modules torn down and print a ``TypeError``. A frame
    that outlives the run (in a traceback, or kept by vLLM) keeps at most the proxy."""
    arg_utils = require("vllm.engine.arg_utils", "vllm", by="tqueue demo --engine vllm")
    async_llm = require("vllm.v1.engine.async_llm", "vllm", by="tqueue demo --engine vllm")
    print("tqueue demo: starting a vLLM engine (CPU, tiny random Llama, float32) ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    llm = async_llm.AsyncLLM.from_engine_args(
        arg_utils.AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                                  use_tqdm_on_load=verbose)
    )
    try:
        print(f"tqueue demo: engine ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        return await _main(weakref.proxy(llm), **run)
    finally:
        llm.shutdown(timeout=SHUTDOWN_S)
        del llm
        gc.collect()  # the engine's reference cycles, while vLLM's modules are still there


def _progress(row: dict[str, Any], steps: int, started: float) -> None:
    """One line per trained step, on stderr."""
    lo, hi = row["versions"]
    print(f"tqueue demo: step {row['step']} trained ({row['step'] + 1} of {steps}): {row['samples']} samples, token "
          f"versions {lo}..{hi}, {row['mixed']} mixed-version, {'OK' if row['ok'] else 'FAILED'}, "
          f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


async def _main(llm: Any, *, steps: int, groups: int, n: int, over: float, trainer_kind: str = "") -> list[dict[str, Any]]:
    from ..bridges import Rollouts, VLLMEngine
    from ..client import AsyncClient, OverSampling
    from ..launch import LocalCluster

    rng = random.Random(0)
    asked = max(groups + 1, round(groups * over))
    with LocalCluster(num_storage_units=2) as cluster:
        async with AsyncClient(cluster.address) as producer, AsyncClient(cluster.address) as trainer:
            for k in range(steps + 1):  # the last one only receives what the last step recycles
                await trainer.create_partition(
                    f"rl/step-{k}", over_sampling=OverSampling(samples=groups * n, recycle_to=f"rl/step-{k + 1}"), tasks=["train"]
                )
            await trainer.rollouts.set_staleness(max_staleness=1, batch_size=groups * n)
            driver = Rollouts(producer, VLLMEngine(llm, sampling={"temperature": 1.0}), max_new_tokens=96)
            await driver.set_version(0)
            reports: list[Any] = []

            async def rollout() -> None:
                for k in range(steps):
                    fresh = max(1, asked - driver.partials // n)  # partials waiting count toward the ask
                    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randrange(4, 16))] for _ in range(fresh)]
                    budgets = [rng.choice((16, 32, 96)) for _ in prompts]  # short ones finish first
                    reports.append(await driver.step(f"rl/step-{k}", prompts, n=n, max_new_tokens=budgets))

            async def train() -> list[dict[str, Any]]:
                seen: list[dict[str, Any]] = []
                began = time.monotonic()
                for k in range(steps):
                    started = time.monotonic()
                    batch = await trainer.get_data(
                        f"rl/step-{k}", ["response_ids", "response_logprobs", "version_spans"], groups * n,
                        task="train", timeout=600,
                    )
                    versions = batch.token_versions("response_ids")
                    lo = min(int(v.min()) for v in versions if len(v))
                    hi = max(int(v.max()) for v in versions if len(v))
                    mixed = sum(1 for v in versions if len(v) and int(v.min()) != int(v.max()))
                    ok = all(len(a) == len(b) for a, b in zip(batch["response_ids"], batch["response_logprobs"]))
                    await trainer.ack(batch.meta)
                    await trainer.set_version(k + 1)  # the trainer's step: new weights ...
                    await driver.set_version(k + 1)  # ... that the engine now runs
                    seen.append({"step": k, "samples": len(batch.meta), "versions": (lo, hi), "mixed": mixed,
                                 "staleness": k - lo, "ok": ok, "wait": time.monotonic() - started})
                    _progress(seen[-1], steps, began)
                return seen

            if trainer_kind == "megatron":
                print(f"tqueue demo: the trainer is {DP_RANKS} megatron-core data-parallel ranks on gloo, reading through "
                      "StepReader", file=sys.stderr, flush=True)
                seen = (await asyncio.gather(rollout(), _megatron_trainer(cluster.address, driver, steps, groups * n)))[1]
            else:
                seen = (await asyncio.gather(rollout(), train()))[1]
    rows = []
    for report, got in zip(reports, seen):
        rows.append({**got, "requests": report.requests, "stored": report.stored, "aborted": report.aborted,
                     "recycled": report.recycled, "resumed": report.resumed, "abort_s": report.abort_seconds})
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    head: tuple[str, ...] = ("step", "requests", "stored", "aborted", "recycled", "resumed", "trained", "token versions",
                             "mixed-version samples", "staleness", "abort took", "result")
    ranks = rows and "micro" in rows[0]
    if ranks:
        head += ("micro-batches per rank", "loss (stand-in)")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        took = "-" if r["abort_s"] is None else f"{r['abort_s']:.2f} s"
        cells: tuple[Any, ...] = (r["step"], r["requests"], r["stored"], r["aborted"], r["recycled"], r["resumed"], r["samples"],
                 f"{r['versions'][0]}..{r['versions'][1]}", r["mixed"], r["staleness"], took, "OK" if r["ok"] else "FAILED")
        if ranks:
            cells += (r["micro"], f"{r['loss']:.3f}")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    sys.stdout.flush()
