"""The wire module alone: frames of each message, and refusal of anything malformed."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from tqueue.errors import ProtocolError
from tqueue.wire import _messages as _wire


def test_every_kind_has_one_struct():
    kinds = [cls.KIND for cls in _wire._TYPES.values()]
    assert len(kinds) == len(set(kinds)) == len(_wire.Kind)


def test_frames_are_kind_header_then_buffers_untouched():
    buf = bytearray(b"\x01\x02\x03")
    msg = _wire.Fetch(rid=7, partition="p", partition_uid=3, indexes=[1, 2], fields=["a"])
    frames = _wire.encode(msg, [buf, memoryview(b"xyz")])
    assert len(frames) == 4
    assert frames[0] == bytes([_wire.Kind.FETCH])
    assert frames[2] is buf  # payload is passed through, not copied or re-encoded
    back, buffers = _wire.decode(frames)
    assert back == msg and back.rid == 7
    assert buffers == frames[2:]


@pytest.mark.parametrize(
    "frames, match",
    [
        pytest.param([], "kind and a header", id="empty"),
        pytest.param([b"\x03"], "kind and a header", id="kind-only"),
        pytest.param([b"\xff", b"\x80"], "unknown message kind", id="unknown-kind"),
        pytest.param([b"\x03\x03", b"\x80"], "unknown message kind", id="long-kind"),
        pytest.param([bytes([_wire.Kind.HELLO]), b"\x85\xa3ri"], "bad Hello header", id="truncated"),
        pytest.param([bytes([_wire.Kind.HELLO]), b"garbage!"], "bad Hello header", id="garbage"),
        pytest.param(
            [bytes([_wire.Kind.GET_META]), msgspec.msgpack.encode({"partition": 3})],
            r"bad GetMeta header: Expected `str`, got `int` - at `\$.partition`",
            id="wrong-type",
        ),
    ],
)
def test_malformed_messages_are_protocol_errors(frames, match):
    with pytest.raises(ProtocolError, match=match):
        _wire.decode(frames)


def test_pickled_header_is_refused_without_unpickling():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled!",))

    with pytest.raises(ProtocolError, match="bad Hello header"):
        _wire.decode([bytes([_wire.Kind.HELLO]), pickle.dumps(Boom())])


def test_oversized_header_is_refused():
    big = msgspec.msgpack.encode(_wire.Clear(partition="x" * 2000))
    with pytest.raises(ProtocolError, match=r"Clear header of \d+ bytes exceeds the limit of 1000"):
        _wire.decode([bytes([_wire.Kind.CLEAR]), big], max_header=1000)


@pytest.mark.parametrize(
    "header, rid",
    [
        pytest.param(msgspec.msgpack.encode({"rid": 42, "x": "?"}), 42, id="map-with-rid"),
        pytest.param(b"garbage!", 0, id="garbage"),
        pytest.param(msgspec.msgpack.encode({"rid": True}), 0, id="bool-rid"),
    ],
)
def test_salvage_rid(header, rid):
    assert _wire.salvage_rid([b"\x03", header]) == rid


def test_batch_meta_round_trips_as_msgpack():
    meta = _wire.BatchMeta(
        partition="train/step-1",
        partition_uid=2,
        indexes=[4, 5],
        units=[0, 1],
        fields=["a"],
        schema={"a": _wire.FieldSpec(kind="tensor", dtype="bfloat16", shape=(3,))},
        groups=["g", 7],
        task="actor",
        lease=9,
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=_wire.BatchMeta)
    assert back == meta and len(back) == 2 and back.size == 2
