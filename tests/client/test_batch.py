"""How a batch presents its fields: stacking, jagged modes, stable types, assembly order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tqueue.errors import InvalidArgumentError, UnknownFieldError

# Servers of this module's own, served in this process (tests/conftest.py): a test puts until
# placement reaches the second unit, which takes a bounded number of puts only where the
# units' loads are the module's own.
OWN_CLUSTER = True


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
    any_client.put(partition, {"x": torch.ones(2, 3), "ids": [torch.ones(2), torch.ones(5)], "s": ["a", "b"],
                               "mm": [torch.ones(2), None]})  # a nested value (a tensor) beside None
    td = any_client.get_data(partition, ["x", "ids", "s", "mm"], 2, task="t", timeout=10).to_tensordict()
    assert td.batch_size == torch.Size([2])
    assert td["x"].shape == (2, 3)
    assert td["ids"].is_nested
    assert list(td["s"]) == ["a", "b"] and td[1]["s"] == "b"
    assert torch.equal(td[0]["mm"], torch.ones(2)) and td[1]["mm"] is None


# micro-batches shaped for the trainer: padded per micro-batch, packed (THD)

LENGTHS = [5, 1, 7, 3, 2, 8, 4, 6]


def sample(index: int) -> torch.Tensor:
    return torch.arange(LENGTHS[index]) + 1000 * index


@pytest.fixture
def planned(client, partition):
    """One rank's share of 8 samples (sample i: 1000 i, 1000 i + 1, ...), cut by the
    controller into micro-batches of at most 12 tokens."""
    client.put(partition, {"ids": [sample(i) for i in range(8)], "n": torch.tensor(LENGTHS),
                           "tag": [f"s{i}" for i in range(8)]})
    meta = client.get_meta(partition, ["ids", "n", "tag"], 8, task="t", dp_rank=0, dp_size=1,
                           max_tokens_per_micro_batch=12, timeout=10)
    assert meta.num_microbatches >= 3
    return meta


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@pytest.mark.parametrize("multiple", [1, 4], ids=lambda m: f"multiple{m}")
def test_each_micro_batch_is_padded_to_its_own_longest_sample(client, planned, multiple):
    batch = client.get_data(planned)
    mbs = batch.micro_batches(pad_to_multiple_of=multiple, pad_value=-1)
    assert [mb.positions for mb in mbs] == planned.micro_batch_indices
    cells = 0
    for mb, rows in zip(mbs, planned.micro_batch_indices):
        indexes = [planned.indexes[p] for p in rows]
        lens = [LENGTHS[i] for i in indexes]
        width = ceil_to(max(lens), multiple)
        assert mb.form == "padded" and mb.size == len(rows) and mb.meta.indexes == indexes
        assert mb["ids"].shape == (len(rows), width) and mb["ids"].dtype == torch.int64
        for row, i in zip(mb["ids"], indexes):
            assert row.tolist() == sample(i).tolist() + [-1] * (width - LENGTHS[i])
        assert mb.lengths().tolist() == mb.lengths("ids").tolist() == lens
        assert mb.attention_mask().tolist() == [[c < n for c in range(width)] for n in lens]
        assert mb.position_ids().tolist() == [list(range(width))] * len(rows)
        assert mb["n"].tolist() == lens and mb["tag"] == [f"s{i}" for i in indexes]
        assert mb.max_seqlen() == width
        cells += mb["ids"].numel()
    if multiple == 1:  # 54 cells here, where the share padded to its longest sample has 64
        assert cells < len(LENGTHS) * max(LENGTHS)


def test_left_padding_per_micro_batch(client, planned):
    mbs = client.get_data(planned).micro_batches(["ids"], padding_side="left", pad_to_multiple_of=4)
    for mb in mbs:
        width = mb["ids"].shape[1]
        for row, mask, pos, i in zip(mb["ids"], mb.attention_mask(), mb.position_ids(), mb.meta.indexes):
            pad = width - LENGTHS[i]
            assert row.tolist() == [0] * pad + sample(i).tolist()
            assert mask.tolist() == [False] * pad + [True] * LENGTHS[i]
            assert pos.tolist() == [0] * pad + list(range(LENGTHS[i]))
        assert list(mb) == ["ids"]


@pytest.mark.parametrize("multiple", [1, 4], ids=lambda m: f"multiple{m}")
def test_packed_micro_batches_carry_cu_seqlens_and_restarting_positions(client, planned, multiple):
    batch = client.get_data(planned)
    for mb in batch.micro_batches(form="packed", pad_to_multiple_of=multiple):
        lens = [LENGTHS[i] for i in mb.meta.indexes]
        taken = [ceil_to(n, multiple) for n in lens]
        want = torch.cat([torch.cat([sample(i), torch.zeros(t - n, dtype=torch.int64)])
                          for i, n, t in zip(mb.meta.indexes, lens, taken)])
        assert torch.equal(mb["ids"], want)
        cu = mb.cu_seqlens()
        assert cu.dtype == torch.int32 and cu.tolist() == np.cumsum([0, *lens]).tolist()
        assert mb.cu_seqlens_padded().dtype == torch.int32
        assert mb.cu_seqlens_padded().tolist() == np.cumsum([0, *taken]).tolist()
        assert mb.position_ids().tolist() == [p for t in taken for p in range(t)]
        assert mb.max_seqlen() == max(taken)
        kwargs = mb.packed_seq_kwargs()
        assert kwargs["qkv_format"] == "thd" and kwargs["max_seqlen_q"] == kwargs["max_seqlen_kv"] == max(taken)
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert torch.equal(kwargs[name], mb.cu_seqlens_padded())  # the offsets, as verl passes them
        real = mb.packed_seq_kwargs(real_lengths=True)
        assert torch.equal(real["cu_seqlens_q"], cu) and torch.equal(real["cu_seqlens_kv"], cu)
        assert torch.equal(real["cu_seqlens_q_padded"], mb.cu_seqlens_padded())


def test_a_whole_batch_packs_into_one_micro_batch_by_hand(any_client, jagged_meta):
    """No plan (a plain get_meta): the batch is one micro-batch. Samples [1, 2, 3], [4], [5, 6],
    each padded to a multiple of 2."""
    [mb] = any_client.get_data(jagged_meta).micro_batches(form="packed", pad_to_multiple_of=2)
    assert mb["ids"].tolist() == [1, 2, 3, 0, 4, 0, 5, 6]
    assert mb.cu_seqlens().tolist() == [0, 3, 4, 6]
    assert mb.cu_seqlens_padded().tolist() == [0, 4, 6, 8]
    assert mb.position_ids().tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
    assert mb.max_seqlen() == 4 and mb["n"].tolist() == [0, 1, 2]
    assert [t.tolist() for t in mb.unpad("ids")] == [[1, 2, 3], [4], [5, 6]]


@pytest.mark.parametrize("form", ["padded", "packed"])
@pytest.mark.parametrize("fetched", ["list", "padded-right", "padded-left", "nested"])
@pytest.mark.parametrize("multiple", [1, 3, 8], ids=lambda m: f"multiple{m}")
def test_every_sample_comes_back_exact_after_unpadding_or_unpacking(client, partition, form, fetched, multiple):
    """Random lengths (empty samples too), rows of 3 floats, an int field beside: however the
    share was fetched and shaped, each sample's rows come back bit for bit."""
    rng = np.random.default_rng(multiple)
    lengths = rng.integers(0, 40, 32).tolist()
    rows = [torch.from_numpy(rng.standard_normal((n, 3)).astype(np.float32)) for n in lengths]
    ids = [torch.from_numpy(rng.integers(0, 1 << 20, n)) for n in lengths]
    client.put(partition, {"rows": rows, "ids": ids, "k": torch.arange(32)})
    meta = client.get_meta(partition, ["rows", "ids", "k"], 16, task="t", dp_rank=0, dp_size=2, round=0,
                           max_tokens_per_micro_batch=64, timeout=10)
    jagged, side = (fetched.split("-") + ["right"])[:2]
    batch = client.get_data(meta, jagged=jagged, padding_side=side, pad_value=7)
    mbs = batch.micro_batches(form=form, pad_to_multiple_of=multiple, pad_value={"rows": float("nan"), "ids": -1})
    assert len(mbs) == meta.num_microbatches
    seen = []
    for mb in mbs:
        for name, originals in (("rows", rows), ("ids", ids)):
            got = mb.unpad(name)
            assert len(got) == mb.size
            for value, i in zip(got, mb.meta.indexes):
                assert value.dtype == originals[i].dtype and torch.equal(value, originals[i])
        assert mb["k"].tolist() == mb.meta.indexes
        if form == "packed":
            assert mb["rows"].shape == (mb.cu_seqlens_padded()[-1].item(), 3)
            assert all(t % multiple == 0 for t in mb.cu_seqlens_padded().diff().tolist())
        else:
            assert mb["rows"].shape[1] % multiple == 0
        seen += mb.meta.indexes
    assert sorted(seen) == sorted(meta.indexes)


def test_fields_of_different_lengths_are_named(client, partition):
    client.put(partition, {"prompt_ids": [torch.ones(4), torch.ones(2)], "response_ids": [torch.ones(3), torch.ones(5)]})
    [mb] = client.get_data(partition, ["prompt_ids", "response_ids"], 2, task="t", timeout=10).micro_batches()
    with pytest.raises(InvalidArgumentError, match=r"fields 'prompt_ids' and 'response_ids' differ in length.*name the field"):
        mb.lengths()
    assert mb.lengths("prompt_ids").tolist() == [4, 2] and mb.lengths("response_ids").tolist() == [3, 5]
    assert mb["prompt_ids"].shape == (2, 4) and mb["response_ids"].shape == (2, 5)
    with pytest.raises(InvalidArgumentError, match=r"cu_seqlens|attention_mask is for form='padded'"):
        client.get_data(partition, ["prompt_ids"], 2, task="u", timeout=10).micro_batches(form="packed")[0].attention_mask()
    with pytest.raises(InvalidArgumentError, match=r"field 'prompt' is not a jagged field.*did you mean 'prompt_ids'"):
        mb.lengths("prompt")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(form="thd"), InvalidArgumentError, r"form is one of \['padded', 'packed'\], got 'thd'"),
        (dict(pad_to_multiple_of=0), InvalidArgumentError, r"pad_to_multiple_of must be an integer >= 1, got 0"),
        (dict(form="packed", padding_side="left"), InvalidArgumentError, r"padding_side='left' is for form='padded'"),
        (dict(fields=["idz"]), UnknownFieldError, r"field 'idz' is not in this batch; did you mean 'ids'"),
    ],
    ids=["form", "multiple", "packed-left", "unknown-field"],
)
def test_micro_batch_options_are_checked(any_client, jagged_meta, kwargs, error, match):
    with pytest.raises(error, match=match):
        any_client.get_data(jagged_meta).micro_batches(**kwargs)


def test_a_short_last_round_fills_fixed_micro_batches_with_pad_rows(client, partition):
    """6 samples left in a sealed partition, 2 ranks of 4, micro-batches of exactly 2: two pad
    rows (index -1) fill the round; in a micro-batch they are samples of length 0."""
    client.put(partition, {"ids": [torch.arange(n) for n in (3, 5, 2, 6, 4, 1)]})
    client.seal(partition)
    metas = [client.get_meta(partition, ["ids"], 4, task="t", dp_rank=r, dp_size=2, round=0, micro_batch_size=2,
                             pad=True, timeout=10) for r in range(2)]
    assert sum(m.pads for m in metas) == 2
    for meta in metas:
        assert meta.num_microbatches == 2 and [len(mb) for mb in meta.micro_batch_indices] == [2, 2]
        for mb in client.get_data(meta).micro_batches(form="packed"):
            assert mb.size == 2
            assert mb.lengths().tolist() == [0 if i < 0 else [3, 5, 2, 6, 4, 1][i] for i in mb.meta.indexes]
            assert mb.is_pad.tolist() == [i < 0 for i in mb.meta.indexes]


def test_an_object_field_of_0d_tensors_stays_a_list_in_micro_batches():
    """Nested values may be bare tensors; a micro-batch keeps an object field's values as
    they are, where a jagged field of scalars is stacked."""
    from tqueue.client._batch import Batch
    from tqueue.wire import BatchMeta, FieldSpec

    schema = {"mm": FieldSpec(kind="object", layout="jagged"), "j": FieldSpec(kind="tensor", dtype="float32", layout="jagged")}
    meta = BatchMeta(partition="p", partition_uid=0, indexes=[0, 1], units=[0, 0], fields=["mm", "j"], schema=schema)
    scalars = [torch.tensor(1.0), torch.tensor(2.0)]
    (mb,) = Batch(meta, {"mm": scalars, "j": scalars}, {}).micro_batches()
    assert isinstance(mb["mm"], list) and mb["mm"][1] is scalars[1]
    assert torch.equal(mb["j"], torch.tensor([1.0, 2.0]))
