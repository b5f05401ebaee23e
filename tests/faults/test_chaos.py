"""The chaos run, short (benchmarks/chaos.py; a long run's totals are in docs/reliability.md):
a streaming job of producers, a reward task that updates and a trainer, on three units, while
a producer, a consumer or a unit is SIGKILLed every 1.5 s and restarted. Every sample put is
ledgered; at the end each acknowledged sample was consumed once by each task, or was lost with
its unit and counted lost for that task; nothing was read corrupt; the controller holds no more
fds or threads than it started with."""

from __future__ import annotations

import pytest

from benchmarks import chaos


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



@pytest.mark.soak
def test_with_two_copies_and_one_unit_killed_at_a_time_nothing_is_lost():
    """replicas=2: a unit is killed only once the one killed before is known dead and its
    samples have their second copies again; then no acknowledged sample may be lost and every
    one is consumed by each task (``chaos.run`` raises on any breach)."""
    result = chaos.run(seconds=20.0, units=3, producers=2, kill_every=1.5, seed=11, drain_timeout=90.0, replicas=2)
    print(f"\nchaos, replicas=2: {result}")
    assert result["kills"].get("unit", 0) >= 1 and result["partition_lost"] == 0
    for task in chaos.TASKS:
        t = result[task]
        assert t["twice"] == t["missing"] == t["lost"] == t["lost_counted"] == 0
        assert t["consumed"] + t["consumed_unrecorded"] + t["gone_in_a_kill_window"] == result["acknowledged_puts"] > 0
