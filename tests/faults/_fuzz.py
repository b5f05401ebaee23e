"""A seeded generator of malformed traffic for a unit's ZeroMQ port and its bulk port.

Each message is made in a few microseconds from templates encoded once: truncated headers,
kinds the unit does not serve, huge declared sizes and indexes, deep nesting, random bytes,
valid headers with the wrong number of frames, and bit flips of valid messages. Templates
name partition uids far from the ones a test's correct client uses, so that a message the
unit finds valid touches nothing of that client's.
"""

from __future__ import annotations

import random
import struct

from tqueue.transport import _bulk
from tqueue.wire import Kind
from tqueue.wire import _messages as _wire

FAR = 10**6  # partition uids of the templates
_SPEC = _wire.FieldSpec(kind="tensor", dtype="uint8", layout="dense", shape=[8])
_HUGE = [2**62, 2**63 - 1, -(2**63), 2**40, -1]


def _store(**kw: object) -> _wire.Store:
    block = _wire.FieldBlock(name="x", spec=kw.pop("spec", _SPEC), counts=kw.pop("counts", [1]))  # type: ignore[arg-type]
    fields: dict = dict(rid=1, grant_id=FAR, partition="fuzz", partition_uid=FAR, start=0, count=1, blocks=[block])
    fields.update(kw)
    return _wire.Store(**fields)


TEMPLATES: list[list[bytes]] = [
    _wire.encode(m)
    for m in (
        _wire.Hello(rid=1, protocol=_wire.PROTOCOL_VERSION),
        _wire.Fetch(rid=2, partition="fuzz", partition_uid=FAR + 1, indexes=[0, 1], fields=["x"]),
        _wire.Drop(rid=3, partition_uid=FAR + 2, indexes=[0]),
        _wire.Release(rid=4, holds=[FAR]),
        _wire.Move(rid=5, src_uid=FAR + 3, dst_uid=FAR + 4, dst_name="fuzz", src_indexes=[0], dst_indexes=[1]),
        _wire.Cancel(rid=6, of=FAR),
        _store(),
    )
]
HUGE: list[list[bytes]] = [
    _wire.encode(m)
    for n in _HUGE
    for m in (
        _wire.Fetch(rid=7, partition="fuzz", partition_uid=FAR, indexes=[n], fields=["x"]),
        _wire.Alloc(rid=8, nbytes=n),
        _store(count=n if n > 0 else 1, counts=[abs(n)]),
        _store(start=n, count=2),
        _store(spec=_wire.FieldSpec(kind="tensor", dtype="uint8", layout="dense", shape=[abs(n)])),
        _wire.Move(rid=9, src_uid=FAR, dst_uid=FAR + 5, dst_name="fuzz", src_indexes=[0], dst_indexes=[n]),
        _wire.Drop(rid=10, partition_uid=FAR, indexes=[n]),
    )
]
REPLY_KINDS = [Kind.ERROR, Kind.OK, Kind.HELLO_REPLY, Kind.STORED, Kind.FETCHED, Kind.ALLOCATED, Kind.DROPPED, Kind.META]
CONTROLLER_KINDS = [Kind.REGISTER_UNIT, Kind.GRANT, Kind.COMMIT, Kind.GET_META, Kind.STATUS, Kind.SEAL, Kind.RESERVE]


def message(rng: random.Random) -> list[bytes]:
    """One malformed (or, rarely by chance, valid and harmless) message."""
    pick = rng.randrange(9)
    if pick == 0:  # random bytes, random kind
        return [bytes([rng.randrange(256)]), rng.randbytes(rng.randrange(64))]
    if pick == 1:  # a valid header cut short
        kind, header, *rest = rng.choice(TEMPLATES)
        return [kind, header[: rng.randrange(len(header))], *rest]
    if pick == 2:  # a kind the unit does not serve, over another message's header
        kind = rng.choice(REPLY_KINDS + CONTROLLER_KINDS)
        return [bytes([kind]), rng.choice(TEMPLATES)[1]]
    if pick == 3:  # huge declared sizes, counts and indexes
        return list(rng.choice(HUGE))
    if pick == 4:  # nested too deep for the decoder
        depth = rng.choice([200, 2_000, 20_000])
        return [bytes([rng.choice([Kind.HELLO, Kind.FETCH, Kind.STORE])]), b"\x91" * depth + b"\x00"]
    if pick == 5:  # a valid Store header with the wrong number of frames
        kind, header = _wire.encode(_store())
        return [kind, header, *([bytes(8)] * rng.choice([0, 2, 3, 40]))]
    if pick == 6:  # bit flips in a valid message (uids stay far from real ones: see FAR)
        kind, header, *rest = rng.choice(TEMPLATES)
        flipped = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return [kind, bytes(flipped), *rest]
    if pick == 7:  # a kind frame alone, or an empty one
        return [rng.choice([b"", bytes([Kind.FETCH]), b"\x00\x00"])]
    kind, header, *rest = rng.choice(TEMPLATES)  # junk frames after a valid message
    return [kind, header, *rest, *(rng.randbytes(rng.randrange(16)) for _ in range(rng.randrange(1, 5)))]


def bulk_opening(rng: random.Random) -> list[bytes]:
    """What a stranger writes on a fresh bulk connection before closing it."""
    pick = rng.randrange(5)
    token = rng.getrandbits(64)
    hello = _bulk._HELLO.pack(_bulk._MAGIC, token)
    if pick == 0:
        return [rng.randbytes(rng.randrange(1, 64))]  # random bytes
    if pick == 1:
        return [hello[: rng.randrange(1, len(hello))]]  # a hello cut short
    if pick == 2:
        return [b"XXXX" + struct.pack("<Q", token)]  # a wrong magic
    if pick == 3:
        return [hello, rng.randbytes(rng.randrange(1, 4096))]  # a hello, then junk nobody asked for
    return [hello]  # a hello, then gone
