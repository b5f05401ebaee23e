"""Malformed traffic sent straight to the servers' ports: each gets a typed error reply,
and the servers go on serving correct clients."""

from __future__ import annotations

import pickle
import re
import socket

import msgspec
import pytest
import torch

from tqueue.wire import Kind
from tqueue.wire import _messages as _wire

K = lambda kind: bytes([kind])  # noqa: E731


def still_serves(client, partition):
    meta = client.put(partition, {"x": torch.arange(3), "s": ["a", "b", "c"]})
    batch = client.get_data(client.get_meta(partition, ["x", "s"], 3, task="t", timeout=10))
    assert batch["x"].tolist() == [0, 1, 2] and batch["s"] == ["a", "b", "c"]
    return meta


class Evil:
    def __reduce__(self):
        return (pytest.fail, ("the server unpickled network input",))


BAD = [
    pytest.param([b"\x99", b"\x80"], "protocol", r"unknown message kind", id="unknown-kind"),
    pytest.param([K(Kind.HELLO)], "protocol", r"needs a kind and a header", id="no-header"),
    pytest.param([K(Kind.HELLO), b"\x85\xa3rid\x07"], "protocol", r"bad Hello header", id="truncated-header"),
    pytest.param([K(Kind.GRANT), b"\xc1garbage"], "protocol", r"bad Grant header", id="garbage-header"),
    pytest.param([K(Kind.HELLO), pickle.dumps(Evil())], "protocol", r"bad Hello header", id="pickle"),
    pytest.param(
        [K(Kind.HELLO), msgspec.msgpack.encode({"rid": 5, "protocol": 999})],
        "protocol_version",
        rf"peer speaks tqueue protocol 999, the \w[\w ]+ speaks protocol {_wire.PROTOCOL_VERSION}",
        id="version-mismatch",
    ),
    # too deep for the decoder (RecursionError): it costs that message, not the receive loop
    pytest.param([K(Kind.HELLO), b"\x91" * 100_000 + b"\x00"], "protocol", r"bad Hello header", id="deep-nesting"),
]


@pytest.mark.parametrize("frames, code, match", BAD)
def test_controller_answers_garbage_with_typed_errors(cluster, client, raw, partition, frames, code, match):
    peer = raw(cluster.address)
    reply = peer.ask(frames)
    assert isinstance(reply, _wire.Error) and reply.code == code
    assert re.search(match, reply.message), reply.message
    still_serves(client, partition)


@pytest.mark.parametrize("frames, code, match", BAD)
def test_unit_answers_garbage_with_typed_errors(cluster, client, raw, partition, frames, code, match):
    peer = raw(cluster.unit_addresses[0])
    reply = peer.ask(frames)
    assert isinstance(reply, _wire.Error) and reply.code == code
    assert re.search(match, reply.message), reply.message
    still_serves(client, partition)


def test_oversized_header_to_controller(cluster, client, raw, partition):
    peer = raw(cluster.address)
    reply = peer.ask([K(Kind.HELLO), b"\x00" * (17 << 20)])
    assert reply.code == "protocol"
    assert "Hello header of 17825792 bytes exceeds the limit of 16777216 bytes" in reply.message
    still_serves(client, partition)


def test_wrong_message_for_the_server(cluster, client, raw, partition):
    reply = raw(cluster.address).ask(_wire.encode(_wire.Fetch(rid=3, partition="p", partition_uid=1, indexes=[0], fields=["x"])))
    assert reply.code == "protocol" and reply.rid == 3
    assert reply.message == "controller does not handle Fetch messages"
    still_serves(client, partition)


def store(partition, blocks, count=1):
    return _wire.Store(rid=11, grant_id=424242, partition=partition, partition_uid=1, start=0, count=count, blocks=blocks)


def int64_block(counts, name="x"):
    return _wire.FieldBlock(name=name, spec=_wire.FieldSpec(kind="tensor", dtype="int64", shape=(3,)), counts=counts)


def packed_block(packed):
    block = int64_block([1])
    block.packed = packed
    return block


@pytest.mark.parametrize(
    "msg, frames, match",
    [
        pytest.param(store("p", [int64_block([1])]), [], r"field 'x': header declares 1 frame\(s\), 0 arrived", id="missing-frame"),
        pytest.param(store("p", [int64_block([1])]), [b"\x00" * 10], r"field 'x': frame 0 has 10 bytes, the header declares 24", id="truncated-frame"),
        pytest.param(store("p", [int64_block([1])]), [b"\x00" * 4096], r"frame 0 has 4096 bytes, the header declares 24", id="oversized-frame"),
        pytest.param(store("p", [int64_block([1])]), [b"\x00" * 24, b"extra"], r"1 frame\(s\) beyond what the header declares", id="extra-frame"),
        pytest.param(
            store("p", [_wire.FieldBlock(name="x", spec=_wire.FieldSpec(kind="tensor", dtype="pyobject"), counts=[1])]),
            [b"\x00"],
            r"unknown torch dtype 'pyobject'",
            id="bad-dtype",
        ),
        pytest.param(
            store("p", [_wire.FieldBlock(name="x", spec=_wire.FieldSpec(kind="ndarray", dtype="O"), counts=[1])]),
            [b"\x00" * 8],
            r"numpy dtype 'O' cannot travel as raw bytes",
            id="object-dtype",
        ),
        pytest.param(store("p", [int64_block([2])]), [b"\x00" * 48], r"2 samples in the block, 1 in the write", id="count-mismatch"),
        pytest.param(
            store("p", [packed_block(["int8"])]), [b"\x00" * 24], r"field 'x': frame 0 has 24 bytes, the header declares 3", id="packed-wide-frame"
        ),
        pytest.param(
            store("p", [packed_block(["float32"])]),
            [b"\x00" * 12],
            r"bad Store header: Invalid enum value 'float32' - at `\$.blocks\[0\].packed\[0\]`",
            id="packed-not-an-int",
        ),
        pytest.param(store("p", [int64_block([1])]), [b"\x00" * 24], r"grant 424242 is unknown", id="no-grant"),
    ],
)
def test_unit_refuses_bad_stores_and_keeps_nothing(cluster, client, raw, partition, msg, frames, match):
    peer = raw(cluster.unit_addresses[0])
    reply = peer.ask(_wire.encode(msg, frames))
    assert isinstance(reply, _wire.Error) and reply.rid == 11
    assert re.search(match, reply.message), reply.message
    still_serves(client, partition)


def test_raw_tcp_garbage_does_not_disturb_servers(cluster, client, partition):
    for address in [cluster.address, *cluster.unit_addresses]:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    still_serves(client, partition)


@pytest.mark.parametrize("server", ["controller", "unit"])
def test_a_cancel_gets_no_reply(cluster, client, raw, partition, server):
    """A requester that gives up sends ``Cancel``; no server answers it (the next reply on
    the same connection is the next request's), whether it withdraws anything or not."""
    peer = raw(cluster.address if server == "controller" else cluster.unit_addresses[0])
    peer.send(_wire.encode(_wire.Cancel(rid=7, of=6)))
    peer.send([K(Kind.CANCEL), b"\xc1garbage"])  # even one that cannot be read
    reply = peer.ask(_wire.encode(_wire.Hello(rid=8, protocol=_wire.PROTOCOL_VERSION)))
    assert isinstance(reply, _wire.HelloReply) and reply.rid == 8
    still_serves(client, partition)


def deep_tag_keys(rid: int, depth: int = 10_000) -> bytes:
    """A TagKeys header whose tags nest ``depth`` maps deep, ending with its request id."""
    return (b"\x84\xa9partition\xa1p\xa4keys\x91\xa1a\xa4tags\x91" + b"\x81\xa1x" * depth + b"\x00" + b"\xa3rid"
            + bytes([0xCD]) + rid.to_bytes(2, "big"))


def test_an_oversized_header_is_answered_at_once_with_its_request_id(cluster, client, raw, partition):
    """The caller matches the reply by its id, so it learns within a second (not at its
    30 s request timeout): the id is read from the header's tail, nothing else of it."""
    peer = raw(cluster.address)
    from tqueue.wire import TagKeys

    frames = _wire.encode(TagKeys(rid=41, partition=partition, keys=["a"], tags=[{"x": "y" * (17 << 20)}]))
    reply = peer.ask(frames, timeout=1.0)
    assert isinstance(reply, _wire.Error) and (reply.code, reply.rid) == ("protocol", 41)
    assert re.search(r"TagKeys header of \d+ bytes exceeds the limit of 16777216 bytes", reply.message)
    still_serves(client, partition)


def test_a_client_sending_an_oversized_header_gets_protocol_error_at_once(client, partition):
    import time

    from tqueue.errors import ProtocolError

    start = time.monotonic()
    with pytest.raises(ProtocolError, match=r"TagKeys header of \d+ bytes exceeds the limit of 16777216 bytes"):
        client.tag_keys(partition, ["a"], [{"x": "y" * (17 << 20)}])
    assert time.monotonic() - start < 1.0
    still_serves(client, partition)


@pytest.mark.parametrize("server", ["controller", "unit"])
def test_a_header_nested_10000_deep_gets_a_protocol_error_with_its_request_id(cluster, client, raw, partition, server):
    address = cluster.address if server == "controller" else cluster.unit_addresses[0]
    reply = raw(address).ask([K(Kind.TAG_KEYS), deep_tag_keys(4242)], timeout=1.0)
    assert isinstance(reply, _wire.Error) and (reply.code, reply.rid) == ("protocol", 4242), reply
    assert re.search(r"(bad TagKeys header|RecursionError|deep)", reply.message), reply.message
    still_serves(client, partition)
