"""Data-parallel ranks read their steps through StepReader: real processes on 127.0.0.1,
as plain ``torch.distributed`` ranks (the integration tier runs megatron-core's
``parallel_state``: tests/bridges/test_megatron_core.py). Both ways of reaching a replica: each
rank reads, or the first rank of a broadcast group reads and broadcasts tensors.

Every job names its default group's backend and its device. On CPU, ``cuda:gloo`` stands in
for NCCL: a default group with no CPU backend. The CUDA/NCCL cases skip, saying why, on a host
with fewer GPUs than ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tqueue
from tqueue.bridges.megatron import StepReader, backend_for, pick_device

from ._dist import (
    FIELDS,
    Setup,
    broadcast_rank,
    free_port,
    restart_rank,
    run_job,
    start_ranks,
    stop,
)

STEPS, BATCH = 3, 8  # per DP rank


def producer(address: str, prefix: str, dp: int):
    rng = np.random.default_rng(7)

    def produce(k: int) -> None:
        put(address, f"{prefix}-{k}", dp * BATCH, rng, k)

    return produce


def put(address: str, partition: str, n: int, rng: np.random.Generator, k: int = 0, tasks=("train", "check")) -> None:
    lengths = (rng.lognormal(3.0, 0.8, n).astype(int) + 1).clip(1, 60).tolist()
    with tqueue.Client(address) as c:
        c.create_partition(partition, tasks=list(tasks))  # "check" reads the written-back values
        c.put(partition, {
            "ids": [torch.arange(length, dtype=torch.int64) + 1000 * k + i for i, length in enumerate(lengths)],
            "n": torch.tensor(lengths), "tag": [f"s{k}-{i}" for i in range(len(lengths))],
            "flag": torch.tensor([i % 3 == 0 for i in range(len(lengths))]),
        })
        c.seal(partition)


def check(result: dict, world: int, tp: int, pp: int = 1) -> None:
    reports = result["reports"]
    dp = world // (tp * pp)
    replicas: dict[int, list[int]] = {}
    writers: dict[int, int] = {}
    for rank, (dp_rank, replica, bcast, writer) in result["ready"].items():
        replicas.setdefault(dp_rank, replica)
        writers.setdefault(dp_rank, writer)
        assert replicas[dp_rank] == replica and rank in replica and rank in bcast and set(bcast) <= set(replica)
        assert writers[dp_rank] == writer and writer in replica
    assert sorted(replicas) == list(range(dp))
    for k in range(STEPS):
        shares = {}
        for dp_rank, replica in replicas.items():
            got = [reports[(r, k)] for r in replica]
            first = got[0]
            for other in got[1:]:  # every TP/PP rank of a replica: identical bytes and schedule
                assert other["digest"] == first["digest"] and other["mb_digest"] == first["mb_digest"]
                assert (other["indexes"], other["micro"], other["num_micro"]) == (first["indexes"], first["micro"], first["num_micro"])
            # the writer alone wrote
            assert [r for r in replica if reports[(r, k)]["wrote"]] == [writers[dp_rank]]
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
    """Each replica's writer wrote ``value`` (its position + 100 step + dp rank + 1000 its
    rank) once; a second task reads it. Then every task is done and each sealed step frees
    itself."""
    with tqueue.Client(address) as c:
        for k in range(STEPS):
            expected = {}
            for (_rank, step), rep in result["reports"].items():
                if step == k and rep["wrote"]:
                    dp_rank = result["ready"][rep["rank"]][0]
                    expected.update({i: float(pos + 100 * k + dp_rank + 1000 * rep["rank"])
                                     for pos, i in enumerate(rep["indexes"])})
            meta = c.get_meta(f"{prefix}-{k}", ["value"], len(expected), task="check", timeout=10)
            values = c.get_data(meta)["value"].tolist()
            assert {i: v for i, v in zip(meta.indexes, values)} == expected
            c.ack(meta)
        assert not [p.name for p in c.status().partitions if p.name.startswith(prefix)]


ON = {  # (default group's backend, device)
    "cpu-cuda:gloo": Setup(tp=2, backend="cuda:gloo", device="cpu"),  # no CPU backend, as NCCL's
    "cuda-nccl": Setup(tp=2, backend="nccl", device="cuda"),
}


@pytest.mark.parametrize("on", list(ON), ids=list(ON))
@pytest.mark.parametrize("mode", ["each", pytest.param("broadcast", marks=pytest.mark.slow)])
def test_dp2_tp2_ranks_get_disjoint_balanced_shares_and_replicas_identical_bytes(cluster, partition, mode, on):
    result = run_job(cluster.address, partition, world=4, steps=STEPS, batch=BATCH, mode=mode, setup=ON[on],
                     produce=producer(cluster.address, partition, 2))
    check(result, 4, tp=2)
    check_written_back(cluster.address, partition, result)


@pytest.mark.parametrize("mode", [pytest.param("each", marks=pytest.mark.slow), "broadcast"])
def test_tp2_pp2_each_stage_reads_and_the_last_stage_writes_back(cluster, partition, mode):
    """Plain torch.distributed ranks in Megatron's order (stage 0: ranks 0, 1; stage 1: 2, 3)
    give the reader their TP group and the writer, rank 2: the last stage's first TP rank,
    where values and log-probs are. Each stage's first rank reads in broadcast mode."""
    result = run_job(cluster.address, partition, world=4, steps=STEPS, batch=BATCH, mode=mode,
                     setup=Setup(tp=2, pp=2, explicit=True), produce=producer(cluster.address, partition, 1))
    check(result, 4, tp=2, pp=2)
    assert {r: (rep[2], rep[3]) for r, rep in result["ready"].items()} == {
        0: ([0, 1], 2), 1: ([0, 1], 2), 2: ([2, 3], 2), 3: ([2, 3], 2)}
    assert result["readers"] == (4 if mode == "each" else 2)
    check_written_back(cluster.address, partition, result)


@pytest.mark.parametrize("mode", ["each", "broadcast"])
def test_one_rank_under_a_default_group_with_no_cpu_backend(cluster, partition, mode):
    """``cuda:gloo``, like NCCL, has no CPU backend: the reader's layout goes over a gloo
    group of its own (here, in this process, at world size 1)."""
    import torch.distributed as dist

    put(cluster.address, partition, 4, np.random.default_rng(1), tasks=("train",))
    dist.init_process_group("cuda:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with tqueue.Client(cluster.address) as client:
            reader = StepReader(client, mode=mode, device="cpu", dp_rank=0, dp_size=1)
            step = reader.read(partition, FIELDS, 4, timeout=10)
            assert sorted(step.meta.indexes) == [0, 1, 2, 3] and step.fields["ids"].device.type == "cpu"
            assert reader.is_writer and reader.update(step, {"n": step.fields["n"]})
            reader.done(step)
            assert partition not in [p.name for p in client.status().partitions]
    finally:
        dist.destroy_process_group()


# --- restarts --------------------------------------------------------------------------------


@pytest.mark.parametrize("lease_timeout", [pytest.param(1.0, marks=pytest.mark.slow), math.inf], ids=["lease-1s", "lease-inf"])
def test_a_rank_killed_mid_step_takes_its_share_back_when_the_job_restarts(cluster, partition, lease_timeout):
    """DP=2. Rank 0 trains its share and acks it; rank 1 is SIGKILLed holding its share. The
    job restarts (every rank, new processes, as torchrun does): each asks round 0 again.
    Rank 1 gets its own samples back (under a new lease where the old one lapsed) and its
    done() frees the step; rank 0 gets its own, already acked, share: nothing of rank 1's, and
    its ack again changes nothing."""
    from tests.faults._proc import until

    put(cluster.address, partition, 2 * BATCH, np.random.default_rng(3))
    procs, out, _ = start_ranks(restart_rank, 2, cluster.address, partition, BATCH, lease_timeout, 1)
    try:
        first: dict[int, tuple] = {}
        while len(first) < 2 or not any(kind == "done" for kind, *_ in first.values()):
            kind, rank, indexes, lease = out.get(timeout=60)
            first[rank] = (kind, indexes, lease) if kind == "read" else (kind, first[rank][1], first[rank][2])
        assert set(first[0][1]).isdisjoint(first[1][1]) and len(first[0][1]) == len(first[1][1]) == BATCH
        procs[1].kill()  # mid-step, holding its share
        procs[0].join(timeout=60)
        assert procs[0].exitcode == 0
    finally:
        stop(procs)

    with tqueue.Client(cluster.address) as c:
        def train() -> tqueue.wire.TaskStatus:
            return next(p for p in c.status().partitions if p.name == partition).tasks["train"]

        if math.isinf(lease_timeout):
            assert (train().leased, train().consumed) == (BATCH, BATCH)
        else:  # the server's clock lapses the lease: nothing to wait on but its status
            until(lambda: train().expired == BATCH, 30, "rank 1's lease lapsed")
            assert (train().leased, train().consumed) == (0, BATCH)

        procs, out, _ = start_ranks(restart_rank, 2, cluster.address, partition, BATCH, lease_timeout, -1)
        try:
            again: dict[int, tuple] = {}
            while sum(kind == "done" for kind, *_ in again.values()) < 2:
                kind, rank, indexes, lease = out.get(timeout=60)
                again[rank] = (kind, indexes, lease) if kind == "read" else (kind, again[rank][1], again[rank][2])
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == 0
        finally:
            stop(procs)
        assert again[0][1] == first[0][1] and again[0][2] == first[0][2]  # its own share, as acked
        assert again[1][1] == first[1][1]  # exactly its samples
        assert (again[1][2] != first[1][2]) == (not math.isinf(lease_timeout))  # a new lease where it lapsed
        status = train()
        assert (status.leased, status.consumed) == (0, 2 * BATCH)  # every sample acked once
        meta = c.get_meta(partition, ["n"], 2 * BATCH, task="check", timeout=10)
        c.ack(meta)
        assert partition not in [p.name for p in c.status().partitions]  # the step freed itself


def test_a_lapsed_round_share_is_leased_again_for_its_rank_and_its_peers(cluster, partition):
    """The controller's side: round 0 of DP=2. Rank 0 acks; rank 1's lease lapses. Rank 1
    asking again gets exactly its samples under a new lease, and so do its TP peers after it.
    The dead lease's ack is ignored; rank 0 asking again gets its acked share unchanged."""
    from tests.faults._proc import until

    put(cluster.address, partition, 8, np.random.default_rng(5), tasks=("train",))
    ask = dict(task="train", dp_size=2, round=0, timeout=10, lease_timeout=0.3)
    with tqueue.Client(cluster.address) as c:
        zero = c.get_meta(partition, FIELDS, 4, dp_rank=0, **ask)
        one = c.get_meta(partition, FIELDS, 4, dp_rank=1, **ask)
        c.renew(zero, lease_timeout=60)
        c.ack(zero)
        tasks = lambda: next(p for p in c.status().partitions if p.name == partition).tasks["train"]  # noqa: E731
        until(lambda: tasks().expired == 4, 30, "rank 1's lease lapsed")
        again = c.get_meta(partition, FIELDS, 4, dp_rank=1, **dict(ask, lease_timeout=60))
        peer = c.get_meta(partition, FIELDS, 4, dp_rank=1, **dict(ask, lease_timeout=60))
        assert again.indexes == one.indexes and again.lease != one.lease and again.lease_timeout == 60
        assert peer == again  # its peers get the refreshed meta
        assert c.get_meta(partition, FIELDS, 4, dp_rank=0, **ask) == zero
        c.ack(one)  # the lapsed lease: ignored
        assert (tasks().leased, tasks().consumed) == (4, 4)
        c.ack(again)
        assert partition not in [p.name for p in c.status().partitions]


# --- broadcast mode: a read's timeout, and a dead or hung rank --------------------------------


def broadcast_job(address: str, partition: str, timeout: float, request_timeout: float = 30.0, victim: int | None = None,
                  signal: str = "kill") -> dict[int, tuple]:
    """Ranks 0 (the reader) and 1 of one broadcast group read an empty ``partition``. Once
    rank 0 is parked at the controller and rank 1 has begun its read, ``victim`` is SIGKILLed
    (or SIGSTOPped). Returns what each other rank raised and after how long."""
    import os
    import signal as signals

    from tests.faults._proc import until

    procs, out, _ = start_ranks(broadcast_rank, 2, address, partition, timeout, request_timeout)
    try:
        reading = 0
        while reading < 2:
            kind, rank, *_ = out.get(timeout=60)
            reading += kind == "reading"
        with tqueue.Client(address) as c:
            until(lambda: any(w.partition == partition for w in c.status().waiting), 30, "rank 0 parked")
        if victim is not None:
            os.kill(procs[victim].pid, signals.SIGKILL if signal == "kill" else signals.SIGSTOP)
        got: dict[int, tuple] = {}
        while len(got) < 2 - (victim is not None):
            kind, rank, name, rest = out.get(timeout=timeout + request_timeout + 30)
            got[rank] = (kind, name, rest)
        for r, p in enumerate(procs):
            if r != victim:
                p.join(timeout=60)
                assert p.exitcode == 0
        return got
    finally:
        if victim is not None and signal == "stop":
            procs[victim].kill()
        stop(procs)


def test_a_broadcast_read_timeout_reaches_every_rank(cluster, partition):
    got = broadcast_job(cluster.address, partition, timeout=2.0)
    for rank in (0, 1):
        kind, name, (elapsed, message) = got[rank]
        assert (kind, name) == ("raised", "WaitTimeoutError"), got
        assert 1.9 <= elapsed < 4.0, (rank, elapsed)
        assert f"partition {partition!r}" in message


@pytest.mark.parametrize("victim", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["reader-killed", "peer-killed"])
def test_a_rank_killed_mid_read_gives_its_peers_a_typed_error_within_the_timeout(cluster, partition, victim):
    """The reader killed: its peer's wait for the header breaks at once. The peer killed: the
    reader learns it when it next sends, at the latest when its read times out."""
    got = broadcast_job(cluster.address, partition, timeout=5.0, victim=victim)
    kind, name, (elapsed, message) = got[1 - victim]
    assert (kind, name) == ("raised", "UnavailableError"), got
    assert elapsed < 6.5, elapsed
    assert "broadcast group [0, 1] lost a rank" in message


@pytest.mark.slow
def test_a_hung_reader_gives_its_peer_a_timeout_after_the_read_and_request_timeouts(cluster, partition):
    """Rank 0 stopped (SIGSTOP: alive, connections open, silent): rank 1 gives up after its
    read's timeout plus its client's request_timeout (what rank 0's own client allows)."""
    got = broadcast_job(cluster.address, partition, timeout=2.0, request_timeout=1.0, victim=0, signal="stop")
    kind, name, (elapsed, message) = got[1]
    assert (kind, name) == ("raised", "WaitTimeoutError"), got
    assert 3.9 <= elapsed < 6.0, elapsed
    assert "rank 0, the first of its broadcast group [0, 1], which sent nothing" in message


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

    if not torch.cuda.is_available():
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
    micro-batches come packed as asked, every sample exact, on the device this host picks (a
    GPU where there is one)."""
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
        assert mb["ids"].device.type == pick_device().type
        assert all(torch.equal(got.cpu(), ids[i]) for got, i in zip(mb.unpad("ids"), indexes))
    reader.done(step)
    client.put(f"{partition}-b", {"ids": ids, "n": torch.tensor(lengths)})  # a task's rounds keep one shape
    step = reader.read(f"{partition}-b", ["ids", "n"], 12, micro_batch_size=3, form="padded", timeout=10)
    assert [mb.size for mb in step.micro_batches] == [3] * 4
    assert [mb["ids"].shape[1] for mb in step.micro_batches] == [max(mb.lengths().tolist()) for mb in step.micro_batches]
    with pytest.raises(tqueue.InvalidArgumentError, match=r"form is one of \['padded', 'packed'\], got 'thd'"):
        reader.read(partition, ["ids"], 12, form="thd", timeout=10)  # type: ignore[arg-type]
    reader.done(step)
