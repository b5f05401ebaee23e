"""A storage unit that dies (SIGKILL) or stops (SIGSTOP past the liveness window): it is
declared dead within a few heartbeats, gets no new placements, and what it held is lost:
counted per partition and task, never handed out again, reported to the group policy, and a
read of it raises DataLostError naming the samples. A unit that comes back rejoins empty. A
unit stopped for less than the controller's window is unavailable, not lost: a read of it
fails with StorageUnitUnavailableError and succeeds once it runs again."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import time
from collections.abc import Iterator

import pytest
import torch

import tqueue
from tqueue.errors import DataLostError, WaitTimeoutError
from tqueue.transport._liveness import HEARTBEAT_LIVENESS, UNIT_LIVENESS

from ._proc import until

INTERVAL = 0.5  # the test clusters' heartbeat interval
# generous for two busy cores, and far below the 30 s request timeout a read used to wait out
UNIT_BOUND = INTERVAL * (UNIT_LIVENESS + 2) + 5.0
READ_BOUND = INTERVAL * (HEARTBEAT_LIVENESS + 1) + 5.0


@pytest.fixture
def cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": INTERVAL}) as c:
        yield c


def put_groups(client: tqueue.Client, partition: str, groups: int, metas: list | None = None) -> dict[int, list[int]]:
    """``groups`` groups of 4, each put as two halves (placement alternates between the two
    units, so most groups span both); the samples on each unit."""
    on: dict[int, list[int]] = {}
    for g in range(groups):
        for _ in range(2):
            meta = client.put(partition, {"x": torch.full((2, 3), float(g))}, groups=f"g{g}")
            for i, u in zip(meta.indexes, meta.units):
                on.setdefault(u, []).append(i)
            if metas is not None:
                metas.append(meta)
    return on


def unit_pid(cluster: tqueue.LocalCluster, client: tqueue.Client, unit_id: int) -> int:
    address = next(u.address for u in client.status().units if u.unit_id == unit_id)
    return cluster.pids[1 + cluster.unit_addresses.index(address)]


def dead(client: tqueue.Client, unit_id: int) -> bool:
    return any(u.unit_id == unit_id and not u.alive for u in client.status().units)


@pytest.mark.parametrize("policy", ["drop_group", "mask_member"])
def test_a_killed_unit_is_dead_and_its_samples_lost_counted_and_never_served(cluster, policy):
    with cluster.client() as c:
        c.create_partition("p", group_size=4, on_member_failure=policy, tasks=["train", "eval", "reward"])
        on = put_groups(c, "p", 8)
        assert len(on) == 2, on  # both units hold samples
        leased = c.get_meta("p", ["x"], 8, task="train", policy="groups")  # two whole groups
        victim = leased.units[0]
        survivor = next(u for u in on if u != victim)
        lost = set(on[victim])
        pid = unit_pid(cluster, c, victim)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()

        with pytest.raises(DataLostError, match=rf"partition 'p': samples \[.*\] on storage unit {victim} at tcp://"):
            c.get_data(leased)
        read_error = time.monotonic() - t0
        assert read_error < READ_BOUND, read_error

        until(lambda: dead(c, victim), UNIT_BOUND, f"unit {victim} declared dead")
        declared = time.monotonic() - t0
        assert declared < UNIT_BOUND, declared

        status = c.status()
        (part,) = status.partitions
        assert part.lost == len(lost) and part.reasons["lost"] == len(lost)
        # the task had leased 8 samples (none consumed): every lost one counts for it
        assert status.partitions[0].tasks["train"].lost == len(lost)
        unit = next(u for u in status.units if u.unit_id == victim)
        assert not unit.alive and unit.silent >= INTERVAL * UNIT_LIVENESS

        # what is still served: never a lost sample; with drop_group, no member of a group
        # that lost one either; with mask_member, the groups' surviving members
        spans = {g: {u for u in on if any(i in on[u] for i in range(g * 4, g * 4 + 4))} for g in range(8)}
        whole = [g for g in range(8) if spans[g] == {survivor}]
        served: list[int] = []
        while True:
            try:
                meta = c.get_meta("p", ["x"], 1, task="eval", timeout=0, policy="first_ready")
            except WaitTimeoutError:
                break
            served += meta.indexes
        assert not set(served) & lost
        if policy == "drop_group":
            assert sorted(served) == sorted(i for g in whole for i in range(g * 4, g * 4 + 4))
        else:
            assert sorted(served) == sorted(on[survivor])
        # a task that first read after the death, and a declared one that never read, count every
        # lost sample too: consumed + lost reaches the partition's samples for a drained task
        tasks = c.status().partitions[0].tasks
        assert tasks["eval"].lost == tasks["reward"].lost == len(lost)
        if policy == "mask_member":
            assert tasks["eval"].lost + len(served) == 32

        # every new put goes to the survivor, and is read back exactly
        for k in range(4):
            meta = c.put("q", {"y": torch.arange(k, k + 4, dtype=torch.int64).reshape(2, 2)})
            assert set(meta.units) == {survivor}
            assert torch.equal(c.get_data(meta)["y"], torch.arange(k, k + 4, dtype=torch.int64).reshape(2, 2))
        print(f"unit SIGKILL: DataLostError after {read_error:.2f} s, declared dead after {declared:.2f} s, "
              f"{len(lost)} samples lost (heartbeat {INTERVAL} s)")


def test_a_unit_stopped_past_the_window_rejoins_under_its_id_and_empty(cluster):
    with cluster.client() as c:
        metas: list[tqueue.BatchMeta] = []
        on = put_groups(c, "p", 4, metas)
        victim = next(iter(on))
        pid = unit_pid(cluster, c, victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            until(lambda: dead(c, victim), UNIT_BOUND, f"unit {victim} declared dead")
            # its connection is open, its process stopped: lost, because the controller said so
            gone = next(m for m in metas if m.units[0] == victim)
            with pytest.raises(DataLostError, match=rf"partition 'p': samples \[.*\] on storage unit {victim} at .* cannot be read: "):
                c.get_data(gone)
        finally:
            os.kill(pid, signal.SIGCONT)
        # its next heartbeat is answered "unknown": it frees what it held and registers again
        until(
            lambda: any(u.unit_id == victim and u.alive and u.nbytes == 0 for u in c.status().units),
            UNIT_BOUND, f"unit {victim} back, empty",
        )
        (part,) = c.status().partitions
        assert part.lost == len(on[victim])
        units = set()
        for k in range(6):
            meta = c.put("fresh", {"y": torch.full((1, 2), float(k))})
            units |= set(meta.units)
            assert torch.equal(c.get_data(meta)["y"], torch.full((1, 2), float(k)))
        assert victim in units  # placements again
        # the old samples stay lost: a read of them is refused, not served stale
        with pytest.raises(tqueue.errors.PartitionClearedError, match=re.escape("has no data on this unit")):
            c.get_data(gone)


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "arena"])
def test_a_unit_stopped_within_the_window_is_unavailable_not_lost_and_serves_once_it_runs(shm):
    """SIGSTOP the unit, then read: the read fails at the client's deadline (2 s through the
    arena, 4 s over TCP, where the reply's bytes add to it) with StorageUnitUnavailableError
    naming the samples, not DataLostError, since the controller, which waits 5 heartbeats
    (15 s, at least 12 s after the stop), has not declared the unit dead. SIGCONT: the same
    samples read back exactly. (Before, a read over TCP called them lost.)"""
    heartbeat = 3.0
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": heartbeat}) as cluster:
        config = dataclasses.replace(tqueue.ClientConfig.from_env(), request_timeout=2.0, shm=shm)
        with tqueue.Client(cluster.address, config=config) as c:
            want = {"x": torch.randn(64, 1024)}
            c.put("p", want)
            meta = c.get_meta("p", ["x"], 64, task="t")
            pid = cluster.pids[1]
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(tqueue.StorageUnitUnavailableError, match=(
                    r"partition 'p': samples \[0, 1, .*\] and 32 more on storage unit 0 at tcp://.* cannot be read now: "
                    r".*They are not lost unless the controller declares the unit dead"
                )) as caught:
                    c.get_data(meta)
                took = time.monotonic() - t0
                assert not isinstance(caught.value, DataLostError)
                assert not dead(c, 0)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert took < heartbeat * UNIT_LIVENESS, took  # within the controller's window, as the test means
            got = c.get_data(meta)
            assert torch.equal(got["x"], want["x"][got.meta.indexes])


def test_a_put_whose_only_unit_dies_under_it_waits_for_a_live_one_then_says_so(monkeypatch):
    """The kill comes between the grant and the store (a hook on this client's Store), and
    no other unit has room: the put is placed again, waits for a live unit up to its
    timeout, and then says none is alive; the unit is declared dead by the failed store's
    probe, not at the end of its heartbeat window."""
    from tqueue.transport import _zmq
    from tqueue.wire import Store

    controller = {"heartbeat_interval": 2.0}  # a window of 10 s
    with tqueue.LocalCluster(num_storage_units=1, controller=controller) as cluster:
        with cluster.client(config=tqueue.ClientConfig(shm=False)) as c:
            c.put("warm", {"x": torch.ones(1, 2)})
            pid = unit_pid(cluster, c, 0)
            real = _zmq.Peer.request

            async def request(self: _zmq.Peer, msg, *args, **kwargs):
                if isinstance(msg, Store):
                    os.kill(pid, signal.SIGKILL)
                return await real(self, msg, *args, **kwargs)

            monkeypatch.setattr(_zmq.Peer, "request", request)
            t0 = time.monotonic()
            with pytest.raises(tqueue.StorageFullError, match=r"put timed out after .* no live storage unit \(1 registered"):
                c.put("doomed", {"x": torch.ones(3, 2)}, timeout=3)
            assert time.monotonic() - t0 < 3 + READ_BOUND
            monkeypatch.undo()
            assert dead(c, 0)  # by the probe: 3 s, inside the 10 s window


def test_puts_made_as_a_unit_dies_are_placed_again_on_the_live_one(caplog):
    """Right after one of two units is SIGKILLed, long before its heartbeats run out (10 s
    here), puts placed on it fail to store and are placed again on the survivor: every put
    succeeds and reads back exact. The failed store makes the controller probe the unit,
    which is declared dead at the probe's end (4 s), not at the end of the heartbeat window."""
    interval = 2.0
    with tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": interval}) as cluster:
        with cluster.client() as c:
            c.put("warm", {"x": torch.zeros(2, 3)})
            c.put("warm", {"x": torch.zeros(2, 3)})  # both units placed on: the client knows both
            victim = 0
            os.kill(unit_pid(cluster, c, victim), signal.SIGKILL)
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="tqueue.client"):
                metas = [c.put("p", {"x": torch.full((2, 3), float(i))}, timeout=30) for i in range(8)]
            assert all(m.units == [1 - victim] * 2 for m in metas)
            assert any("placing the put again" in r.getMessage() for r in caplog.records)
            batch = c.get_data(c.get_meta("p", ["x"], 16, task="t", timeout=10))
            got = {i: float(row[0]) for i, row in zip(batch.meta.indexes, batch["x"])}
            assert got == {i: float(m) for m, meta in enumerate(metas) for i in meta.indexes}
            until(lambda: dead(c, victim), 30, f"unit {victim} declared dead")
            declared = time.monotonic() - t0
            assert declared < interval * UNIT_LIVENESS, declared  # the probe, not the heartbeat window


def test_an_append_to_samples_whose_unit_died_fails_by_name_and_they_are_lost(cluster, partition):
    """A turn appended to a trajectory whose unit was SIGKILLed: a typed error naming the
    partition and the samples, at once (the unit refuses connections); once the controller
    declares the unit dead the samples are lost, and a read of them says so."""
    with tqueue.Client(cluster.address) as c:
        meta = c.put(partition, {"t": [torch.arange(3), torch.arange(4)]}, partial=True, version=0)
        address = next(u.address for u in c.status().units if u.unit_id == meta.units[0])
        os.kill(cluster.pids[1 + cluster.unit_addresses.index(address)], signal.SIGKILL)
        with pytest.raises(tqueue.errors.StorageUnitUnavailableError,
                           match=rf"partition '{partition}': samples \[{meta.indexes[0]}, {meta.indexes[1]}\] were not stored"):
            c.rollouts.complete(meta, {"t": [torch.arange(2), torch.arange(2)]}, version=1, first_token=3, append=["t"])
        until(lambda: next(p for p in c.status().partitions if p.name == partition).lost == 2, UNIT_BOUND,
              "the trajectories counted lost")
