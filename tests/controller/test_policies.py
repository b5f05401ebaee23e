"""Batch policies are pluggable: loaded into the controller by name, checked when they answer."""

from __future__ import annotations

import pytest
import torch

from tqueue.errors import InvalidArgumentError, StorageFullError
from tqueue.wire import Error, GetMeta, MetaReply

from ..servers import LoopCluster
from .parking import park, replies, waiting

POLICIES = [
    "newest_first=tests.controller.custom_policy:NewestFirst",
    "greedy=tests.controller.custom_policy:Greedy",
    "exploding=tests.controller.custom_policy:Exploding",
    "skip=tests.controller.custom_policy:Skip",
]


@pytest.fixture(scope="module")
def cluster():
    """A controller with two extra policies and a 6 MiB budget for the whole cluster."""
    options = {"policies": POLICIES, "capacity_bytes": 6 << 20}
    with LoopCluster(num_storage_units=2, controller=options) as c:
        yield c


def test_a_loaded_policy_chooses_the_batch(client, partition):
    client.put(partition, {"x": torch.arange(6)}, version=[1, 3, 2, 3, 1, 2])
    meta = client.get_meta(partition, ["x"], 2, task="t", policy="newest_first", timeout=5)
    assert meta.indexes == [1, 3] and meta.versions == [3, 3]
    rest = client.get_meta(partition, ["x"], 4, task="t", policy="first_ready", timeout=5)
    assert rest.indexes == [0, 2, 4, 5]  # a task's samples are shared by its policies


def test_a_readers_policy_args_reach_the_policy(cluster, client, partition, raw):
    client.put(partition, {"x": torch.arange(8)})
    assert client.get_meta(partition, ["x"], 2, task="t", policy="skip", policy_args={"skip": 3}, timeout=5).indexes == [3, 4]
    assert client.get_meta(partition, ["x"], 2, task="t", policy="skip", timeout=5).indexes == [0, 1]
    # the built-in policies take and ignore them
    assert client.get_meta(partition, ["x"], 1, task="t", policy_args={"skip": 3}, timeout=5).indexes == [2]
    # a parked request keeps its arguments until samples come (5, 6, 7 are ready: too few)
    peer = raw(cluster.address)
    ask = GetMeta(rid=1, partition=partition, fields=["x"], batch_size=2, task="t", policy="skip", policy_args={"skip": 4}, timeout=60)
    assert waiting(park(peer, ask), partition) == ["get_meta"]
    client.put(partition, {"x": torch.arange(3)})
    got = replies(peer, 1)[1]
    assert isinstance(got, MetaReply) and got.meta.indexes == [9, 10]


@pytest.mark.parametrize(
    "args, match",
    [
        pytest.param({"skip": object()}, r"policy_args\['skip'\] is a object, not a MessagePack value", id="value"),
        pytest.param({1: 2}, r"policy_args: names are strings, got 1", id="name"),
        pytest.param([("skip", 1)], r"policy_args is a mapping of names to values, got list", id="not-a-mapping"),
        pytest.param({f"a{i}": i for i in range(65)}, r"policy_args lists 65 entries; at most 64", id="too-many"),
    ],
)
def test_bad_policy_args_are_refused_naming_them(client, partition, args, match):
    client.put(partition, {"x": torch.arange(2)})
    with pytest.raises(InvalidArgumentError, match=match):
        client.get_meta(partition, ["x"], 1, task="t", policy="skip", policy_args=args, timeout=0)


def test_a_policy_cannot_hand_out_samples_that_are_not_ready(client, partition):
    client.put(partition, {"x": torch.arange(4)})
    with pytest.raises(InvalidArgumentError, match=r"policy 'greedy' chose samples .* not ready"):
        client.get_meta(partition, ["x"], 2, task="t", policy="greedy", timeout=5)
    with pytest.raises(InvalidArgumentError, match=r"unknown policy 'nope'; known: \['exploding', 'first_ready', 'greedy', 'groups', 'newest_first', 'skip'\]"):
        client.get_meta(partition, ["x"], 2, task="t", policy="nope", timeout=5)


def test_the_cluster_budget_holds_across_units(client, partition):
    big = {"x": torch.zeros(16, 1 << 16)}  # 4 MiB
    client.put(f"{partition}-a", big)
    try:
        with pytest.raises(StorageFullError, match=r"a write of 4194304 bytes .* needs memory: 4[12]\d{5} bytes used of 6291456 allowed in the cluster"):
            client.put(partition, big, timeout=0.2)  # each unit alone would have room
    finally:
        client.clear(f"{partition}-a")
    client.put(partition, big, timeout=5)
    client.clear(partition)


def test_bad_policy_specs_are_refused():
    from tqueue.controller.planning._batch_policies import load

    with pytest.raises(ValueError, match="name=module:attribute"):
        load(["nonsense"])


def test_a_waiter_that_fails_gets_the_error_alone_and_the_waking_put_stands(cluster, client, partition, raw):
    """A plain exception while serving a parked get_meta woken by a put: that waiter gets a
    typed error, the next waiter is served, and the put (already recorded) succeeds."""
    client.put(partition, {"x": torch.arange(1)})
    peer = raw(cluster.address)
    status = park(
        peer,
        GetMeta(rid=1, partition=partition, fields=["x"], batch_size=2, task="t", policy="exploding", timeout=60),
        GetMeta(rid=2, partition=partition, fields=["x"], batch_size=2, task="u", timeout=60),
    )
    assert waiting(status, partition) == ["get_meta", "get_meta"]
    put = client.put(partition, {"x": torch.arange(1, 2)})
    assert (put.status, put.indexes) == ("ok", [1])
    got = replies(peer, 2)
    assert isinstance(got[1], Error) and "RuntimeError: exploding policy" in got[1].message
    assert isinstance(got[2], MetaReply) and got[2].meta.indexes == [0, 1]
    assert {p.name: p for p in client.status().partitions}[partition].samples == 2
    assert client.get_data(got[2].meta)["x"].tolist() == [0, 1]  # controller and unit agree
