"""Shared fixtures. ``cluster`` is a local cluster on 127.0.0.1: one for the whole session, in
real processes, in the directories whose tests neither kill, stop nor reconfigure it and keep
to partitions of their own (``SHARED``: the `partition` fixture names them); one per module
elsewhere, served on a loop thread of this process (``tests.servers.LoopCluster``) in the
directories whose tests need the servers' behaviour, not their processes (``LOOP``: on the
tests' clock, which a test about time moves on with ``cluster.advance``), and in any module that sets ``OWN_CLUSTER = True`` (its tests need units whose loads, or a version,
are the module's own); real processes (``tqueue.LocalCluster``) elsewhere, and in a ``LOOP``
module that sets ``PROCESSES = True`` (it reads its servers' pids). A module that needs a
cluster with other options, or one it kills, defines a ``cluster`` fixture of its own, or
starts one in the test."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

import tqueue
from tqueue.wire import _messages as _wire

from .servers import LoopCluster

_names = itertools.count()
_TESTS = pathlib.Path(__file__).parent
# directories (and "" for the modules at the top) whose modules share the session's cluster
SHARED = {"", "client", "storage", "transport", "wire", "lifecycle"}
# directories whose modules have a LoopCluster of their own (unless they set PROCESSES = True)
LOOP = {"controller"}


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=2) as c:
        yield c


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    where = request.path.parent.relative_to(_TESTS).parts
    top = where[0] if where else ""
    module = request.module
    if getattr(module, "OWN_CLUSTER", False) or (top in LOOP and not getattr(module, "PROCESSES", False)):
        # on the tests' clock (tests/servers.py), which a test about time moves on; it runs
        # in real time as well, for the others
        with LoopCluster(num_storage_units=2, clock=True) as loop:
            yield loop
        return
    if top in SHARED:
        yield request.getfixturevalue("shared_cluster")
        return
    with tqueue.LocalCluster(num_storage_units=2) as c:
        yield c


@pytest.fixture
def client(cluster: Any) -> Iterator[tqueue.Client]:
    with tqueue.Client(cluster.address) as c:
        yield c


PATHS = {
    "socket": tqueue.ClientConfig(shm=False),
    "shm": tqueue.ClientConfig(shm=True, shm_min_bytes=0),
}


@pytest.fixture(params=list(PATHS))
def any_client(cluster: Any, request: pytest.FixtureRequest) -> Iterator[tqueue.Client]:
    """A client on each payload path: sockets only, and the unit's shared-memory arena."""
    with tqueue.Client(cluster.address, config=PATHS[request.param]) as c:
        yield c


@pytest.fixture
def partition(request: pytest.FixtureRequest) -> str:
    """A partition name no other test uses (regex-safe, so tests can put it in ``match``)."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)
    return f"{name}-{next(_names)}"


class RawPeer:
    """A bare DEALER socket for sending hand-made frames to a server."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout: float = 10.0) -> tuple[Any, list[Any]]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply within {timeout} s")
        return _wire.decode(self.sock.recv_multipart())

    def ask(self, frames: list[Any], timeout: float = 10.0) -> Any:
        self.send(frames)
        return self.recv(timeout)[0]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def raw() -> Iterator[Any]:
    peers: list[RawPeer] = []

    def make(address: str) -> RawPeer:
        peers.append(RawPeer(address))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


def header(msg: Any) -> bytes:
    return msgspec.msgpack.encode(msg)
