"""Partitions of two copies (``create_partition(copies=2)``): each put is acknowledged once two
units hold it, a unit SIGKILLed in the middle of a put and get stream loses no acknowledged
sample, readers holding metas of the dead unit switch to the copies within the liveness
window, and updates reach both copies."""

from __future__ import annotations

import os
import signal
import threading
import zlib
from collections.abc import Iterator

import msgspec
import pytest
import torch

import tqueue

from ._proc import until

INTERVAL = 0.5  # the clusters' heartbeat interval


@pytest.fixture
def cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=3, controller={"heartbeat_interval": INTERVAL}) as c:
        yield c


def kill_unit(cluster: tqueue.LocalCluster, client: tqueue.Client, unit_id: int) -> None:
    address = next(u.address for u in client.status().units if u.unit_id == unit_id)
    os.kill(cluster.pids[1 + cluster.unit_addresses.index(address)], signal.SIGKILL)


def rows(first: int, n: int) -> torch.Tensor:
    return torch.stack([torch.rand(64, generator=torch.Generator().manual_seed(first + i)) for i in range(n)])


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().tobytes())


def status_of(client: tqueue.Client, partition: str) -> tqueue.wire.PartitionStatus:
    return next(p for p in client.status().partitions if p.name == partition)


def test_a_unit_killed_mid_stream_loses_no_acknowledged_sample(partition):
    """Two units. A producer puts 4 samples at a time while a consumer reads and acks; one
    unit is SIGKILLed after a few puts. Every put acknowledged, before or after, is read back
    with its CRC; none is lost. A replacement unit joins, and the samples held once since the
    death are copied onto it (``status().single`` back to 0)."""
    with (
        tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": INTERVAL}) as cluster,
        tqueue.Client(cluster.address) as c,
    ):
        c.create_partition(partition, copies=2)
        acked: dict[int, int] = {}  # sample id -> CRC of its row, for acknowledged puts
        read: dict[int, int] = {}

        def consume() -> None:
            with tqueue.Client(cluster.address) as reader:
                while len(read) < 96:
                    batch = reader.get_data(partition, ["x", "id"], 4, task="train", timeout=30)
                    for row, ident in zip(batch["x"], batch["id"].tolist()):
                        read[ident] = crc(row)
                    reader.ack(batch.meta)

        consumer = threading.Thread(target=consume)
        consumer.start()
        for k in range(24):
            x = rows(4 * k, 4)
            meta = c.put(partition, {"x": x, "id": torch.arange(4 * k, 4 * k + 4)})
            acked.update({4 * k + i: crc(x[i]) for i in range(4)})
            if k == 6:
                kill_unit(cluster, c, meta.units[0])
        consumer.join(timeout=120)
        assert not consumer.is_alive()
        assert read == acked  # every acknowledged sample, exact
        until(lambda: any(not u.alive for u in c.status().units), 30, "the unit declared dead")
        part = status_of(c, partition)
        assert part.lost == 0 and part.copies == 2 and part.single > 0  # one unit left: held once
        assert part.tasks["train"].consumed == 96 and part.tasks["train"].lost == 0
        cluster.start_unit()  # a replacement joins: the samples held once are copied onto it
        until(lambda: status_of(c, partition).single == 0, 30, "copying again onto the new unit")


def test_a_reader_holding_a_meta_of_the_dead_unit_reads_the_copies(cluster, partition):
    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2)
        x = rows(0, 16)
        c.put(partition, {"x": x})
        meta = c.get_meta(partition, ["x"], 16, task="t", timeout=10)
        kill_unit(cluster, c, meta.units[0])
        batch = c.get_data(meta)  # the unit is gone: the read waits for its copies to be served
        assert torch.equal(batch["x"], x)
        c.ack(meta)
        assert status_of(c, partition).tasks["t"].consumed == 16


def test_updates_reach_both_copies(cluster, partition):
    """A reward worker's update, then the death of the unit each sample was read from: the
    copies hold the update; an update after the death writes the copies left."""
    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2)
        for k in range(4):
            c.put(partition, {"x": rows(4 * k, 4)})
        meta = c.get_meta(partition, ["x"], 16, task="reward", timeout=10)
        c.update(meta, {"r": torch.arange(16.0)})
        c.ack(meta)
        kill_unit(cluster, c, meta.units[0])
        until(lambda: any(not u.alive for u in c.status().units), 30, "the unit declared dead")
        every = c.select(partition, ["x", "r"])
        assert sorted(c.get_data(every)["r"].tolist()) == [float(i) for i in range(16)]
        c.update(every, {"r": torch.arange(16.0) + 100})
        assert sorted(c.get_data(c.select(partition, ["r"]))["r"].tolist()) == [100.0 + i for i in range(16)]


def test_a_put_with_no_second_unit_is_stored_once_and_three_copies_are_refused(partition):
    with tqueue.LocalCluster(num_storage_units=1) as alone, tqueue.Client(alone.address) as c:
        c.create_partition(partition, copies=2)
        c.put(partition, {"x": torch.ones(2, 3)})
        assert torch.equal(c.get_data(partition, ["x"], 2, task="t", timeout=5)["x"], torch.ones(2, 3))
    with pytest.raises(tqueue.errors.InvalidArgumentError, match="copies is 1 or 2"):
        with tqueue.LocalCluster(num_storage_units=1) as alone, tqueue.Client(alone.address) as c:
            c.create_partition(partition, copies=3)


def test_both_units_hold_a_put_of_two_copies_and_a_clear_frees_both(cluster, partition):
    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2)
        before = {u.unit_id: u.nbytes for u in c.status().units}
        c.put(partition, {"x": torch.zeros(64, 1024)})  # 256 KiB
        grown = {u.unit_id: u.nbytes - before[u.unit_id] for u in c.status().units}
        assert sorted(grown.values())[-2:] == [sorted(grown.values())[-1]] * 2 and max(grown.values()) >= 64 * 1024 * 4
        c.clear(partition)
        until(lambda: {u.unit_id: u.nbytes for u in c.status().units} == before, 30, "both copies freed")


def test_an_update_located_before_a_copy_was_made_reaches_both_copies(cluster, partition, monkeypatch):
    """A writer located its samples while they were held once (after a unit's death), and a
    copy was made on another unit before its grant. The grant names where the copies are now,
    and the update reaches both. (Before, the writer wrote the one unit it knew, the controller
    waited for the other's commit, and the update was acknowledged but never became visible: a
    reader of its field waited without end. A chaos run showed it as a group the trainer never
    got.) The stale ``Locate`` is the writer's view a moment earlier, given back as it was."""
    from tqueue.client._puts import Puts

    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2)
        x = rows(0, 8)
        c.put(partition, {"x": x})
        kill_unit(cluster, c, c.select(partition, ["x"]).units[0])
        until(lambda: any(not u.alive for u in c.status().units)
              and status_of(c, partition).single == 0, 30, "the samples held once copied again")
        meta = c.select(partition, ["x"])
        holder = meta.units[0]

        async def stale(self, m):  # where the samples were before the copy: held once, on the holder
            return msgspec.structs.replace(m, units=[holder] * len(m.indexes)), [-1] * len(m.indexes)

        monkeypatch.setattr(Puts, "_locate", stale)
        c.update(meta, {"r": torch.arange(8.0)})
        monkeypatch.undo()
        got = c.get_data(partition, ["x", "r"], 8, task="t", timeout=10)
        assert sorted(got["r"].tolist()) == list(map(float, range(8)))
        kill_unit(cluster, c, holder)  # the copy alone now: it has the update too
        until(lambda: sum(not u.alive for u in c.status().units) == 2, 30, "the holder declared dead")
        every = c.select(partition, ["x", "r"])
        batch = c.get_data(every)
        assert batch["r"].tolist() == [float(i) for i in every.indexes] and torch.equal(batch["x"], x[every.indexes])
        assert status_of(c, partition).lost == 0


def test_an_update_whose_samples_are_on_two_pairs_now_is_located_again(cluster, partition, monkeypatch):
    """The writer's view put all 8 samples on one unit; the controller has them on two pairs
    of units: the grant says ``moved``, the writer locates them again and writes each pair's."""
    from tqueue.client._puts import Puts

    real = Puts._locate
    calls = []

    async def stale_once(self, m):
        calls.append(len(m.indexes))
        if len(calls) > 1:
            return await real(self, m)
        return msgspec.structs.replace(m, units=[m.units[0]] * len(m.indexes)), [-1] * len(m.indexes)

    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2)
        x = rows(0, 8)
        c.put(partition, {"x": x[:4]})
        c.put(partition, {"x": x[4:]})  # the least loaded units: another pair
        meta = c.select(partition, ["x"])
        monkeypatch.setattr(Puts, "_locate", stale_once)
        c.update(meta, {"r": torch.arange(8.0)})
        monkeypatch.undo()
        assert calls[0] == 8 and len(calls) >= 2  # located again after the grant said moved
        batch = c.get_data(c.select(partition, ["x", "r"]))
        assert sorted(batch["r"].tolist()) == [float(i) for i in range(8)]


def test_samples_held_once_are_copied_again_so_a_second_death_loses_nothing(cluster, partition):
    """Three units: the first death leaves samples held once; the controller copies them to
    the third unit in the background (``status().single`` back to 0), dense and jagged fields
    alike, and a field shared by content (one value for all 32 samples); then a second unit
    dies and nothing is lost either."""
    with tqueue.Client(cluster.address) as c:
        c.create_partition(partition, copies=2, dedup=["img"])
        x = rows(0, 32)
        jag = [torch.arange(i % 7 + 1) for i in range(32)]
        img = torch.rand(4096)
        for k in range(4):
            c.put(partition, {"x": x[8 * k : 8 * k + 8], "j": jag[8 * k : 8 * k + 8], "img": [img] * 8})
        first, second = sorted({u.unit_id for u in c.status().units})[:2]
        kill_unit(cluster, c, first)
        until(lambda: any(not u.alive for u in c.status().units)
              and status_of(c, partition).single == 0, 30, "the samples held once copied again")
        kill_unit(cluster, c, second)
        until(lambda: sum(not u.alive for u in c.status().units) == 2, 30, "the second unit declared dead")
        part = status_of(c, partition)
        assert part.lost == 0 and part.single == 32  # one unit left: held once, nowhere to copy to
        batch = c.get_data(c.select(partition, ["x", "j", "img"]))
        assert torch.equal(batch["x"], x) and all(torch.equal(a, b) for a, b in zip(batch["j"], jag))
        assert all(torch.equal(a, img) for a in batch["img"])


def test_a_restored_partition_of_two_copies_is_copied_again(partition, tmp_path):
    """A checkpoint holds one copy of each sample; restored into 3 units, the samples are
    copied again in the background, so that a death after the restore loses nothing."""
    x = rows(0, 16)
    with tqueue.LocalCluster(num_storage_units=2) as old, tqueue.Client(old.address) as c:
        c.create_partition(partition, copies=2)
        c.put(partition, {"x": x})
        c.save_checkpoint(str(tmp_path / "ck"))
    with (
        tqueue.LocalCluster(num_storage_units=3, controller={"heartbeat_interval": INTERVAL}) as new,
        tqueue.Client(new.address) as c,
    ):
        c.load_checkpoint(str(tmp_path / "ck"))
        until(lambda: status_of(c, partition).single == 0, 30, "the restored samples copied again")
        kill_unit(new, c, c.select(partition, ["x"]).units[0])
        until(lambda: any(not u.alive for u in c.status().units), 30, "the unit declared dead")
        assert status_of(c, partition).lost == 0
        assert torch.equal(c.get_data(c.select(partition, ["x"]))["x"], x)


def test_a_read_waits_for_the_copies_no_longer_than_its_timeout(cluster, partition):
    """A unit that stops answering but is not declared dead within the reader's request
    timeout (SIGSTOP; heartbeats every 0.5 s, dead after 5 missed): the read's wait for the
    copies, parked at the controller, ends at that timeout with the unit's error, not later."""
    import time

    with tqueue.Client(cluster.address, config=tqueue.ClientConfig(request_timeout=1.0)) as c:
        c.create_partition(partition, copies=2)
        c.put(partition, {"x": rows(0, 4)})
        meta = c.get_meta(partition, ["x"], 4, task="t", timeout=10)
        address = next(u.address for u in c.status().units if u.unit_id == meta.units[0])
        pid = cluster.pids[1 + cluster.unit_addresses.index(address)]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(tqueue.errors.StorageUnitUnavailableError, match="samples"):
                c.get_data(meta)
            assert time.monotonic() - t0 < 8.0  # fetch (1 s), the parked Locate (1 s), the verdict
        finally:
            os.kill(pid, signal.SIGCONT)


def test_a_copy_is_recorded_only_for_samples_whose_revision_did_not_move():
    """Copying again reads samples, then stores them elsewhere; an update of the holder in
    between makes the copy stale: the commit records it for the unchanged samples only."""
    import numpy as np

    from tqueue.controller.model._partition import GrantRecord, Partition
    from tqueue.controller.model._samples import COMMITTED
    from tqueue.controller.parts._copies import record_copy

    part = Partition("p", 1)
    part.allocate(4, None, None)
    s = part.samples
    s.mask[:4] |= COMMITTED
    s.unit[:4] = 0
    part.single = 4
    idx = np.arange(4)
    grant = GrantRecord(7, 1, 2, 0, 4, idx, frozenset({"x"}), copy_of=s.revision[idx].copy())
    s.revision[1] += 1  # updated on the holder after the read
    s.unit[3] = 1  # its holder died meanwhile (promoted elsewhere): unit 1 is not alive
    assert record_copy(part, grant, 2, alive={0, 2}) == 2
    assert s.second_unit[:4].tolist() == [2, -1, 2, -1] and part.single == 2


def unit_of(client: tqueue.Client, address: str) -> tqueue.wire.UnitStatus:
    """The unit at ``address`` (its live incarnation, where a restart reused the address)."""
    units = [u for u in client.status().units if u.address == address]
    return next((u for u in units if u.alive), units[0])


def test_a_copy_made_while_an_update_is_in_flight_is_made_again_once_it_commits(partition, monkeypatch):
    """Samples held once (their second unit SIGKILLed, no unit to copy to) are updated: the
    update is granted while they are held once, so it writes the holder alone, and its store
    is held back (a hook on this client) while a new unit joins and the controller copies the
    samples onto it. That copy lacks the update: it is not recorded (``single`` stays 8),
    and it is tried again, with backoff, until the update has committed; then the copy holds
    it, and once the holder dies too the copy serves ``r``. (Before, the copy was recorded;
    once the holder died, the copy was the only one and had "no field 'r' on this unit", and
    copying it again failed the same way at every try: samples stayed held once.)"""
    import asyncio
    import time

    from tqueue.client._puts import Puts

    with (
        tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": INTERVAL}) as cluster,
        tqueue.Client(cluster.address) as c,
        tqueue.Client(cluster.address) as writer,
    ):
        c.create_partition(partition, copies=2)
        x = rows(0, 8)
        c.put(partition, {"x": x})
        kill_unit(cluster, c, c.select(partition, ["x"]).units[0])
        until(lambda: any(not u.alive for u in c.status().units), 30, "the unit declared dead")
        assert status_of(c, partition).single == 8  # one unit left: nowhere to copy to
        meta = c.select(partition, ["x"])
        holder = meta.units[0]

        granted, release = threading.Event(), threading.Event()
        real = Puts._store

        async def held_back(self, unit, part, grant, enc, indexes, *rest):
            if indexes is not None:  # the update's store, after its grant
                granted.set()
                await asyncio.to_thread(release.wait, 30)
            return await real(self, unit, part, grant, enc, indexes, *rest)

        monkeypatch.setattr(Puts, "_store", held_back)
        updating = threading.Thread(target=writer.update, args=(meta, {"r": torch.arange(8.0)}))
        updating.start()
        try:
            assert granted.wait(30)
            cluster.start_unit()  # somewhere to copy to: the controller copies at once
            new = cluster.unit_addresses[-1]
            until(lambda: unit_of(c, new).nbytes > 0, 30, "the copy stored on the new unit")
            assert status_of(c, partition).single == 8  # stored, not recorded: it lacks the update
        finally:
            release.set()
            updating.join(timeout=30)
        monkeypatch.undo()
        t0 = time.monotonic()
        until(lambda: status_of(c, partition).single == 0, 30, "the samples copied again, update and all")
        print(f"copied again {time.monotonic() - t0:.2f} s after the update committed")
        kill_unit(cluster, c, holder)
        until(lambda: sum(not u.alive for u in c.status().units) == 2, 30, "the holder declared dead")
        every = c.select(partition, ["x", "r"])
        assert set(every.units) == {unit_of(c, new).unit_id}
        batch = c.get_data(every)
        assert batch["r"].tolist() == [float(i) for i in every.indexes] and torch.equal(batch["x"], x[every.indexes])
        part = status_of(c, partition)
        assert part.lost == 0 and part.single == 8  # held once again, on the copy: nowhere else to go


def test_a_copy_whose_target_is_killed_mid_copy_is_made_on_another_unit_without_waiting_for_its_death(partition):
    """Two units hold every sample; a third (another host) is SIGSTOPped, then the second
    unit restarts (its old incarnation is dead at once, its samples held once). The copier
    picks the stopped unit (another host first), whose store hangs; it is SIGKILLed in the
    middle. The copy fails at once (its connection closed) and is tried again 50 ms later on
    the restarted unit, long before the killed one's silence (10 s) declares it dead: before,
    a failed copy waited for the next death or registration."""
    import time

    with (
        tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": 2.0}) as cluster,
        tqueue.Client(cluster.address) as c,
    ):
        c.create_partition(partition, copies=2)
        x = rows(0, 16)
        c.put(partition, {"x": x})
        assert status_of(c, partition).single == 0
        stopped = cluster.start_unit(host="elsewhere")
        target = cluster.unit_addresses[-1]
        until(lambda: unit_of(c, target).alive, 30, "the third unit registered")
        os.kill(stopped, signal.SIGSTOP)
        try:
            cluster.restart_unit(1)  # the old incarnation is dead at its successor's registration
            assert status_of(c, partition).single == 16  # held once: the copy to the stopped unit hangs
            os.kill(stopped, signal.SIGKILL)
        finally:
            os.kill(stopped, signal.SIGCONT)
        t0 = time.monotonic()
        until(lambda: status_of(c, partition).single == 0, 30, "the samples copied to the restarted unit")
        took = time.monotonic() - t0
        assert unit_of(c, target).alive, "the retry came from the killed unit's death, not the backoff"
        print(f"copied again {took:.2f} s after the target was killed")
        cluster.restart_unit(0)  # the holder's turn: everything is read from the copies
        until(lambda: status_of(c, partition).single == 0, 30, "copied again after the holder's death")
        part = status_of(c, partition)
        assert part.lost == 0
        assert torch.equal(c.get_data(c.select(partition, ["x"]))["x"], x)
