"""Rows allocated ahead of their data (``allocate``; TransferQueue's ``get_meta(mode="insert")``):
committed samples with no fields and no unit, placed by their first write, filled by updates
in any order and field by field; readers see a row once it holds what they ask for."""

from __future__ import annotations

import msgspec
import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError, WaitTimeoutError

from ..servers import LoopCluster

# Servers of this module's own, served in this process (tests/conftest.py): a test's placement
# ("the other unit, the less loaded one") needs units whose loads are the module's own.
OWN_CLUSTER = True


def part_of(meta: tqueue.BatchMeta, a: int, b: int) -> tqueue.BatchMeta:
    """Samples ``a`` to ``b`` of ``meta``, as the caller kept it (units as they were then)."""
    return msgspec.structs.replace(meta, indexes=meta.indexes[a:b], units=meta.units[a:b])


def rows(values: range) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)[:, None].repeat(1, 3)


def test_rows_are_filled_in_parts_across_units_and_overwritten_where_writes_overlap(any_client, partition):
    """40 rows; the first 20 written, then the last 20 (placed on the other unit, the less
    loaded one), then 10 to 30 overwritten with a new field too: an update that spans both
    units, from the allocation's own meta, whose units say -1 still."""
    c = any_client
    alloc = c.allocate(partition, 40)
    assert alloc.indexes == list(range(40)) and set(alloc.units) == {-1}
    c.update(part_of(alloc, 0, 20), {"x": rows(range(0, 20))})
    c.update(part_of(alloc, 20, 40), {"x": rows(range(20, 40))})
    c.update(part_of(alloc, 10, 30), {"x": rows(range(1010, 1030)), "y": torch.arange(20)})
    every = c.select(partition, ["x"])
    assert every.indexes == list(range(40)) and len(set(every.units)) == 2
    x = c.get_data(every)["x"][:, 0].tolist()
    assert x == [float(v) for v in [*range(10), *range(1010, 1030), *range(30, 40)]]
    both = c.get_data(partition, ["x", "y"], 20, task="t", timeout=10)
    assert sorted(both.meta.indexes) == list(range(10, 30)) and both["y"].tolist() == list(range(20))


def test_a_reader_waits_for_rows_until_they_hold_its_fields(client, partition):
    alloc = client.allocate(partition, 4)
    with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0.2)
    client.update(part_of(alloc, 1, 3), {"x": torch.tensor([1.0, 2.0])})
    meta = client.get_meta(partition, ["x"], 2, task="t", timeout=5)
    assert sorted(meta.indexes) == [1, 2]
    with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0.2)
    assert next(p for p in client.status().partitions if p.name == partition).samples == 4


def test_rows_that_a_partition_cannot_count_are_refused(client, partition):
    client.create_partition(f"{partition}-target", target=8)
    with pytest.raises(InvalidArgumentError, match="has a target or groups"):
        client.allocate(f"{partition}-target", 2)
    client.create_partition(f"{partition}-groups", group_size=4)
    with pytest.raises(InvalidArgumentError, match="has a target or groups"):
        client.allocate(f"{partition}-groups", 4)
    with pytest.raises(InvalidArgumentError, match="count >= 1"):
        client.allocate(partition, 0)
    client.put(partition, {"x": torch.ones(2)})
    client.seal(partition)
    with pytest.raises(InvalidArgumentError, match="is sealed"):
        client.allocate(partition, 1)


def test_a_half_filled_allocation_comes_back_from_a_checkpoint_and_fills_there(partition, tmp_path):
    with LoopCluster(num_storage_units=2) as old, tqueue.Client(old.address) as c:
        alloc = c.allocate(partition, 8)
        c.update(part_of(alloc, 0, 4), {"x": torch.arange(4.0)})
        c.save_checkpoint(str(tmp_path / "ck"))
    with LoopCluster(num_storage_units=3) as new, tqueue.Client(new.address) as c:
        c.load_checkpoint(str(tmp_path / "ck"))
        assert c.select(partition, ["x"]).indexes == [0, 1, 2, 3]
        c.update(part_of(alloc, 4, 8), {"x": torch.arange(4.0, 8.0)})
        assert c.get_data(c.select(partition, ["x"]))["x"].tolist() == [float(i) for i in range(8)]


def test_rows_postponed_before_their_data_move_and_fill_there(client, partition):
    """A postpone moves rows that have no data yet with the rest (nothing to re-key on any
    unit: they are on none); they are filled where they landed. Found by the controller fuzz."""
    alloc = client.allocate(partition, 4)
    client.update(part_of(alloc, 0, 2), {"x": torch.tensor([1.0, 2.0])})
    moved = client.postpone(alloc, f"{partition}-later")
    assert len(moved) == 4 and client.select(f"{partition}-later", ["x"]).indexes == moved.indexes[:2]
    client.update(part_of(moved, 2, 4), {"x": torch.tensor([3.0, 4.0])})
    assert client.get_data(client.select(f"{partition}-later", ["x"]))["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
