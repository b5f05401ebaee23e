"""Data-parallel ranks laid out by megatron-core's ``parallel_state`` (the integration tier:
the ``megatron`` extra), 4 real processes on gloo, on CPU: DP=2 x TP=2 and TP=2 x PP=2 (DP=1),
both ways of reaching a replica. The checks are those of test_megatron.py, and the reader
takes from megatron what it needs: the broadcast groups are megatron's tensor-parallel groups
(each pipeline stage reads), and the writer is the last stage's first tensor-parallel rank."""

from __future__ import annotations

import pytest

from ._dist import Setup, run_job
from .test_megatron import BATCH, STEPS, check, check_written_back, producer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode", ["each", "broadcast"])
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_megatron_parallel_state_layouts(cluster, partition, mode, tp, pp):
    dp = 4 // (tp * pp)
    result = run_job(cluster.address, partition, world=4, steps=STEPS, batch=BATCH, mode=mode,
                     setup=Setup(tp=tp, pp=pp, megatron=True), produce=producer(cluster.address, partition, dp))
    check(result, 4, tp=tp, pp=pp)
    # megatron's own groups: a replica is the ranks of one DP rank (TP x PP), contiguous TP first
    replicas = sorted({tuple(r[1]) for r in result["ready"].values()})
    assert replicas == ([(0, 1), (2, 3)] if pp == 1 else [(0, 1, 2, 3)])
    # broadcast groups: megatron's TP groups; the writer: the last stage's first TP rank
    assert sorted({tuple(r[2]) for r in result["ready"].values()}) == [(0, 1), (2, 3)]
    assert {r: rep[3] for r, rep in result["ready"].items()} == ({0: 0, 1: 0, 2: 2, 3: 2} if pp == 1 else dict.fromkeys(range(4), 2))
    assert result["readers"] == (4 if mode == "each" else 2)
    check_written_back(cluster.address, partition, result)
