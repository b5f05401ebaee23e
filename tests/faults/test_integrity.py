"""Checksums end to end: a bit flipped in a unit's memory (for real, through /proc/PID/mem of
the unit's process) or on the wire is a DataCorruptionError naming partition, sample, field
and unit; the bytes are never served; with copies the reader gets the other copy's exact
bytes, the bad copy is dropped and the sample is copied again; without, it is lost for every
task, counted."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tqueue
from tqueue.client._assemble import Part, unpack
from tqueue.client._integrity import crcs_of, crcs_widened
from tqueue.client._routes import BatchBuffers, InlineRoute
from tqueue.wire import BatchMeta, FieldBlock, FieldSpec

from ._proc import flip_in_memory, until

ROUTES = {
    "inline": tqueue.ClientConfig(shm=False, bulk=False),
    "bulk": tqueue.ClientConfig(shm=False, bulk=True, bulk_put_min_bytes=0),
    "arena": tqueue.ClientConfig(shm=True, arena_checksums=True, shm_min_bytes=0),
}


@pytest.fixture(scope="module")
def pair() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=2) as c:
        yield c


def _unit_pid(cluster: tqueue.LocalCluster, client: tqueue.Client, unit_id: int) -> int:
    """The pid of the unit process with this id (units start after the controller)."""
    (address,) = [u.address for u in client.status().units if u.unit_id == unit_id]
    return cluster.pids[1 + cluster.unit_addresses.index(address)]


def _part(client: tqueue.Client, name: str) -> Any:
    return next(p for p in client.status().partitions if p.name == name)


def _samples(n: int, size: int) -> tuple[torch.Tensor, list[bytes]]:
    """Dense rows and object values, each sample's bytes its own (a marker per sample)."""
    rows = torch.from_numpy(np.frombuffer(os.urandom(n * size), dtype=np.uint8).reshape(n, size).copy())
    values = [os.urandom(size) for _ in range(n)]
    return rows, values


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_bit_flipped_in_a_units_memory_is_reported_and_never_served(pair, partition, route):
    """One copy: the read fails naming the sample, field and unit; the sample is lost for
    the task (consumed + lost == samples), the other samples read back exact."""
    rows, values = _samples(4, 16 << 10)
    with tqueue.Client(pair.address, config=ROUTES[route]) as c:
        c.create_partition(partition, tasks=["train"], copies=1)
        put = c.put(partition, {"x": rows, "obj": values})
        pid = _unit_pid(pair, c, put.units[2])
        assert flip_in_memory(pid, rows[2, :64].numpy().tobytes(), at=100) >= 1
        meta = c.get_meta(partition, ["x", "obj"], batch_size=4, task="train")
        with pytest.raises(
            tqueue.DataCorruptionError,
            match=rf"partition '{partition}': field 'x' of samples \[2\] on storage unit {put.units[2]} fails its CRC-32C",
        ) as info:
            c.get_data(meta)
        assert isinstance(info.value, tqueue.DataLostError)
        assert c.stats.corrupt == 1
        task = _part(c, partition).tasks["train"]
        assert task.lost == 1
        c.ack(meta)
        part = _part(c, partition)
        assert part.tasks["train"].consumed + part.tasks["train"].lost == 4
        assert part.corrupt == 1
        with pytest.raises(tqueue.WaitTimeoutError, match="0 ready for this task"):
            c.get_meta(partition, ["x"], batch_size=1, task="train", timeout=0.2)  # never served again


def test_an_object_value_flipped_in_memory_is_reported(pair, partition):
    rows, values = _samples(3, 16 << 10)
    with tqueue.Client(pair.address, config=ROUTES["inline"]) as c:
        c.create_partition(partition, copies=1)
        put = c.put(partition, {"obj": values})
        assert flip_in_memory(_unit_pid(pair, c, put.units[1]), values[1][:64], at=5000) >= 1
        with pytest.raises(tqueue.DataCorruptionError, match=r"field 'obj' of samples \[1\]"):
            c.get_data(put)
        good = c.get_data(BatchMeta(**{**_as_dict(put), "indexes": [0, 2], "units": [put.units[0], put.units[2]]}))
        assert good["obj"] == [values[0], values[2]]


def _as_dict(meta: BatchMeta) -> dict[str, Any]:
    return {f: getattr(meta, f) for f in meta.__struct_fields__}


def test_with_two_copies_the_reader_gets_the_good_one_and_the_bad_one_is_copied_again(pair, partition):
    rows, values = _samples(4, 16 << 10)
    with tqueue.Client(pair.address, config=ROUTES["inline"]) as c:
        c.create_partition(partition, tasks=["train"], copies=2)
        put = c.put(partition, {"x": rows, "obj": values})
        first = put.units[1]
        assert flip_in_memory(_unit_pid(pair, c, first), rows[1, :64].numpy().tobytes(), at=7) >= 1
        meta = c.get_meta(partition, ["x", "obj"], batch_size=4, task="train")
        batch = c.get_data(meta)
        assert torch.equal(batch["x"], rows) and batch["obj"] == values
        assert c.stats.corrupt == 1
        part = _part(c, partition)
        assert part.corrupt == 1 and part.lost == 0
        until(lambda: _part(c, partition).single == 0, 20, "the sample copied again")
        # the copy made again is good: read from either unit, the bytes are exact
        again = c.get_data(meta)
        assert torch.equal(again["x"], rows)
        c.ack(meta)


class _Flipping(InlineRoute):
    """The inline route with one bit of each fetched frame flipped as it arrives: the wire."""

    async def fetch(self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str], rows: BatchBuffers) -> Part:
        part = await super().fetch(meta, positions, indexes, fields, rows)
        for name, (block, frames) in part.blocks.items():
            part.blocks[name] = (block, [_flipped(f) for f in frames])
        return part


def _flipped(frame: Any) -> bytearray:
    out = bytearray(memoryview(frame.buffer if hasattr(frame, "buffer") else frame))
    if out:
        out[len(out) // 2] ^= 0x10
    return out


def test_a_bit_flipped_on_the_wire_is_reported(pair, partition):
    with tqueue.Client(pair.address, config=ROUTES["inline"]) as c:
        c.create_partition(partition, copies=1)
        conns = c._inner._conns
        conns.choose = lambda info: _Flipping(info, conns.connect_unit(info))
        put = c.put(partition, {"ids": torch.arange(64, dtype=torch.int64).reshape(4, 16) * 1000})
        with pytest.raises(tqueue.DataCorruptionError, match=r"field 'ids' of samples \[\d\]"):
            c.get_data(put)


def test_checksums_off_serve_what_the_unit_holds(pair, partition):
    """The switch is a choice: with ``checksums=False`` nothing is computed or checked."""
    rows, _ = _samples(2, 16 << 10)
    config = tqueue.ClientConfig(shm=False, bulk=False, checksums=False)
    with tqueue.Client(pair.address, config=config) as c:
        c.create_partition(partition, copies=1)
        put = c.put(partition, {"x": rows})
        assert flip_in_memory(_unit_pid(pair, c, put.units[0]), rows[0, :64].numpy().tobytes(), at=9) >= 1
        got = c.get_data(put)["x"]
        assert not torch.equal(got[0], rows[0]) and torch.equal(got[1], rows[1])


def test_checksums_are_per_sample_over_the_bytes_readers_get():
    block = FieldBlock(name="x", spec=FieldSpec(kind="tensor", dtype="uint8", shape=(3,)), counts=[2])
    import crc32c

    assert crcs_of(block, [b"abcdef"]).tolist() == [crc32c.crc32c(b"abc"), crc32c.crc32c(b"def")]


def test_packed_values_are_checked_as_widened_without_widening_them():
    """crcs_widened gives each value of packed frames the CRC-32C of its widened bytes, as
    crcs_of of the widened frames does: small values in runs, one past the scratch buffer in
    pieces, a frame left wide between packed ones, an empty value."""
    rng = np.random.default_rng(3)
    lengths = [[5, 0, 300], [400_000], [7, 9]]  # frame 1: 1.6 MB once widened (past 1 MiB)
    frames, shapes, packed = [], [], []
    for f, (kind, lens) in enumerate(zip(["uint8", "int16", ""], lengths)):
        wide = [rng.integers(0, 250 if f == 0 else 30000, size=(n, 1), dtype=np.int32) for n in lens]
        frames.append(np.concatenate(wide).astype(kind or np.int32).tobytes())
        shapes += [v for n in lens for v in (n, 1)]
        packed.append(kind)
    block = FieldBlock(name="ids", spec=FieldSpec(kind="tensor", dtype="int32", layout="jagged", ndim=2),
                       counts=[len(x) for x in lengths], shapes=shapes, packed=packed)
    assert crcs_widened(block, frames).tolist() == crcs_of(*unpack(block, frames)).tolist()


@pytest.mark.parametrize("copies", [1, 2])
def test_routed_experts_packed_over_sockets_are_checked_kept_narrow(pair, partition, copies):
    """Routed experts (jagged int32, ids under 128) are held at one byte an id: a bit flipped in
    the unit is caught in the sample it hit, for a reader that keeps them narrow too."""
    g = torch.Generator().manual_seed(5)
    experts = [torch.randint(0, 128, (3000 + 500 * i, 8, 8), dtype=torch.int32, generator=g) for i in range(4)]
    with tqueue.Client(pair.address, config=ROUTES["inline"]) as c:
        c.create_partition(partition, copies=copies)
        put = c.put(partition, {"routed_experts": experts})
        narrow = experts[2][1000:1008].numpy().astype(np.int8).tobytes()
        assert flip_in_memory(_unit_pid(pair, c, put.units[2]), narrow, at=5) >= 1
        if copies == 1:
            with pytest.raises(tqueue.DataCorruptionError, match=r"field 'routed_experts' of samples \[2\]"):
                c.get_data(put, dtype={"routed_experts": torch.uint8})
        else:
            got = c.get_data(put, dtype={"routed_experts": torch.uint8})["routed_experts"]
            assert all(v.dtype == torch.uint8 and torch.equal(v.int(), e) for v, e in zip(got, experts))
        assert c.stats.corrupt == 1


@pytest.mark.parametrize("copies", [1, 2])
def test_packed_integers_are_checked_once_widened_in_the_batch(pair, partition, copies):
    """Token ids that travel narrowed (pack_ints): the unit holds int16 values, the CRC covers
    the int64 values readers get; a flipped bit is caught in the batch's rows."""
    ids = torch.from_numpy(np.random.default_rng(7).integers(-30000, 30000, size=(4, 8192), dtype=np.int64))
    with tqueue.Client(pair.address, config=ROUTES["inline"]) as c:
        c.create_partition(partition, copies=copies)
        put = c.put(partition, {"ids": ids})
        narrow = ids[3, :32].numpy().astype(np.int16).tobytes()
        assert flip_in_memory(_unit_pid(pair, c, put.units[3]), narrow, at=11) >= 1
        if copies == 1:
            with pytest.raises(tqueue.DataCorruptionError, match=r"field 'ids' of samples \[3\]"):
                c.get_data(put)
        else:
            assert torch.equal(c.get_data(put)["ids"], ids)
        assert c.stats.corrupt == 1


def test_a_sample_changed_before_a_checkpoint_is_caught_after_its_restore(tmp_path, partition):
    """The checkpoint keeps each sample's CRC-32C from its producer (the file's own checksum
    covers the disk; this covers the unit's memory before the save): after a restore into a
    fresh cluster the changed sample is reported at its read, the others read back exact."""
    rows, values = _samples(3, 16 << 10)
    with tqueue.LocalCluster(num_storage_units=1) as first:
        with tqueue.Client(first.address, config=ROUTES["inline"]) as c:
            c.put(partition, {"x": rows, "obj": values})
            assert flip_in_memory(first.pids[1], values[2][:64], at=300) >= 1
            c.save_checkpoint(tmp_path / "ckpt")
    with tqueue.LocalCluster(num_storage_units=1) as second:
        with tqueue.Client(second.address, config=ROUTES["inline"]) as c:
            c.load_checkpoint(tmp_path / "ckpt")
            meta = c.get_meta(partition, ["x", "obj"], batch_size=3, task="t")
            with pytest.raises(tqueue.DataCorruptionError, match=r"field 'obj' of samples \[2\]"):
                c.get_data(meta)
            good = c.get_data(BatchMeta(**{**_as_dict(meta), "indexes": meta.indexes[:2], "units": meta.units[:2]}))
            assert torch.equal(good["x"], rows[:2]) and good["obj"] == values[:2]
