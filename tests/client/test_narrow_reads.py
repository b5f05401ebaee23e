"""``get_data(..., dtype={field: torch.uint8})``: integer fields read at a narrower width.
Routed experts stored packed at one byte come back at one byte (on every route without
being widened, their checksums checked as they stand); a value the width cannot hold is refused, naming its field, partition and
sample; non-integer fields and dtypes are refused."""

from __future__ import annotations

import pytest
import torch

import tqueue
from tqueue.client import _assemble

from ..servers import LoopCluster


def _experts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (400 + 9 * i, 4, 2), generator=g, dtype=torch.int32) for i in range(n)]


def test_routed_experts_read_at_one_byte_an_id(any_client: tqueue.Client, partition: str, monkeypatch: pytest.MonkeyPatch) -> None:
    experts = _experts(6)
    dense = torch.randint(0, 200, (6, 16), dtype=torch.int64)
    any_client.put(partition, {"routed_experts": experts, "pos": dense})
    meta = any_client.get_meta(partition, ["routed_experts", "pos"], 6, task="t")
    # held packed (ids under 128: int8) and read as they lie, never widened: on the arena, and
    # over sockets, where their checksums are checked through a small buffer
    monkeypatch.setattr(_assemble, "unpack", lambda *a: pytest.fail("a packed field was widened"))
    batch = any_client.get_data(meta, fields=["routed_experts"], dtype={"routed_experts": torch.uint8})
    monkeypatch.undo()
    batch = any_client.get_data(meta, dtype={"routed_experts": torch.uint8, "pos": torch.uint8})
    at = [i - min(meta.indexes) for i in meta.indexes]
    for got, k in zip(batch["routed_experts"], at):
        assert got.dtype == torch.uint8 and torch.equal(got.to(torch.int32), experts[k])
    assert batch["pos"].dtype == torch.uint8 and torch.equal(batch["pos"].to(torch.int64), dense[at])
    padded = any_client.get_data(meta, fields=["routed_experts"], jagged="padded", dtype={"routed_experts": torch.int16})
    assert padded["routed_experts"].dtype == torch.int16


def test_a_value_too_wide_for_the_asked_dtype_is_refused_by_name(client: tqueue.Client, partition: str) -> None:
    experts = _experts(3, seed=1)
    experts[2][5, 1, 0] = 300
    client.put(partition, {"routed_experts": experts, "pos": torch.tensor([[1], [2], [999]])})
    meta = client.get_meta(partition, ["routed_experts", "pos"], 3, task="t")
    third = meta.indexes[[i - min(meta.indexes) for i in meta.indexes].index(2)]
    with pytest.raises(tqueue.InvalidArgumentError,
                       match=rf"field 'routed_experts' of partition '{partition}': sample {third} holds a value outside uint8"):
        client.get_data(meta, fields=["routed_experts"], dtype={"routed_experts": torch.uint8})
    with pytest.raises(tqueue.InvalidArgumentError, match=rf"field 'pos' of partition '{partition}': sample {third} holds"):
        client.get_data(meta, fields=["pos"], dtype={"pos": torch.int8})
    assert torch.equal(client.get_data(meta, fields=["pos"], dtype={"pos": torch.int16})["pos"].flatten().sort().values,
                       torch.tensor([1, 2, 999], dtype=torch.int16))


def test_dtype_is_for_integer_fields_and_integer_dtypes(client: tqueue.Client, partition: str) -> None:
    client.put(partition, {"reward": torch.rand(2), "ids": torch.arange(4).reshape(2, 2)})
    meta = client.get_meta(partition, ["reward", "ids"], 2, task="t")
    with pytest.raises(tqueue.InvalidArgumentError, match="field 'reward' of partition .* holds float32, not integers"):
        client.get_data(meta, dtype={"reward": torch.int8})
    with pytest.raises(tqueue.InvalidArgumentError, match="dtype= for field 'ids' is torch.float16: an integer dtype"):
        client.get_data(meta, dtype={"ids": torch.float16})


@pytest.mark.parametrize("pack_dense", [False, True])
def test_dense_integer_fields_in_the_arena_are_wide_unless_asked(pack_dense: bool) -> None:
    """The choice docs/api.md states: on the same-host arena a dense integer field stays wide
    (its readers view the pages in place) and a jagged one is held narrow; with
    ``arena_pack_dense`` the dense one is held narrow too. Either way readers get exact values
    in the field's dtype, or at the width they ask."""
    ids = torch.randint(0, 30_000, (8, 512), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(8, 512, dtype=torch.int64)
    experts = _experts(8, seed=3)
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0, arena_pack_dense=pack_dense)
    with LoopCluster(num_storage_units=1) as cluster, tqueue.Client(cluster.address, config=config) as c:
        c.put("p", {"ids": ids, "mask": mask, "routed_experts": experts})
        held = cluster.call(lambda: sum(u.data.nbytes for u in cluster.units))
        narrow_experts = sum(e.numel() for e in experts)  # ids under 128: one byte each
        dense = (ids.numel() * 2 + mask.numel()) if pack_dense else (ids.nbytes + mask.nbytes)  # int16, int8
        assert held == dense + narrow_experts
        meta = c.get_meta("p", ["ids", "mask", "routed_experts"], 8, task="t")
        at = [i - min(meta.indexes) for i in meta.indexes]
        batch = c.get_data(meta)
        assert batch["ids"].dtype == torch.int64 and torch.equal(batch["ids"], ids[at])
        assert torch.equal(batch["mask"], mask[at])
        assert all(torch.equal(batch["routed_experts"][j], experts[k]) for j, k in enumerate(at))
        small = c.get_data(meta, fields=["mask"], dtype={"mask": torch.int8})["mask"]
        assert small.dtype == torch.int8 and torch.equal(small.long(), mask[at])
