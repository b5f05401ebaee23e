"""Micro-batches of one training step: tqueue's plan and shaping against verl's, on the same step.

    python benchmarks/microbatches.py [--samples 512] [--dp 2,4] [--cap 16384] [--vpp 1,4]
                                      [--multiple 8] [--repeat 3] [--verl DIR]

The step: ``--samples`` sequences, prompts of 128 to 1024 tokens (uniform), responses of 16 to
2048 (log-normal, median about 450, clipped), seeded. For each data-parallel size and virtual
pipeline size, two planners split the step among the ranks and cut every rank's share into the
same number of micro-batches under a token cap, that number a multiple of the virtual pipeline
size:

* tqueue: the controller's planner (``tqueue.controller.planning._balance.plan_round`` with a
  ``MicroRule``), whose micro-batches are then shaped by the client's own code
  (``tqueue.client._micro.shape``): the cells counted are those of the tensors it builds;
* verl: verl's own ``get_seqlen_balanced_partitions`` over ``calculate_workload`` for the ranks
  (``RayPPOTrainer._balance_batch``) and ``rearrange_micro_batches`` for the micro-batches, the
  count made equal across ranks as its all-reduce does (each rank's count first, then the
  largest as ``min_num_micro_batch``). verl is imported from an install without its
  dependencies (``pip install --no-deps verl`` into a throwaway virtual environment, and
  ``--verl`` naming its site-packages): ``seqlen_balancing.py`` is loaded from there with
  stand-ins for the three verl modules it imports (``DataProto``, which it does not call here,
  ``get_device_name``, and verl's ``tensordict_utils``, loaded for real).

Columns: micro-batches per rank; the largest micro-batch's tokens and how many micro-batches
of more than one sample exceed the cap (verl's count is a lower bound that its workload
balance may overshoot); the heaviest rank's and micro-batch's tokens over the mean; padding,
as a share of the cells of the jagged field: padded to the longest sample of the share (what a
share fetched ``jagged="padded"`` holds), padded per micro-batch, packed with each sequence
padded to a multiple of ``--multiple``; the planning time (the best of ``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import pathlib
import sys
import time
import types
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from tqueue.client._micro import shape
from tqueue.controller.planning._balance import MicroRule, plan_round
from tqueue.wire import BatchMeta, FieldSpec


def step_lengths(samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(128, 1025, samples)
    responses = np.clip(rng.lognormal(np.log(450), 0.9, samples), 16, 2048).astype(np.int64)
    return prompts + responses


def load_verl(site: str | None) -> types.ModuleType:
    """verl's ``verl/utils/seqlen_balancing.py``, from ``site`` or from ``sys.path``."""
    spec = importlib.machinery.PathFinder.find_spec("verl", [site] if site else None)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "verl is not installed: python -m venv /tmp/verl-venv && /tmp/verl-venv/bin/pip install --no-deps verl, "
            "then --verl /tmp/verl-venv/lib/python3.X/site-packages"
        )
    root = pathlib.Path(list(spec.submodule_search_locations)[0])

    def module(name: str, path: pathlib.Path | None = None, **attrs: Any) -> types.ModuleType:
        if path is None:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package, for the submodules below
        else:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            mod = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = mod
            file_spec.loader.exec_module(mod)
        for key, value in attrs.items():
            setattr(mod, key, value)
        sys.modules[name] = mod
        return mod

    module("verl")
    module("verl.protocol", DataProto=object)
    module("verl.utils")
    module("verl.utils.device", get_device_name=lambda: "cpu")
    module("verl.utils.tensordict_utils", root / "utils" / "tensordict_utils.py")
    return module("verl.utils.seqlen_balancing", root / "utils" / "seqlen_balancing.py")


def verl_plan(verl: types.ModuleType, lengths: np.ndarray, dp: int, cap: int, vpp: int) -> list[list[list[int]]]:
    """Per rank, its micro-batches as positions into ``lengths``, as verl plans them."""
    from tensordict import TensorDict

    workload = verl.calculate_workload(torch.from_numpy(lengths)).tolist()
    ranks = verl.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)

    def rearrange(rank: list[int], least: int | None) -> list[list[int]]:
        rank_lengths = lengths[rank]
        mask = torch.arange(int(rank_lengths.max())) < torch.from_numpy(rank_lengths)[:, None]
        batch = TensorDict({"input_ids": mask.long(), "attention_mask": mask}, batch_size=[len(rank)])
        _, idx = verl.rearrange_micro_batches(
            batch, max_token_len=cap, num_batches_divided_by=vpp if least is not None else None,
            min_num_micro_batch=least,
        )
        return [[rank[i] for i in mb] for mb in idx]

    counts = [len(rearrange(r, None)) for r in ranks]  # each rank's own count, before the all-reduce
    return [rearrange(r, max(counts)) for r in ranks]


def tqueue_plan(lengths: np.ndarray, dp: int, cap: int, vpp: int) -> list[list[list[int]]]:
    plan = plan_round(lengths, dp, rule=MicroRule(max_tokens=cap, multiple_of=vpp))
    return plan.micro_batches  # positions into lengths, as verl_plan's


def cells(lengths: np.ndarray, micro: list[list[list[int]]], multiple: int) -> dict[str, int]:
    """Cells of the jagged field for each layout, counted on the tensors tqueue's client builds."""
    spec = {"input_ids": FieldSpec(kind="tensor", dtype="int32", layout="jagged", ndim=1)}
    out = {"share": 0, "padded": 0, "packed": 0}
    for mbs in micro:
        share = [p for mb in mbs for p in mb]
        where = {p: i for i, p in enumerate(share)}
        out["share"] += len(share) * int(lengths[share].max())
        meta = BatchMeta(partition="step", partition_uid=1, indexes=share, units=[0] * len(share),
                         fields=["input_ids"], schema=spec, micro_batch_indices=[[where[p] for p in mb] for mb in mbs],
                         num_microbatches=len(mbs))
        values = {"input_ids": [torch.zeros(int(lengths[p]), dtype=torch.int32) for p in share]}
        out["padded"] += sum(mb["input_ids"].numel() for mb in shape(meta, values, form="padded"))
        out["packed"] += sum(mb["input_ids"].numel() for mb in shape(meta, values, form="packed", pad_to_multiple_of=multiple))
    return out


def row(name: str, lengths: np.ndarray, micro: list[list[list[int]]], cap: int, multiple: int, ms: float) -> str:
    tokens = int(lengths.sum())
    rank_sums = [sum(int(lengths[mb].sum()) for mb in mbs) for mbs in micro]
    mb_sums = [int(lengths[mb].sum()) for mbs in micro for mb in mbs]
    over = sum(1 for mbs in micro for mb in mbs if len(mb) > 1 and lengths[mb].sum() > cap)
    counts = {len(mbs) for mbs in micro}
    c = cells(lengths, micro, multiple)
    waste = {k: 100 * (v - tokens) / v for k, v in c.items()}
    return (
        f"| {name} | {'/'.join(map(str, sorted(counts)))} | {max(mb_sums)} | {over} | "
        f"{max(rank_sums) / np.mean(rank_sums):.4f} | {max(mb_sums) / np.mean(mb_sums):.3f} | "
        f"{waste['share']:.1f}% | {waste['padded']:.1f}% | {waste['packed']:.1f}% | {ms:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--dp", default="2,4", help="data-parallel sizes")
    ap.add_argument("--cap", type=int, default=16384, help="max tokens per micro-batch (verl's ppo_max_token_len_per_gpu)")
    ap.add_argument("--vpp", default="1,4", help="virtual pipeline sizes: the count is a multiple of it")
    ap.add_argument("--multiple", type=int, default=8, help="packed form: each sequence padded to a multiple (e.g. 2*CP*TP)")
    ap.add_argument("--verl", default=None, help="site-packages directory holding verl (pip install --no-deps verl)")
    ap.add_argument("--repeat", type=int, default=3, help="plans timed per row; the fastest is reported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    verl = load_verl(args.verl)
    lengths = step_lengths(args.samples, args.seed)
    print(f"step: {args.samples} sequences, {int(lengths.sum())} tokens, lengths {int(lengths.min())}..{int(lengths.max())} "
          f"(median {int(np.median(lengths))}); cap {args.cap} tokens per micro-batch; packed: multiple of {args.multiple}")
    print()
    print("| planner | micro-batches per rank | largest micro-batch (tokens) | over the cap | heaviest rank / mean "
          "| heaviest micro-batch / mean | padding: share padded | padding: per micro-batch | padding: packed | plan ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dp in (int(x) for x in args.dp.split(",")):
        for vpp in (int(x) for x in args.vpp.split(",")):
            for name, planner in (("tqueue", lambda d=dp, v=vpp: tqueue_plan(lengths, d, args.cap, v)),
                                  ("verl", lambda d=dp, v=vpp: verl_plan(verl, lengths, d, args.cap, v))):
                ms = float("inf")
                for _ in range(max(1, args.repeat)):
                    t0 = time.perf_counter()
                    micro = planner()
                    ms = min(ms, 1000 * (time.perf_counter() - t0))
                print(row(f"{name}, DP={dp}, VPP={vpp}", lengths, micro, args.cap, args.multiple, ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
