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

