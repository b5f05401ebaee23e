"""Encoding of put data, without a cluster: what is accepted, and the errors for the rest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tqueue.client._assemble import _DECODER
from tqueue.client._encode import EXT_TENSOR, LEAF_HEAD, MAX_DEPTH, MAX_NESTING, OWN_FRAME, encode
from tqueue.errors import FieldTypeError, InvalidArgumentError, ProtocolError, SchemaError

CHUNK = 1 << 20


def enc(data, **kw):
    return encode(data, partition="p", chunk_bytes=kw.pop("chunk", CHUNK), **kw)


def test_dense_tensor_is_sent_without_copy_in_chunks_on_sample_boundaries():
    t = torch.arange(4 * 1000, dtype=torch.int64).reshape(1000, 4)  # 32 bytes per sample
    out = enc({"x": t}, chunk=3200)
    assert out.count == 1000 and out.copied == 0
    assert out.blocks[0].counts == [100] * 10
    assert len(out.buffers) == 10
    assert all(b.nbytes == 3200 for b in out.buffers)
    # the frames alias the tensor's memory
    t[0, 0] = 99
    assert bytes(out.buffers[0][:8]) == (99).to_bytes(8, "little")


def test_non_contiguous_tensor_is_copied_once_and_counted():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    out = enc({"x": t})
    assert out.copied == t.numel() * 4
    assert bytes(out.buffers[0]) == t.contiguous().numpy().tobytes()


def test_jagged_small_samples_are_joined_big_ones_stand_alone():
    big = torch.zeros(OWN_FRAME // 4, dtype=torch.float32)
    values = [torch.ones(3), torch.ones(5), big, torch.ones(2)]
    out = enc({"x": values})
    assert out.blocks[0].counts == [2, 1, 1]
    assert out.blocks[0].shapes == [3, 5, OWN_FRAME // 4, 2]
    assert out.copied == 8 * 4  # only the two joined small samples


def test_objects_are_msgpack_per_sample():
    out = enc({"s": ["a", {"k": [1, 2.5, None, True, b"\x00"]}, 7]})
    assert out.blocks[0].spec.kind == "object"
    assert sum(out.blocks[0].sizes) == sum(len(b) for b in out.buffers)


def test_rows_become_columns():
    out = enc([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    assert [b.name for b in out.blocks] == ["a", "b"] and out.count == 2


def test_numpy_string_and_object_arrays_are_object_fields():
    out = enc({"u": np.array(["ab", "c"]), "o": np.array([{"k": 1}, None], dtype=object)})
    assert [b.spec.kind for b in out.blocks] == ["object", "object"]


@pytest.mark.parametrize(
    "data, err, match",
    [
        pytest.param(
            {"meta": ["ok", {"when": object()}]},
            FieldTypeError,
            r"sample 1 of field 'meta' of partition 'p' holds a value of type builtins.object",
            id="unknown-object",
        ),
        pytest.param(
            {"meta": [(1, 2)]},
            FieldTypeError,
            r"sample 0 of field 'meta' .* type builtins.tuple",
            id="tuple-is-not-exact",
        ),
        pytest.param(
            {"meta": [np.float32(1.0)]},
            FieldTypeError,
            r"sample 0 of field 'meta' .* numpy.float32",
            id="numpy-scalar",
        ),
        pytest.param(
            {"mixed": [torch.ones(2), {"img": [torch.ones(1), {1, 2}]}]},
            FieldTypeError,
            r"sample 1 of field 'mixed' of partition 'p' holds a value of type builtins.set at \['img'\]\[1\]",
            id="set-beside-tensors",
        ),
        pytest.param(
            {"big": [1 << 70]},
            FieldTypeError,
            r"sample 0 of field 'big' .* 64 bits",
            id="int-overflow",
        ),
        pytest.param({"x": 3}, FieldTypeError, r"field 'x' of partition 'p': expected per-sample", id="scalar"),
        pytest.param(
            {"x": torch.ones(2, dtype=torch.int8).to_sparse()},
            FieldTypeError,
            r"field 'x' .* layout torch.sparse_coo cannot travel",
            id="sparse",
        ),
        pytest.param("text", FieldTypeError, r"takes a mapping .* got str", id="not-a-mapping"),
        pytest.param({3: [1]}, FieldTypeError, r"field names are non-empty strings", id="bad-name"),
        pytest.param(
            {"a": torch.ones(3), "b": [1, 2]},
            SchemaError,
            r"different sample counts: 'a': 3, 'b': 2",
            id="counts-differ",
        ),
        pytest.param(
            [{"a": 1, "b": 2}, {"a": 3}],
            SchemaError,
            r"field 'b' is missing from sample 1 of the put to partition 'p'",
            id="field-missing-from-sample",
        ),
        pytest.param(
            {"x": [torch.ones(2), torch.ones(2, dtype=torch.int32)]},
            SchemaError,
            r"sample 1 of field 'x' .* has dtype int32; sample 0 has float32",
            id="jagged-dtype",
        ),
        pytest.param(
            {"x": [torch.ones(2), torch.ones(2, 2)]},
            SchemaError,
            r"sample 1 of field 'x' .* has 2 dimensions",
            id="jagged-ndim",
        ),
        pytest.param({"x": torch.tensor(1.0)}, SchemaError, r"0-d tensor", id="0d-field"),
        pytest.param({"x": []}, InvalidArgumentError, r"has no samples", id="empty"),
        pytest.param({}, InvalidArgumentError, r"has no fields", id="no-fields"),
    ],
)
def test_bad_input_names_field_sample_and_type(data, err, match):
    with pytest.raises(err, match=match):
        enc(data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where pinned memory is refused")
def test_refused_pinned_memory_falls_back_to_pageable_copies_and_says_so_once(monkeypatch, caplog):
    """Pinned memory is refused for real here (no CUDA). ``_from_cuda`` is what ``put`` calls
    for CUDA tensors; on a CPU tensor it exercises the same refusal and fallback."""
    from tqueue.client import _encode

    monkeypatch.setattr(_encode, "_unpinned", False)
    out = _encode.Encoded(count=0, blocks=[], buffers=[])
    src = torch.arange(12).reshape(3, 4).t()  # not contiguous
    with caplog.at_level("WARNING", logger="tqueue.client._encode"):
        first = _encode._from_cuda(src, out)
        second = _encode._from_cuda(src * 2, out)
    assert torch.equal(first, src) and torch.equal(second, src * 2)
    assert first.is_contiguous() and not out.cuda_devices
    warned = [r for r in caplog.records if "no pinned host memory" in r.getMessage()]
    assert len(warned) == 1


def test_a_field_left_on_its_device_materializes_into_the_frames_an_eager_encode_makes(monkeypatch):
    """``encode(defer_device=True)`` leaves a dense CUDA field's bytes on the device (frames
    and ``whole`` None) until ``materialize()``, which must produce the very frames an eager
    encode would. Run on CPU: the device is a CPU tensor and its copy to pinned memory a clone
    (CUDA itself: tests/client/test_cuda.py)."""
    from tqueue.client import _encode

    g = torch.Generator().manual_seed(2)
    data = {"a": torch.randn(10, 1000, generator=g), "s": [f"x{i}" for i in range(10)],
            "b": torch.randint(0, 1 << 40, (10, 300), generator=g)[:, ::3]}
    eager = encode(data, partition="p", chunk_bytes=12_000)
    later = _encode.Encoded(count=10, blocks=[], buffers=[], defer_device=True)
    for name, value in data.items():
        ctx = _encode._Ctx("p", name)
        if isinstance(value, torch.Tensor):
            _encode._dense_on_device(value, ctx, 12_000, later)
        else:
            _encode._encode_field(value, ctx, 12_000, later)
    assert set(later.on_device) == {0, 2} and later.whole[0] is None and later.buffers[0] is None
    assert (later.nbytes, [b.counts for b in later.blocks]) == (eager.nbytes, [b.counts for b in eager.blocks])
    monkeypatch.setattr(_encode, "_from_cuda", lambda t, out: t.clone())
    later.materialize()
    assert not later.on_device
    assert [bytes(f) for f in later.buffers] == [bytes(f) for f in eager.buffers]
    assert [bytes(w) if w is not None else None for w in later.whole] == [bytes(w) if w is not None else None for w in eager.whole]
    later.materialize()  # nothing left to do


def samples(out):
    """The per-sample values of an encoded object field, decoded as a reader decodes them."""
    block, raw = out.blocks[0], b"".join(bytes(b) for b in out.buffers)
    ends = np.cumsum([0, *block.sizes]).tolist()
    return [_DECODER.decode(raw[a:b]) for a, b in zip(ends[:-1], ends[1:])]


def same(a, b):
    """Equal values of the same types, tensors and arrays bit for bit, dtype and shape."""
    if isinstance(a, torch.Tensor):
        return (
            type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def nested_values():
    g = torch.Generator().manual_seed(0)
    return [
        {"pixel_values": torch.randn(4, 6, generator=g).t(), "image_grid_thw": torch.tensor([[1, 2, 3]])},
        None,  # a text-only sample
        [[0, 1], [2, 3, 4], torch.arange(3, dtype=torch.int8)],
        {
            "bf16": torch.randn(3, generator=g).to(torch.bfloat16),
            "fp8": torch.randn(2, 2, generator=g).to(torch.float8_e4m3fn),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 5, dtype=torch.float16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "np": np.arange(6, dtype=">f4").reshape(2, 3)[:, ::2],  # not contiguous, big-endian
            "np_empty": np.zeros((0,), np.int16),
            7: ["text", b"\x00", 1.5, True, None],
        },
        torch.arange(5),  # a tensor as the whole value
    ]


def test_nested_values_with_tensor_leaves_round_trip_exactly():
    values = nested_values()
    out = enc({"mm": values})
    assert out.blocks[0].spec.kind == "object" and len(out.blocks[0].sizes) == len(values)
    got = samples(out)
    assert all(same(v, g) for v, g in zip(values, got)), got
    # leaves are copies: contiguous, writable, no longer tied to the bytes they came from
    pv = got[0]["pixel_values"]
    assert pv.is_contiguous() and pv.shape == (6, 4)
    pv[0, 0] = 1.0
    assert got[3]["np"].flags.writeable and got[3]["np"].flags.c_contiguous


def test_plain_values_keep_their_encoding():
    import msgspec

    values = ["a", {"k": [1, 2.5, None, True, b"\x00"]}, 7, None]
    out = enc({"s": values})
    assert b"".join(bytes(b) for b in out.buffers) == b"".join(msgspec.msgpack.encode(v) for v in values)


def test_a_nested_value_counts_its_leaf_bytes():
    big = torch.zeros(1000, dtype=torch.float32)
    out = enc({"mm": [{"x": big}, None]})
    assert out.blocks[0].sizes[0] > big.nbytes and out.nbytes == sum(out.blocks[0].sizes)
    assert out.copied == big.nbytes + sum(out.blocks[0].sizes)  # into its extension, then the sample's bytes
    strided = enc({"mm": [{"x": torch.zeros(1000, 2)[:, 0]}]})
    assert strided.copied == 2 * big.nbytes + sum(strided.blocks[0].sizes)  # made contiguous first


def deep(levels):
    v = torch.ones(1)
    for _ in range(levels):
        v = [v]
    return v


def test_depth_limit_is_inclusive():
    assert same(samples(enc({"d": [deep(MAX_DEPTH)]}))[0], deep(MAX_DEPTH))


@pytest.mark.parametrize(
    "value, match",
    [
        pytest.param(
            deep(MAX_DEPTH + 1),
            rf"sample 1 of field 'f' of partition 'p' nests lists and dicts deeper than {MAX_DEPTH} at (\[0\]){{8}};",
            id="too-deep",
        ),
        pytest.param(
            {"pixel_values": [torch.ones(1), torch.ones(1), object()]},
            r"sample 1 of field 'f' .* type builtins.object at \['pixel_values'\]\[2\]",
            id="custom-object",
        ),
        pytest.param({"t": torch.ones(1), "c": (1, 2)}, r"type builtins.tuple at \['c'\]", id="tuple"),
        pytest.param({"t": torch.ones(1), (1,): 2}, r"key of type builtins.tuple; dict keys", id="key"),
        pytest.param(
            {"s": torch.ones(2).to_sparse()}, r"sample 1 .* tensor of dtype .* layout torch.sparse_coo at \['s'\]",
            id="sparse",
        ),
        pytest.param(
            {"o": np.array([{}], dtype=object)}, r"numpy array of dtype object at \['o'\]", id="object-array"
        ),
    ],
)
def test_bad_nested_values_name_field_sample_and_path(value, match):
    with pytest.raises(FieldTypeError, match=match):
        enc({"f": [None, value]})


def plain_deep(levels, inner=1):
    v = inner
    for _ in range(levels):
        v = [v] if levels % 2 else {"k": v}
    return v


def test_plain_values_nest_up_to_the_documented_depth_and_no_further():
    """A value nested 10,000 deep is a FieldTypeError naming the field and sample, not a
    RecursionError; MAX_NESTING itself round-trips."""
    assert samples(enc({"d": [plain_deep(MAX_NESTING)]}))[0] == plain_deep(MAX_NESTING)
    for levels in (MAX_NESTING + 1, 10_000):
        with pytest.raises(FieldTypeError, match=rf"sample 1 of field 'f' of partition 'p': .* deeper than {MAX_NESTING}"):
            enc({"f": [None, plain_deep(levels)]})


def test_a_value_too_deep_to_decode_is_a_protocol_error_naming_its_position():
    """What a hostile producer could store (raw MessagePack 10,000 arrays deep): the reader
    names the batch position, it does not raise RecursionError."""
    from tqueue.client._assemble import Pieces, _one_by_one
    from tqueue.wire import FieldSpec

    raw = np.frombuffer(b"\x91" * 10_000 + b"\xc0", dtype=np.uint8)
    p = Pieces(spec=FieldSpec(kind="object", layout="jagged"), positions=np.array([3]), buffers=[raw],
               buffer_of=np.array([0]), offsets=np.array([0]), sizes=np.array([raw.nbytes]), shapes=None, counts=[(0, 1)])
    with pytest.raises(ProtocolError, match="batch position 3 nests lists and maps too deep"):
        _one_by_one(p, [3], 0, 1)


def leaf_bytes(dtype, shape, raw, code=EXT_TENSOR):
    import msgspec

    head = msgspec.msgpack.encode([dtype, shape])
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, LEAF_HEAD.pack(len(head)) + head + raw))


@pytest.mark.parametrize(
    "sample, match",
    [
        pytest.param(leaf_bytes("float32", [4], b"\x00" * 8), r"float32 leaf of shape \[4\] is 16 bytes; 8 arrived", id="short"),
        pytest.param(leaf_bytes("float32", [1], b"\x00" * 8), r"is 4 bytes; 8 arrived", id="long"),
        pytest.param(leaf_bytes("int8", [1 << 40, 1 << 40], b""), r"is 1208925819614629174706176 bytes; 0", id="huge"),
        pytest.param(leaf_bytes("int8", [0, 1 << 63], b""), r"no such shape", id="huge-empty"),
        pytest.param(leaf_bytes("int8", [-1], b""), r"no such shape", id="negative"),
        pytest.param(leaf_bytes("int8", [1] * 65, b"\x00"), r"no such shape", id="too-many-dims"),
        pytest.param(leaf_bytes("float99", [1], b"\x00"), r"unknown torch dtype 'float99'", id="dtype"),
        pytest.param(leaf_bytes("O", [1], b"\x00" * 8, code=2), r"numpy dtype 'O' cannot travel", id="numpy-object"),
        pytest.param(leaf_bytes("int8", [1], b"\x00", code=9), r"unknown MessagePack extension type 9", id="code"),
        pytest.param(b"\xd4\x01\x07", r"has no header", id="no-header"),
        pytest.param(b"\xd5\x01\xff\x00", r"header of 255 bytes overruns", id="header-overrun"),
        pytest.param(b"\xd6\x01\x02\x00\xc1\xc1", r"not \[dtype, shape\]", id="header-garbage"),
    ],
)
def test_a_hostile_leaf_is_a_protocol_error_before_any_allocation(sample, match):
    with pytest.raises(ProtocolError, match=match):
        _DECODER.decode(sample)


def test_a_batch_with_a_hostile_leaf_names_its_position():
    """Assembly decodes a run of samples in one call; a bad leaf among them is then named
    by the batch position of its sample."""
    from tqueue._memory import BufferPool
    from tqueue.client._ask import Options
    from tqueue.client._assemble import Part, assemble_field
    from tqueue.wire import BatchMeta

    out = enc({"mm": [None, {"t": torch.ones(2)}, "x"]})
    block = out.blocks[0]
    raw = bytearray(b"".join(bytes(b) for b in out.buffers))
    bad = raw[: block.sizes[0] + block.sizes[1]].rfind(torch.ones(2).numpy().tobytes())
    raw[bad - 1] ^= 0x7F  # the shape entry of the leaf's header: its bytes no longer agree
    block.counts = [3]
    meta = BatchMeta(partition="p", partition_uid=1, indexes=[0, 1, 2], units=[0, 0, 0], fields=["mm"],
                     schema={"mm": block.spec})
    part = Part(positions=np.arange(3), blocks={"mm": (block, [np.frombuffer(raw, np.uint8)])})
    with pytest.raises(ProtocolError, match=r"object value for batch position 1: a float32 leaf of shape \[125\] is 500 bytes; 8 arrived"):
        assemble_field(meta, "mm", [part], Options(), BufferPool(0))
