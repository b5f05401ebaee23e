"""Every kind of field through a real cluster (controller and units in their own processes),
back bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.client.test_encode import nested_values, same
from tqueue.client._encode import TORCH_DTYPES
from tqueue.wire._layout import TORCH_ITEMSIZE

# Servers of this module's own, served in this process (tests/conftest.py): a test puts until
# placement reaches the second unit, which takes a bounded number of puts only where the
# units' loads are the module's own.
OWN_CLUSTER = True

# float4 packs two values in a byte and has no constructors worth testing with.
DTYPES = [
    pytest.param(
        name,
        id=name,
        # torch warns that complex32 support is experimental whenever one is made
        marks=[pytest.mark.filterwarnings("ignore:ComplexHalf")] if name == "complex32" else [],
    )
    for name in TORCH_DTYPES
    if name != "float4_e2m1fn_x2"
]


def random_tensor(shape, dtype_name, seed=0):
    """Random bytes reinterpreted as the dtype: every bit pattern, NaNs included."""
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype_name]
    item = TORCH_ITEMSIZE[dtype_name]
    n = int(np.prod(shape)) * item
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dt is torch.bool:
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def roundtrip(client, partition, data, fields=None, **opts):
    meta = client.put(partition, data)
    fields = fields or list(meta.fields)
    got = client.get_meta(partition, fields, len(meta), task="check", timeout=10)
    return client.get_data(got, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_dense_and_jagged_bit_exact(any_client, partition, dtype):
    dense = random_tensor((5, 3, 2), dtype, seed=1)
    jagged = [random_tensor((k, 2), dtype, seed=k) for k in (0, 1, 4, 2, 3)]
    batch = roundtrip(any_client, partition, {"d": dense, "j": jagged})
    assert same_bits(batch["d"], dense)
    assert isinstance(batch["j"], list) and len(batch["j"]) == 5
    for got, want in zip(batch["j"], jagged):
        assert same_bits(got, want)


def test_zero_size_and_0d_samples(any_client, partition):
    data = {
        "empty_rows": torch.zeros(3, 0, dtype=torch.float16),
        "scalars": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),  # 0-d per sample
        "jagged_scalars": [torch.tensor(i, dtype=torch.int8) for i in range(3)],
        "jagged_empty": [torch.zeros(0, 4), torch.zeros(0, 4), torch.ones(1, 4)],
    }
    batch = roundtrip(any_client, partition, data)
    assert batch["empty_rows"].shape == (3, 0) and batch["empty_rows"].dtype == torch.float16
    assert same_bits(batch["scalars"], data["scalars"])
    assert [t.shape for t in batch["jagged_scalars"]] == [torch.Size([])] * 3
    assert [int(t) for t in batch["jagged_scalars"]] == [0, 1, 2]
    assert [tuple(t.shape) for t in batch["jagged_empty"]] == [(0, 4), (0, 4), (1, 4)]


def test_non_contiguous_inputs(any_client, partition):
    base = torch.arange(60, dtype=torch.int32).reshape(6, 10)
    data = {"t": base.t()[:, ::2][:6], "j": [base[i, ::3] for i in range(6)]}
    assert not data["t"].is_contiguous() and not data["j"][0].is_contiguous()
    batch = roundtrip(any_client, partition, data)
    assert torch.equal(batch["t"], data["t"])
    assert all(torch.equal(a, b) for a, b in zip(batch["j"], data["j"]))


def test_numpy_fields_come_back_as_numpy(any_client, partition):
    dense = np.arange(12, dtype=">f8").reshape(4, 3)  # big-endian survives as such
    jagged = [np.arange(k, dtype=np.uint16) for k in (1, 3, 0, 2)]
    when = np.array(["2024-01-01", "2025-06-30", "1970-01-01", "2000-02-29"], dtype="datetime64[D]")
    batch = roundtrip(any_client, partition, {"d": dense, "j": jagged, "when": when})
    assert isinstance(batch["d"], np.ndarray) and batch["d"].dtype == dense.dtype
    np.testing.assert_array_equal(batch["d"], dense)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(batch["j"], jagged))
    np.testing.assert_array_equal(batch["when"], when)


def test_object_values(any_client, partition):
    values = ["prompt " * 300, b"\x00\xff", 3, -1.5, True, None, [1, [2, {"a": None}]], {"k": "v", 5: b"x"}]
    batch = roundtrip(any_client, partition, {"v": values})
    assert batch["v"] == values
    assert [type(x) for x in batch["v"]] == [type(x) for x in values]


def test_large_fields_cross_many_frames(any_client, partition):
    n = 64
    dense = random_tensor((n, 40_000), "bfloat16", seed=3)  # 80 kB per sample, > 1 chunk
    jagged = [random_tensor((1000 * (i % 7) + 1,), "float32", seed=i) for i in range(n)]
    batch = roundtrip(any_client, partition, {"d": dense, "j": jagged})
    assert same_bits(batch["d"], dense)
    assert all(same_bits(a, b) for a, b in zip(batch["j"], jagged))


def test_update_adds_and_overwrites_fields(any_client, partition):
    meta = any_client.put(partition, {"x": torch.arange(4), "r": torch.zeros(4)})
    any_client.update(meta, {"r": torch.tensor([1.0, 2.0, 3.0, 4.0]), "note": ["a", "b", "c", "d"]})
    got = any_client.get_meta(partition, ["x", "r", "note"], 4, task="t", timeout=10)
    batch = any_client.get_data(got)
    assert batch["r"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert batch["note"] == ["a", "b", "c", "d"]


def test_update_across_units_keeps_each_sample_on_its_unit(any_client, partition):
    units: set[int] = set()
    n = 0
    while len(units) < 2:  # least-loaded placement alternates once loads cross
        assert n < 20, "puts never reached a second unit"
        meta = any_client.put(partition, {"x": torch.arange(n, n + 3), "pad": torch.zeros(3, 1 << 18)})
        units.update(meta.units)
        n += 3
    both = any_client.get_meta(partition, ["x"], n, task="reward", timeout=10)
    assert len(set(both.units)) == 2
    any_client.update(both, {"r": (torch.tensor(both.indexes) * 10).float()})
    got = any_client.get_data(any_client.get_meta(partition, ["x", "r"], n, task="train", timeout=10), ["x", "r"])
    assert got["r"].tolist() == [float(10 * i) for i in got.meta.indexes]
    assert got["x"].tolist() == got.meta.indexes


def test_nested_values_with_tensor_leaves(any_client, partition):
    """A multimodal field: per sample a dict of tensors, or None for a text-only sample, beside
    ragged lists and numpy leaves; 64 KiB of pixels so the arena client stores it in its arena."""
    values = nested_values()
    values[0]["pixel_values"] = random_tensor((128, 256), "bfloat16", seed=4)
    batch = roundtrip(any_client, partition, {"mm": values, "x": torch.arange(len(values))})
    assert all(same(v, g) for v, g in zip(values, batch["mm"]))
    got = batch["mm"][0]["pixel_values"]
    got.add_(1)  # writable, and a copy: a second read sees the stored values
    again = any_client.get_data(any_client.get_meta(partition, ["mm"], len(values), task="again", timeout=10))
    assert same(values[0]["pixel_values"], again["mm"][0]["pixel_values"])


def test_nested_leaves_count_toward_the_partition_bytes(client, partition):
    client.put(partition, {"mm": [{"pv": torch.zeros(10_000)}, None], "x": torch.arange(2)})
    status = next(p for p in client.status().partitions if p.name == partition)
    assert 40_000 < status.nbytes < 40_000 + 1024
