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


def header(kind: _wire.Kind, msg: _wire.Message, **change) -> list[bytes]:
    """The frames of ``msg`` with some header fields replaced by raw values."""
    fields = msgspec.to_builtins(msg)
    for path, value in change.items():
        *outer, last = path.split("__")
        at = fields
        for key in outer:
            at = at[int(key)] if key.isdigit() else at[key]
        at[last] = value
    return [bytes([kind]), msgspec.msgpack.encode(fields)]


def a_store(**block) -> _wire.Store:
    spec = _wire.FieldSpec(kind="tensor", dtype="int64", shape=(3,))
    return _wire.Store(
        grant_id=1, partition="p", partition_uid=1, start=0, count=1,
        blocks=[_wire.FieldBlock(name="x", spec=spec, counts=[1], **block)],
    )


@pytest.mark.parametrize(
    "frames, match",
    [
        pytest.param(
            header(_wire.Kind.STORE, a_store(), blocks__0__spec__kind="pickle"),
            r"bad Store header: Invalid enum value 'pickle' - at `\$.blocks\[0\].spec.kind`",
            id="field-kind",
        ),
        pytest.param(
            header(_wire.Kind.STORE, a_store(), blocks__0__spec__layout="sparse"),
            r"Invalid enum value 'sparse' - at `\$.blocks\[0\].spec.layout`",
            id="field-layout",
        ),
        pytest.param(
            header(_wire.Kind.STORE, a_store(packed=["int8"]), blocks__0__packed=["uint16"]),
            r"Invalid enum value 'uint16' - at `\$.blocks\[0\].packed\[0\]`",
            id="packed-type",
        ),
        pytest.param(
            header(_wire.Kind.STORE, a_store(), bulk=[[5, 1, 7]]),
            r"Expected `array` of length 2, got 3 - at `\$.bulk\[0\]`",
            id="lane-not-a-pair",
        ),
        pytest.param(
            header(_wire.Kind.GRANTED, _wire.Granted(grant_id=1, partition_uid=1, start=0), status="lost"),
            r"bad Granted header: Invalid enum value 'lost' - at `\$.status`",
            id="put-status",
        ),
        pytest.param(
            header(_wire.Kind.CREATE_PARTITION, _wire.CreatePartition(partition="p"), on_member_failure="shrug"),
            r"Invalid enum value 'shrug' - at `\$.on_member_failure`",
            id="member-failure",
        ),
        pytest.param(
            header(_wire.Kind.GRANT, _wire.Grant(partition="p", count=1, blocks=[]), segment=[1, 2, 3]),
            r"Expected `array` of length 2, got 3 - at `\$.segment`",
            id="segment-not-a-pair",
        ),
    ],
)
def test_closed_names_and_pairs_are_checked_by_decoding(frames, match):
    """Enum-like names and fixed pairs are typed on the wire: decoding refuses what no
    handler could use, naming the path, before any handler sees it."""
    with pytest.raises(ProtocolError, match=match):
        _wire.decode(frames)


def test_typed_names_and_pairs_encode_as_before():
    """``Literal`` names and tuples encode as the strings and arrays they replaced: peers
    of this protocol version read each other either way."""
    store = a_store(packed=["int8"])
    store.bulk = [(5, 1)]
    fields = msgspec.msgpack.decode(_wire.encode(store)[1])
    assert fields["bulk"] == [[5, 1]] and fields["blocks"][0]["packed"] == ["int8"]
    back, _ = _wire.decode(header(_wire.Kind.STORE, store))
    assert back.bulk == [(5, 1)] and back.blocks[0].spec.kind == "tensor"
