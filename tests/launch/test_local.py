"""The embedded local cluster starts real processes and never leaves them behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest
import torch

import tqueue


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Wait (on pidfds, no polling) until the processes exit; return those still alive."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    try:
        left = dict(fds)
        while left:
            ready, _, _ = select.select(list(left), [], [], timeout)
            if not ready:
                break
            for fd in ready:
                left.pop(fd)
        return sorted(left.values())
    finally:
        for fd in fds:
            os.close(fd)


def test_cluster_serves_on_loopback_and_stops_on_exit():
    with tqueue.LocalCluster(num_storage_units=3) as cluster:
        pids = cluster.pids
        assert len(pids) == 4
        assert cluster.address.startswith("tcp://127.0.0.1:")
        assert all(a.startswith("tcp://127.0.0.1:") for a in cluster.unit_addresses)
        with cluster.client() as c:
            assert len(c.status().units) == 3
            c.put("p", {"x": torch.ones(2)})
    assert wait_gone(pids) == []


def test_cluster_stops_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with tqueue.LocalCluster(num_storage_units=1) as cluster:
            pids = cluster.pids
            raise RuntimeError("boom")
    assert wait_gone(pids) == []


def test_servers_stop_when_their_launcher_is_killed():
    code = (
        "import json, sys, tqueue\n"
        "c = tqueue.LocalCluster(num_storage_units=2).start()\n"
        "print(json.dumps(c.pids), flush=True)\n"
        "sys.stdin.read()\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        pids = json.loads(launcher.stdout.readline())
        assert len(pids) == 3
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_gone(pids) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        launcher.stdin.close()


def test_zero_units_is_refused():
    with pytest.raises(ValueError, match="num_storage_units must be at least 1"):
        tqueue.LocalCluster(num_storage_units=0)
