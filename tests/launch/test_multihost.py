"""The cluster across simulated hosts: a network namespace per host, joined by veth pairs to
a bridge (benchmarks/netns.py). Puts from one namespace, gets from another, every byte
checked, placement by host. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from benchmarks import multihost, netns

WHY = netns.unavailable()
needs_namespaces = pytest.mark.skipif(bool(WHY), reason=WHY or "namespaces can be made")


def test_without_root_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root (ip netns add)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/" + tool)
    assert netns.unavailable() == "'tc' (iproute2) is not installed"


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    with netns.Hosts(["p", "u0", "u1", "c"]) as made:
        yield made


@needs_namespaces
@pytest.mark.slow
def test_puts_and_gets_cross_namespaces(hosts: netns.Hosts) -> None:
    address = multihost.start_cluster(hosts, ctl="c", units=("u0", "u1"))
    assert address.startswith(f"tcp://{hosts.ip['c']}:")
    # a producer on a unit's host: every put lands on that host's unit
    near = multihost.run_worker(hosts, "u1", "produce", {
        "address": address, "partition": "x", "puts": 4, "samples": 4, "row": 3000, "concurrency": 1,
        "first": 0,
    }, timeout=60)
    assert near["units"] == ["u1"] * 4
    # a producer on a host without a unit: the least-loaded unit, which is u0 now
    far = multihost.run_worker(hosts, "p", "produce", {
        "address": address, "partition": "x", "puts": 2, "samples": 4, "row": 3000, "concurrency": 1,
        "first": 1000,
    }, timeout=60)
    assert far["units"] == ["u0", "u0"]
    # a consumer on a fourth host reads all of them from both units, byte for byte
    got = multihost.run_worker(hosts, "c", "consume", {
        "address": address, "partition": "x", "count": 32, "batch": 8,
    }, timeout=60)
    assert got["bad"] == [] and got["samples"] == 32 and got["bytes"] == 32 * 3000
    assert got["from"] == {"u0": 12, "u1": 20}


@needs_namespaces
def test_teardown_leaves_nothing() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), netns.Hosts(["a", "b"]) as made:
        made.tqueue("a", "controller", "--bind", f"tcp://{made.ip['a']}:0")
        procs, names = list(made.procs), [made.ns("a"), made.ns("b"), made.bridge_ns]
        assert set(names) <= set(_namespaces())
        raise RuntimeError("boom")  # leaving on an error still stops and removes everything
    assert procs and all(p.returncode is not None for p in procs)
    assert not set(names) & set(_namespaces())
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


@needs_namespaces
def test_namespaces_of_a_dead_process_are_reaped() -> None:
    child = subprocess.Popen(["true"])
    child.wait()  # a pid that is gone
    stale, live = f"tq{child.pid}-x", f"tq{os.getpid()}-keep"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in netns.reap_stale()
        assert stale not in _namespaces() and live in _namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
