"""The chaos run, short (benchmarks/chaos.py; a long run's totals are in docs/reliability.md):
a streaming job of producers, a reward task that updates and a trainer, on three units, while
a producer, a consumer or a unit is SIGKILLed every 1.5 s and restarted. Every sample put is
ledgered; at the end each acknowledged sample was consumed once by each task, or was lost with
its unit and counted lost for that task; nothing was read corrupt; the controller holds no more
fds or threads than it started with."""

from __future__ import annotations

import json

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
    status = SimpleNamespace(tasks={"reward": SimpleNamespace(lost=16), "train": SimpleNamespace(lost=16)}, lost=16, single=0)
    nothing = SimpleNamespace(indexes=[])
    totals = chaos._check(tmp_path, status, nothing, {"reward": nothing, "train": nothing}, True, {"reward": 1})
    assert (totals["reward"]["lost"], totals["reward"]["gone_in_a_kill_window"]) == (8, 8)
    assert totals["train"]["lost"] == 16 and totals["breaches"] == []
    # the same ledger without the failure's line: sixteen in the window of one kill, a breach
    (tmp_path / "ledger-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines if "error" not in line))
    totals = chaos._check(tmp_path, status, nothing, {"reward": nothing, "train": nothing}, True, {"reward": 1})
    assert totals["reward"]["gone_in_a_kill_window"] == 16
    assert totals["breaches"] == ["reward: 16 samples gone in kill windows, more than 1 kills explain"]
