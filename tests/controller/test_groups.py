"""GRPO groups: released whole, by explicit id, never by index adjacency; failed members."""

from __future__ import annotations

import random

import pytest
import torch

from tqueue.errors import InvalidArgumentError, WaitTimeoutError


def put_member(client, partition, group, member):
    client.put(partition, {"x": torch.tensor([member]), "g": [group]}, groups=group)


def test_interleaved_out_of_order_members_come_out_as_whole_groups(client, partition):
    client.create_partition(partition, group_size=4)
    members = [(g, m) for g in ("a", "b", "c", "d") for m in range(4)]
    random.Random(7).shuffle(members)
    # hold back the last member of "a" and "b": only "c" and "d" can complete
    late = [gm for gm in members if gm in (("a", 3), ("b", 3))]
    for group, member in [gm for gm in members if gm not in late]:
        put_member(client, partition, group, member)
    meta = client.get_meta(partition, ["x", "g"], 8, task="t", policy="groups", timeout=5)
    batch = client.get_data(meta)
    assert sorted(set(meta.groups)) == ["c", "d"]
    assert sorted(batch["g"]) == ["c"] * 4 + ["d"] * 4
    assert [meta.groups.count(g) for g in ("c", "d")] == [4, 4]
    assert batch["g"] == meta.groups  # each sample's own group, whatever its index
    with pytest.raises(WaitTimeoutError, match="2 groups complete"):
        client.get_meta(partition, ["x"], 4, task="t", policy="groups", timeout=0.1)
    for group, member in late:
        put_member(client, partition, group, member)
    rest = client.get_meta(partition, ["x", "g"], 8, task="t", policy="groups", timeout=5)
    assert sorted(client.get_data(rest)["g"]) == ["a"] * 4 + ["b"] * 4


def test_drop_group_aborts_the_group_of_a_failed_member(client, partition):
    client.create_partition(partition, group_size=2)
    for group in ("ok", "bad"):
        put_member(client, partition, group, 0)
    client.fail(partition, group="bad", count=1, reason="engine timeout")
    put_member(client, partition, "ok", 1)
    put_member(client, partition, "bad", 1)  # a late member of an aborted group: discarded
    meta = client.get_meta(partition, ["x"], 2, task="t", policy="groups", timeout=5)
    assert meta.groups == ["ok", "ok"]
    with pytest.raises(WaitTimeoutError, match="2 ready for this task"):  # "bad" is out for every task
        client.get_meta(partition, ["x"], 3, task="t2", timeout=0.1)
    status = {p.name: p for p in client.status().partitions}[partition]
    assert status.excluded == 2 and status.reasons == {"member failed: engine timeout": 1, "group aborted": 1}


def test_mask_member_releases_the_group_without_it(client, partition):
    client.create_partition(partition, group_size=3, on_member_failure="mask_member")
    put_member(client, partition, "g", 0)
    put_member(client, partition, "g", 1)
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["x"], 3, task="t", policy="groups", timeout=0.1)
    client.fail(partition, group="g", count=1, reason="length limit")
    meta = client.get_meta(partition, ["x"], 3, task="t", policy="groups", timeout=5)
    assert meta.groups == ["g", "g"] and len(meta) == 2


def test_failing_a_put_sample_drops_its_group(client, partition):
    client.create_partition(partition, group_size=2)
    meta = client.put(partition, {"x": torch.arange(4)}, groups=["p", "p", "q", "q"])
    reward = client.get_meta(partition, ["x"], 4, task="reward", timeout=5)
    assert reward.indexes == meta.indexes
    client.fail(reward.select([0]), reason="bad reward")
    got = client.get_meta(partition, ["x"], 2, task="train", policy="groups", timeout=5)
    assert got.groups == ["q", "q"]


@pytest.mark.parametrize(
    "options, kwargs, match",
    [
        pytest.param({}, {"batch_size": 4}, r"policy 'groups' needs a group_size", id="no-group-size"),
        pytest.param({"group_size": 4}, {"batch_size": 6}, r"batch of 6 samples is not a whole number of groups of 4", id="not-whole"),
    ],
)
def test_group_policy_arguments(client, partition, options, kwargs, match):
    client.create_partition(partition, **options)
    client.put(partition, {"x": torch.arange(8)}, groups=[i // 4 for i in range(8)])
    with pytest.raises(InvalidArgumentError, match=match):
        client.get_meta(partition, ["x"], task="t", policy="groups", timeout=1, **kwargs)


def test_bad_failure_policy(client, partition):
    with pytest.raises(InvalidArgumentError, match=r"on_member_failure is one of \['drop_group', 'mask_member'\]"):
        client.create_partition(partition, on_member_failure="ignore")
