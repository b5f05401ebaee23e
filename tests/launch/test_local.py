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


def test_puts_go_to_a_unit_on_the_producers_host():
    with tqueue.LocalCluster(num_storage_units=3, unit_hosts=["node-a", "node-b", "node-b"]) as cluster:
        ids = {}
        with cluster.client() as c:
            ids = {u.host: [] for u in c.status().units}
            for u in c.status().units:
                ids[u.host].append(u.unit_id)
        for host in ("node-a", "node-b"):
            config = tqueue.ClientConfig(host=host)
            with tqueue.Client(cluster.address, config=config) as producer:
                placed = {producer.put(f"p-{host}", {"x": torch.zeros(4, 1 << 16)}).units[0] for _ in range(4)}
            assert placed <= set(ids[host])
        assert placed == set(ids["node-b"])  # both node-b units share that host's puts
        with tqueue.Client(cluster.address, config=tqueue.ClientConfig(host="node-z")) as remote:
            assert remote.put("p-z", {"x": torch.zeros(1)}).units[0] in range(3)  # no local unit: any


@pytest.mark.parametrize("role", ["controller", "storage"])
def test_a_server_freezes_what_it_made_at_its_start_before_it_says_ready(role):
    """What a server holds from its start (modules, config) is moved out of the cyclic
    collector's sight before it serves, so a full collection does not walk it: the
    controller's one full collection in a 6 s scale run took 32 ms before, with every
    request waiting (docs/performance-history.md, "The collector's pauses")."""
    code = (
        "import gc, json, sys\n"
        "from tqueue.config import ControllerConfig, StorageConfig\n"
        "from tqueue.launch import _serve\n"
        "real, seen = gc.freeze, []\n"
        "def freeze():\n"
        "    real(); seen.append(gc.get_freeze_count())\n"
        "gc.freeze = freeze\n"
        "config = ControllerConfig() if sys.argv[1] == 'controller' else StorageConfig(controller=sys.argv[2])\n"
        "_serve.run(config, watch_stdin=True)\n"
        "print('FROZEN', json.dumps(seen), flush=True)\n"
    )
    with tqueue.LocalCluster(num_storage_units=1) as cluster:  # the unit's role registers with it
        with subprocess.Popen([sys.executable, "-c", code, role, cluster.address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None and proc.stdin is not None
                assert proc.stdout.readline().startswith("TQUEUE-READY ")
                proc.stdin.close()  # the launcher went away: the server stops
                rest = proc.stdout.read()
                assert proc.wait(timeout=60) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
    frozen = json.loads(rest.split("FROZEN ", 1)[1])
    assert len(frozen) == 1 and frozen[0] > 10_000, rest  # once, before READY: the modules and more
