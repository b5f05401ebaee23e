"""The controller through real clients: parking, timeouts that explain themselves,
schemas, placement, leases and acks, clear."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
import torch

import tqueue
from tqueue.errors import (
    InvalidArgumentError,
    PartitionClearedError,
    SchemaError,
    UnknownFieldError,
    WaitTimeoutError,
)
from tqueue.wire import Cancel, GetMeta, Grant, Sealed, StatusRequest
from tqueue.wire import _messages as wire

from .parking import park, waiting

# a test reads the controller's CPU time by its pid: the module's cluster is processes
# (tests/conftest.py)
PROCESSES = True


async def started(coro):
    """Run ``coro`` as a task up to its first real suspension: its request is then sent,
    and a later request on the same connection reaches the server after it."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_parked_get_meta_is_answered_when_a_put_commits(cluster, partition):
    asyncio.run(_parked_then_woken(cluster.address, partition))


async def _parked_then_woken(address, partition):
    async with tqueue.AsyncClient(address) as consumer, tqueue.AsyncClient(address) as producer:
        waiting = await started(consumer.get_meta(partition, ["x"], 4, task="t", timeout=60))
        # One connection delivers in order: once status answers, the get_meta is parked.
        status = await consumer.status()
        assert [(w.partition, w.task) for w in status.waiting] == [(partition, "t")]
        assert "does not exist yet" in status.waiting[0].reason
        await producer.put(partition, {"x": torch.arange(2)})
        assert not waiting.done()
        await producer.put(partition, {"x": torch.arange(2, 4)})
        meta = await asyncio.wait_for(waiting, 10)
        assert meta.indexes == [0, 1, 2, 3] and meta.task == "t"


def test_parked_controller_does_not_spin(cluster, client, partition):
    pid = cluster.pids[0]
    before = cpu_seconds(pid)
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["x"], 1, task="t", timeout=1.0)
    assert cpu_seconds(pid) - before < 0.1


def test_timeout_says_what_it_waited_for_and_what_was_ready(client, partition):
    client.put(partition, {"a": torch.zeros(3)})
    with pytest.raises(
        WaitTimeoutError,
        match=rf"timed out after 0.2 s waiting for 5 samples of partition '{partition}' with "
        rf"fields \['a'\] for task 'train': 3 ready for this task",
    ) as info:
        client.get_meta(partition, ["a"], 5, task="train", timeout=0.2)
    assert isinstance(info.value, TimeoutError)


def test_timeout_names_fields_never_written(client, partition):
    client.put(partition, {"a": torch.zeros(3)})
    with pytest.raises(WaitTimeoutError, match=r"fields never written to it: \['rewards'\] \(known: \['a'\]\)"):
        client.get_meta(partition, ["a", "rewards"], 1, task="t", timeout=0.1)


def test_timeout_on_a_partition_nobody_wrote(client, partition):
    with pytest.raises(WaitTimeoutError, match="does not exist yet"):
        client.get_meta(partition, ["a"], 1, task="t", timeout=0)


def test_declared_partition_refuses_unknown_fields_at_once(client, partition):
    client.create_partition(partition, fields=["prompt", "response"])
    with pytest.raises(UnknownFieldError, match=rf"field 'rewrds' is not declared for partition '{partition}'"):
        client.get_meta(partition, ["prompt", "rewrds"], 1, task="t", timeout=30)
    with pytest.raises(UnknownFieldError, match=r"field 'other' is not declared .* \['prompt', 'response'\]"):
        client.put(partition, {"prompt": ["p"], "other": [1]})


def test_a_field_no_sample_of_a_sealed_partition_has_fails_at_once_with_the_near_miss(client, partition):
    client.put(partition, {"reward": torch.zeros(3), "x": torch.zeros(3)})
    client.seal(partition)
    started = time.monotonic()
    with pytest.raises(UnknownFieldError, match=rf"no sample of partition '{partition}' has field 'rewards'.*did you mean 'reward'\?"):
        client.get_meta(partition, ["x", "rewards"], 1, task="t", timeout=60)
    assert time.monotonic() - started < 5
    meta = client.get_meta(partition, ["x", "reward"], 3, task="t", timeout=5)
    with pytest.raises(UnknownFieldError, match=r"field 'rewrd' is not in the schema .*did you mean 'reward'\?"):
        client.get_data(meta, ["rewrd"])


def test_a_misspelt_field_of_an_open_partition_fails_at_once_and_a_new_one_is_waited_for(client, partition):
    """A name one edit from a field the samples have, that no put or update under way writes,
    is a misspelling: said at once, not after the timeout. A name like none of them may be a
    field a later put or update writes (a reward): it is waited for."""
    client.put(partition, {"reward": torch.zeros(3), "x": torch.zeros(3)})
    started = time.monotonic()
    with pytest.raises(UnknownFieldError, match=rf"partition '{partition}' has field 'rewrad' .*did you mean 'reward'\?"):
        client.get_meta(partition, ["x", "rewrad"], 1, task="t", timeout=60)
    assert time.monotonic() - started < 5
    with pytest.raises(WaitTimeoutError, match=r"fields never written to it: \['advantages'\]"):
        client.get_meta(partition, ["x", "advantages"], 1, task="t", timeout=0.2)


def test_a_reader_parked_on_a_field_learns_at_the_seal_that_it_cannot_come(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as consumer, tqueue.AsyncClient(cluster.address) as producer:
            await producer.put(partition, {"x": torch.zeros(2)})
            reader = await started(consumer.get_meta(partition, ["x", "y"], 2, task="t", timeout=60))
            assert [w.partition for w in (await consumer.status()).waiting] == [partition]
            await producer.seal(partition)
            with pytest.raises(UnknownFieldError, match=rf"partition '{partition}' has field 'y'"):
                await asyncio.wait_for(reader, 10)

    asyncio.run(main())


def test_a_field_an_update_may_still_write_is_waited_for(client, partition):
    """A sealed partition that declares its fields waits for one no sample has yet (a later
    task's update writes it); one being written by an update in flight waits too."""
    client.create_partition(partition, fields=["x", "adv"])
    client.put(partition, {"x": torch.zeros(2)})
    client.seal(partition)
    with pytest.raises(WaitTimeoutError, match=r"fields never written to it: \['adv'\]"):
        client.get_meta(partition, ["x", "adv"], 2, task="t", timeout=0.2)
    meta = client.get_meta(partition, ["x"], 2, task="reward", timeout=5)
    client.update(meta, {"adv": torch.ones(2)})
    assert client.get_meta(partition, ["x", "adv"], 2, task="t", timeout=5).indexes == [0, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"timeout": -1}, r"timeout must be >= 0 seconds", id="negative-timeout"),
        pytest.param({"timeout": float("nan")}, r"timeout must be >= 0 seconds", id="nan-timeout"),
        pytest.param({"batch_size": 0}, r"batch_size must be at least 1, got 0", id="batch-size"),
        pytest.param({"task": ""}, r"get_meta needs a task name", id="no-task"),
        pytest.param({"fields": ["a", "a"]}, r"distinct field names", id="duplicate-fields"),
    ],
)
def test_bad_get_meta_arguments(client, partition, kwargs, match):
    args = {"fields": ["a"], "batch_size": 1, "task": "t", "timeout": 1.0} | kwargs
    with pytest.raises(InvalidArgumentError, match=match):
        client.get_meta(partition, args.pop("fields"), args.pop("batch_size"), **args)


@pytest.mark.parametrize(
    "second, match",
    [
        pytest.param({"x": torch.zeros(2, 4, dtype=torch.int64)}, r"has dtype float32; this write has dtype int64", id="dtype"),
        pytest.param({"x": torch.zeros(2, 5)}, r"has per-sample shape \(4,\); this write has \(5,\)", id="shape"),
        pytest.param(
            {"x": [torch.zeros(4), torch.zeros(3)]},
            r"has per-sample shape \(4,\); sample 1 of this write has shape \(3,\)",
            id="jagged-into-dense",
        ),
        pytest.param({"x": ["a", "b"]}, r"holds tensor values; this write has object values", id="kind"),
    ],
)
def test_later_writes_must_match_the_field(client, partition, second, match):
    client.put(partition, {"x": torch.zeros(2, 4)})
    with pytest.raises(SchemaError, match=rf"field 'x' of partition '{partition}' {match}"):
        client.put(partition, second)


def test_a_jagged_fields_spec_keeps_its_one_shape_until_two_samples_differ(client, partition):
    """A jagged field says whether its shapes have varied: ``shape`` is the one shape of every
    sample so far, ``()`` once a put or an update gives another (and it stays so)."""
    first = client.put(partition, {"x": [torch.zeros(4, 2), torch.ones(4, 2)], "o": ["a", "bb"]})
    assert first.schema["x"] == tqueue.FieldSpec(kind="tensor", dtype="float32", layout="jagged", shape=(4, 2), ndim=2)
    assert first.schema["o"].shape == ()
    same = client.put(partition, {"x": torch.zeros(3, 4, 2)})  # dense, the same shape
    assert same.schema["x"].shape == (4, 2)
    client.update(first, {"x": [torch.zeros(4, 2), torch.zeros(4, 2)]})
    assert _spec(client, partition, "x").shape == (4, 2)
    client.update(first, {"x": [torch.zeros(4, 2), torch.zeros(5, 2)]})
    varied = _spec(client, partition, "x")
    assert (varied.layout, varied.shape, varied.ndim) == ("jagged", (), 2)
    assert client.put(partition, {"x": torch.zeros(1, 4, 2)}).schema["x"].shape == ()  # for good
    got = client.get_data(client.get_meta(partition, ["x"], 6, task="t", timeout=0), ["x"])
    assert [tuple(t.shape) for t in got["x"]] == [(4, 2), (5, 2), (4, 2), (4, 2), (4, 2), (4, 2)]
    other = client.put(partition, {"y": [torch.zeros(2), torch.zeros(3)]})
    assert other.schema["y"].shape == ()


def _spec(client, partition, field):
    return next(p for p in client.status().partitions if p.name == partition).fields[field]


def test_a_put_is_placed_whole_on_one_unit_and_visible_at_once(client, partition):
    metas = [client.put(partition, {"x": torch.zeros(64, 1024)}) for _ in range(4)]
    for m in metas:
        assert len(set(m.units)) == 1
    assert len({m.units[0] for m in metas}) == 2  # equal puts spread over both units
    got = client.get_meta(partition, ["x"], 256, task="t", timeout=0)
    assert got.indexes == list(range(256))


def test_a_task_never_gets_a_sample_twice_other_tasks_get_their_own(client, partition):
    client.put(partition, {"x": torch.arange(4)}, groups=["g0", "g0", "g1", "g1"])
    first = client.get_meta(partition, ["x"], 4, task="actor", timeout=1, policy="first_ready")
    assert first.groups == ["g0", "g0", "g1", "g1"]
    with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
        client.get_meta(partition, ["x"], 1, task="actor", timeout=0, policy="first_ready")  # leased, not acked
    client.ack(first)
    client.ack(first)  # twice is harmless
    with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
        client.get_meta(partition, ["x"], 1, task="actor", timeout=0, policy="first_ready")  # consumed
    ref = client.get_meta(partition, ["x"], 4, task="ref", timeout=0, policy="first_ready")
    assert ref.indexes == first.indexes
    status = {p.name: p for p in client.status().partitions}[partition]
    assert status.tasks["actor"].consumed == 4 and status.tasks["ref"].leased == 4


def test_clear_frees_bytes_wakes_waiters_and_allows_reuse(cluster, client, partition):
    old = client.put(partition, {"x": torch.zeros(8, 1000)})
    assert {p.name: p for p in client.status().partitions}[partition].nbytes == 8 * 4000

    async def scenario():
        async with tqueue.AsyncClient(cluster.address) as a:
            waiting = await started(a.get_meta(partition, ["y"], 1, task="t", timeout=60))
            await a.status()  # parked once this answers
            await a.clear(partition)
            with pytest.raises(PartitionClearedError, match="cleared while get_meta waited"):
                await asyncio.wait_for(waiting, 10)

    asyncio.run(scenario())
    assert partition not in {p.name for p in client.status().partitions}
    new = client.put(partition, {"x": torch.ones(2, 1000)})
    assert new.partition_uid != old.partition_uid and new.indexes == [0, 1]
    with pytest.raises(PartitionClearedError):
        client.update(old, {"x": torch.zeros(8, 1000)})


def test_status_reports_progress_exclusions_and_waiting_calls(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.create_partition(partition, group_size=2)
            await c.put(partition, {"x": torch.zeros(4, 100)}, groups=["a", "a", "b", "b"])
            await c.fail(partition, group="b", count=1, reason="timeout")
            meta = await c.get_meta(partition, ["x"], 2, task="actor", timeout=5)
            await c.ack(meta)
            await c.get_meta(partition, ["x"], 2, task="ref", timeout=5)
            waiting = await started(c.get_meta(partition, ["x"], 2, task="actor", timeout=60))
            status = await c.status()
            part = {p.name: p for p in status.partitions}[partition]
            assert (part.samples, part.ready, part.excluded) == (4, 2, 2)
            assert part.reasons == {"member failed: timeout": 2}
            assert part.nbytes == 4 * 400 and part.groups_complete == 2 and not part.sealed
            assert (part.tasks["actor"].consumed, part.tasks["ref"].leased) == (2, 2)
            [w] = [w for w in status.waiting if w.partition == partition]
            assert (w.kind, w.task) == ("get_meta", "actor")
            assert "0 ready for this task (4 samples committed" in w.reason
            await c.clear(partition)
            with pytest.raises(PartitionClearedError):
                await waiting

    asyncio.run(main())


def test_a_cancelled_get_meta_is_withdrawn_and_the_samples_go_to_a_live_caller(cluster, client, partition, raw):
    peer = raw(cluster.address)
    asked = GetMeta(rid=1, partition=partition, fields=["x"], batch_size=2, task="t", timeout=math.inf)
    assert waiting(park(peer, asked), partition) == ["get_meta"]
    assert waiting(park(peer, Cancel(rid=2, of=1)), partition) == []
    client.put(partition, {"x": torch.arange(2)})
    assert client.get_meta(partition, ["x"], 2, task="t", timeout=0).indexes == [0, 1]
    # the next reply on the raw connection is for the next request: none went to 1 or 2
    assert peer.ask(wire.encode(StatusRequest(rid=3))).rid == 3


def test_a_cancelled_seal_wait_is_withdrawn(cluster, client, partition, raw):
    peer = raw(cluster.address)
    park(peer, Sealed(rid=1, partition=partition, timeout=math.inf), Cancel(rid=2, of=1))
    client.put(partition, {"x": torch.arange(2)})
    client.seal(partition)
    assert peer.ask(wire.encode(StatusRequest(rid=3))).rid == 3


def test_a_cancel_that_crosses_its_reply_releases_the_lease(cluster, client, partition, raw):
    client.put(partition, {"x": torch.arange(2)})
    peer = raw(cluster.address)
    served = peer.ask(wire.encode(GetMeta(rid=1, partition=partition, fields=["x"], batch_size=2, task="t",
                                          lease_timeout=math.inf)))
    assert served.meta.indexes == [0, 1]  # leased without expiry to a caller that then gives up
    park(peer, Cancel(rid=2, of=1))
    assert client.get_meta(partition, ["x"], 2, task="t", timeout=0).indexes == [0, 1]


def test_a_put_of_several_callers_is_cut_after_the_caller_that_crosses_the_target(cluster, client, partition, raw):
    """``Grant.callers`` (coalesced puts): with 6 places of a target of 10 left (4 held by an
    uncommitted grant), a put of callers [2, 2, 2, 2] is answered ``take=6`` and nothing is
    granted; [4, 4], whose last caller crosses, is granted as one put, its first 6 kept."""
    from tqueue.client._encode import encode

    client.create_partition(partition, target=10)
    peer = raw(cluster.address)

    def grant(rid, count, callers=None):
        enc = encode({"x": torch.arange(count)}, partition=partition, chunk_bytes=1 << 20)
        msg = Grant(rid=rid, partition=partition, count=count, blocks=enc.grant_blocks(), nbytes=enc.nbytes, callers=callers)
        return peer.ask(wire.encode(msg))

    assert grant(1, 4).kept == -1  # 4 places held
    cut = grant(2, 8, [2, 2, 2, 2])
    assert (cut.take, cut.grant_id, cut.unit) == (6, 0, None)
    held = {p.name: p for p in client.status().partitions}[partition]
    assert (held.in_flight, held.reasons) == (1, {})  # nothing granted or counted for the cut put
    whole = grant(3, 8, [4, 4])
    assert (whole.take, whole.kept) == (0, 6)
    late = grant(4, 4, [2, 2])  # every place is held: late as a whole (aborted: no recycle_to)
    assert (late.take, late.status) == (0, "aborted")


def test_a_cancelled_put_whose_grant_was_sent_frees_its_target_places(cluster, client, partition, raw):
    from tqueue.client._encode import encode

    client.create_partition(partition, target=2)
    enc = encode({"x": torch.arange(2)}, partition=partition, chunk_bytes=1 << 20)
    peer = raw(cluster.address)
    granted = peer.ask(wire.encode(Grant(rid=1, partition=partition, count=2, blocks=enc.grant_blocks(), nbytes=enc.nbytes)))
    assert (granted.status, granted.kept) == ("ok", -1)  # both places held for this put...
    park(peer, Cancel(rid=2, of=1))  # ...whose caller gives up before it stores
    meta = client.put(partition, {"x": torch.arange(2)})
    assert (meta.status, meta.fates) == ("ok", None)
