"""Token-balanced DP rounds: peers agree, ranks are disjoint and balanced, micro-batch
counts are equal, and the batch layout survives the trip."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError
from tqueue.wire import Error, GetMeta

from .parking import park, replies, waiting

DP, TP, BATCH = 4, 2, 32
CAP = 4096


def skewed_lengths(n, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(5.5, 1.0, n).astype(int) + 8
    lengths[rng.choice(n, n // 16, replace=False)] = rng.integers(2000, 4000, n // 16)  # a long tail
    return np.minimum(lengths, 4000).tolist()


def test_four_ranks_two_peers_each(cluster, partition):
    lengths = skewed_lengths(2 * DP * BATCH, seed=3)
    with tqueue.Client(cluster.address) as producer:
        producer.put(partition, {"resp": [torch.full((n,), i) for i, n in enumerate(lengths)], "n": torch.tensor(lengths)})

    def rank(dp_rank: int, tp_rank: int) -> list[tqueue.BatchMeta]:
        with tqueue.Client(cluster.address) as c:
            metas = []
            for _ in range(2):
                meta = c.get_meta(partition, ["resp", "n"], BATCH, task="actor", timeout=30,
                                  dp_rank=dp_rank, dp_size=DP, max_tokens_per_micro_batch=CAP)
                batch = c.get_data(meta)
                assert batch["n"].tolist() == [len(r) for r in batch["resp"]]  # fields stay together
                metas.append(meta)
            return metas

    with concurrent.futures.ThreadPoolExecutor(DP * TP) as pool:
        futures = {(d, t): pool.submit(rank, d, t) for d in range(DP) for t in range(TP)}
        got = {k: f.result(timeout=60) for k, f in futures.items()}

    for r in range(2):
        metas = [got[(d, 0)][r] for d in range(DP)]
        for d in range(DP):
            assert got[(d, 1)][r] == metas[d]  # TP peers: the identical meta
        samples = [i for m in metas for i in m.indexes]
        assert len(samples) == len(set(samples)) == DP * BATCH  # ranks are disjoint
        sums = [sum(lengths[i] for i in m.indexes) for m in metas]
        assert max(sums) <= 1.05 * min(sums), sums
        assert {len(m) for m in metas} == {BATCH}
        assert len({m.num_microbatches for m in metas}) == 1
        for d, m in enumerate(metas):
            assert (m.dp_rank, m.dp_size, m.round, m.global_batch_size) == (d, DP, r, DP * BATCH)
            mbs = m.micro_batch_indices
            assert len(mbs) == m.num_microbatches
            assert sorted(i for mb in mbs for i in mb) == list(range(BATCH))
            for mb in mbs:
                tokens = sum(lengths[m.indexes[i]] for i in mb)
                assert tokens <= CAP or len(mb) == 1
    first = {i for d in range(DP) for i in got[(d, 0)][0].indexes}
    second = {i for d in range(DP) for i in got[(d, 0)][1].indexes}
    assert not first & second  # rounds do not overlap


def test_rounds_must_agree_on_their_shape(client, partition):
    client.put(partition, {"x": torch.arange(16)})
    client.get_meta(partition, ["x"], 2, task="t", dp_rank=0, dp_size=4, timeout=5)
    with pytest.raises(InvalidArgumentError, match=r"rounds are dp_size=4, batch_size=2.*asked for 2, 2"):
        client.get_meta(partition, ["x"], 2, task="t", dp_rank=0, dp_size=2, timeout=5)
    with pytest.raises(InvalidArgumentError, match=r"dp_rank must be in \[0, dp_size\)"):
        client.get_meta(partition, ["x"], 2, task="t", dp_rank=4, dp_size=4, timeout=5)


def test_group_rounds_give_each_rank_whole_groups(cluster, partition):
    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, group_size=4)
        lengths = skewed_lengths(32, seed=5)
        c.put(partition, {"resp": [torch.zeros(n) for n in lengths]}, groups=[f"g{i // 4}" for i in range(32)])
        metas = [c.get_meta(partition, ["resp"], 8, task="t", policy="groups", dp_rank=r, dp_size=2,
                            round=0, max_tokens_per_micro_batch=2048, timeout=5) for r in range(2)]
    for m in metas:
        assert len(m) == 8 and all(m.groups.count(g) == 4 for g in set(m.groups))
    assert not set(metas[0].groups) & set(metas[1].groups)
    assert metas[0].num_microbatches == metas[1].num_microbatches


def test_a_round_that_cannot_be_planned_fails_its_waiter_and_the_put_stands(cluster, client, partition, raw):
    """Whole groups over 2 ranks, one group short (mask_member), a token cap: one rank needs
    two micro-batches, the other holds one sample. The planner's failure reaches the parked
    request; the put that woke it is recorded by controller and unit alike."""
    client.create_partition(partition, group_size=2, on_member_failure="mask_member")
    client.put(partition, {"ids": [torch.ones(10), torch.ones(10)]}, groups=["a", "a"])
    client.fail(partition, group="b", count=1, reason="engine died")  # b will be short
    peer = raw(cluster.address)
    asked = GetMeta(rid=1, partition=partition, fields=["ids"], batch_size=2, task="t", policy="groups",
                    dp_rank=0, dp_size=2, round=0, max_tokens_per_micro_batch=10, timeout=60)
    assert waiting(park(peer, asked), partition) == ["get_meta"]  # one complete group of two
    put = client.put(partition, {"ids": [torch.ones(10)]}, groups=["b"])  # completes b
    assert (put.status, put.indexes) == ("ok", [2])
    [reply] = replies(peer, 1).values()
    assert isinstance(reply, Error)  # typed (whatever the planner raises), to this waiter alone
    assert {p.name: p for p in client.status().partitions}[partition].samples == 3
    meta = client.get_meta(partition, ["ids"], 3, task="u", timeout=5, policy="first_ready")
    assert [len(x) for x in client.get_data(meta)["ids"]] == [10] * 3  # controller and unit agree
