"""Data-parallel ranks laid out by megatron-core's ``parallel_state`` (the integration tier:
the ``megatron`` extra), 4 real processes on gloo: DP=2 x TP=2 and TP=2 x PP=2 (DP=1), both
ways of reaching a replica. The checks are those of test_megatron.py."""

from __future__ import annotations

import pytest

from ._dist import run_job
from .test_megatron import BATCH, STEPS, check, check_written_back, producer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode", ["each", "broadcast"])
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_megatron_parallel_state_layouts(cluster, partition, mode, tp, pp):
    dp = 4 // (tp * pp)
    result = run_job(cluster.address, partition, world=4, steps=STEPS, batch=BATCH, mode=mode,
                     layout={"megatron": 1, "tp": tp, "pp": pp}, produce=producer(cluster.address, partition, dp))
    check(result, 4, tp=tp, pp=pp)
    # megatron's own groups: a replica is the ranks of one DP rank (TP x PP), contiguous TP first
    replicas = sorted({tuple(r) for _, r in result["ready"].values()})
    assert replicas == ([(0, 1), (2, 3)] if pp == 1 else [(0, 1, 2, 3)])
    check_written_back(cluster.address, partition, result)
