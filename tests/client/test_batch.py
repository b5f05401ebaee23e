"""How a batch presents its fields: stacking, jagged modes, stable types, assembly order."""

from __future__ import annotations

import pytest
import torch

from tqueue.errors import InvalidArgumentError, UnknownFieldError


@pytest.fixture
def jagged_meta(any_client, partition):
    any_client.put(partition, {"ids": [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])], "n": torch.arange(3)})
    return any_client.get_meta(partition, ["ids", "n"], 3, task="t", timeout=10)


def test_jagged_as_list_are_zero_copy_views(any_client, jagged_meta):
    before = any_client.stats.copied_bytes
    batch = any_client.get_data(jagged_meta)
    assert [t.tolist() for t in batch["ids"]] == [[1, 2, 3], [4], [5, 6]]
    assert batch.lengths("ids").tolist() == [3, 1, 2]
    assert any_client.stats.copied_bytes == before  # views of the received frames


@pytest.mark.parametrize(
    "side, want",
    [
        pytest.param("right", [[1, 2, 3], [4, -1, -1], [5, 6, -1]], id="right"),
        pytest.param("left", [[1, 2, 3], [-1, -1, 4], [-1, 5, 6]], id="left"),
    ],
)
def test_jagged_padded(any_client, jagged_meta, side, want):
    batch = any_client.get_data(jagged_meta, jagged="padded", pad_value=-1, padding_side=side)
    assert batch["ids"].tolist() == want
    assert batch.lengths("ids").tolist() == [3, 1, 2]


def test_jagged_nested(any_client, jagged_meta):
    batch = any_client.get_data(jagged_meta, jagged={"ids": "nested"})
    nt = batch["ids"]
    assert nt.is_nested and nt.layout == torch.jagged
    assert [t.tolist() for t in nt.unbind()] == [[1, 2, 3], [4], [5, 6]]


def test_padded_multi_dim_samples(any_client, partition):
    any_client.put(partition, {"img": [torch.ones(2, 3), torch.full((1, 3), 2.0)]})
    m = any_client.get_meta(partition, ["img"], 2, task="t", timeout=10)
    out = any_client.get_data(m, jagged="padded")["img"]
    assert out.shape == (2, 2, 3)
    assert out[1].tolist() == [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]


def test_padding_refuses_samples_ragged_beyond_dim0(any_client, partition):
    any_client.put(partition, {"img": [torch.ones(2, 3), torch.ones(2, 4)]})
    m = any_client.get_meta(partition, ["img"], 2, task="t", timeout=10)
    with pytest.raises(InvalidArgumentError, match=r"field 'img': samples differ beyond their first dimension"):
        any_client.get_data(m, jagged="padded")
    assert [tuple(t.shape) for t in any_client.get_data(m)["img"]] == [(2, 3), (2, 4)]


def test_jagged_field_stays_jagged_when_a_batch_is_uniform(any_client, partition):
    any_client.put(partition, {"resp": [torch.ones(4), torch.ones(4)]})
    batch = any_client.get_data(partition, ["resp"], 2, task="t", timeout=10)
    assert isinstance(batch["resp"], list)


def test_dense_field_stays_dense_when_written_as_list(any_client, partition):
    any_client.put(partition, {"x": torch.zeros(2, 3)})
    any_client.put(partition, {"x": [torch.ones(3), torch.ones(3)]})  # matches the dense shape
    batch = any_client.get_data(partition, ["x"], 4, task="t", timeout=10)
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape == (4, 3)
    assert batch["x"].sum().item() == 6.0


def test_batch_follows_meta_order_across_units(any_client, partition):
    """Samples held by two units interleave in the meta; the batch keeps meta order."""
    units: set[int] = set()
    puts = 0
    while len(units) < 2:  # least-loaded placement alternates once loads cross
        assert puts < 64, "puts never reached a second unit"
        m = any_client.put(partition, {"x": torch.arange(puts * 100, puts * 100 + 4), "pad": torch.zeros(4, 1 << 18)})
        units.update(m.units)
        puts += 1
    meta = any_client.get_meta(partition, ["x"], 4 * puts, task="t", timeout=10)
    assert len(set(meta.units)) == 2  # every sample: some on each unit
    order = [int(i) for i in torch.randperm(len(meta), generator=torch.Generator().manual_seed(0))]
    shuffled = type(meta)(
        partition=meta.partition,
        partition_uid=meta.partition_uid,
        indexes=[meta.indexes[i] for i in order],
        units=[meta.units[i] for i in order],
        fields=meta.fields,
        schema=meta.schema,
        task=meta.task,
        lease=meta.lease,
    )
    want = any_client.get_data(meta, ["x"])["x"]
    got = any_client.get_data(shuffled, ["x"])["x"]
    assert got.tolist() == [want[i].item() for i in order]


def test_whole_batch_from_one_frame_is_not_copied(any_client, partition):
    x = torch.arange(1000) * (1 << 40)  # int64 values that no narrower type holds
    any_client.put(partition, {"x": x})
    before = any_client.stats.copied_bytes
    batch = any_client.get_data(partition, ["x"], 1000, task="t", timeout=10)
    assert torch.equal(batch["x"], x)
    assert any_client.stats.copied_bytes == before


def test_batch_is_a_read_only_mapping(any_client, jagged_meta):
    batch = any_client.get_data(jagged_meta)
    assert set(batch) == {"ids", "n"} and len(batch) == 2 and batch.size == 3
    with pytest.raises(TypeError):
        batch["n"] = 1  # type: ignore[index]
    assert "Batch(partition=" in repr(batch)


def test_fields_outside_the_schema_are_refused(any_client, jagged_meta):
    with pytest.raises(UnknownFieldError, match=r"field 'nope' is not in the schema .* known: \['ids', 'n'\]"):
        any_client.get_data(jagged_meta, ["nope"])


def test_to_tensordict(any_client, partition):
    pytest.importorskip("tensordict")
    any_client.put(partition, {"x": torch.ones(2, 3), "ids": [torch.ones(2), torch.ones(5)], "s": ["a", "b"]})
    td = any_client.get_data(partition, ["x", "ids", "s"], 2, task="t", timeout=10).to_tensordict()
    assert td.batch_size == torch.Size([2])
    assert td["x"].shape == (2, 3)
    assert td["ids"].is_nested
    assert list(td["s"]) == ["a", "b"] and td[1]["s"] == "b"
