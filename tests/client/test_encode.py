"""Encoding of put data, without a cluster: what is accepted, and the errors for the rest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tqueue.client._encode import OWN_FRAME, encode
from tqueue.errors import FieldTypeError, InvalidArgumentError, SchemaError

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
            {"mixed": [torch.ones(2), "x"]},
            FieldTypeError,
            r"sample 0 of field 'mixed' .* torch.Tensor.*field of their own",
            id="tensor-among-values",
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
