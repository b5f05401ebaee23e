"""With authentication on (``LocalCluster(auth=True)``: CurveZMQ, a ZAP allow-list of
client keys), strangers get nothing, and keyed clients cannot take what is another's:
another client's lease is not theirs to ack or renew, nor its arena hold to release, and
the messages of units (register, commit, heartbeat, drop, move) are the cluster key's only.
"""

from __future__ import annotations

import pathlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

import tqueue
from tqueue import wire
from tqueue.errors import AuthenticationError, PermissionDeniedError
from tqueue.transport import _auth, _bulk

from ._proc import until

HANDSHAKE_WAIT_MS = 10_000  # a refused handshake is reported within this (generous) bound


@pytest.fixture(scope="module")
def cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=1, auth=True) as c:
        yield c


@pytest.fixture(scope="module")
def other_keys(cluster: tqueue.LocalCluster) -> Iterator[str]:
    """A key directory with the cluster's public key (so the stranger knows which server it
    talks to) and a key pair of its own that the cluster never admitted."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="tqueue-other-"))
    _, secret = zmq.auth.create_certificates(str(root), "other")
    shutil.copy(pathlib.Path(cluster.auth_dir) / "cluster.key", root / "cluster.key")
    pathlib.Path(secret).replace(root / "client.key_secret")
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)


class Raw:
    """A raw ZeroMQ DEALER, plain or with CURVE ``(public, secret, server)``, and its monitor."""

    def __init__(self, address: str, keys: tuple[bytes, bytes, bytes] | None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.mon = self.sock.get_monitor_socket()
        self.sock.connect(address)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(linger=0)
        self.sock.close(linger=0)


def dealer(address: str, keys: tuple[bytes, bytes, bytes] | None) -> Raw:
    return Raw(address, keys)


def handshake(raw: Raw) -> int:
    """The first handshake event of ``raw``: succeeded, or failed and how."""
    mon = raw.mon
    wanted = {
        zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    }
    while mon.poll(HANDSHAKE_WAIT_MS):
        event = recv_monitor_message(mon)["event"]
        if event in wanted:
            return int(event)
    raise AssertionError("no handshake event")


def ask(raw: Raw, msg: wire.Message, wait_ms: int = 10_000) -> Any:
    raw.sock.send_multipart(wire.encode(msg))
    assert raw.sock.poll(wait_ms), f"no answer to {type(msg).__name__}"
    reply, _ = wire.decode(raw.sock.recv_multipart())
    return reply


def keys_of(auth_dir: str) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(str(pathlib.Path(auth_dir) / "client.key_secret"))
    server, _ = zmq.auth.load_certificate(str(pathlib.Path(auth_dir) / "cluster.key"))
    assert secret is not None
    return public, secret, server


def test_an_authenticated_client_moves_exact_bytes_on_every_path(cluster):
    for n, config in enumerate([
        cluster.client_config(),  # same host: the arena
        cluster.client_config(shm=False),  # ZeroMQ frames
        cluster.client_config(shm=False, host="elsewhere"),  # bulk streams
    ]):
        with tqueue.Client(cluster.address, config=config) as c:
            data = {"x": torch.arange(4 * (1 << 18), dtype=torch.float32).reshape(4, -1) + n, "s": ["a", "b", "c", "d"]}
            c.put(f"ok{n}", data)
            meta = c.get_meta(f"ok{n}", ["x", "s"], 4, task="t")
            got = c.get_data(meta)
            assert torch.equal(got["x"], data["x"]) and got["s"] == data["s"]
            c.ack(meta)


def test_a_stranger_never_completes_a_handshake_and_changes_nothing(cluster, other_keys):
    with cluster.client() as c:
        c.put("mine", {"x": torch.ones(2, 2)})
        before = c.status()
        for address in (cluster.address, cluster.unit_addresses[0]):
            plain = dealer(address, None)
            unlisted = dealer(address, keys_of(other_keys))  # right server key, key not on the list
            try:
                assert handshake(plain) != zmq.EVENT_HANDSHAKE_SUCCEEDED
                assert handshake(unlisted) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                for raw in (plain, unlisted):  # whatever they send goes nowhere
                    for msg in (wire.StatusRequest(rid=1), wire.Clear(rid=2, partition="mine"),
                                wire.RegisterUnit(rid=3, protocol=wire.PROTOCOL_VERSION, address="tcp://127.0.0.1:1", host="x"),
                                wire.Release(rid=4, holds=[1, 2, 3])):
                        try:
                            raw.sock.send_multipart(wire.encode(msg), flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # no connection to queue on: refused
                    assert not raw.sock.poll(500)
            finally:
                plain.close()
                unlisted.close()
        after = c.status()
        assert [p.samples for p in after.partitions] == [p.samples for p in before.partitions]
        assert len(after.units) == len(before.units) == 1
        assert torch.equal(c.get_data(c.get_meta("mine", ["x"], 1, task="t"))["x"], torch.ones(1, 2))
    # the client API says so in a typed error, at once (tests/transport/test_connect.py times it)
    config = tqueue.ClientConfig(auth_dir=other_keys, request_timeout=5)
    with pytest.raises(AuthenticationError, match=r"refused this client's authentication \(ZAP status 400\)"):
        with tqueue.Client(cluster.address, config=config) as stranger:
            stranger.status()


def test_a_stranger_on_the_bulk_port_receives_nothing(cluster):
    host, port = cluster.client_config(shm=False, host="elsewhere"), None
    with tqueue.Client(cluster.address, config=host) as c:
        c.connect()
        (info,) = c._inner._conns.units.values()
        port = int(info.bulk.rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            stream_token = 12345
            sock.sendall(_bulk._HELLO.pack(_bulk._MAGIC, stream_token))
            sock.recv(1)  # its own stream: a token nobody authenticated will ever name
            data = {"x": torch.rand(4, 1 << 18)}
            assert torch.equal(c.get_data(c.put("bulk", data))["x"], data["x"])  # over a stream of its own
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # not a byte of it came this way


def test_a_client_cannot_act_as_a_unit_nor_release_another_sessions_hold():
    """B holds the same admitted client key as A (raw sockets, so its messages are exactly
    these): units' messages are refused by role, and a hold is its session's alone."""
    with tqueue.LocalCluster(num_storage_units=1, auth=True) as cluster:
        a = cluster.client(config=tqueue.ClientConfig(arena_lease_bytes=0))  # a lease would stay in use
        try:
            a.put("p", {"x": torch.ones(2, 3 << 18)})
            meta = a.get_meta("p", ["x"], 2, task="t")
            b_keys = keys_of(cluster.auth_dir)
            b = dealer(cluster.address, b_keys)
            assert handshake(b) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            for msg in (wire.RegisterUnit(rid=1, protocol=wire.PROTOCOL_VERSION, address="tcp://127.0.0.1:1", host="x"),
                        wire.Heartbeat(rid=2, unit_id=0),
                        wire.Commit(rid=3, grant_id=1, unit_id=0, fields=["x"], nbytes=1, partition_bytes=1, unit_bytes=1)):
                reply = ask(b, msg)
                assert isinstance(reply, wire.Error) and reply.code == "permission_denied", reply
                assert "is for the cluster key only" in reply.message
            unit = dealer(cluster.unit_addresses[0], b_keys)
            for msg in (wire.Drop(rid=4, partition_uid=meta.partition_uid),
                        wire.Move(rid=5, src_uid=meta.partition_uid, dst_uid=99, dst_name="q", src_indexes=[0], dst_indexes=[0])):
                reply = ask(unit, msg)
                assert isinstance(reply, wire.Error) and reply.code == "permission_denied", reply
            # an arena hold is released by the session that got it, never by another
            got = ask(unit, wire.Fetch(rid=6, partition="p", partition_uid=meta.partition_uid, indexes=[0, 1], fields=["x"], shm=True))
            assert isinstance(got, wire.Fetched) and got.hold
            thief = dealer(cluster.unit_addresses[0], b_keys)
            assert isinstance(ask(thief, wire.Release(rid=7, holds=[got.hold])), wire.Ok)
            a.clear("p")
            held = lambda: a.status().units[0].arena_used  # noqa: E731
            until(lambda: held() > 0, 10, "the unit reports the held bytes")
            assert held() >= 2 * (3 << 20)  # still held: the thief's release did nothing
            assert isinstance(ask(unit, wire.Release(rid=8, holds=[got.hold])), wire.Ok)
            until(lambda: held() == 0, 10, "the owner's release frees them")
            for s in (b, unit, thief):
                s.close()
        finally:
            a.close()


def test_only_the_client_holding_a_lease_acks_or_renews_it(tmp_path):
    keys = _auth.generate(tmp_path / "keys", clients=2)
    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(keys / "cluster.key", second / "cluster.key")
    shutil.copy(keys / "private" / "client1.key_secret", second / "client.key_secret")
    with tqueue.LocalCluster(num_storage_units=1, auth=str(keys)) as cluster:
        with cluster.client() as a, tqueue.Client(cluster.address, config=tqueue.ClientConfig(auth_dir=str(second))) as b:
            a.put("p", {"x": torch.ones(4, 2)})
            meta = a.get_meta("p", ["x"], 4, task="t")
            with pytest.raises(PermissionDeniedError, match=rf"lease {meta.lease} of task 't' was given to client:"):
                b.ack(meta)
            with pytest.raises(PermissionDeniedError, match=rf"lease {meta.lease} of task 't' was given to client:"):
                b.renew(meta)
            assert a.status().partitions[0].tasks["t"].consumed == 0
            a.ack(meta)
            assert a.status().partitions[0].tasks["t"].consumed == 4
