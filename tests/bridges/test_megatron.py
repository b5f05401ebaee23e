"""Data-parallel ranks read their steps: 4 real processes on gloo, DP=2 x TP=2 given as plain
``torch.distributed`` ranks (the integration tier runs the same with megatron-core's
``parallel_state``: tests/bridges/test_megatron_core.py). Both ways of reaching a replica:
each rank reads, or the first reads and broadcasts tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tqueue
from tqueue.bridges.megatron import backend_for, pick_device

from ._dist import run_job

STEPS, BATCH = 3, 8  # per DP rank


def producer(address: str, prefix: str, dp: int):
    rng = np.random.default_rng(7)

    def produce(k: int) -> None:
        lengths = (rng.lognormal(3.0, 0.8, dp * BATCH).astype(int) + 1).clip(1, 60).tolist()
        with tqueue.Client(address) as c:
            c.create_partition(f"{prefix}-{k}", tasks=["train", "check"])  # "check" reads the written-back values
            c.put(f"{prefix}-{k}", {
                "ids": [torch.arange(n, dtype=torch.int64) + 1000 * k + i for i, n in enumerate(lengths)],
                "n": torch.tensor(lengths), "tag": [f"s{k}-{i}" for i in range(len(lengths))],
                "flag": torch.tensor([i % 3 == 0 for i in range(len(lengths))]),
            })
            c.seal(f"{prefix}-{k}")

    return produce


def check(result: dict, world: int, tp: int, pp: int = 1) -> None:
    reports = result["reports"]
    dp = world // (tp * pp)
    replicas = {}
    for rank, (dp_rank, replica) in result["ready"].items():
        replicas.setdefault(dp_rank, replica)
        assert replicas[dp_rank] == replica and rank in replica
    assert sorted(replicas) == list(range(dp))
    for k in range(STEPS):
        shares = {}
        for dp_rank, replica in replicas.items():
            got = [reports[(r, k)] for r in replica]
            first = got[0]
            for other in got[1:]:  # every TP/PP rank of a replica: identical bytes and schedule
                assert other["digest"] == first["digest"] and other["mb_digest"] == first["mb_digest"]
                assert (other["indexes"], other["micro"], other["num_micro"]) == (first["indexes"], first["micro"], first["num_micro"])
            shares[dp_rank] = first
        everyone = [i for s in shares.values() for i in s["indexes"]]
        assert len(everyone) == len(set(everyone)) == dp * BATCH  # disjoint, whole round
        tokens = [s["tokens"] for s in shares.values()]
        assert max(tokens) <= 1.25 * min(tokens) + 60, tokens  # balanced (within one sample)
        assert len({s["num_micro"] for s in shares.values()}) == 1  # equal micro-batch counts
        for s in shares.values():
            assert s["global"] == dp * BATCH and len(s["micro"]) == s["num_micro"]
            assert sorted(i for mb in s["micro"] for i in mb) == list(range(BATCH))
            assert s["mb_sizes"] == [len(mb) for mb in s["micro"]]
            assert all(t.startswith(f"s{k}-") for t in s["tags"])

    held = result["held"]
    for rank in result["ready"]:
        wall, cpu = reports[(rank, STEPS - 1)]["waited"]
        assert wall >= held * 0.9, (rank, wall)
        assert cpu < 0.25, f"rank {rank} burnt {cpu:.3f} s of CPU in {wall:.2f} s of waiting"


def check_written_back(address: str, prefix: str, result: dict) -> None:
    """Each replica's first rank wrote ``value`` (its position + 100 step + dp rank) once; a
    second task reads it. Then every task is done and each sealed step frees itself."""
    with tqueue.Client(address) as c:
        for k in range(STEPS):
            shares = {}
            for (_rank, step), rep in result["reports"].items():
                if step == k:
                    shares[tuple(rep["indexes"])] = rep
            expected = {}
            for indexes, rep in shares.items():
                dp_rank = result["ready"][rep["rank"]][0]
                expected.update({i: float(pos + 100 * k + dp_rank) for pos, i in enumerate(indexes)})
            meta = c.get_meta(f"{prefix}-{k}", ["value"], len(expected), task="check", timeout=10)
            values = c.get_data(meta)["value"].tolist()
            assert {i: v for i, v in zip(meta.indexes, values)} == expected
            c.ack(meta)
        assert not [p.name for p in c.status().partitions if p.name.startswith(prefix)]


@pytest.mark.parametrize("mode", ["each", "broadcast"])
def test_dp2_tp2_ranks_get_disjoint_balanced_shares_and_replicas_identical_bytes(cluster, partition, mode):
    result = run_job(cluster.address, partition, world=4, steps=STEPS, batch=BATCH, mode=mode, layout={"tp": 2},
                     produce=producer(cluster.address, partition, 2))
    check(result, 4, tp=2)
    check_written_back(cluster.address, partition, result)


STAND_IN = """
import sys, types, torch
# a stand-in for torch_npu: importing the real one renames torch's private backend to "npu"
# and adds torch.npu; it needs Huawei's CANN libraries, which these machines lack
fake = types.ModuleType("torch_npu")
sys.modules["torch_npu"] = fake
torch.utils.rename_privateuse1_backend("npu")
torch.npu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 3)
torch.cuda.is_available = lambda: False
from tqueue.bridges.megatron import backend_for, pick_device
device = pick_device()
print(device, backend_for(device))
"""


def test_the_device_and_backend_follow_what_is_there():
    """CPU here; CUDA and Ascend are chosen when present. The NPU path runs with the NPU
    module replaced by a stand-in (it has not run on Ascend hardware)."""
    import subprocess
    import sys

    assert pick_device() == torch.device("cpu") and backend_for(pick_device()) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(tqueue.InvalidArgumentError, match=r"no collective backend known for device type 'meta'"):
        backend_for(torch.device("meta"))
    out = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "npu:3 hccl"


def test_read_passes_the_micro_batch_options_through(client, partition):
    """One rank (no torch.distributed): the planner's options reach the controller, and the
    micro-batches come packed as asked, every sample exact."""
    from tqueue.bridges.megatron import StepReader

    lengths = [9, 3, 14, 6, 1, 11, 7, 5, 12, 2, 8, 4]
    ids = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]
    client.put(partition, {"ids": ids, "n": torch.tensor(lengths)})
    reader = StepReader(client, dp_rank=0, dp_size=1)
    step = reader.read(partition, ["ids", "n"], 12, max_tokens_per_micro_batch=40, min_num_microbatches=3,
                       num_microbatches_multiple_of=2, form="packed", pad_to_multiple_of=4, timeout=10)
    assert step.num_microbatches == 4 and len(step.micro_batches) == 4  # 2 needed, at least 3, a multiple of 2
    for mb, rows in zip(step.micro_batches, step.micro_batch_indices):
        indexes = [step.meta.indexes[p] for p in rows]
        assert mb.form == "packed" and mb.meta.indexes == indexes and mb["n"].tolist() == [lengths[i] for i in indexes]
        assert mb.cu_seqlens().tolist() == np.cumsum([0] + [lengths[i] for i in indexes]).tolist()
        assert all(t % 4 == 0 for t in mb.cu_seqlens_padded().diff().tolist())
        assert all(torch.equal(got, ids[i]) for got, i in zip(mb.unpad("ids"), indexes))
    reader.done(step)
    client.put(f"{partition}-b", {"ids": ids, "n": torch.tensor(lengths)})  # a task's rounds keep one shape
    step = reader.read(f"{partition}-b", ["ids", "n"], 12, micro_batch_size=3, form="padded", timeout=10)
    assert [mb.size for mb in step.micro_batches] == [3] * 4
    assert [mb["ids"].shape[1] for mb in step.micro_batches] == [max(mb.lengths().tolist()) for mb in step.micro_batches]
    with pytest.raises(tqueue.InvalidArgumentError, match=r"form is one of \['padded', 'packed'\], got 'thd'"):
        reader.read(partition, ["ids"], 12, form="thd", timeout=10)  # type: ignore[arg-type]
    reader.done(step)
