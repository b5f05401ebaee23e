"""A blocking call interrupted (Ctrl-C, SIGINT) withdraws what it had parked at the controller.

The interrupted client is a real :class:`tqueue.Client` in a process of its own
(tests/client/_interrupted.py) that lives on after the interrupt, as a notebook does: what it
had parked must not wait for its session to end, nor samples be leased to it. The servers
run in this process (tests/servers.py): the client is the process that must be real.
"""

from __future__ import annotations

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
import zmq

import tqueue
from tqueue.errors import ControllerUnavailableError
from tqueue.transport import _zmq
from tqueue.wire import _messages as wire

from ..servers import LoopCluster

ROOT = pathlib.Path(__file__).resolve().parents[2]


def waiting(client: tqueue.Client, kind: str) -> int:
    return sum(1 for w in client.status().waiting if w.kind == kind)


def until(condition: Any, timeout: float, what: str) -> None:
    """Wait for the controller's status to show what a call in another process did."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.1f} s: {what}")
        pause.wait(0.05)


def line_of(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the client process said nothing within {timeout} s"
    return proc.stdout.readline().decode().strip()


@pytest.fixture
def interrupted() -> Iterator[Any]:
    """Start ``_interrupted MODE ADDRESS`` and wait for it to say it is about to wait."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str, address: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.client._interrupted", mode, address],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        procs.append(proc)
        assert line_of(proc, 120) == "waiting"
        return proc

    yield start
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def test_an_interrupted_get_meta_is_withdrawn_and_leased_nothing(interrupted):
    with LoopCluster(num_storage_units=1) as c, c.client() as client:
        consumer = interrupted("get_meta", c.address)
        until(lambda: waiting(client, "get_meta") == 1, 60, "the consumer's get_meta parked")
        t0 = time.monotonic()
        consumer.send_signal(signal.SIGINT)
        assert line_of(consumer, 30) == "interrupted"
        assert client.status().waiting == []  # withdrawn at once, its process alive
        put = client.put("empty", {"x": torch.arange(8.0).reshape(4, 2)})
        meta = client.get_meta("empty", ["x"], 4, task="t", timeout=2)  # a live consumer gets them all
        assert sorted(meta.indexes) == sorted(put.indexes)
        assert {p.name: p for p in client.status().partitions}["empty"].tasks["t"].expired == 0
        assert consumer.poll() is None
        print(f"interrupted get_meta: withdrawn and the samples served after {time.monotonic() - t0:.2f} s")


@pytest.mark.parametrize("coalesce", ["0", "1"], ids=["alone", "coalesced"])
def test_an_interrupted_put_that_waits_for_memory_leaves_no_parked_write_and_no_grant(interrupted, coalesce):
    """Also with ``coalesce_puts``: the put went out one loop turn after the call, as a
    coalesced put of one caller, which is withdrawn once that caller gives up."""
    storage = {"capacity_bytes": 4 << 20}  # one unit of 4 MiB
    with LoopCluster(num_storage_units=1, storage=storage) as c, c.client() as client:
        client.put("filler", {"x": torch.zeros(12, 1 << 16)})  # 3 MiB: the 2 MiB put must wait
        producer = interrupted("put", c.address, {"TQUEUE_COALESCE_PUTS": coalesce})
        until(lambda: waiting(client, "put") == 1, 60, "the producer's put parked for memory")
        assert [w.cause for w in client.status().waiting] == ["memory"]
        producer.send_signal(signal.SIGINT)
        assert line_of(producer, 30) == "interrupted"
        # withdrawn: waited for, as the coalesced case was once seen still parked at an at-once check
        until(lambda: client.status().waiting == [], 10, "the interrupted put's parked write withdrawn")
        client.clear("filler")  # were the put still parked, it would be granted 2 MiB now
        meta = client.put("after", {"x": torch.zeros(12, 1 << 16)}, timeout=0)  # 3 MiB: room at once
        assert len(meta) == 12
        assert "p" not in {p.name for p in client.status().partitions}
        assert producer.poll() is None


def test_a_blocking_peer_interrupted_while_it_waits_withdraws_its_request():
    """The calling thread's own connection (a blocking client's get_meta): SIGINT to the
    waiting thread once the server has the request; the server then gets its Cancel."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    got: list[wire.Message] = []

    def serve() -> None:
        for _ in range(2):  # the request, then its Cancel
            if got and not server.poll(30_000):
                return  # no Cancel came
            _, *frames = server.recv_multipart()
            got.append(wire.decode(frames)[0])
            if len(got) == 1:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    thread = threading.Thread(target=serve)
    # Ctrl-C's handler, even where the tests run as a background job (SIGINT then inherited ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread.start()
    peer = _zmq.BlockingPeer(f"tcp://127.0.0.1:{port}", name="controller", unavailable=ControllerUnavailableError)
    try:
        with pytest.raises(KeyboardInterrupt):
            peer.request(wire.Hello(protocol=1), expect=wire.HelloReply, timeout=60)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len(got) == 2, f"the server got {got}: no Cancel after the interrupt"
        request, cancel = got
        assert isinstance(cancel, wire.Cancel) and cancel.of == request.rid
    finally:
        signal.signal(signal.SIGINT, previous)
        peer.close()
        server.close(linger=0)
        ctx.term()
