"""Clients and the controller disappearing (SIGKILL): a dead controller is reported to every
waiting call within the liveness window, not at each call's own timeout; a client that dies
loses at once its parked calls, its grants (budget back) and its arena allocations and holds.

The producers and consumers killed here are real clients in child processes
(tests/faults/_child.py); each says on stdout when it has reached the point it is killed at.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tqueue
from tqueue.errors import ControllerUnavailableError
from tqueue.transport import _zmq
from tqueue.transport._liveness import HEARTBEAT_LIVENESS
from tqueue.wire import GetMeta, Store
from tqueue.wire import _messages as wire

from ._child import HOLD_BYTES, PUT_BYTES
from ._proc import fds, threads, until

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTERVAL = 0.5
# generous for two busy cores, and far below the timeouts calls used to wait out (30-90 s)
BOUND = INTERVAL * (HEARTBEAT_LIVENESS + 2) + 5.0


def cluster(**controller: Any) -> tqueue.LocalCluster:
    return tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": INTERVAL, **controller})


@pytest.fixture
def child() -> Iterator[Any]:
    """Start ``_child MODE ADDRESS``; returns (process, first line); killed by pid at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str, address: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults._child", mode, address], cwd=ROOT, stdout=subprocess.PIPE
        )
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, f"child {mode} said nothing within 120 s"
        line = proc.stdout.readline().decode().strip()
        assert line, f"child {mode} exited with {proc.wait()}"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def kill(proc: subprocess.Popen[bytes]) -> float:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.monotonic()


def waiting(client: tqueue.Client, kind: str) -> int:
    return sum(1 for w in client.status().waiting if w.kind == kind)


def test_a_killed_controller_fails_parked_calls_of_sync_and_async_clients_at_once():
    with cluster() as c, c.client() as sync_client:
        errors: dict[str, BaseException] = {}
        done = {name: threading.Event() for name in ("sync", "async")}

        def park_sync() -> None:
            try:
                sync_client.get_meta("p", ["x"], 4, task="t", timeout=600)
            except BaseException as exc:
                errors["sync"] = exc
            done["sync"].set()

        async def park_async() -> None:
            async with tqueue.AsyncClient(c.address) as client:
                try:
                    await client.get_meta("p", ["x"], 4, task="t", timeout=600)
                except BaseException as exc:
                    errors["async"] = exc
            done["async"].set()

        threads = [threading.Thread(target=park_sync), threading.Thread(target=asyncio.run, args=(park_async(),))]
        for t in threads:
            t.start()
        with c.client() as probe:
            until(lambda: waiting(probe, "get_meta") == 2, 60, "both get_meta parked")
        os.kill(c.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        for name, event in done.items():
            assert event.wait(BOUND), f"{name} get_meta still waits {BOUND} s after the controller died"
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
        for name in done:
            assert isinstance(errors[name], ControllerUnavailableError), errors[name]
            # the connection closed with the process: at once, not at the end of the window
            assert "closed the connection (it died or restarted)" in str(errors[name]), errors[name]
        # a later call fails too. The sync client's parked get_meta ran on its thread's own
        # connection; its put goes out on the event loop's, whose close may be heard just after
        # the put left (two connections: ZeroMQ orders nothing between them)
        with pytest.raises(ControllerUnavailableError, match="has not been heard from|did not answer|closed the connection"):
            sync_client.put("p", {"x": torch.ones(2, 2)})
        print(f"controller SIGKILL: both parked get_meta failed after {took:.2f} s (heartbeat {INTERVAL} s)")


def kill_at_store(monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
    """SIGKILL ``pid`` as this process's clients send a ``Store``: between grant and store."""
    real = _zmq.Peer.request

    async def request(self: _zmq.Peer, msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, Store):
            os.kill(pid, signal.SIGKILL)
        return await real(self, msg, *args, **kwargs)

    monkeypatch.setattr(_zmq.Peer, "request", request)


def test_a_put_in_flight_when_the_controller_dies_blames_the_controller(monkeypatch):
    """The kill comes between the grant and the store (a hook on this client's Store): the
    unit's commit meets a dead controller, and the writer hears so from the unit."""
    with cluster() as c, c.client(config=tqueue.ClientConfig(shm=False)) as client:
        client.put("p", {"x": torch.ones(2, 2)})  # connected to the unit already
        kill_at_store(monkeypatch, c.pids[0])
        t0 = time.monotonic()
        with pytest.raises(ControllerUnavailableError, match="controller at tcp://.* has not been heard from"):
            client.put("p", {"x": torch.ones(2, 2)})
        assert time.monotonic() - t0 < BOUND


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "arena"])
def test_a_controller_dead_mid_put_is_blamed_whatever_the_clients_timeout(monkeypatch, shm):
    """A client timeout (1.5 s) far shorter than the liveness window (8 s): the unit gives
    up on its commit before the writer gives up on the unit, and says the controller is gone,
    instead of the writer blaming the healthy unit."""
    config = tqueue.ClientConfig(shm=shm, shm_min_bytes=0, request_timeout=1.5)
    with cluster(heartbeat_interval=2.0) as c, c.client(config=config) as client:
        client.put("p", {"x": torch.ones(2, 2)})  # connected to the unit already
        kill_at_store(monkeypatch, c.pids[0])
        t0 = time.monotonic()
        with pytest.raises(ControllerUnavailableError, match=r"controller at tcp://\S+ did not answer Commit"):
            client.put("p", {"x": torch.ones(2, 2)})
        assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("path", ["put-arena", "put-tcp"])
def test_a_producer_killed_mid_put_gives_its_budget_back_at_once(child, path):
    capacity = PUT_BYTES + PUT_BYTES // 2  # room for one such put, not two
    with cluster(capacity_bytes=capacity) as c, c.client() as client:
        producer = child(path, c.address)  # granted PUT_BYTES, and stopped before storing
        t0 = kill(producer)
        meta = client.put("q", {"x": torch.full((4, PUT_BYTES // 16), 2.0)}, timeout=BOUND)
        took = time.monotonic() - t0
        assert torch.equal(client.get_data(meta)["x"], torch.full((4, PUT_BYTES // 16), 2.0))
        assert all(p.in_flight == 0 for p in client.status().partitions)  # the dead one's grant lapsed
        print(f"producer SIGKILL mid-put ({path}): its {PUT_BYTES >> 20} MiB of budget back, the next put through after {took:.2f} s")


def test_a_consumer_killed_holding_arena_views_frees_them_at_once(child):
    with cluster() as c, c.client() as client:
        client.put("big", {"x": torch.full((4, HOLD_BYTES // 16), 3.0)})
        consumer = child("hold", c.address)
        arena = lambda: client.status().units[0].arena_used  # noqa: E731
        until(lambda: arena() >= HOLD_BYTES, 30, "the unit reports the arena bytes")
        client.clear("big")
        t0 = kill(consumer)
        until(lambda: arena() == 0, BOUND, "the dead reader's hold freed")
        print(f"consumer SIGKILL holding {HOLD_BYTES >> 20} MiB of arena views: freed after {time.monotonic() - t0:.2f} s")


def test_a_consumer_that_dies_parked_is_leased_nothing(child):
    with cluster() as c, c.client() as client:
        consumer = child("park", c.address)
        until(lambda: waiting(client, "get_meta") == 1, 60, "the consumer's get_meta parked")
        t0 = kill(consumer)
        until(lambda: waiting(client, "get_meta") == 0, BOUND, "the dead consumer's get_meta withdrawn")
        withdrawn = time.monotonic() - t0
        put = client.put("empty", {"x": torch.arange(8.0).reshape(4, 2)})
        meta = client.get_meta("empty", ["x"], 4, task="t", timeout=30)  # nothing leased to the dead one
        assert sorted(meta.indexes) == sorted(put.indexes)
        print(f"parked consumer SIGKILL: its get_meta withdrawn after {withdrawn:.2f} s")


def test_samples_put_inside_a_dead_consumers_liveness_window_are_not_leased_to_it(child):
    """The race just inside the liveness window: the consumer is SIGKILLed while parked, and
    samples come before the controller has missed its heartbeats. They are served to the
    dead consumer's parked request. Its reply cannot be delivered (ZeroMQ knows the peer is
    gone: usually) and the lease is released at once; or it went down the dead connection
    in the instant before ZeroMQ knew, and the lease is released when the session ends.
    Either way not at the lease's expiry (lease_timeout, 600 s by default)."""
    interval = 2.0  # a window of 6 s
    with cluster(heartbeat_interval=interval) as c, c.client() as client:
        consumer = child("park", c.address)
        until(lambda: waiting(client, "get_meta") == 1, 60, "the consumer's get_meta parked")
        t0 = kill(consumer)
        put = client.put("empty", {"x": torch.arange(8.0).reshape(4, 2)})
        meta = client.get_meta("empty", ["x"], 4, task="t", timeout=60)
        served = time.monotonic() - t0
        assert sorted(meta.indexes) == sorted(put.indexes)
        assert served < interval * (HEARTBEAT_LIVENESS + 2) + 5.0  # the window, and the sweep's step
        # taken back from the dead consumer once (4), or never given to it (0: the live
        # consumer's get_meta reached the controller before the put's commit woke the waiters)
        status = {p.name: p for p in client.status().partitions}["empty"]
        assert status.tasks["t"].expired in (0, 4) and status.tasks["t"].leased == 4
        print(f"parked consumer SIGKILL, put at once: a live consumer served after {served:.2f} s")


def test_a_lease_sent_to_a_client_that_fell_silent_returns_when_its_session_ends(raw):
    """The other side of that race, made certain: the reply reaches a socket whose owner is
    frozen (a raw peer that never reads, never heartbeats again). The lease, sent after its
    last sign of life, is released when its session ends, not at lease_timeout (600 s).

    The peer's last sign of life (a Ping) comes just before the put, with a window of 6 s: the
    put must reach the parked request while the peer still counts as alive, and on two busy
    cores the wait for the park alone can outlast a short window (the peer would be gone, its
    request dropped, before the samples came)."""
    interval = 2.0
    with cluster(heartbeat_interval=interval) as c, c.client() as client:
        frozen = raw(c.address)
        frozen.send(wire.encode(GetMeta(rid=1, partition="p", task="t", fields=["x"], batch_size=4, lease_timeout=600)))
        until(lambda: waiting(client, "get_meta") == 1, 60, "the frozen peer's get_meta parked")
        frozen.send(wire.encode(wire.Ping()))  # its last sign of life
        t0 = time.monotonic()
        put = client.put("p", {"x": torch.arange(8.0).reshape(4, 2)})
        meta = client.get_meta("p", ["x"], 4, task="t", timeout=60)
        served = time.monotonic() - t0
        assert sorted(meta.indexes) == sorted(put.indexes)
        assert served < interval * (HEARTBEAT_LIVENESS + 2) + 5.0
        assert {p.name: p for p in client.status().partitions}["p"].tasks["t"].expired == 4
        replies = [frozen.recv(timeout=5)[0] for _ in range(2)]  # the Pong, and the lease it was sent first
        assert [r.meta.indexes for r in replies if isinstance(r, wire.MetaReply)] == [put.indexes]
        print(f"a lease sent to a frozen client: back after {served:.2f} s (window {interval * HEARTBEAT_LIVENESS} s)")


def test_a_consumer_killed_mid_stream_leaves_the_unit_as_it_was(child):
    """The unit is writing a 96 MiB batch on a bulk stream its reader stopped reading."""
    with cluster() as c, c.client() as client:
        unit = c.pids[1]
        client.put("big", {"x": torch.full((4, HOLD_BYTES // 16), 5.0)})
        fd0, th0 = fds(unit), threads(unit)
        consumer = child("stream", c.address)
        assert fds(unit) > fd0 and threads(unit) > th0  # its connection, its stream and the stream's writer
        t0 = kill(consumer)
        # back where it was, but for the streams' hang-up watcher, started with the first stream
        until(lambda: fds(unit) <= fd0 + 1 and threads(unit) <= th0 + 1, BOUND, "the dead reader's stream reclaimed")
        took = time.monotonic() - t0
        with c.client(config=tqueue.ClientConfig(shm=False, host="elsewhere")) as other:
            got = other.get_data(other.get_meta("big", ["x"], 4, task="after"))
            assert torch.equal(got["x"], torch.full((4, HOLD_BYTES // 16), 5.0))
        print(f"consumer SIGKILL mid-stream: the unit's stream and thread reclaimed after {took:.2f} s")


def test_a_backlog_longer_than_the_liveness_window_is_not_silence(raw, partition):
    """60 connections each queue 4 reads whose policy holds the controller's loop 10 ms: ZeroMQ
    serves the connections in turn, so each one, the client's and the unit's included, has a
    message handled once in 0.6 s, longer than the liveness windows (0.3 s for clients, 0.5 s
    for units). Pings are answered as they arrive and every arrival counts for its sender, so
    the put made meanwhile is stored and the unit stays alive. Answered in turn (as before),
    the client's pings waited a whole round each and its put failed with
    ControllerUnavailableError, or the unit, its heartbeats unread, was declared dead."""
    policies = ["slow=tests.controller.custom_policy:Slow"]
    with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": 0.1, "policies": policies}) as c:
        with tqueue.Client(c.address) as client:
            client.put(partition, {"x": torch.zeros(1, dtype=torch.int64)})
            peers = [raw(c.address) for _ in range(60)]
            started = time.monotonic()
            for rid, peer in enumerate(peers):
                for k in range(4):
                    peer.send(wire.encode(GetMeta(rid=4 * rid + k, partition=partition, fields=["x"], batch_size=2,
                                                  task="t", policy="slow", timeout=0)))
            meta = client.put(partition, {"x": torch.arange(4)})
            for peer in peers:  # the whole backlog, answered
                for _ in range(4):
                    peer.recv(timeout=60)
            backlog = time.monotonic() - started
            assert backlog > 1.0, f"the backlog lasted {backlog:.2f} s, not longer than the windows: the test proves nothing"
            assert [u.alive for u in client.status().units] == [True]
            assert client.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
