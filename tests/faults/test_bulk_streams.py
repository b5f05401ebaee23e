"""Bulk streams never outlive their clients: a closed or killed session leaves no fd and no
thread in the unit, and the streams a unit holds are capped in all and per peer."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import tqueue
from tqueue.errors import StorageUnitUnavailableError
from tqueue.transport import _bulk
from tqueue.wire import _messages as _wire

from ._proc import fds, threads, until
from .conftest import bulk_address_of

SESSIONS = 300
SLACK = 2  # fds or threads of the last session may still be closing as we count


def closed_by_unit(stream: _bulk.BulkStream) -> None:
    """Close our end's writing half and wait for the unit to close the stream: the unit
    noticed the hang-up (the handshake the counts below rely on)."""
    try:
        stream.sock.shutdown(socket.SHUT_WR)
        stream.sock.settimeout(30)
        assert stream.sock.recv(1) == b""
    finally:
        stream.close()


def test_closed_sessions_leave_no_fd_and_no_thread(unit_cluster, unit_pid):
    address = bulk_address_of(unit_cluster)
    closed_by_unit(_bulk.BulkStream(address, 10))  # the unit's lasting threads exist now
    fd0, th0 = fds(unit_pid), threads(unit_pid)
    for _ in range(SESSIONS):
        closed_by_unit(_bulk.BulkStream(address, 10))
    fd1, th1 = fds(unit_pid), threads(unit_pid)
    # before: every session left 2 fds and 2 threads (600 and 600 here)
    assert fd1 - fd0 <= SLACK and th1 - th0 <= SLACK, (fd0, fd1, th0, th1)


def test_a_client_session_closing_releases_its_streams(unit_cluster, unit_pid):
    config = tqueue.ClientConfig(shm=False, host="elsewhere", bulk_lanes=2)

    with tqueue.Client(unit_cluster.address, config=config) as c:
        meta = c.put("sessions", {"x": torch.arange(1 << 17)})
        assert c.get_data(meta)["x"].sum() == (1 << 17) * ((1 << 17) - 1) // 2
    address = bulk_address_of(unit_cluster)
    fd0, th0 = fds(unit_pid), threads(unit_pid)
    for _ in range(20):
        with tqueue.Client(unit_cluster.address, config=config) as c:
            assert c.get_data(meta)["x"][-1] == (1 << 17) - 1
    # a session of our own after them: the watch has handled the hang-ups before ours
    closed_by_unit(_bulk.BulkStream(address, 10))
    # ZeroMQ tears its connections down on its own threads, a little after each close
    until(lambda: fds(unit_pid) - fd0 <= SLACK, 30, f"unit fds back to {fd0}")
    until(lambda: threads(unit_pid) - th0 <= SLACK, 30, f"unit threads back to {th0}")  # a stream's ends, as its fds


CHILD = textwrap.dedent(
    """
    import sys
    from tqueue.transport import _bulk
    stream = _bulk.BulkStream(sys.argv[1], 10)
    print(stream.token, flush=True)
    sys.stdin.readline()
    stream.sock.sendall(bytes(1 << 20))
    print("wrote", flush=True)
    sys.stdin.readline()
    """
)


def killed_mid_put(address: str, peer) -> None:
    """A client process that opened a stream, began a 64 MiB put on it and was SIGKILLed."""
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        token = int(child.stdout.readline())
        spec = _wire.FieldSpec(kind="tensor", dtype="uint8", layout="dense", shape=[64 << 20])
        block = _wire.FieldBlock(name="x", spec=spec, counts=[1])
        store = _wire.Store(
            rid=1, grant_id=1, partition="killed", partition_uid=99, start=0, count=1, blocks=[block], bulk=[(token, 1)]
        )
        peer.send(_wire.encode(store))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "wrote\n"
        child.send_signal(signal.SIGKILL)
        reply = peer.recv(timeout=30)[0]  # the unit's read failed: the put is refused
        assert isinstance(reply, _wire.Error) and re.search(rf"bulk stream {token} broke while a put was read", reply.message)


def test_a_client_killed_mid_put_leaves_nothing(unit_cluster, unit_pid, raw):
    address = bulk_address_of(unit_cluster)
    peer = raw(unit_cluster.unit_addresses[0])
    killed_mid_put(address, peer)  # the unit's read threads and our ZeroMQ connection exist now
    closed_by_unit(_bulk.BulkStream(address, 10))
    fd0, th0 = fds(unit_pid), threads(unit_pid)
    for _ in range(3):
        killed_mid_put(address, peer)
    closed_by_unit(_bulk.BulkStream(address, 10))
    assert fds(unit_pid) - fd0 <= SLACK and threads(unit_pid) - th0 <= SLACK, (fd0, fds(unit_pid), th0, threads(unit_pid))


@pytest.fixture(scope="module")
def capped() -> tqueue.LocalCluster:
    with tqueue.LocalCluster(num_storage_units=1, storage={"bulk_streams": 4, "bulk_streams_per_peer": 3}) as c:
        yield c


def test_streams_beyond_the_caps_are_refused_with_the_reason(capped):
    address = bulk_address_of(capped)
    mine = [_bulk.BulkStream(address, 10) for _ in range(3)]
    with pytest.raises(StorageUnitUnavailableError, match=r"refused the stream: 3 bulk streams from 127\.0\.0\.1 are open"):
        _bulk.BulkStream(address, 10)
    host, _, port = address.rpartition(":")
    other = socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0))
    other.sendall(_bulk._HELLO.pack(_bulk._MAGIC, 12345))
    assert other.recv(1) == b"K"  # another peer's first stream: 4 in all
    third = socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.3", 0))
    assert third.recv(200) == b"R4 bulk streams are open (StorageConfig.bulk_streams)"
    third.close()
    closed_by_unit(mine.pop())  # a stream given back makes room again
    mine.append(_bulk.BulkStream(address, 10))
    for s in mine:
        s.close()
    other.close()
