"""Leases: a consumer that dies loses nothing; no task sees a sample twice unless its lease
expired without an ack; renewals and stale acks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import msgspec
import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError, WaitTimeoutError

CONSUMER = """
import json, sys, tqueue
client = tqueue.Client(sys.argv[1])
meta = client.get_meta(sys.argv[2], ["x"], 4, task="train", timeout=30, lease_timeout=float(sys.argv[3]))
print(json.dumps(meta.indexes), flush=True)
sys.stdin.read()  # hold the lease until killed
"""


def test_sigkilled_consumer_loses_nothing_and_each_sample_is_consumed_once(cluster, client, partition):
    client.put(partition, {"x": torch.arange(8)})
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, cluster.address, partition, "1.0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = json.loads(proc.stdout.readline())  # the handshake: it holds a lease
        assert len(held) == 4
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    delivered = []
    with tqueue.Client(cluster.address) as other:
        for turn in range(2):  # the 4 free samples now, the 4 dead ones once their lease expires
            if turn:
                cluster.advance(1.0)  # the servers' clock (tests/conftest.py) passes the lease's end
            meta = other.get_meta(partition, ["x"], 4, task="train", timeout=10)
            batch = other.get_data(meta)
            assert batch["x"].tolist() == meta.indexes
            delivered += meta.indexes
            other.ack(meta)
    assert sorted(delivered) == list(range(8))  # each exactly once among the living
    assert set(held) <= set(delivered)
    status = {p.name: p for p in client.status().partitions}[partition].tasks["train"]
    assert (status.consumed, status.leased, status.expired) == (8, 0, 4)


def test_without_expiry_a_leased_sample_is_not_served_again(client, partition):
    client.put(partition, {"x": torch.arange(2)})
    client.get_meta(partition, ["x"], 2, task="t", timeout=1, lease_timeout=float("inf"))
    with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0.2)


def test_renew_keeps_samples_and_stale_acks_are_ignored(cluster, client, partition):
    client.put(partition, {"x": torch.arange(2)})
    # no wall clock raced against a short lease: the lease is long, renewed without expiry,
    # then renewed short, which shows a renewal replaces the deadline
    first = client.get_meta(partition, ["x"], 2, task="t", timeout=1, lease_timeout=60)
    client.renew(first, lease_timeout=float("inf"))
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["x"], 2, task="t", timeout=0)
    client.renew(first, lease_timeout=2.0)
    cluster.advance(2.0)  # the servers' clock (tests/conftest.py); less than the sessions' window
    with tqueue.Client(cluster.address) as other:
        second = other.get_meta(partition, ["x"], 2, task="t", timeout=10)  # after expiry
        assert second.indexes == first.indexes and second.lease != first.lease
        client.ack(first)  # too late: the samples are leased to someone else now
        status = {p.name: p for p in client.status().partitions}[partition].tasks["t"]
        assert (status.leased, status.consumed) == (2, 0)
        other.ack(second)
    status = {p.name: p for p in client.status().partitions}[partition].tasks["t"]
    assert (status.leased, status.consumed) == (0, 2)
    with pytest.raises(InvalidArgumentError, match="no longer held"):
        client.renew(second)


def test_bad_lease_timeout(client, partition):
    with pytest.raises(InvalidArgumentError, match=r"lease_timeout must be >= 0 seconds"):
        client.get_meta(partition, ["x"], 1, task="t", lease_timeout=-1)


def test_an_ack_that_names_a_sample_twice_counts_it_once_and_acks_the_rest_of_its_lease(client, partition):
    """An ack listing one sample twice (a meta a user put together by hand) once made the
    task's leased count go below the truth: the sample counted twice, the lease's last sample
    stayed held."""
    client.put(partition, {"x": torch.arange(3)})
    meta = client.get_meta(partition, ["x"], 3, task="t", timeout=10)
    first, second, third = meta.indexes
    doubled = msgspec.structs.replace(meta, indexes=[first, first, second])
    client.ack(doubled)
    status = {p.name: p for p in client.status().partitions}[partition].tasks["t"]
    assert (status.consumed, status.leased) == (2, 1)
    client.ack(meta)  # the rest of the lease, then nothing is left held
    status = {p.name: p for p in client.status().partitions}[partition].tasks["t"]
    assert (status.consumed, status.leased) == (3, 0)


def test_an_ack_of_an_unknown_task_or_sample_is_refused_and_changes_nothing(client, partition):
    """An ack that names a task with no state on the partition, or a sample the partition does
    not have, is refused with the partition and what is wrong; the right ack afterwards
    consumes the samples."""
    client.put(partition, {"x": torch.arange(4)})
    meta = client.get_meta(partition, ["x"], 4, task="t", timeout=5)
    with pytest.raises(InvalidArgumentError, match=rf"task 'nobody' has no samples of partition '{partition}' to acknowledge"):
        client.ack(msgspec.structs.replace(meta, task="nobody"))
    with pytest.raises(InvalidArgumentError, match=rf"partition '{partition}' has no sample \[0, 1, 2, 99\]"):
        client.ack(msgspec.structs.replace(meta, indexes=[0, 1, 2, 99]))
    client.ack(meta)
    with pytest.raises(WaitTimeoutError):  # consumed by "t": nothing left for it
        client.get_meta(partition, ["x"], 1, task="t", timeout=0)
