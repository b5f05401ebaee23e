"""The trainer's version and where its weights are: ``set_version`` with a pointer, and a
version wait parked at the controller until a newer version (answered with both), bounded by
``max_parked``, withdrawn on ``Cancel`` or when its client's session ends, expired at its
deadline with a timeout that says why."""

from __future__ import annotations

import math

import pytest

import tqueue
from tqueue.errors import WaitTimeoutError
from tqueue.wire import Bye, Cancel, Error, VersionReply, VersionWait
from tqueue.wire import _messages as wire

from ..servers import LoopCluster
from .parking import park


def test_a_parked_version_wait_is_answered_by_a_newer_version_with_its_weights(cluster, client, raw):
    now = client.status().version
    peer = raw(cluster.address)
    park(peer, VersionWait(rid=1, after=now, timeout=math.inf))
    client.set_version(now, weights="s3://w/same")  # not newer: changes nothing, answers nobody
    assert client.status().weights != "s3://w/same"
    client.set_version(now + 1, weights="s3://w/next")
    reply, _ = peer.recv()
    assert isinstance(reply, VersionReply) and (reply.rid, reply.version, reply.weights) == (1, now + 1, "s3://w/next")
    status = client.status()
    assert (status.version, status.weights) == (now + 1, "s3://w/next")
    reply = client.wait_version(now, timeout=0)  # already past: answered at once
    assert (reply.version, reply.weights) == (now + 1, "s3://w/next")
    client.set_version(now + 2)  # a version without a pointer has none: not the last one's
    assert client.wait_version(now + 1, timeout=0).weights == ""


def test_a_version_wait_ends_at_its_deadline_saying_why(cluster, client):
    now = client.status().version
    with pytest.raises(WaitTimeoutError, match=rf"^the trainer's version stayed at {now} for 0.05 s \(waited for a version past {now}\)$"):
        client.wait_version(now, timeout=0.05)
    with pytest.raises(WaitTimeoutError, match=rf"^the trainer's version is {now}, not past {now + 5}$"):
        client.wait_version(now + 5, timeout=0)


def test_version_waits_are_bounded_and_a_withdrawn_or_expired_one_frees_its_place(raw):
    with LoopCluster(num_storage_units=1, controller={"max_parked": 1}) as cluster, tqueue.Client(cluster.address) as client:
        peer = raw(cluster.address)
        park(peer, VersionWait(rid=1, after=0, timeout=math.inf))
        refused = peer.ask(wire.encode(VersionWait(rid=2, after=0, timeout=math.inf)))
        assert isinstance(refused, Error) and (refused.rid, refused.code) == (2, "unavailable")
        assert "a wait for a version past 0 cannot wait: 1 requests are parked at the controller (max_parked=1)" in refused.message
        park(peer, Cancel(rid=3, of=1))  # withdrawn: no reply, and its place is free...
        with pytest.raises(WaitTimeoutError):
            client.wait_version(0, timeout=0.05)  # ...for this one, parked then expired, which frees it again
        park(peer, VersionWait(rid=4, after=0, timeout=math.inf))  # (a refusal would reply before the status)
        client.set_version(1, weights="s3://w/1")
        reply, _ = peer.recv()
        assert (reply.rid, reply.version, reply.weights) == (4, 1, "s3://w/1")  # rid 1 was never answered


def test_a_version_wait_of_a_session_that_ends_is_withdrawn(cluster, client, raw):
    peer = raw(cluster.address)
    now = client.status().version
    park(peer, VersionWait(rid=1, after=now, timeout=math.inf))
    peer.send(wire.encode(Bye()))
    reply, _ = peer.recv()
    assert isinstance(reply, Error) and (reply.rid, reply.code) == (1, "unavailable"), reply
    assert "its parked calls are withdrawn" in reply.message
