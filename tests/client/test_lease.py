"""Arena leases (tqueue/client/_routes/arena.py): a writer on a unit's host takes an arena range
for several puts and puts into it one after another, asking the unit for a range once per
lease. Real units and their arenas; the only hook counts the ``Alloc`` requests a client sends."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tqueue
from tqueue.client._routes import ArenaRoute
from tqueue.errors import ProtocolError
from tqueue.transport import _zmq
from tqueue.wire import FieldBlock, FieldSpec, Store, Stored

from ..faults._proc import until
from ..servers import LoopCluster

KiB = 1 << 10
PUT = 128 * KiB  # a put's arena bytes: 8 samples of 4096 float32
LEASE = 1 << 20  # eight puts a lease
CONFIG = tqueue.ClientConfig(shm=True, shm_min_bytes=0, arena_lease_bytes=LEASE)
# the unit reports its arena with its heartbeats: a short interval, for the waits on them
BEATS = {"heartbeat_interval": 0.25}


def group(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096) + i * 1e5}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Requests this process's async peers send, by message kind."""
    kinds: Counter[str] = Counter()
    real = _zmq.Peer.request

    async def request(self: _zmq.Peer, msg: Any, *args: Any, **kwargs: Any) -> Any:
        kinds[type(msg).__name__] += 1
        return await real(self, msg, *args, **kwargs)

    monkeypatch.setattr(_zmq.Peer, "request", request)
    return kinds


@pytest.fixture
def unit() -> Iterator[tqueue.LocalCluster]:
    with LoopCluster(num_storage_units=1, storage={"alloc_timeout": 60.0}, controller=BEATS) as c:
        yield c


def arena_used(c: tqueue.Client) -> int:
    return c.status().units[0].arena_used


def route_of(c: tqueue.Client) -> ArenaRoute:
    (route,) = c._inner._conns.routes.values()
    assert isinstance(route, ArenaRoute)
    return route


def test_puts_into_a_lease_come_back_exact_and_ask_the_unit_for_a_range_once_a_lease(unit, sent, partition):
    """24 puts of 128 KiB fill three leases of 1 MiB: three Allocs, not 24. The two leases
    filled are released with the next Store, so once the samples are cleared the unit holds
    the current lease alone, and nothing once the client is gone."""
    with tqueue.Client(unit.address, config=CONFIG) as c:
        metas = [c.put(partition, group(i)) for i in range(24)]
        assert sent["Alloc"] == 3 and sent["Store"] == 24
        for i, meta in enumerate(metas):
            assert torch.equal(c.get_data(meta)["x"], group(i)["x"])
        lease = route_of(c).lease
        assert lease is not None and lease.end - lease.offset == LEASE
        c.clear(partition)
        until(lambda: arena_used(c) == LEASE, 30, "the unit holds the current lease alone")
        with tqueue.Client(unit.address) as other:
            c.close()
            until(lambda: arena_used(other) == 0, 30, "the lease freed with its client's session")


def test_puts_bigger_than_half_a_lease_get_a_range_of_their_own_and_leave_the_lease_alone(unit, sent, partition):
    with tqueue.Client(unit.address, config=dataclasses.replace(CONFIG, arena_lease_bytes=2 * PUT - 1)) as c:
        metas = [c.put(partition, group(i)) for i in range(3)]
        assert sent["Alloc"] == 3 and route_of(c).lease is None
        assert all(torch.equal(c.get_data(m)["x"], group(i)["x"]) for i, m in enumerate(metas))
        until(lambda: arena_used(c) == 3 * PUT, 30, "the unit reports three ranges")
        c.clear(partition)
        until(lambda: arena_used(c) == 0, 30, "nothing kept")
    with tqueue.Client(unit.address, config=CONFIG) as c:
        c.put(partition, group(0))  # a lease of 1 MiB
        lease = route_of(c).lease
        big = [{"x": torch.arange(8 * 20_000, dtype=torch.float32).reshape(8, 20_000) + i} for i in range(2)]
        metas = [c.put(f"{partition}-big", b) for b in big]  # 625 KiB: more than half of arena_lease_bytes
        assert route_of(c).lease is lease and sent["Alloc"] == 6
        meta = c.put(partition, group(1))  # into the lease still
        assert sent["Alloc"] == 6 and torch.equal(c.get_data(meta)["x"], group(1)["x"])
        assert all(torch.equal(c.get_data(m)["x"], b["x"]) for m, b in zip(metas, big))


def test_concurrent_puts_share_a_lease_and_each_lands_whole(unit, sent, partition):
    """32 puts at once from one AsyncClient (no coalescing): each cuts its own range out of
    the lease in force when it starts; those that find it full take the next."""

    async def main() -> None:
        async with tqueue.AsyncClient(unit.address, config=dataclasses.replace(CONFIG, coalesce_puts=False)) as c:
            metas = await asyncio.gather(*(c.put(partition, group(i)) for i in range(32)))
            assert sent["Store"] == 32 and sent["Alloc"] <= 8
            for i, meta in enumerate(metas):
                assert torch.equal((await c.get_data(meta))["x"], group(i)["x"])
            for _ in range(600):  # reported with the unit's next heartbeat
                if (await c.status()).units[0].arena_used >= 32 * PUT:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the unit never reported the leases")
            await c.clear(partition)

    asyncio.run(main())
    with tqueue.Client(unit.address) as c:
        until(lambda: arena_used(c) == 0, 30, "every lease freed with its client's session")


def test_a_lease_that_lapsed_on_the_unit_is_not_put_into_and_its_late_release_spares_the_next(partition, sent):
    """The unit lets a lease go ``alloc_timeout`` after the last put into it; the client puts
    into a lease only within half of that. After the lapse the next put takes a new lease,
    which first-fit hands out at the same offset; the old lease's release rides on that
    put's Store, and its token keeps it from ending the new allocation there."""
    with LoopCluster(num_storage_units=1, storage={"alloc_timeout": 0.5}, controller=BEATS) as cluster:
        with tqueue.Client(cluster.address, config=CONFIG) as c:
            c.put(partition, group(0))
            old = route_of(c).lease
            assert old is not None
            until(lambda: arena_used(c) == LEASE, 30, "the unit reports the lease")  # not a stale 0
            c.clear(partition)
            until(lambda: arena_used(c) == 0, 30, "the lease lapsed on the unit")
            meta = c.put(partition, group(1))
            new = route_of(c).lease
            assert new is not None and new is not old and (new.offset, sent["Alloc"]) == (old.offset, 2)
            assert new.token != old.token
            assert torch.equal(c.get_data(meta)["x"], group(1)["x"])
            c.put(partition, group(2))  # the new lease is still the unit's
            assert sent["Alloc"] == 2


def test_a_store_into_another_writers_range_is_refused(unit, partition):
    """A range belongs to the session that was given it: a Store from another client naming
    it fails, and the owner's next put into it is unharmed."""
    with tqueue.Client(unit.address, config=CONFIG) as owner, tqueue.Client(unit.address, config=CONFIG) as other:
        owner.put(partition, group(0))
        lease = route_of(owner).lease
        assert lease is not None
        other.put(partition, group(1))
        peer = route_of(other).peer
        block = FieldBlock(name="x", spec=FieldSpec(kind="tensor", dtype="float32", shape=(4,)), counts=[1])
        store = Store(
            grant_id=1, partition=partition, partition_uid=1, start=100, count=1, blocks=[block],
            region=lease.offset, shm=[[lease.at, 16]], keep=True,
        )

        async def steal() -> None:
            await peer.request(store, expect=Stored)

        with pytest.raises(ProtocolError, match=f"arena region {lease.offset} was not allocated to this writer"):
            other._run(steal())
        meta = owner.put(partition, group(2))
        assert torch.equal(owner.get_data(meta)["x"], group(2)["x"])


def test_a_unit_killed_and_restarted_under_a_lease_costs_the_next_put_nothing(partition):
    """SIGKILL the unit a client holds a lease on and start it again at its address: the
    client's next put reaches the new unit (its new arena), whole."""
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": 0.5}) as cluster:
        with tqueue.Client(cluster.address, config=CONFIG) as c:
            c.put(partition, group(0))
            assert route_of(c).lease is not None
            pid = cluster.pids[1]
            os.kill(pid, signal.SIGKILL)
            until(lambda: not c.status().units[0].alive, 30, "the unit is declared dead")
            cluster.restart_unit(0)
            until(lambda: c.status().units[0].alive, 30, "the unit registers again")
            meta = c.put(f"{partition}-after", group(1))
            assert torch.equal(c.get_data(meta)["x"], group(1)["x"])
