"""DP rounds of whole groups where a group lost a member (``mask_member``) and a micro-batch
cap applies: the round is planned where a plan exists, else the request fails with a typed
error naming the groups and the cap (it used to fail with a ValueError from the planner)."""

from __future__ import annotations

import pytest
import torch

from tqueue.errors import InvalidArgumentError


def put_round(client, partition, members: dict[str, list[int]], short: str) -> None:
    """Each group's members as jagged ``resp`` samples; the 4th member of ``short`` fails."""
    client.create_partition(partition, group_size=4, on_member_failure="mask_member")
    for group, lengths in members.items():
        client.put(partition, {"resp": [torch.zeros(n) for n in lengths]}, groups=group)
    client.fail(partition, group=short, count=1, reason="length limit")


def ask(client, partition, dp_rank: int):
    return client.get_meta(partition, ["resp"], 8, task="t", policy="groups", dp_rank=dp_rank, dp_size=2,
                           round=0, max_tokens_per_micro_batch=1000, timeout=5)


def test_short_group_round_is_planned_where_a_plan_exists(client, partition):
    put_round(client, partition, {"a": [600] * 4, "b": [600] * 4, "c": [1500, 1500, 1000], "d": [200] * 4}, short="c")
    metas = [ask(client, partition, r) for r in range(2)]
    assert sorted(len(m) for m in metas) == [7, 8]
    assert metas[0].num_microbatches == metas[1].num_microbatches == 7
    for m in metas:
        assert len(m.micro_batch_indices) == 7
        assert sorted(i for mb in m.micro_batch_indices for i in mb) == list(range(len(m)))
        assert len(set(m.groups)) == 2  # whole groups, two each
    assert {g for m in metas for g in m.groups} == {"a", "b", "c", "d"}


def test_short_group_round_without_a_plan_is_an_invalid_argument(client, partition):
    put_round(client, partition, {"a": [600] * 4, "b": [600] * 4, "c": [600] * 3, "d": [600] * 4}, short="c")
    with pytest.raises(InvalidArgumentError, match=r"max_tokens_per_micro_batch=1000.*\(3 samples, 3 micro-batches\)"):
        ask(client, partition, 0)
    with pytest.raises(InvalidArgumentError, match=r"cannot plan a round of 4 whole groups over 2 ranks"):
        ask(client, partition, 1)  # the controller still answers, and the same way


def test_replica_groups_read_disjoint_samples_and_the_ranks_of_a_group_the_same(cluster, partition):
    """TransferQueue's RankAwareSampler over rounds: each data-parallel replica group (two
    ranks each, separate clients) forms and counts its own rounds (``dp_size=1``), so groups
    take disjoint samples of the task, and both ranks of a group the identical meta, round
    after round, whichever rank asks first."""
    import tqueue

    with tqueue.Client(cluster.address) as producer:
        producer.put(partition, {"x": torch.arange(32)})
    ranks = {(g, r): tqueue.Client(cluster.address) for g in ("0", "1") for r in range(2)}
    try:
        seen: dict[str, list[list[int]]] = {"0": [], "1": []}
        for step in range(4):
            order = sorted(ranks, key=lambda k: (k[1] + step) % 2)  # the first to ask changes
            metas = {k: ranks[k].get_meta(partition, ["x"], 4, task="train", dp_rank=0, dp_size=1,
                                          replica_group=k[0], timeout=5) for k in order}
            for g in ("0", "1"):
                assert metas[(g, 0)].indexes == metas[(g, 1)].indexes and metas[(g, 0)].round == step
                seen[g].append(metas[(g, 0)].indexes)
        every = [i for g in seen.values() for batch in g for i in batch]
        assert sorted(every) == list(range(32))  # disjoint, and all of them
    finally:
        for c in ranks.values():
            c.close()


def test_a_replica_group_needs_rounds(client, partition):
    client.put(partition, {"x": torch.arange(4)})
    with pytest.raises(InvalidArgumentError, match="replica_group needs dp_size"):
        client.get_meta(partition, ["x"], 2, task="t", replica_group="0", timeout=1)
