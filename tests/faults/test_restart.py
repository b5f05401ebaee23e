"""One process restarted: the controller SIGKILLed (by pid) and started again at its address,
from the last checkpoint (``ControllerConfig.restore``), while the storage units and the
clients stay. The units rejoin under the ids they had; the clients, with no code of their
own for it, go on: their calls wait until the checkpoint is loaded, then see it exactly."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

import tqueue
from tqueue.errors import ControllerUnavailableError, InvalidArgumentError, TQueueError, WaitTimeoutError

from ._proc import until

INTERVAL = 0.5


def payload(first: int, count: int) -> dict[str, torch.Tensor]:
    i = torch.arange(first, first + count)
    return {"x": (i[:, None] * 1000 + torch.arange(256)[None, :]).to(torch.int32), "i": i}


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def check(batch: tqueue.Batch, want: set[int]) -> None:
    """``batch`` holds exactly the samples numbered ``want``, each byte as put."""
    got = [int(v) for v in batch["i"]]
    assert sorted(got) == sorted(want), sorted(got)
    expect = payload(0, max(want) + 1)["x"]
    for row, i in enumerate(got):
        assert crc(batch["x"][row]) == crc(expect[i]), i


def test_a_controller_restarted_from_its_checkpoint_resumes_with_the_units_and_clients_it_had(tmp_path: pathlib.Path) -> None:
    options = {"heartbeat_interval": INTERVAL}
    with tqueue.LocalCluster(num_storage_units=2, controller=options) as cluster, cluster.client() as c, cluster.client() as waiter:
        c.create_partition("roll")
        c.create_partition("quiet")
        c.put("roll", payload(0, 16))
        c.ack(c.get_meta("roll", ["x", "i"], 6, task="train"))  # consumed before the checkpoint
        c.get_meta("roll", ["x", "i"], 2, task="train")  # leased, not acked: ready again after
        units = {(u.unit_id, u.address) for u in c.status().units}
        c.save_checkpoint(tmp_path, metadata={"step": 3})
        c.put("roll", payload(16, 4))  # after the checkpoint: gone with the controller
        parked: list[BaseException] = []

        def park() -> None:
            try:
                waiter.get_meta("quiet", ["x"], 1, task="t", timeout=120)
            except TQueueError as exc:
                parked.append(exc)

        reader = threading.Thread(target=park)
        reader.start()
        until(lambda: any(w.partition == "quiet" for w in c.status().waiting), 10, "the read parks at the controller")
        pid = cluster.restart_controller(restore=str(tmp_path))
        ready = time.monotonic()
        # the first call waits for the units and the load, then is served
        batch = c.get_data("roll", ["x", "i"], 10, task="train", timeout=30)
        served = time.monotonic() - ready
        check(batch, set(range(6, 16)))  # the 6 acked stay consumed; the 2 leased came back
        reader.join(30)
        assert not reader.is_alive() and len(parked) == 1 and isinstance(parked[0], ControllerUnavailableError), parked
        status = c.status()
        assert {(u.unit_id, u.address) for u in status.units} == units and all(u.alive for u in status.units)
        assert {p.name: p.samples for p in status.partitions} == {"roll": 16, "quiet": 0}
        check(c.get_data("roll", ["x", "i"], 16, task="eval", timeout=10), set(range(16)))
        # the clients' connections to the units are still right: a put and a read through them
        c.put("roll", payload(20, 8))
        check(c.get_data("roll", ["x", "i"], 8, task="train", timeout=10), set(range(20, 28)))
        assert pid == cluster.pids[0]
        print(f"restarted controller: first call served {served:.2f} s after it was ready (heartbeat {INTERVAL} s)")


def test_an_async_clients_parked_call_fails_at_the_restart_and_its_next_call_is_served(tmp_path: pathlib.Path) -> None:
    """The event-loop client's connection: what was parked at the old controller fails as the
    connection closes (it would wait to its own timeout otherwise: the new controller never
    heard of it, and answers the pings), the next call goes to the new one."""

    async def main(cluster: tqueue.LocalCluster) -> None:
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.create_partition("quiet")
            await c.save_checkpoint(tmp_path)
            parked = asyncio.ensure_future(c.get_meta("quiet", ["x"], 1, task="t", timeout=120))
            deadline = time.monotonic() + 10
            while not any(w.partition == "quiet" for w in (await c.status()).waiting):  # status shows it parked
                assert time.monotonic() < deadline, "the read did not park"
                await asyncio.sleep(0.02)
            await asyncio.to_thread(cluster.restart_controller, restore=str(tmp_path))
            with pytest.raises(ControllerUnavailableError, match="closed the connection .* in flight on it are lost"):
                await asyncio.wait_for(parked, 30)
            await c.put("quiet", payload(0, 2))
            meta = await c.get_meta("quiet", ["x", "i"], 2, task="t", timeout=30)
            assert sorted(meta.indexes) == [0, 1]

    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": INTERVAL}) as cluster:
        asyncio.run(main(cluster))


def test_a_unit_that_does_not_come_back_leaves_its_files_to_the_others(tmp_path: pathlib.Path) -> None:
    """The restarted controller waits ``restore_wait`` for the checkpoint's units, then loads
    the files of a unit that did not come back into the ones that did."""
    options = {"heartbeat_interval": INTERVAL, "restore_wait": 1.0}
    with tqueue.LocalCluster(num_storage_units=2, controller=options) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 16))
        c.save_checkpoint(tmp_path)
        gone = cluster.pids[2]
        os.kill(gone, signal.SIGKILL)
        cluster.restart_controller(restore=str(tmp_path))
        check(c.get_data("roll", ["x", "i"], 16, task="train", timeout=30), set(range(16)))
        assert [u.alive for u in c.status().units] == [True]


def test_a_restart_without_a_checkpoint_keeps_the_units_ids_and_starts_empty() -> None:
    with tqueue.LocalCluster(num_storage_units=2, controller={"heartbeat_interval": INTERVAL}) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 8))
        units = {(u.unit_id, u.address) for u in c.status().units}
        cluster.restart_controller()
        c.put("fresh", payload(0, 8))  # placed on units that registered again
        check(c.get_data("fresh", ["x", "i"], 8, task="t", timeout=30), set(range(8)))
        until(lambda: len(c.status().units) == 2, 30, "both units register again")  # each at its next heartbeat
        assert {(u.unit_id, u.address) for u in c.status().units} == units
        with pytest.raises(WaitTimeoutError, match="partition 'roll' .* does not exist yet"):
            c.get_meta("roll", ["x"], 1, task="t", timeout=0.5)


def test_a_controller_told_to_restore_a_missing_checkpoint_does_not_start(tmp_path: pathlib.Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tqueue", "controller", "--bind", "tcp://127.0.0.1:0", "--restore", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "TQUEUE-READY" not in out.stdout
    assert f"no checkpoint in {tmp_path / 'none'}" in out.stderr, out.stderr[-2000:]


def test_a_unit_restarted_with_its_checkpointed_payload_keeps_what_did_not_change(tmp_path: pathlib.Path) -> None:
    """Restarted (at its address, so under its name) before the controller noticed it was gone,
    with ``StorageConfig.restore``: the samples the checkpoint holds as they still are stay,
    readable byte for byte; what came after the checkpoint is lost and counted; the payload of
    a partition cleared since is freed on the unit. The heartbeat is 2 s, so that the restart
    is well inside the unit's liveness window (10 s)."""
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": 2.0}) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 16))
        c.put("gone", payload(0, 4))
        c.ack(c.get_meta("roll", ["x", "i"], 4, task="train"))
        c.save_checkpoint(tmp_path)
        c.put("late", payload(0, 8))  # after the checkpoint: lost with the restart
        c.clear("gone")
        before = c.status().units[0]
        cluster.restart_unit(0, restore=str(tmp_path))
        check(c.get_data("roll", ["x", "i"], 12, task="train", timeout=30), set(range(4, 16)))
        check(c.get_data("roll", ["x", "i"], 16, task="eval", timeout=30), set(range(16)))
        status = c.status()
        parts = {p.name: p for p in status.partitions}
        assert (parts["roll"].lost, parts["late"].lost) == (0, 8)
        unit = status.units[0]
        assert (unit.unit_id, unit.address, unit.alive) == (before.unit_id, before.address, True)
        c.put("roll", payload(16, 4))  # the clients' connection to the unit (a new process) is right
        check(c.get_data("roll", ["x", "i"], 4, task="train", timeout=30), set(range(16, 20)))


def test_a_unit_back_after_it_was_declared_dead_keeps_nothing(tmp_path: pathlib.Path) -> None:
    """Lost is final: the samples of a unit declared dead were reported lost, so the same
    unit restarted from the checkpoint afterwards frees what it loaded and starts empty."""
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": INTERVAL}) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 8))
        c.save_checkpoint(tmp_path)
        os.kill(cluster.pids[1], signal.SIGKILL)
        until(lambda: not c.status().units[0].alive, 30, "the unit is declared dead")
        cluster.restart_unit(0, restore=str(tmp_path))
        until(lambda: c.status().units[0].alive, 30, "the unit registers again")
        assert {p.name: p.lost for p in c.status().partitions} == {"roll": 8}
        c.put("fresh", payload(0, 2))
        check(c.get_data("fresh", ["x", "i"], 2, task="t", timeout=30), {0, 1})


def test_a_unit_told_to_restore_a_checkpoint_without_its_name_does_not_start(tmp_path: pathlib.Path) -> None:
    with tqueue.LocalCluster(num_storage_units=1) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 2))
        c.save_checkpoint(tmp_path)
        named = cluster.unit_addresses[0]
        out = subprocess.run(
            [sys.executable, "-m", "tqueue", "storage-unit", "--controller", cluster.address, "--bind", "tcp://127.0.0.1:0",
             "--name", "other", "--restore", str(tmp_path)],
            capture_output=True, text=True, timeout=60,
        )
    assert out.returncode != 0 and "TQUEUE-READY" not in out.stdout
    assert f"holds no payload of a unit named 'other' (it names ['{named}'])" in out.stderr, out.stderr[-2000:]


def test_an_ack_or_renew_of_a_lease_from_before_the_restart_is_refused_and_its_samples_come_again(tmp_path: pathlib.Path) -> None:
    """The controller SIGKILLed by pid and started again from its checkpoint: the lease a
    trainer held then is unknown to the new one. Its ack (and renew) fails loudly, naming the
    lease and the restart, instead of succeeding and consuming nothing; the samples it named
    are served again, and acked under their new lease they are consumed."""
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": INTERVAL}) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 4))
        old = c.get_meta("roll", ["x", "i"], 4, task="train")
        c.save_checkpoint(tmp_path)
        pid = cluster.pids[0]
        new_pid = cluster.restart_controller(restore=str(tmp_path))
        assert new_pid != pid
        with pytest.raises(InvalidArgumentError, match=rf"lease {old.lease} of task 'train' on partition 'roll' is unknown: "
                           r"it is from before a controller restart .* nothing was acknowledged; its samples are served again"):
            c.ack(old)
        with pytest.raises(InvalidArgumentError, match=rf"lease {old.lease} .* from before a controller restart .* nothing was renewed"):
            c.renew(old)
        again = c.get_meta("roll", ["x", "i"], 4, task="train", timeout=30)
        assert sorted(again.indexes) == sorted(old.indexes) and again.lease != old.lease
        c.ack(again)
        c.ack(again)  # acked twice in this incarnation: harmless, as before
        tasks = {p.name: p for p in c.status().partitions}["roll"].tasks["train"]
        assert (tasks.consumed, tasks.leased) == (4, 0)


def test_a_lease_from_before_a_restart_without_a_checkpoint_is_refused_too() -> None:
    """Without a checkpoint the new controller starts empty and may make the partition again
    (its uid can match the old one's): the old lease is still refused, not taken for a new one."""
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": INTERVAL}) as cluster, cluster.client() as c:
        c.put("roll", payload(0, 2))
        old = c.get_meta("roll", ["x", "i"], 2, task="train")
        cluster.restart_controller()
        c.put("roll", payload(0, 2))
        with pytest.raises(InvalidArgumentError, match=r"from before a controller restart"):
            c.ack(old)
        fresh = c.get_meta("roll", ["x", "i"], 2, task="train", timeout=30)
        c.ack(fresh)
