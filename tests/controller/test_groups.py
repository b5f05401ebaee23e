"""GRPO groups: released whole, by explicit id, never by index adjacency; failed members."""

from __future__ import annotations

import random

import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError, WaitTimeoutError

from ..servers import LoopCluster


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


def test_by_default_a_partition_with_a_group_size_releases_whole_groups_to_each_dp_rank(client, partition):
    """No policy named: a partition with a group_size deals whole groups, never split across
    DP ranks, though members arrive one by one and out of order (the design's promise 3)."""
    client.create_partition(partition, group_size=4)
    members = [(g, m) for g in "abcd" for m in range(4)]
    random.Random(3).shuffle(members)
    held_back = ("d", 0)
    for group, member in members:
        if (group, member) != held_back:
            put_member(client, partition, group, member)
    with pytest.raises(WaitTimeoutError, match="3 groups complete"):  # "d" is not whole yet
        client.get_meta(partition, ["x"], 8, task="t", timeout=0.1, data_parallel=tqueue.DataParallel(0, 2))
    put_member(client, partition, *held_back)
    shares = [client.get_meta(partition, ["x", "g"], 8, task="t", timeout=5, data_parallel=tqueue.DataParallel(rank, 2))
              for rank in range(2)]
    per_rank = [sorted(set(client.get_data(m)["g"])) for m in shares]
    assert [len(m) for m in shares] == [8, 8]
    assert sorted(per_rank[0] + per_rank[1]) == list("abcd")  # two whole groups each, none split
    assert all(m.groups.count(g) == 4 for m in shares for g in set(m.groups))


def test_by_default_a_batch_that_is_not_whole_groups_is_refused_at_once(client, partition):
    client.create_partition(partition, group_size=2)
    client.put(partition, {"x": torch.arange(4)}, groups=["a", "a", "b", "b"])
    with pytest.raises(InvalidArgumentError, match=f"batch of 3 samples is not a whole number of groups of 2 \\(partition '{partition}'\\)"):
        client.get_meta(partition, ["x"], 3, task="t", timeout=5)
    meta = client.get_meta(partition, ["x"], 3, task="t", timeout=5, policy="first_ready")  # asked for: split
    assert meta.groups == ["a", "a", "b"]


def test_a_default_read_of_groups_without_a_group_size_takes_index_order_and_says_so(partition, caplog):
    """Samples put with groups to a partition that has no group size: nothing can tell when a
    group is whole, so a default read takes index order, and the controller (served in this
    process, to read its log) says so once, at the first put with groups."""
    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "has no group_size" in r.getMessage()]

    with LoopCluster(1) as cluster, cluster.client() as client, caplog.at_level("WARNING", logger="tqueue.controller"):
        client.put(partition, {"x": torch.arange(3)}, groups=["a", "a", "b"])
        assert len(told()) == 1
        client.put(partition, {"x": torch.arange(1)}, groups=["c"])
        assert client.get_meta(partition, ["x"], 2, task="t", timeout=5).groups == ["a", "a"]
        client.get_meta(partition, ["x"], 1, task="u", timeout=5)
    assert told() == [f"partition {partition!r} holds samples put with groups but has no group_size: a read that names "
                    "no policy takes them in index order, and may split groups (create_partition(..., grouping=Grouping(n)) "
                    "keeps them whole)"]


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
        client.get_meta(partition, ["x"], 3, task="t2", timeout=0.1, policy="first_ready")
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


def test_a_padded_read_ends_a_sealed_partition_with_its_last_whole_groups(client, partition):
    """``pad=True`` (the loader's read) under the default whole-groups policy: once sealed and
    drained, the short last batch holds the groups left, whole, then pad rows; then the end."""
    client.create_partition(partition, group_size=2)
    client.put(partition, {"x": torch.arange(6)}, groups=["a", "b", "a", "c", "b", "c"])
    client.seal(partition)
    first = client.get_meta(partition, ["x"], 4, task="t", timeout=5, pad=True)
    last = client.get_meta(partition, ["x"], 4, task="t", timeout=5, pad=True)
    assert (first.groups, first.pads) == (["a", "a", "b", "b"], 0)
    assert (last.indexes[:2], last.groups[:2], last.pads) == ([3, 5], ["c", "c"], 2)
    client.ack(first)
    client.ack(last)
    assert client.get_meta(partition, ["x"], 4, task="t", timeout=5, pad=True).indexes == []


def test_a_partition_that_over_samples_by_samples_reads_in_index_order_by_default(client, partition):
    """A ``target`` in samples cuts groups already (the rollout driver's steps): a default read
    takes samples in index order there, groups or not."""
    client.create_partition(partition, target=3)
    client.put(partition, {"x": torch.arange(4)}, groups=["a", "a", "b", "b"])
    assert client.get_meta(partition, ["x"], 3, task="t", timeout=5).indexes == [0, 1, 2]
