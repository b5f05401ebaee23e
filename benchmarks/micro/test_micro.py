"""Micro-benchmarks: the wire codec on a realistic batch header, get_meta latency against
partition size, and the DP split planner."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tqueue
from benchmarks.workload import make_batch
from tqueue.client._encode import encode
from tqueue.wire import _messages as _wire

pytest.importorskip("pytest_benchmark")

N = 1024


@pytest.fixture(scope="module")
def encoded():
    batch = make_batch(N)
    batch["responses_jagged"] = [torch.zeros(int(k), dtype=torch.int32) for k in np.random.default_rng(0).integers(16, 2048, N)]
    return encode(batch, partition="train/step-0", chunk_bytes=1 << 20)


def test_encode_put_fields(benchmark):
    """Client-side: validate and encode a 1024-sample batch into blocks and zero-copy frames."""
    batch = make_batch(N)
    benchmark(encode, batch, partition="p", chunk_bytes=1 << 20)


def test_store_header_encode(benchmark, encoded):
    msg = _wire.Store(grant_id=1, partition="train/step-0", partition_uid=1, start=0, count=N, blocks=encoded.blocks)
    benchmark(_wire.encode, msg)


def test_store_header_decode(benchmark, encoded):
    msg = _wire.Store(grant_id=1, partition="train/step-0", partition_uid=1, start=0, count=N, blocks=encoded.blocks)
    frames = _wire.encode(msg)
    benchmark(_wire.decode, frames)


def test_batch_meta_decode(benchmark):
    meta = _wire.BatchMeta(
        partition="train/step-0",
        partition_uid=1,
        indexes=list(range(N)),
        units=[0] * N,
        fields=["input_ids", "responses"],
        schema={"input_ids": _wire.FieldSpec(kind="tensor", dtype="int64", shape=(4096,))},
        groups=[f"uid-{i // 8}" for i in range(N)],
        task="actor_train",
        lease=1,
    )
    frames = _wire.encode(_wire.MetaReply(meta=meta))
    benchmark(_wire.decode, frames)


@pytest.fixture(scope="module")
def cluster():
    with tqueue.LocalCluster(num_storage_units=1) as c:
        yield c


@pytest.mark.parametrize("size", [100, 10_000, 1_000_000], ids=["1e2", "1e4", "1e6"])
def test_get_meta_latency(benchmark, cluster, size):
    """One get_meta round trip (sync client) leasing a 256-sample batch (64 for 1e2) from a
    partition of ``size`` ready samples; each round takes the next batch."""
    batch = min(256, size // 2 + 1 if size < 256 else 256)
    with tqueue.Client(cluster.address) as client:
        name = f"lat-{size}"
        for a in range(0, size, 65536):
            client.put(name, {"x": torch.arange(a, min(size, a + 65536))})
        per_task = size // batch
        calls = itertools.count()

        def one():
            i = next(calls)
            client.get_meta(name, ["x"], batch, task=f"t{i // per_task}", timeout=1)

        benchmark.pedantic(one, rounds=300 if size >= 10_000 else 100, warmup_rounds=5)
        client.clear(name)


def _planner_lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.minimum(rng.lognormal(6.5, 1.0, n).astype(np.int64) + 16, 8192)


@pytest.mark.parametrize("cap", [4096, 16384], ids=lambda c: f"cap{c}")
@pytest.mark.parametrize("n", [4096, 16384], ids=lambda n: f"n{n}")
def test_dp_split_planner(benchmark, n, cap):
    """Token-balanced split of one round over 8 DP ranks into micro-batches of at most ``cap``
    tokens (skewed lengths): what the controller's loop waits for once per round."""
    balance = pytest.importorskip("tqueue.controller.planning._balance")
    benchmark(balance.plan_round, _planner_lengths(n), 8, max_tokens_per_micro_batch=cap)


@pytest.mark.parametrize("dp", [4, 8], ids=lambda d: f"dp{d}")
def test_dp_split_planner_partition_4096(benchmark, dp):
    """balanced_partition alone (equal sizes, no micro-batches)."""
    balance = pytest.importorskip("tqueue.controller.planning._balance")
    benchmark(balance.balanced_partition, _planner_lengths(4096), dp)


# --- packed integer fields (tqueue/wire/_pack.py, native/pack.c) ----------------------------


@pytest.fixture(params=["numpy", "native"])
def narrowing(request, monkeypatch):
    """tqueue.wire._pack.narrow with its one-pass C routine, or with numpy's min, max and cast."""
    from tqueue.wire import _pack

    if request.param == "native" and _pack._native_pack is None:
        pytest.skip("tqueue._native_pack is not built (no C compiler at install time)")
    if request.param == "numpy":
        monkeypatch.setattr(_pack, "_native_pack", None)
    return _pack


@pytest.mark.parametrize("field", ["input_ids", "attention_mask", "position_ids"])
def test_narrow_field_1024(benchmark, narrowing, field):
    """Narrow one int64 [1024, 4096] field of the workload (32 MiB) to int32 / int8 / int16."""
    values = make_batch(N)[field].numpy().reshape(-1)
    benchmark(narrowing.narrow, values)


def test_widen_field_1024(benchmark):
    """Widen the packed input_ids (int32) back into an int64 [1024, 4096] buffer, in 1 MiB frames."""
    from tqueue.wire import _pack

    narrow, _ = _pack.narrow(make_batch(N)["input_ids"].numpy().reshape(-1))
    out = np.empty(len(narrow), dtype=np.int64)
    step = (1 << 20) // 4
    jobs = [(out[a : a + step], narrow[a : a + step]) for a in range(0, len(narrow), step)]
    benchmark(_pack.widen_all, jobs)
