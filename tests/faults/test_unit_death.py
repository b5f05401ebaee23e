"""A storage unit that dies (SIGKILL) or stops (SIGSTOP past the liveness window): it is
declared dead within a few heartbeats, gets no new placements, and what it held is lost:
counted per partition and task, never handed out again, reported to the group policy, and a
read of it raises DataLostError naming the samples. A unit that comes back rejoins empty."""

from __future__ import annotations

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
        c.create_partition("p", group_size=4, on_member_failure=policy)
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
                meta = c.get_meta("p", ["x"], 1, task="eval", timeout=0)
            except WaitTimeoutError:
                break
            served += meta.indexes
        assert not set(served) & lost
        if policy == "drop_group":
            assert sorted(served) == sorted(i for g in whole for i in range(g * 4, g * 4 + 4))
        else:
            assert sorted(served) == sorted(on[survivor])

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
        gone = next(m for m in metas if m.units[0] == victim)
        with pytest.raises(tqueue.errors.PartitionClearedError, match=re.escape("has no data on this unit")):
            c.get_data(gone)


def test_a_put_to_a_unit_that_dies_under_it_names_partition_and_samples(cluster, monkeypatch):
    """The kill comes between the grant and the store (a hook on this client's Store)."""
    from tqueue.transport import _zmq
    from tqueue.wire import Store

    with cluster.client(config=tqueue.ClientConfig(shm=False)) as c:
        c.put("warm", {"x": torch.ones(1, 2)})
        pids = {u.unit_id: unit_pid(cluster, c, u.unit_id) for u in c.status().units}
        real = _zmq.Peer.request
        killed: list[int] = []

        async def request(self: _zmq.Peer, msg, *args, **kwargs):
            if isinstance(msg, Store) and not killed:  # the unit this put was placed on
                killed.append(msg.partition_uid)
                os.kill(pids[int(self.name.rpartition(" ")[2])], signal.SIGKILL)
            return await real(self, msg, *args, **kwargs)

        monkeypatch.setattr(_zmq.Peer, "request", request)
        t0 = time.monotonic()
        with pytest.raises(tqueue.StorageUnitUnavailableError,
                           match=r"partition 'doomed': samples \[\d+, \d+, \d+\] were not stored on storage unit \d "
                                 r"at tcp://.*has not been heard from"):
            c.put("doomed", {"x": torch.ones(3, 2)})
        assert time.monotonic() - t0 < READ_BOUND
