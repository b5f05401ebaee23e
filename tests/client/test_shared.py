"""Fields shared by content (``create_partition(dedup=[...])``): a GRPO group's image and
prompt stored once per unit, sent once per put and per read, and freed with their last holder,
on every route (ZeroMQ frames, bulk streams, the same-host arena).

The servers run in this process (``LoopCluster``), so that a test can read a unit's store
directly and force a hash collision by replacing ``tqueue.wire._shared.digest`` on both sides."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tqueue
from tqueue.errors import ProtocolError
from tqueue.wire import FieldBlock, FieldSpec, _durable, _shared
from tqueue.wire._crc import crc

from ..servers import LoopCluster

ROUTES = {
    "inline": tqueue.ClientConfig(shm=False, bulk=False),
    "bulk": tqueue.ClientConfig(shm=False, bulk_lanes=1, bulk_put_min_bytes=1),
    "arena": tqueue.ClientConfig(shm=True, shm_min_bytes=0),
}
FIELDS = ["image", "prompt_ids", "response_ids"]
IMAGE = (256, 1024)  # float32: 1 MiB
PROMPT = 4096  # int64 tokens, ids past 2**16 (not narrowed on the way)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopCluster]:
    with LoopCluster(num_storage_units=1, clock=True) as c:
        yield c


@pytest.fixture(params=list(ROUTES))
def client(cluster: LoopCluster, request: pytest.FixtureRequest) -> Iterator[tqueue.Client]:
    with tqueue.Client(cluster.address, config=ROUTES[request.param]) as c:
        yield c


_names = iter(range(1 << 30))


def _partition(client: tqueue.Client, **kwargs: Any) -> str:
    name = f"shared-{next(_names)}"
    client.create_partition(name, dedup=["image", "prompt_ids"], **kwargs)
    return name


def _group(n: int = 16, seed: int = 0, image: torch.Tensor | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(*IMAGE, generator=g) if image is None else image
    prompt = torch.randint(70_000, 1 << 40, (PROMPT,), generator=g)
    return {
        "image": [image] * n,  # one tensor, n references (as a rollout worker repeats a prompt's)
        "prompt_ids": [prompt.clone() for _ in range(n)],  # n equal copies: found by content
        "response_ids": [torch.randint(70_000, 1 << 40, (50 + 7 * i,), generator=g) for i in range(n)],
    }


def _held(cluster: LoopCluster) -> int:
    return cluster.call(lambda: sum(u.data.nbytes for u in cluster.units))


def _nbytes(values: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in values)


def _check(batch: Any, group: dict[str, Any], at: list[int]) -> None:
    for field in FIELDS:
        for got, k in zip(batch[field], at):
            assert torch.equal(got, group[field][k]), (field, k)


def test_a_group_sharing_an_image_and_a_prompt_is_stored_sent_and_read_once(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = _partition(client)
    group = _group()
    once = _nbytes([group["image"][0], group["prompt_ids"][0], *group["response_ids"]])
    logical = _nbytes([t for f in FIELDS for t in group[f]])
    before, sent, put = _held(cluster), client.stats.wire_bytes, client.stats.put_bytes
    client.put(part, group)
    assert _held(cluster) - before <= 1.2 * once  # held once; the responses' own bytes beside
    assert client.stats.wire_bytes - sent <= 1.2 * once
    assert client.stats.put_bytes - put == logical  # what the fields hold, counted as put

    meta = client.get_meta(part, FIELDS, 16, task="t")
    got, sent = client.stats.get_bytes, client.stats.wire_bytes
    batch = client.get_data(meta)
    assert client.stats.wire_bytes - sent <= 1.2 * once  # sent once per read
    assert client.stats.get_bytes - got == logical
    _check(batch, group, meta.indexes)
    prompts = batch["prompt_ids"]
    assert len({t.data_ptr() for t in prompts}) == 1, "each sample's prompt is a view of the one that came"
    prompts[0][0] = -1  # a view: the others see it (the docs say so), the store does not
    assert int(prompts[5][0]) == -1
    client.ack(meta)


def test_a_second_group_with_the_same_image_adds_only_what_differs(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = _partition(client)
    first = _group(seed=1)
    client.put(part, first)
    before = _held(cluster)
    second = _group(seed=2, image=first["image"][0].clone())  # equal bytes, another tensor
    client.put(part, second)
    added = _held(cluster) - before
    assert added == _nbytes([second["prompt_ids"][0], *second["response_ids"]])
    meta = client.get_meta(part, FIELDS, 32, task="t")
    batch = client.get_data(meta)
    at = {i: k for k, i in enumerate(meta.indexes)}
    both = {f: first[f] + second[f] for f in FIELDS}
    _check(batch, both, [sorted(at).index(i) for i in meta.indexes])
    shared = 31 * IMAGE[0] * IMAGE[1] * 4
    stored = cluster.call(lambda: cluster.units[0].data.resident)
    for _ in range(20):  # the unit's figures reach status() with its next heartbeat
        cluster.advance(1.0)
        status = client.status()
        if status.bytes_shared >= shared and status.units[0].nbytes == stored:
            break
    assert status.bytes_shared >= shared
    # what the unit stores, the second image dropped after its commit had reported it
    assert status.units[0].nbytes == stored
    assert next(p for p in status.partitions if p.name == part).dedup == ["image", "prompt_ids"]


def test_a_dense_shared_field_comes_back_as_its_rows(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = _partition(client)
    rows = torch.rand(3, 64, 64)
    image = rows[torch.tensor([0, 1, 0, 2, 1, 0, 0, 2])]  # one dense tensor, 3 distinct rows
    before = _held(cluster)
    client.put(part, {"image": image})
    assert _held(cluster) - before == 3 * 64 * 64 * 4
    batch = client.get_data(client.get_meta(part, ["image"], 8, task="t"))
    assert torch.equal(batch["image"], image)


def test_a_forced_hash_collision_compares_the_bytes_and_keeps_both(
    cluster: LoopCluster, client: tqueue.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_shared, "digest", lambda data: 7)  # every value collides, on both sides
    part = _partition(client)
    a, b = torch.rand(*IMAGE), torch.rand(*IMAGE)
    before = _held(cluster)
    client.put(part, {"image": [a, b, a, b]})
    client.put(part, {"image": [b, a]})
    assert _held(cluster) - before == 2 * a.numel() * 4  # two values, each stored once
    meta = client.get_meta(part, ["image"], 6, task="t")
    got = client.get_data(meta)["image"]
    want = [a, b, a, b, b, a]
    for tensor, i in zip(got, meta.indexes):
        assert torch.equal(tensor, want[i - min(meta.indexes)])


def test_a_shared_value_is_freed_with_its_last_holder(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = _partition(client)
    first = _group(n=4, seed=3)
    second = _group(n=4, seed=4, image=first["image"][0])
    start = _held(cluster)
    m1 = client.put(part, first)
    client.put(part, second)
    image = IMAGE[0] * IMAGE[1] * 4
    client.clear(m1)  # the first put's samples: the image stays, held by the second's
    left = _held(cluster) - start
    assert image <= left <= image + _nbytes([second["prompt_ids"][0], *second["response_ids"]])
    meta = client.get_meta(part, FIELDS, 4, task="t")
    _check(client.get_data(meta), second, [i - min(meta.indexes) for i in meta.indexes])
    client.clear(part)
    assert _held(cluster) == start
    assert cluster.call(lambda: all(not u.data.partitions.get(meta.partition_uid) for u in cluster.units))


def test_a_postponed_shared_sample_reads_back_exactly(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = _partition(client)
    group = _group(n=6, seed=5)
    client.put(part, group)
    meta = client.get_meta(part, FIELDS, 6, task="t")
    later = f"{part}-later"
    moved = client.rollouts.postpone(meta, later)
    batch = client.get_data(client.get_meta(later, FIELDS, 6, task="t"))
    _check(batch, group, [i - min(moved.indexes) for i in moved.indexes])


def _figures(cluster: LoopCluster, client: tqueue.Client) -> tuple[int, int]:
    """``status()``'s bytes_shared and its unit's nbytes, once a heartbeat has brought the
    unit's own figures (a cluster started with ``clock=True``)."""
    own = cluster.call(lambda: (cluster.units[0].data.bytes_shared(), cluster.units[0].data.resident))
    for _ in range(20):
        cluster.advance(1.0)
        status = client.status()
        if (status.bytes_shared, status.units[0].nbytes) == own:
            break
    return status.bytes_shared, status.units[0].nbytes


def _on_disk(folder: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _saved(folder: pathlib.Path, seed: int) -> tuple[dict[str, Any], int, str, Any]:
    """A group of 16 put into a fresh cluster and checkpointed into ``folder``: the group, its
    bytes held once, its partition and the unit's figures at the save."""
    group = _group(n=16, seed=seed)
    once = _nbytes([group["image"][0], group["prompt_ids"][0], *group["response_ids"]])
    with LoopCluster(num_storage_units=1, clock=True) as old, tqueue.Client(old.address) as c:
        part = _partition(c)
        c.put(part, group)
        before = _figures(old, c)
        c.save_checkpoint(folder, metadata=None)
    return group, once, part, before


def test_a_checkpoint_holds_a_shared_value_once_and_restores_it_once_shared(tmp_path: pathlib.Path) -> None:
    """16 samples sharing a 1 MiB image (and a prompt): the checkpoint's files hold it once
    (about 1.1 MB in all; 17.3 MB when each sample's bytes went in), the restored unit stores
    it once and shared (status() as before the save), every sample reads back exact, and the
    value goes with the last sample that holds it."""
    group, once, part, before = _saved(tmp_path / "ck", seed=10)
    assert before[0] == 15 * _nbytes([group["image"][0], group["prompt_ids"][0]])
    assert _on_disk(tmp_path / "ck") < 1.2 * once, "each shared value once in the file, the rest beside it"
    with LoopCluster(num_storage_units=1, clock=True) as other, tqueue.Client(other.address) as c:
        c.load_checkpoint(tmp_path / "ck")
        assert _held(other) == once
        assert _figures(other, c) == before  # bytes_shared and the unit's nbytes as they were
        meta = c.get_meta(part, FIELDS, 16, task="t")
        batch = c.get_data(meta)
        _check(batch, group, [i - min(meta.indexes) for i in meta.indexes])
        first = [k for k, i in enumerate(meta.indexes) if i - min(meta.indexes) < 8]
        c.clear(meta.select(first))  # half the group: the image and the prompt stay, held by the others
        rest = meta.select([k for k in range(16) if k not in first])
        assert _held(other) == once  # (the responses' piece goes with its last sample too)
        _check(c.get_data(rest), group, [i - min(meta.indexes) for i in rest.indexes])
        c.clear(rest)  # the last holders: the image and the prompt are freed with them
        assert _held(other) == 0
        left = other.call(lambda: [col.pieces for col in other.units[0].data.partitions[meta.partition_uid].columns.values()])
        assert left == [{}, {}, {}]


def test_a_checkpoint_of_shared_values_restores_them_once(tmp_path: pathlib.Path) -> None:
    with LoopCluster(num_storage_units=1) as old, tqueue.Client(old.address) as c:
        part = _partition(c)
        group = _group(n=8, seed=6)
        c.put(part, group)
        c.save_checkpoint(tmp_path / "ck", metadata=None)
    with LoopCluster(num_storage_units=1) as other, tqueue.Client(other.address) as c:
        c.load_checkpoint(tmp_path / "ck")
        held = _held(other)
        assert held == _nbytes([group["image"][0], group["prompt_ids"][0], *group["response_ids"]])
        meta = c.get_meta(part, FIELDS, 8, task="t")
        _check(c.get_data(meta), group, [i - min(meta.indexes) for i in meta.indexes])
        c.put(part, _group(n=2, seed=7, image=group["image"][0]))  # matched against the restored value
        assert _held(other) - held == _nbytes([*_group(n=2, seed=7)["response_ids"], _group(n=2, seed=7)["prompt_ids"][0]])


def _as_version_1(folder: pathlib.Path) -> int:
    """The checkpoint in ``folder`` rewritten as version 1 wrote it: each sample's bytes in
    its own row, shared fields too (no ``ref`` column); its manifest with the files' sizes and
    CRC-32Cs. Returns the bytes of the payload files."""
    import pyarrow as pa

    manifest = json.loads((folder / "manifest.json").read_text())
    total = 0
    for unit in manifest["units"]:
        for entry in unit["files"]:
            path = folder / manifest["generation"] / entry["path"]
            reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
            header = json.loads(reader.schema.metadata[b"tqueue"])
            assert header["version"] in (2, 3)
            header["version"] = 1
            names = [n for n in reader.schema.names if n != "ref"]
            schema = pa.schema([reader.schema.field(n) for n in names], metadata={"tqueue": json.dumps(header)})
            sink = pa.BufferOutputStream()
            payload = 0
            with pa.ipc.new_file(sink, schema) as writer:
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    columns = {n: batch.column(n) for n in names}
                    if "ref" in batch.schema.names:  # each holder's own copy of its value
                        ref = batch.column("ref").to_numpy()
                        columns["value"] = columns["value"].take(np.where(ref < 0, np.arange(len(ref)), ref))
                    payload += sum(len(v) for v in columns["value"].to_pylist())
                    writer.write_batch(pa.RecordBatch.from_arrays(list(columns.values()), schema=schema))
            data = sink.getvalue().to_pybytes()
            path.write_bytes(data)
            entry.update(nbytes=len(data), crc32c=crc(data), payload=payload)
            total += len(data)
    manifest["crc32c"] = _durable.manifest_crc(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return total


def test_a_checkpoint_of_the_first_format_still_loads_its_shared_values_once(tmp_path: pathlib.Path) -> None:
    """A checkpoint written before shared values were kept once (payload format version 1:
    every holder's bytes in the file) loads: each value stored once again and shared, every
    sample exact."""
    group, once, part, before = _saved(tmp_path / "ck", seed=11)
    assert _as_version_1(tmp_path / "ck") > 16 * _nbytes([group["image"][0]])  # 16 copies of the image
    with LoopCluster(num_storage_units=1, clock=True) as other, tqueue.Client(other.address) as c:
        c.load_checkpoint(tmp_path / "ck")
        assert _held(other) == once
        assert _figures(other, c) == before
        meta = c.get_meta(part, FIELDS, 16, task="t")
        _check(c.get_data(meta), group, [i - min(meta.indexes) for i in meta.indexes])


def test_a_producer_that_does_not_know_learns_at_its_grant(cluster: LoopCluster) -> None:
    with tqueue.Client(cluster.address) as maker:
        part = _partition(maker)
    group = _group(n=8, seed=8)
    with tqueue.Client(cluster.address) as producer:  # another process's client, in effect
        sent = producer.stats.wire_bytes
        producer.put(part, group)  # its first put learns the fields at its grant
        assert producer.stats.wire_bytes - sent <= 1.2 * _nbytes([group["image"][0], group["prompt_ids"][0], *group["response_ids"]])


# --- the wire form ---------------------------------------------------------------------

def test_shrink_and_expand_give_each_sample_its_bytes_back() -> None:
    values = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)]
    frame = np.concatenate(values).view(np.uint8)
    block = FieldBlock(name="x", spec=FieldSpec(kind="ndarray", dtype="int32", layout="jagged", ndim=1),
                       counts=[3], shapes=[5, 3, 5])
    small, frames, left = _shared.shrink(block, [memoryview(frame)])
    assert small.value_of == [0, 1, 0] and small.shapes == [5, 3] and left == 20
    assert sum(memoryview(f).nbytes for f in frames) == 32
    back, out = _shared.expand(small, frames)
    assert back.shapes == [5, 3, 5] and back.value_of is None
    joined = np.concatenate([np.frombuffer(f, np.uint8) for f in out])
    assert joined.tobytes() == frame.tobytes()


@pytest.mark.parametrize(("value_of", "match"), [
    ([0, 2], "outside the block's 2"), ([0, -1], "outside"), ([0, 0], "values no sample holds"), ([], "values no sample holds"),
])
def test_a_value_of_that_names_what_the_block_does_not_carry_is_refused(value_of: list[int], match: str) -> None:
    block = FieldBlock(name="x", spec=FieldSpec(kind="ndarray", dtype="int32", layout="dense", shape=(2,)),
                       counts=[2], value_of=value_of)
    with pytest.raises(ProtocolError, match=match):
        _shared.value_of(block)
