"""benchmarks/scale.py runs end to end at a tiny size: both kinds of load complete cycles
against a real controller and unit, the controller's CPU is read from its process, and a
filled partition serves get_meta (figures are not asserted: targets live in benchmarks/)."""

from __future__ import annotations

import json

import pytest

from benchmarks import scale


@pytest.mark.parametrize("role", ["raw", "real"], ids=["raw-generator", "async-clients"])
def test_load_runs_cycles_and_reads_controller_cpu(role: str) -> None:
    r = scale.load(role, clients=4, procs=1, seconds=0.3)
    assert r["ops"] >= 3 * 4 and r["ops"] % 3 == 0  # whole cycles: put, get_meta, ack
    assert r["ctl_cpu_s"] > 0 and r["ctl_us_per_op"] > 0
    assert 0 < r["put_p50"] <= r["put_p99"]
    # the messages the controller answered, from its own metrics: a Grant, a GetMeta and an
    # Ack each cycle, and the unit's commits (one message for a turn's stores, so at most one each)
    cycles = r["ops"] // 3
    handled = r["handled"]
    assert handled["Grant"] >= cycles and handled["GetMeta"] >= cycles and handled["Ack"] >= cycles
    commits = handled.get("Commit", 0) + handled.get("Commits", 0)
    assert 1 <= commits <= handled["Grant"]
    assert r["ctl_msgs_per_cycle"] == sum(handled.values()) / cycles


def test_fill_reports_memory_and_get_meta() -> None:
    (row,) = scale.fill([20_000], calls=5)
    # read from the controller's process; not strictly above: its allocator may already hold
    # freed pages enough for 20,000 samples (so it did on a 16-core GPU host)
    assert row["samples"] == 20_000 and row["ctl_rss"] >= row["ctl_base"] > 0
    assert row["get_meta_1_p50_ms"] > 0 and row["get_meta_256_p50_ms"] > 0


def test_profile_top_reads_collapsed_stacks(tmp_path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("main (a.py:1);f (b/c.py:3) 3\nmain (a.py:1);g (d.py:9);f (b/c.py:4) 1\n")
    top = scale.profile_top(str(path))
    assert top[0] == ("f (c.py)", 100.0, 100.0)
    assert [name for name, _, _ in top] == ["f (c.py)"]


def test_gc_controller_reports_its_collector(tmp_path) -> None:
    """The controller launched through the benchmark's wrapper serves as usual and writes what
    its cyclic collector cost when it stops."""
    path = tmp_path / "gc.json"
    r = scale.load("raw", clients=2, procs=1, seconds=0.2, gc_file=str(path))
    assert r["ops"] >= 6
    gcs = json.loads(path.read_text())
    assert 0 <= gcs["gc_cpu_s"] < gcs["cpu_s"] and len(gcs["collections"]) == 3


def test_cpu_seconds_resolves_a_few_milliseconds_of_another_thread() -> None:
    """The benchmarks' CPU clock counts every live thread of a process to well under a
    clock tick (10 ms): a put-cost phase of 128 small puts needs that resolution."""
    import os
    import threading
    import time

    from benchmarks.harness import cpu_seconds

    spun, go, done, leave = [0.0], threading.Event(), threading.Event(), threading.Event()

    def spin() -> None:
        go.wait(10)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.003:
            pass
        spun[0] = time.thread_time() - t0
        done.set()
        leave.wait(10)  # alive at the second reading: an ended thread's time is not counted

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        before = cpu_seconds(os.getpid())
        go.set()
        assert done.wait(10)
        grew = cpu_seconds(os.getpid()) - before
    finally:
        leave.set()
        worker.join()
    # the spin, plus what this process's other threads did between the readings (well under a
    # tick: a count in ticks reads 0 or 10 ms here)
    assert spun[0] <= grew < spun[0] + 0.004, (spun[0], grew)
