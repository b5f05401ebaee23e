"""The controller bounded by construction: no single message makes it allocate, scan or wait
past its configured limits; a refused message changes nothing; timers end with what they
guard; hostile and malformed traffic leaves a correct client served.

Most tests run a controller (and, where data moves, a storage unit) in this process on a
loop thread of their own, so that the tests can look at its state between requests; the
spin test runs it as a real process, so that SIGTERM goes where a launcher's would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

import tqueue
from tqueue.config import ControllerConfig, StorageConfig
from tqueue.controller.server._controller import Controller
from tqueue.storage import StorageUnit
from tqueue.wire import (
    MAX_COMMITS,
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Cancel,
    Clear,
    Commit,
    Commits,
    CommitsDone,
    CreatePartition,
    Error,
    Fail,
    FieldBlock,
    FieldSpec,
    GetMeta,
    Grant,
    Postpone,
    RegisterUnit,
    Renew,
    Reserve,
    Sealed,
    StatusReply,
    StatusRequest,
)
from tqueue.wire._messages import encode

from ..conftest import RawPeer
from ..servers import server
from ._proc import rss

T = TypeVar("T")
BIG = 2**62


class LoopThread:
    """A controller (and optionally a storage unit) served by an event loop on its own
    thread; ``call`` runs a function on that loop and returns its result."""

    def __init__(self, config: ControllerConfig, *, unit: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ctl: Controller = self.run(self._start_controller(config))
        self.unit: StorageUnit | None = None
        if unit:
            self.unit = self.run(self._start_unit())

    async def _start_controller(self, config: ControllerConfig) -> Controller:
        ctl = Controller(config)
        self._serving = [asyncio.ensure_future(ctl.serve())]
        return ctl

    async def _start_unit(self) -> StorageUnit:
        unit = StorageUnit(StorageConfig(controller=self.ctl.address, shm_bytes=0, bulk=False))
        await unit.start()
        self._serving.append(asyncio.ensure_future(unit.serve()))
        return unit

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def body() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the test thread
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(body)
        return done.result(timeout)

    def timers(self) -> int:
        """The controller's timer handles scheduled on its loop and not cancelled (the storage
        unit that shares the loop keeps timers of its own), less its one liveness sweep."""

        def count() -> int:
            handles = self.loop._scheduled  # type: ignore[attr-defined]
            return sum(
                1 for h in handles
                if not h.cancelled() and getattr(h._callback, "__module__", "").startswith("tqueue.controller")
                and getattr(h._callback, "__qualname__", "") != "Liveness._sweep"
            )

        return self.call(count)

    def close(self) -> None:
        async def stop() -> None:
            if self.unit is not None:
                await self.unit.close()
            await self.ctl.close()
            for task in self._serving:
                task.cancel()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def inproc() -> Iterator[Callable[..., LoopThread]]:
    made: list[LoopThread] = []

    def make(config: ControllerConfig | None = None, *, unit: bool = False) -> LoopThread:
        made.append(LoopThread(config or ControllerConfig(), unit=unit))
        return made[-1]

    yield make
    for lt in made:
        lt.close()


def ask(peer: RawPeer, msg: Any, timeout: float = 30.0) -> Any:
    return peer.ask(encode(msg), timeout)


def x_block(count: int) -> FieldBlock:
    return FieldBlock(name="x", spec=FieldSpec(kind="tensor", dtype="int64"), counts=[count])


def register(peer: RawPeer) -> None:
    """A storage unit as the controller sees it (nobody listens there: nothing is stored)."""
    reply = ask(peer, RegisterUnit(protocol=PROTOCOL_VERSION, address="tcp://127.0.0.1:9", host="h"))
    assert reply.unit_id == 0


def put(peer: RawPeer, partition: str, count: int) -> None:
    """Grant ``count`` samples (no commit: enough to give the partition a size)."""
    reply = ask(peer, Grant(partition=partition, count=count, blocks=[x_block(count)], nbytes=8 * count))
    assert reply.status == "ok", reply


def snapshot(lt: LoopThread) -> Any:
    """What a refused message must leave as it was."""

    def take() -> Any:
        s = lt.ctl.s
        parts = {
            name: (p.n, p.in_flight, p.sealed, p.committed, p.excluded, len(p.tasks), len(p.groups.ids), dict(p.specs))
            for name, p in s.partitions.items()
        }
        return parts, len(s.grants), len(lt.ctl.reads.leases), len(s.parked.reads), len(s.parked.writes), len(s.parked.seals), s.trainer.admitted

    return lt.call(take)


def refused(reply: Any, match: str) -> None:
    assert isinstance(reply, Error), reply
    assert reply.code == "invalid_argument", reply
    assert re.search(match, reply.message), reply.message


# --- 1. one message, bounded ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "match"),
    [
        pytest.param(BIG, rf"count={BIG} is out of bounds: at most 1000000", id="2**62"),
        pytest.param(10**7, r"count=10000000 is out of bounds: at most 1000000", id="10**7"),
    ],
)
def test_a_grant_past_the_limit_is_refused_and_changes_nothing(inproc, raw, count, match):
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 4)
    before = snapshot(lt)
    refused(ask(peer, Grant(partition="p", count=count, blocks=[x_block(count)])), match)
    assert snapshot(lt) == before
    assert lt.ctl.s.partitions["p"].n == 4


def test_a_partition_past_its_size_limit_refuses_the_put_and_is_left_as_it_was(inproc, raw):
    lt = inproc(ControllerConfig(max_partition_samples=6))
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 4)
    before = snapshot(lt)
    refused(
        ask(peer, Grant(partition="p", count=3, blocks=[x_block(3)])),
        r"partition 'p' holds 4 samples; count=3 more would pass max_partition_samples=6",
    )
    refused(ask(peer, Grant(partition="q", count=7, blocks=[x_block(7)])), r"max_partition_samples=6")
    assert snapshot(lt) == before  # and no partition "q" either
    put(peer, "p", 2)  # up to the limit is fine


def test_tasks_and_partitions_are_bounded(inproc, raw):
    lt = inproc(ControllerConfig(max_tasks_per_partition=2, max_partitions=2))
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 1)
    put(peer, "q", 1)
    before = snapshot(lt)
    refused(ask(peer, Grant(partition="r", count=1, blocks=[x_block(1)])), r"partition 'r' would be partition 3: max_partitions=2")
    refused(ask(peer, Fail(partition="r", reason="x", group="g", count=1)), r"max_partitions=2")
    assert snapshot(lt) == before
    for task in ("a", "b"):
        assert ask(peer, GetMeta(partition="p", fields=["x"], batch_size=1, task=task, timeout=0.0)).code == "timeout"
    reply = ask(peer, GetMeta(partition="p", fields=["x"], batch_size=1, task="c", timeout=0.0))
    refused(reply, r"task 'c' would pass max_tasks_per_partition=2")


def test_parked_requests_are_bounded_and_a_withdrawn_one_frees_its_place(inproc, raw):
    lt = inproc(ControllerConfig(max_parked=2))
    peer = raw(lt.ctl.address)
    peer.send(encode(GetMeta(rid=1, partition="p", fields=["x"], batch_size=1, task="t")))
    peer.send(encode(Sealed(rid=2, partition="p")))
    reply = ask(peer, GetMeta(rid=3, partition="p", fields=["x"], batch_size=1, task="t"))
    assert (reply.code, reply.rid) == ("unavailable", 3)
    assert "2 requests are parked at the controller (max_parked=2)" in reply.message
    peer.send(encode(Cancel(of=2)))  # the sealed wait is withdrawn: its place is free again
    assert ask(peer, Sealed(rid=4, partition="p", timeout=0.0)).code == "timeout"  # ordered after the cancel
    assert lt.call(lambda: (sum(map(len, lt.ctl.s.parked.reads.values())), dict(lt.ctl.s.parked.seals))) == (1, {})
    assert ask(peer, Sealed(rid=5, partition="p", timeout=0.001)).code == "timeout"  # parked, then expired
    assert lt.call(lambda: dict(lt.ctl.s.parked.seals)) == {}  # no list left behind under the name


def test_a_commit_from_another_unit_is_refused_and_the_grant_stays(inproc, raw):
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 2)
    [grant_id] = lt.ctl.s.grants
    before = snapshot(lt)
    forged = Commit(grant_id=grant_id, unit_id=5, fields=["x"], nbytes=16, partition_bytes=16, unit_bytes=16)
    refused(ask(peer, forged), rf"grant {grant_id} was placed on unit 0; unit 5 cannot commit it")
    assert snapshot(lt) == before and lt.timers() == 1



def test_a_units_commits_in_one_message_are_each_recorded_or_refused_alone(inproc, raw):
    """One ``Commits`` of three grants, the middle one unknown: the first and the last are
    recorded as two lone Commits would be, the middle one is answered with its own error."""
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 2)
    put(peer, "p", 3)
    first, last = sorted(lt.ctl.s.grants)
    reply = ask(peer, Commits(
        unit_id=0, grant_ids=[first, 999_999, last], fields=[["x"], ["x"], ["x"]], nbytes=[16, 8, 24],
        partition_bytes=[16, 16, 40], unit_bytes=40,
    ))
    assert isinstance(reply, CommitsDone), reply
    assert reply.sealed == [False, False, False]
    [(at, code, message)] = reply.errors
    assert (at, code) == (1, "invalid_argument") and "grant 999999 is unknown or already committed" in message
    assert lt.call(lambda: (len(lt.ctl.s.grants), lt.ctl.s.partitions["p"].committed)) == (0, 5)


@pytest.mark.parametrize(
    ("lists", "match"),
    [
        pytest.param(dict(grant_ids=[1, 2], fields=[["x"]], nbytes=[1, 1], partition_bytes=[1, 1]),
                     r"lists 2 grants, 1 field lists, 2 sizes and 2 partition sizes", id="uneven"),
        pytest.param(dict(grant_ids=[1] * (MAX_COMMITS + 1), fields=[["x"]] * (MAX_COMMITS + 1),
                          nbytes=[1] * (MAX_COMMITS + 1), partition_bytes=[1] * (MAX_COMMITS + 1)),
                     rf"of {MAX_COMMITS + 1} commits; at most {MAX_COMMITS}", id="too-many"),
    ],
)
def test_a_malformed_commits_message_is_refused_whole_and_changes_nothing(inproc, raw, lists, match):
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 2)
    before = snapshot(lt)
    reply = ask(peer, Commits(unit_id=0, unit_bytes=0, **lists))
    assert isinstance(reply, Error) and reply.code == "protocol", reply
    assert re.search(match, reply.message), reply.message
    assert snapshot(lt) == before


def _partial_pair(lt: LoopThread, peer: RawPeer) -> int:
    """Two partial samples of partition "p" (target 2), committed on unit 0; its uid."""
    assert ask(peer, CreatePartition(partition="p", target=2)).__class__.__name__ != "Error"
    reply = ask(peer, Grant(partition="p", count=2, blocks=[x_block(2)], nbytes=16, partial=True))
    assert reply.status == "ok", reply
    done = ask(peer, Commit(grant_id=reply.grant_id, unit_id=0, fields=["x"], nbytes=16, partition_bytes=16, unit_bytes=16))
    assert not isinstance(done, Error), done
    return reply.partition_uid


def _completing_update(peer: RawPeer, uid: int) -> int:
    block = FieldBlock(name="y", spec=FieldSpec(kind="tensor", dtype="int64"), counts=[2])
    reply = ask(peer, Grant(partition="p", partition_uid=uid, count=2, blocks=[block], indexes=[0, 1], complete=True, nbytes=16))
    assert reply.status == "ok" and reply.grant_id, reply
    return reply.grant_id


@pytest.mark.parametrize("end", ["writer-gone", "unit-dead"])
def test_an_update_whose_store_never_comes_lapses_and_gives_back_its_target_places(inproc, raw, end):
    """An update that completes partial samples takes places of the partition's target. Its
    writer ends its session (a Bye), or the unit holding the samples dies, before the store:
    the grant lapses then, and the places return (before, update grants had no owner, no
    timer and no unit: they stayed until the partition went, and the target stayed promised)."""
    lt = inproc()
    unit = raw(lt.ctl.address)
    register(unit)
    uid = _partial_pair(lt, unit)
    writer = raw(lt.ctl.address)
    grant_id = _completing_update(writer, uid)
    assert lt.call(lambda: (grant_id in lt.ctl.s.grants, lt.ctl.s.partitions["p"].promised)) == (True, 2)
    assert lt.call(lambda: lt.ctl.s.grants[grant_id].timer is not None)  # grant_timeout holds it too
    if end == "writer-gone":
        writer.send(encode(Bye()))
        ask(writer, StatusRequest())  # the same connection: handled after the Bye
    else:
        lt.call(lambda: lt.ctl.liveness.unit_dead(lt.ctl.s.units[0], "killed by the test"))
    assert lt.call(lambda: (grant_id in lt.ctl.s.grants, lt.ctl.s.partitions["p"].promised)) == (False, 0)

HOSTILE = [
    pytest.param(GetMeta(partition="p", fields=["x"], batch_size=BIG, task="t"), rf"batch_size={BIG} is out of bounds", id="get-batch"),
    pytest.param(
        GetMeta(partition="p", fields=["x"], batch_size=1000, task="t", dp_size=10**4, dp_rank=0, round=0),
        r"dp_size \* batch_size = 10000 \* 1000 is out of bounds", id="get-dp",
    ),
    pytest.param(GetMeta(partition="p", fields=["x"] * 100, batch_size=1, task="t"), r"fields lists 100 entries; at most 61", id="get-fields"),
    pytest.param(GetMeta(partition="p", fields=["x"], batch_size=1, task="t", timeout=math.nan), r"timeout must be >= 0 seconds \(math.inf: none\), got nan", id="get-nan"),
    pytest.param(GetMeta(partition="p", fields=["x"], batch_size=1, task="t" * 5000), r"task is 5000 characters long", id="get-task"),
    pytest.param(Ack(partition="p", partition_uid=0, task="t", indexes=[BIG]), rf"indexes holds sample {BIG}", id="ack-huge"),
    pytest.param(Ack(partition="p", partition_uid=0, task="t", indexes=list(range(10**6 + 1))), r"indexes lists 1000001 entries", id="ack-long"),
    pytest.param(Fail(partition="p", reason="r", indexes=[2**63 - 1]), rf"indexes holds sample {2**63 - 1}", id="fail-huge"),
    pytest.param(Fail(partition="p", reason="r", indexes=[-5]), r"indexes holds sample -5", id="fail-negative"),
    pytest.param(Fail(partition="p", reason="r", group="g", count=BIG), rf"count={BIG} is out of bounds", id="fail-count"),
    pytest.param(Clear(partition="p", indexes=[BIG]), rf"indexes holds sample {BIG}", id="clear-huge"),
    pytest.param(Postpone(partition="p", partition_uid=1, indexes=[BIG], to="q"), rf"indexes holds sample {BIG}", id="postpone-huge"),
    pytest.param(Renew(partition="p", partition_uid=1, task="t", lease=1, timeout=math.nan), r"timeout must be >= 0 seconds", id="renew-nan"),
    pytest.param(Reserve(count=BIG), rf"count={BIG} is out of bounds", id="reserve-count"),
    pytest.param(Reserve(count=1, timeout=math.nan), r"timeout must be >= 0 seconds", id="reserve-nan"),
    pytest.param(Sealed(partition="p", timeout=math.nan), r"timeout must be >= 0 seconds", id="sealed-nan"),
    pytest.param(Sealed(partition="p", timeout=-1.0), r"timeout must be >= 0 seconds", id="sealed-negative"),
    pytest.param(Grant(partition="p", count=1, blocks=[x_block(1)], timeout=math.nan), r"timeout must be >= 0 seconds", id="grant-nan"),
    pytest.param(Grant(partition="p", count=2, blocks=[x_block(2)], versions=[0]), r"versions lists 1 entries for count=2", id="grant-versions"),
    pytest.param(Grant(partition="p", count=1, blocks=[x_block(1)], indexes=[BIG]), rf"indexes holds sample {BIG}", id="grant-index"),
    pytest.param(Grant(partition="p", count=4, blocks=[x_block(4)], callers=[2, 1]), r"partition 'p': callers must be positive counts that sum to count=4 \(got 2 summing to 3\)", id="grant-callers-sum"),
    pytest.param(Grant(partition="p", count=2, blocks=[x_block(2)], callers=[3, -1]), r"callers must be positive counts", id="grant-callers-negative"),
    pytest.param(
        Grant(partition="p", count=1, blocks=[FieldBlock(name="x", spec=FieldSpec(kind="tensor", dtype="int64", shape=(1,) * 40), counts=[1])]),
        r"spec.shape lists 40 entries; at most 32", id="grant-dims",
    ),
    pytest.param(CreatePartition(partition="c", tasks=[str(i) for i in range(2000)]), r"tasks lists 2000 entries; at most 1024", id="create-tasks"),
    pytest.param(CreatePartition(partition="c", target=BIG), rf"target={BIG} is out of bounds", id="create-target"),
    pytest.param(CreatePartition(partition="c", group_size=BIG), rf"group_size={BIG} is out of bounds", id="create-group"),
]


@pytest.mark.parametrize(("msg", "match"), HOSTILE)
def test_a_hostile_field_is_refused_by_name_and_changes_nothing(inproc, raw, msg, match):
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    put(peer, "p", 4)
    before = snapshot(lt)
    refused(ask(peer, msg), match)
    assert snapshot(lt) == before
    assert lt.timers() == 1  # the one grant's: no timer was scheduled for the refused message


# --- 2. the loop never spins -----------------------------------------------------------------


def test_a_huge_grant_then_a_parked_read_leaves_the_controller_answering_and_stoppable(raw):
    with server("controller", "--bind", "tcp://127.0.0.1:0") as address:  # SIGTERM: rc 0 required
        peer = raw(address)
        register(peer)
        refused(ask(peer, Grant(partition="p", count=BIG, blocks=[x_block(BIG)])), rf"count={BIG} is out of bounds")
        peer.send(encode(GetMeta(rid=7, partition="p", fields=["x"], batch_size=1, task="t")))  # parks: no reply
        status = ask(peer, StatusRequest(rid=8), timeout=30.0)
        assert isinstance(status, StatusReply)
        assert [p.name for p in status.partitions] == []  # the refused grant created nothing
        assert [w.partition for w in status.waiting] == ["p"]


# --- 3. timers end with what they guard ---------------------------------------------------


PUTS = 2_000  # a timer left per put would show as 2,000 more


def test_puts_leave_no_timers_and_freeing_leaves_no_records(inproc):
    lt = inproc(unit=True)
    before = lt.timers()
    with tqueue.Client(lt.ctl.address, config=tqueue.ClientConfig(shm=False, bulk=False)) as c:
        c.create_partition("p", tasks=["t"])
        for i in range(PUTS):
            c.put("p", {"x": torch.tensor([i])})
        assert lt.timers() == before  # each grant's timer was cancelled at its commit
        c.seal("p")
        meta = c.get_meta("p", ["x"], batch_size=PUTS, task="t", timeout=30.0, lease_timeout=600.0)
        assert lt.timers() == before + 1  # the lease's
        c.ack(meta)
        status = c.status()
    assert lt.timers() == before
    assert [p.name for p in status.partitions] == []  # freed once consumed

    def records() -> dict[str, int]:
        s = lt.ctl.s
        return {
            "partitions": len(s.partitions), "grants": len(s.grants), "leases": len(lt.ctl.reads.leases),
            "waiters": len(s.parked.reads), "parked": len(s.parked.writes), "sealed_waiters": len(s.parked.seals),
            "rounds": len(lt.ctl.reads.rounds),
        }

    assert lt.call(records) == dict.fromkeys(records_keys(), 0)


def records_keys() -> list[str]:
    return ["partitions", "grants", "leases", "waiters", "parked", "sealed_waiters", "rounds"]


def test_a_lapsed_or_cancelled_grant_cancels_its_timer(inproc, raw):
    lt = inproc()
    peer = raw(lt.ctl.address)
    register(peer)
    before = lt.timers()
    put(peer, "p", 1)
    assert lt.timers() == before + 1
    [grant_id] = lt.ctl.s.grants
    lt.call(lambda: lt.ctl.writes._lapse_grant(grant_id, "was dropped by the test"))
    assert lt.timers() == before
    put(peer, "p", 1)
    assert lt.timers() == before + 1
    part = lt.ctl.s.partitions["p"]
    assert lt.call(lambda: lt.ctl.cleanup.forget(part, None))  # what a clear or a free does first
    assert lt.timers() == before and lt.ctl.s.grants == {}


# --- 4. fuzz ------------------------------------------------------------------------------

FUZZ_MESSAGES = int(os.environ.get("TQUEUE_FUZZ_CONTROLLER_MESSAGES", 100_000))
# Not fuzzed: what only a storage unit or the trainer sends, which the controller trusts when
# authentication is off (with it on, units' messages are for the cluster key only:
# tests/faults/test_auth.py): RegisterUnit (placement uses the unit), Commit (a forged commit
# records another producer's samples) and Admission (the cluster-wide staleness switch).
FUZZ_SKIP = {"RegisterUnit", "Commit", "Admission"}
INTS = [0, 1, -1, 2, 3, 7, 64, 1000, 10_000, 10_001, 2**31, 2**62, 2**63 - 1, -(2**63)]
FLOATS = [0.0, 0.001, 0.5, -1.0, math.nan, math.inf, -math.inf, 1e308]
NAMES = ["f0", "f1", "f2", "x", "y", "", "z" * 5000]
LENGTHS = [0, 1, 2, 3, 5, 64]


def fuzz_value(rng: Any, t: Any) -> Any:
    """A random value of msgspec type ``t``, drawn mostly from the edges."""
    import msgspec.inspect as mi

    if isinstance(t, mi.IntType):
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randrange(-5, 100)
    if isinstance(t, mi.FloatType):
        return rng.choice(FLOATS)
    if isinstance(t, mi.StrType):
        return rng.choice(NAMES)
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.UnionType):
        return fuzz_value(rng, rng.choice(t.types))
    if isinstance(t, mi.LiteralType):
        return rng.choice(t.values)
    if isinstance(t, mi.ListType):
        return [fuzz_value(rng, t.item_type) for _ in range(rng.choice(LENGTHS))]
    if isinstance(t, mi.TupleType):
        return tuple(fuzz_value(rng, item) for item in t.item_types)
    if isinstance(t, mi.VarTupleType):
        return tuple(fuzz_value(rng, t.item_type) for _ in range(rng.choice(LENGTHS[:4])))
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: fuzz_value(rng, f.type) for f in t.fields if f.required or rng.random() < 0.5})
    if isinstance(t, mi.DictType):
        return {}
    return None  # Any


def fuzz_frames(rng: Any, types: list[type]) -> list[bytes]:
    """One hostile message: well-formed with values at the edges, or malformed."""
    import msgspec
    import msgspec.inspect as mi

    roll = rng.random()
    cls = rng.choice(types)
    if roll < 0.6:
        msg = fuzz_value(rng, mi.type_info(cls))
        frames = [bytes(f) for f in encode(msg)]
        if rng.random() < 0.1:
            frames += [rng.randbytes(rng.choice([0, 1, 100]))]  # stray payload frames
        return frames
    kind = bytes([cls.KIND])
    if roll < 0.7:  # a valid header cut short
        header = bytes(encode(fuzz_value(rng, mi.type_info(cls)))[1])
        return [kind, header[: rng.randrange(len(header))]]
    if roll < 0.8:  # garbage
        return [rng.randbytes(rng.choice([0, 1, 2])), rng.randbytes(rng.choice([0, 1, 9, 200]))]
    if roll < 0.85:  # nested far deeper than any message
        return [kind, b"\x91" * rng.choice([100, 10_000, 100_000]) + b"\xc0"]
    if roll < 0.9:  # the right keys, the wrong types
        return [kind, msgspec.msgpack.encode({"rid": rng.choice(INTS), "partition": [1], "count": "x", "indexes": {"a": 1}})]
    if roll < 0.95:  # missing frames
        return [kind] if rng.random() < 0.5 else [b""]
    return [kind, msgspec.msgpack.encode({"rid": 1, "partition": "f0", "count": 1, "blocks": [], "junk": [0] * 1000})]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.soak
def test_fuzzed_traffic_leaves_a_correct_client_served_and_memory_bounded(inproc, raw, capsys, caplog):
    import logging
    import random
    import time

    caplog.set_level(logging.ERROR)  # a malformed request is a warning each: not kept, not counted

    from tqueue.wire import _messages

    config = ControllerConfig(max_samples_per_request=10_000, max_partition_samples=20_000, max_partitions=64, max_parked=5_000)
    lt = inproc(config, unit=True)
    types = [t for t in _messages._TYPES.values() if t.__name__ not in FUZZ_SKIP]
    rng = random.Random(20261123)
    peer = raw(lt.ctl.address)
    rss_start = 0
    with tqueue.Client(lt.ctl.address, config=tqueue.ClientConfig(shm=False, bulk=False, request_timeout=60.0)) as good:
        good.create_partition("good", tasks=["t"], auto_free=False)
        started = time.perf_counter()
        for i in range(FUZZ_MESSAGES):
            peer.send(fuzz_frames(rng, types))
            while peer.sock.poll(0):  # replies are read, not waited for
                peer.sock.recv_multipart()
            if i % 1000 == 999:
                good.put("good", {"x": torch.tensor([i])})
                meta = good.get_meta("good", ["x"], batch_size=1, task="t", timeout=60.0)
                assert meta.size == 1
                good.ack(meta)
            if i == 1999:
                rss_start = rss_bytes()  # after the first partitions and parked requests are made
        elapsed = time.perf_counter() - started
        assert [p.name for p in good.status().partitions if p.name == "good"] == ["good"]
    grown = rss_bytes() - rss_start
    with capsys.disabled():
        print(f"\nfuzz: {FUZZ_MESSAGES} messages in {elapsed:.2f} s ({FUZZ_MESSAGES / elapsed:.0f}/s), RSS +{grown / 2**20:.1f} MiB")
    assert grown < 128 * 2**20
    parked = lt.call(lambda: len(lt.ctl.s.parked.writes) + sum(map(len, lt.ctl.s.parked.reads.values())))
    assert parked <= config.max_parked
    assert [r.getMessage() for r in caplog.records] == []  # no untyped failure in any handler


def test_an_empty_partition_costs_the_controller_under_2_kb():
    """max_partitions empty partitions must fit in memory: 100,000 of them once took 4.2 GiB
    (45 KB each, per-sample arrays preallocated for 1,024 samples). Measured on the
    controller process: its resident bytes per partition created."""
    count = 5000
    with tqueue.LocalCluster(num_storage_units=1) as cluster:

        async def create(first: int) -> None:
            async with tqueue.AsyncClient(cluster.address) as c:
                for at in range(first, first + count, 500):
                    await asyncio.gather(*(c.create_partition(f"empty-{i}") for i in range(at, at + 500)))

        asyncio.run(create(0))  # warm: allocator arenas, caches, the client's session
        before = rss(cluster.pids[0])
        asyncio.run(create(count))
        per = (rss(cluster.pids[0]) - before) / count
        with cluster.client() as c:
            assert len(c.status().partitions) == 2 * count
    print(f"an empty partition costs the controller {per:.0f} bytes")
    assert per < 2048, per


# --- keys and tags, bounded per sample, per partition and in all -------------------------------


def keys_snapshot(lt: LoopThread) -> Any:
    def take() -> Any:
        return {
            name: (dict(p.keys.index), dict(p.keys.sample_tags), dict(p.keys.key_tags))
            for name, p in lt.ctl.s.partitions.items() if p.keys is not None
        }

    return lt.call(take)


def test_tags_and_keys_past_their_bounds_are_refused_by_partition_and_bound_and_change_nothing(inproc, raw):
    from tqueue.wire import TagKeys

    config = ControllerConfig(
        max_tag_bytes=1000, max_tag_bytes_per_partition=5000, max_tag_bytes_total=6000,
        max_keys_per_partition=10, max_keys_total=15,
    )
    lt = inproc(config)
    peer = raw(lt.ctl.address)
    assert ask(peer, TagKeys(partition="p", keys=["a", "b"], tags=[{"x": 1}, {"y": "z" * 100}])).KIND
    before = keys_snapshot(lt)
    refused(ask(peer, TagKeys(partition="p", keys=["c"], tags=[{"x": "y" * 2000}])),
            r"the tags of key 'c' of partition 'p' are 2006 bytes as MessagePack, more than max_tag_bytes=1000")
    refused(ask(peer, TagKeys(partition="p", keys=[str(i) for i in range(9)], tags=[{}] * 9)),
            r"partition 'p' would hold 11 keys, more than max_keys_per_partition=10")
    refused(ask(peer, TagKeys(partition="p", keys=[str(i) for i in range(6)], tags=[{"x": "y" * 900}] * 6)),
            r"partition 'p' would hold \d+ bytes of tags, more than max_tag_bytes_per_partition=5000")
    assert keys_snapshot(lt) == before
    ask(peer, TagKeys(partition="q", keys=[str(i) for i in range(8)], tags=[{}] * 8))
    refused(ask(peer, TagKeys(partition="r", keys=[str(i) for i in range(6)], tags=[{}] * 6)),
            r"partition 'r': 6 new keys would make 16 in all partitions, more than max_keys_total=15")
    ask(peer, TagKeys(partition="q", keys=["0", "1", "2", "3", "4"], tags=[{"x": "y" * 900}] * 5))
    refused(ask(peer, TagKeys(partition="p", keys=["a", "b"], tags=[{"x": "y" * 900}] * 2)),
            r"partition 'p': \d+ more bytes of tags would make \d+ in all partitions, more than max_tag_bytes_total=6000")
    # a write that takes no more is never refused
    ask(peer, TagKeys(partition="q", keys=["0", "1", "2", "3", "4"], tags=[{}] * 5))
    keys = ask(peer, StatusRequest()).keys
    assert (keys.keys, keys.max_keys_total, keys.max_tag_bytes_total) == (10, 15, 6000)
    assert keys.partitions["p"].keys == 2 and keys.partitions["q"].keys == 8
    assert keys.tag_bytes == sum(u.tag_bytes for u in keys.partitions.values()) == 4 + 105 + 8 * 1


def test_a_frame_far_past_the_header_bound_drops_its_connection_and_nothing_else(inproc, raw):
    """No request to the controller carries payload: a frame over four times
    ``max_header_bytes`` is never received (ZeroMQ drops that peer's connection as it
    arrives; no 64 MiB is allocated), and every other peer is served as before."""
    import zmq

    lt = inproc(ControllerConfig(max_header_bytes=1 << 20))
    assert lt.ctl._server._socket.sock.getsockopt(zmq.MAXMSGSIZE) == 4 << 20
    big = raw(lt.ctl.address)
    big.send([encode(StatusRequest())[0], b"\0" * (64 << 20)])
    with pytest.raises(TimeoutError):
        big.recv(timeout=0.5)
    reply = ask(raw(lt.ctl.address), StatusRequest())
    assert not isinstance(reply, Error), reply
