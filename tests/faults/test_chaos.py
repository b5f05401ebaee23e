"""The chaos run, short (benchmarks/chaos.py; a long run's totals are in docs/reliability.md):
a streaming job of producers, a reward task that updates and a trainer, on three units, while
a producer, a consumer or a unit is SIGKILLed every 1.5 s and restarted. Every sample put is
ledgered; at the end each acknowledged sample was consumed once by each task, or was lost with
its unit and counted lost for that task; nothing was read corrupt; the controller holds no more
fds or threads than it started with."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch

import tqueue
from benchmarks import chaos

from ._proc import until


@pytest.mark.soak
def test_a_job_whose_processes_are_killed_at_random_loses_nothing_it_does_not_report():
    result = chaos.run(seconds=12.0, units=3, producers=2, kill_every=1.5, seed=7, drain_timeout=90.0)
    print(f"\nchaos: {result}")
    assert sum(result["kills"].values()) >= 6
    for task in chaos.TASKS:
        t = result[task]
        assert t["twice"] == t["missing"] == 0
        explained = t["consumed"] + t["consumed_unrecorded"] + t["lost"] + t["gone_in_a_kill_window"]
        assert explained == result["acknowledged_puts"] > 0
        assert t["lost"] <= t["lost_counted"]
        assert t["consumed_counted"] + t["lost_counted"] == result["samples"]
    assert result["held_once"] == 0


@pytest.mark.soak
def test_with_two_copies_and_one_unit_killed_at_a_time_nothing_is_lost():
    """copies=2: a unit is killed only once the one killed before is known dead and its
    samples have their second copies again; then no acknowledged sample may be lost and every
    one is consumed by each task (``chaos.run`` raises on any breach)."""
    result = chaos.run(seconds=20.0, units=3, producers=2, kill_every=1.5, seed=11, drain_timeout=90.0, copies=2)
    print(f"\nchaos, copies=2: {result}")
    assert result["kills"].get("unit", 0) >= 1 and result["partition_lost"] == 0
    for task in chaos.TASKS:
        t = result[task]
        assert t["twice"] == t["missing"] == t["lost"] == t["lost_counted"] == 0
        assert t["consumed"] + t["consumed_unrecorded"] + t["gone_in_a_kill_window"] == result["acknowledged_puts"] > 0
        assert t["consumed_counted"] == result["samples"]
    assert result["held_once"] == 0


def test_the_ledger_counts_a_failed_ack_as_lost_and_a_kill_between_ack_and_record_as_a_window(tmp_path):
    """The checker alone, on a ledger written by hand: a reward consumer acking samples 0-7
    whose update failed (``not_acked``), and one acking 8-15 that was killed before it wrote
    ``acked``; all sixteen were lost with their unit. The first eight count as lost (the
    controller counted them), the others as gone in the kill window of the one consumer
    killed. Before ``not_acked``, all sixteen counted as in kill windows, a breach."""
    from types import SimpleNamespace

    ids = list(range(16))
    lines = [
        {"put": ids, "idx": ids},
        {"acking": ids[:8], "task": "reward"},
        {"error": "StorageUnitUnavailableError", "not_acked": ids[:8], "task": "reward"},
        {"acking": ids[8:], "task": "reward"},
    ]
    (tmp_path / "ledger-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tasks = {t: SimpleNamespace(lost=16, consumed=0) for t in ("reward", "train")}
    status = SimpleNamespace(tasks=tasks, lost=16, single=0, samples=16)
    nothing = SimpleNamespace(indexes=[])
    totals = chaos._check(tmp_path, status, nothing, {"reward": nothing, "train": nothing}, True, {"reward": 1})
    assert (totals["reward"]["lost"], totals["reward"]["gone_in_a_kill_window"]) == (8, 8)
    assert totals["train"]["lost"] == 16 and totals["breaches"] == []
    # the same ledger without the failure's line: sixteen in the window of one kill, a breach
    (tmp_path / "ledger-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines if "error" not in line))
    totals = chaos._check(tmp_path, status, nothing, {"reward": nothing, "train": nothing}, True, {"reward": 1})
    assert totals["reward"]["gone_in_a_kill_window"] == 16
    assert totals["breaches"] == ["reward: 16 samples gone in kill windows, more than 1 kills explain"]


def seed_order(seed: int, kills: int, units: int) -> list[tuple[str, int]]:
    """The victims ``chaos.run(seed=seed, producers=2)`` picks, in order, where every worker
    is alive and every unit a candidate at each kill (``Job.kill_one``: one choice among the
    live workers in start order, then the units; the victim's successor goes last): ("unit",
    its place among the live units) or (its role, 0)."""
    rng = random.Random(seed)
    workers = ["producer", "producer", "reward", "train"]
    slots = list(range(units))
    order = []
    for _ in range(kills):
        kind, which = rng.choice([("worker", w) for w in range(len(workers))] + [("unit", u) for u in slots])
        if kind == "unit":
            order.append(("unit", which))
        else:
            order.append((workers[which], 0))
            workers.append(workers.pop(which))
    return order


@pytest.mark.parametrize("copies", [1, 2], ids=["one-copy", "two-copies"])
def test_the_seed_7_ordering_replayed_ends_with_every_sample_consumed_or_lost_for_every_task(partition, copies):
    """The kills of the short chaos run (seed 7: a reward worker, two producers, a unit, a
    producer, the trainer, two units), replayed in order in one process: each step two
    producers put a group, the reward worker leases, updates and acks one, the trainer one
    (from the first unit's death on: it starts late), then the step's victim. A unit is
    SIGKILLed by pid and a replacement started; the next step waits until the controller
    declared it dead (with two copies, also until nothing is held once). A killed consumer
    abandons its next lease (it expires). Then both tasks drain: for each, the samples it
    acked plus those counted lost are every sample put, and ``status()`` says consumed +
    lost == samples, with nothing held once. (A task that first read after a death counted
    no loss, and its drain never ended: the chaos test's failure this ordering found.)"""
    order = seed_order(7, kills=8, units=3)
    assert order == [("reward", 0), ("producer", 0), ("producer", 0), ("unit", 1), ("producer", 0),
                     ("train", 0), ("unit", 2), ("unit", 0)]
    lease = 1.0
    with (
        tqueue.LocalCluster(num_storage_units=3, controller={"heartbeat_interval": 0.3}) as cluster,
        tqueue.Client(cluster.address) as c,
    ):
        c.create_partition(partition, tasks=list(chaos.TASKS), copies=copies)
        units = list(cluster.pids[1:])
        put: dict[int, int] = {}  # sample id -> index
        acked: dict[str, list[int]] = {t: [] for t in chaos.TASKS}
        abandon = {t: False for t in chaos.TASKS}
        deaths = 0

        def consume(task: str, size: int, timeout: float) -> None:
            fields = ["id"] + (["reward"] if task == "train" else [])
            batch = c.get_data(partition, fields, size, task=task, timeout=timeout, lease_timeout=lease)
            ids = batch["id"].tolist()
            if abandon[task]:  # killed after its read: the lease expires
                abandon[task] = False
                return
            if task == "reward":
                c.update(batch.meta, {"reward": torch.tensor([chaos.reward_of(i) for i in ids], dtype=torch.float64)})
            else:
                assert batch["reward"].tolist() == [chaos.reward_of(i) for i in ids]
            c.ack(batch.meta)
            acked[task] += ids

        for step, (victim, which) in enumerate(order):
            for producer in range(2):
                ids = [(producer << 32) | (step * chaos.GROUP + k) for k in range(chaos.GROUP)]
                meta = c.put(partition, {"id": torch.tensor(ids)})
                put.update(zip(ids, meta.indexes))
            consume("reward", chaos.GROUP, 10.0)
            if deaths:
                consume("train", chaos.GROUP, 10.0)
            if victim == "unit":
                os.kill(units.pop(which), signal.SIGKILL)
                units.append(cluster.start_unit())
                deaths += 1
                until(lambda n=deaths: sum(not u.alive for u in c.status().units) == n, 30, "the unit declared dead")
                if copies > 1:
                    until(lambda: status_of(c, partition).single == 0, 30, "the samples held once copied again")
            elif victim in abandon:
                abandon[victim] = True

        def drained(task: str) -> bool:
            part = status_of(c, partition)
            return part.tasks[task].consumed + part.tasks[task].lost >= part.samples

        for task in chaos.TASKS:  # the tail one by one: fewer than a group may be left
            until_drained = 60.0
            while not drained(task):
                try:
                    consume(task, 1, lease + 2.0)
                except tqueue.errors.WaitTimeoutError:
                    until_drained -= lease + 2.0
                    assert until_drained > 0, f"{task}: not drained: {status_of(c, partition)}"
        part = status_of(c, partition)
        assert part.samples == len(put) == 2 * chaos.GROUP * len(order)
        for task in chaos.TASKS:
            t = part.tasks[task]
            assert len(acked[task]) == len(set(acked[task])) == t.consumed
            assert t.consumed + t.lost == part.samples
        assert part.single == 0
        if copies > 1:
            assert part.lost == 0
        else:
            assert part.lost > 0  # the ordering kills units that hold samples


def status_of(client: tqueue.Client, partition: str) -> tqueue.wire.PartitionStatus:
    return next(p for p in client.status().partitions if p.name == partition)
