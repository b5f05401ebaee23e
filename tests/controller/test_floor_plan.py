"""The controller's floor plan, held: how many controller modules one call walks through
(docs/architecture.md, "The controller modules each call enters"), and how much of the
shared state each part reads (``ControllerState``: ten attributes, no part more than eight).

The walk is traced as the map traces it: ``sys.setprofile`` on the servers' loop thread of a
``LoopCluster``, counting each entry into a controller module from another one (a coroutine
resumed counts again). A heartbeat handled during a call would add to it, so each call is
traced three times and the quietest trace counts."""

from __future__ import annotations

import collections
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

import tqueue

ROOT = pathlib.Path(tqueue.__file__).parent / "controller"
PARTS = ROOT / "parts"


def _trace(cluster: Any, call: Callable[[], Any]) -> tuple[collections.Counter[str], Any]:
    """The controller modules ``call`` enters (entries from another module), and its result."""
    entries: collections.Counter[str] = collections.Counter()
    root = str(ROOT) + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        where = frame.f_code.co_filename
        if where.startswith(root) and (frame.f_back is None or frame.f_back.f_code.co_filename != where):
            entries[where[len(root):]] += 1

    cluster.call(lambda: sys.setprofile(profile))
    try:
        out = call()
        cluster.call(lambda: None)  # what the call scheduled after its reply has run
    finally:
        cluster.call(lambda: sys.setprofile(None))
    return entries, out


def _quietest(cluster: Any, call: Callable[[], Any]) -> tuple[collections.Counter[str], Any]:
    traces = [_trace(cluster, call) for _ in range(3)]
    return min(traces, key=lambda t: sum(t[0].values()))


def test_a_put_and_a_read_walk_through_few_controller_modules(cluster: Any) -> None:
    with tqueue.Client(cluster.address) as client:
        client.put("walk", {"x": torch.arange(4).reshape(4, 1)})  # the first put makes the partition
        client.ack(client.get_meta("walk", ["x"], 4, task="t"))  # the task's first read makes its state
        put, _ = _quietest(cluster, lambda: client.put("walk", {"x": torch.arange(4).reshape(4, 1)}))
        get_meta, meta = _quietest(cluster, lambda: client.get_meta("walk", ["x"], 4, task="t"))
        get_data, batch = _trace(cluster, lambda: client.get_data(meta))
        ack, _ = _trace(cluster, lambda: client.ack(meta))
    assert batch["x"].shape == (4, 1)
    # a later put: its Grant and its Commit (no read is parked: no wake after the Commit).
    # The server's module is not on the way: its Door (server/_limits.py) checks a request's
    # bounds and hands it to its part.
    assert set(put) == {
        "server/_limits.py", "parts/_writes.py", "model/_partition.py", "model/_samples.py", "model/_state.py",
    }, put
    # each message enters each module once: the Grant asks the partition once (check and
    # record, after a unit is placed and the budget admits it), the Commit once; the
    # get_meta asks the partition for the mask and the task, and the task to find and lease
    assert max(put.values()) <= 2 and put["parts/_writes.py"] == 2 and put["model/_state.py"] == 1, put
    assert set(get_meta) == {
        "server/_limits.py", "parts/_reads.py", "model/_partition.py", "model/_samples.py",
    }, get_meta
    assert max(get_meta.values()) == 1, get_meta
    assert get_data == {}, "get_data goes to the units alone"
    # the ack asks the partition once (check, acknowledge, finished?), and frees it if so
    assert set(ack) == {
        "server/_limits.py", "parts/_reads.py", "model/_partition.py", "model/_samples.py", "parts/_cleanup.py",
    }, ack
    assert max(ack.values()) == 1, ack
    assert len(set(put) | set(get_meta)) == 6

def _state_names(source: str) -> set[str]:
    return set(re.findall(r"\bself\.state\.([a-z_]+)", source))


def test_the_shared_state_has_ten_attributes_and_no_part_reads_more_than_eight(cluster: Any) -> None:
    names = cluster.call(lambda: sorted(vars(cluster.controller.state)))
    assert names == sorted(
        ["config", "server", "loop", "partitions", "units", "grants", "parked", "prefetching", "trainer", "tasks"]
    )
    read = {path.name: _state_names(path.read_text()) for path in PARTS.glob("_*.py")}
    assert read["_writes.py"] and read["_reads.py"]  # the scan finds what the parts read
    assert set().union(*read.values()) <= set(names)
    assert {name: len(v) for name, v in read.items() if len(v) > 8} == {}
