"""save_checkpoint / load_checkpoint: the whole data plane into Arrow IPC files and a JSON
manifest, and back into a fresh cluster of another size, bit-exact, with every task's
consumption, leases given back and partial rollouts still resumable. The old cluster is
real processes, SIGKILLed (by pid) before the restore; the cluster of the module's tests is
one of their own, as they checkpoint all it holds, and the clusters that take a checkpoint
back are served in this process (tests/servers.py)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.ipc
import pytest
import torch

import tqueue
from tqueue.errors import DataCorruptionError, InvalidArgumentError

from ..servers import LoopCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=2) as c:
        yield c


STEP = "train/step-3"
NEXT = "train/step-4"


def samples(first: int, n: int) -> list[dict]:
    """Fields of every kind a put takes: small int64 (narrowed on the wire), bf16 jagged,
    fp8, bool, objects, nested values with tensor leaves (None in some samples), 64 KiB of
    bytes (its own frame, through the arena for the shm client), and routed experts (jagged
    int32, ids under 128: packed to int8 over sockets)."""
    g = torch.Generator().manual_seed(first)
    return [
        {
            "x": torch.tensor([i, -i, 7], dtype=torch.int64),
            "bf": torch.randn(1 + i % 5, 2, generator=g).to(torch.bfloat16),
            "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
            "ok": torch.tensor([i % 2 == 0, True]),
            "obj": {"i": i, "text": "é" * (i % 3), "ids": list(range(i % 4))},
            "mm": None if i % 3 == 0 else {"pixels": torch.randn(i % 4, 3, generator=g).to(torch.bfloat16), "grid": [[1, i]]},
            "big": torch.randint(0, 255, (64 << 10,), dtype=torch.uint8, generator=g),
            "experts": torch.randint(0, 128, (600 + i, 8), dtype=torch.int32, generator=g),
        }
        for i in range(first, first + n)
    ]


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def check(client: tqueue.Client, meta, written: dict[int, dict]) -> None:
    batch = client.get_data(meta)
    for row, i in enumerate(meta.indexes):
        for name, want in written[i].items():
            got = batch[name][row]
            assert same(got, want), f"sample {i} field {name}: {got!r} != {want!r}"


def kill(cluster: tqueue.LocalCluster) -> None:
    for pid in cluster.pids:
        os.kill(pid, signal.SIGKILL)


def test_a_checkpoint_comes_back_bit_exact_in_a_cluster_of_another_size(tmp_path: pathlib.Path) -> None:
    written: dict[int, dict] = {}
    placed: set[int] = set()
    with tqueue.LocalCluster(num_storage_units=2) as old:
        with tqueue.Client(old.address) as c, tqueue.Client(
            old.address, config=tqueue.ClientConfig(shm=True, shm_min_bytes=0)
        ) as arena:
            c.create_partition(STEP, group_size=2)
            for writer, first in ((c, 0), (arena, 8), (c, 16), (arena, 24)):
                rows = samples(first, 8)
                meta = writer.put(STEP, rows, groups=[f"g{(first + k) // 2}" for k in range(8)], version=2)
                written.update(zip(meta.indexes, rows))
                placed.update(meta.units)
            assert len(placed) == 2  # the payload lies on both units
            half = c.get_meta(STEP, ["x"], 16, task="a")
            c.ack(half)
            c.get_meta(STEP, ["x"], 4, task="b", lease_timeout=600)  # leased, never acked
            partial = c.put(NEXT, {"tokens": [torch.arange(3), torch.arange(5)]}, partial=True, version=2)
            c.set_version(3)
            c.set_staleness(2, batch_size=32)
            info = c.save_checkpoint(tmp_path, metadata={"step": 3, "note": ["resume", 1.5]})
            assert info.partitions == 2 and info.samples == 34 and info.payload_bytes > 32 * (64 << 10)
            assert info.pause < 1.0 and info.controller_pause <= info.pause and info.unit_pause <= info.pause
        kill(old)

    with LoopCluster(num_storage_units=3) as new, tqueue.Client(new.address) as c:
        assert c.load_checkpoint(tmp_path) == {"step": 3, "note": ["resume", 1.5]}
        status = c.status()
        step = next(p for p in status.partitions if p.name == STEP)
        assert step.samples == 32 and step.ready == 32
        assert step.tasks["a"].consumed == 16 and step.tasks["b"].leased == 0 and step.tasks["b"].consumed == 0
        assert status.version == 3 and status.admission_limit == (3 + 2 + 1) * 32
        # task a reads exactly the half it had not consumed, and nothing more
        rest = c.get_meta(STEP, ["x", "bf", "f8", "ok", "obj", "mm", "big", "experts"], 16, task="a", timeout=10)
        assert sorted(rest.indexes) == sorted(set(written) - set(half.indexes))
        check(c, rest, written)
        with pytest.raises(tqueue.errors.WaitTimeoutError):
            c.get_meta(STEP, ["x"], 1, task="a", timeout=0.5, policy="first_ready")
        # task b's lease came back ready: it reads all 32
        every = c.get_meta(STEP, ["x", "bf", "f8", "ok", "obj", "mm", "big", "experts"], 32, task="b", timeout=10)
        check(c, every, written)
        assert len(set(every.units)) >= 2  # two old units' payload, spread over the new ones
        assert sorted(every.groups) == sorted(f"g{i // 2}" for i in range(32))
        # the partial rollouts are still there, hidden until completed, and can be resumed
        with pytest.raises(tqueue.errors.WaitTimeoutError):
            c.get_meta(NEXT, ["tokens"], 1, task="a", timeout=0.3)
        # (a meta from before the restore names the old units: the partition's next step gets
        # a fresh one, as the rollout driver resumes recycled samples)
        fresh = c.postpone(partial, "train/step-5")
        assert fresh.indexes == [0, 1] and set(fresh.units) <= {u.unit_id for u in status.units}
        tokens = c.get_data(fresh)["tokens"]
        assert [t.tolist() for t in tokens] == [[0, 1, 2], [0, 1, 2, 3, 4]]
        assert c.complete(fresh, {"tokens": [torch.arange(2), torch.arange(1)]}, version=3, first_token=3, append=["tokens"]) == []
        done = c.get_meta("train/step-5", ["tokens"], 2, task="a", timeout=10)
        tokens = c.get_data(done)["tokens"]
        assert [t.tolist() for t in tokens] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0]]
        assert done.versions == [2, 2]


def test_the_files_are_read_by_pyarrow_alone(tmp_path: pathlib.Path, client: tqueue.Client) -> None:
    name = f"arrow/{tmp_path.name}"
    rows = [{"x": torch.tensor([i, i + 1], dtype=torch.float32), "obj": f"s{i}"} for i in range(5)]
    client.put(name, rows)
    client.get_meta(name, ["x"], 2, task="t")
    client.save_checkpoint(tmp_path, metadata=None)
    client.clear(name)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    gen = tmp_path / manifest["generation"]
    part = next(p for p in manifest["partitions"] if p["name"] == name)
    table = pa.ipc.open_file(pa.memory_map(str(gen / part["path"]))).read_all()
    assert table.column("task/t").to_pylist() == [1, 1, 0, 0, 0]  # leased at the checkpoint
    files = [f for u in manifest["units"] for f in u["files"] if f["partition"] == name and f["field"] == "x"]
    values = {}
    for f in files:
        t = pa.ipc.open_file(pa.memory_map(str(gen / f["path"]))).read_all()
        header = json.loads(t.schema.metadata[b"tqueue"])
        assert header["spec"]["dtype"] == "float32" and header["partition"] == name and header["field"] == "x"
        for i, v, shape in zip(t.column("index").to_pylist(), t.column("value").to_pylist(), t.column("shape").to_pylist()):
            values[i] = (torch.frombuffer(bytearray(v), dtype=torch.float32).tolist(), shape)
    assert values == {i: ([float(i), float(i + 1)], [2]) for i in range(5)}


def test_loading_refuses_a_clash_and_what_is_not_a_checkpoint(tmp_path: pathlib.Path, client: tqueue.Client) -> None:
    with pytest.raises(InvalidArgumentError, match="no checkpoint in .*nothing: the folder is not there"):
        client.load_checkpoint(tmp_path / "nothing")
    with pytest.raises(InvalidArgumentError, match="checkpoint metadata must be JSON .*bytes"):
        client.save_checkpoint(tmp_path, metadata={"k": b"raw"})
    client.put(f"fresh/{tmp_path.name}", {"x": torch.zeros(1, 2)})
    client.save_checkpoint(tmp_path, metadata=[1])
    with pytest.raises(InvalidArgumentError, match=r"load_checkpoint: \d+ of the checkpoint's partitions exist in this cluster .*replace=True"):
        client.load_checkpoint(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    with LoopCluster(num_storage_units=1) as fresh, tqueue.Client(fresh.address) as c:
        first = next(f for u in manifest["units"] for f in u["files"])
        unit_file = tmp_path / manifest["generation"] / first["path"]
        data = unit_file.read_bytes()
        unit_file.write_bytes(data[:-10])
        with pytest.raises(DataCorruptionError, match="unit-.* has .* bytes, the manifest says .*: the checkpoint is damaged"):
            c.load_checkpoint(tmp_path)
        unit_file.write_bytes(data)
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
        with pytest.raises(InvalidArgumentError, match="a checkpoint of format version 99; this version of tqueue reads versions 1, 2"):
            c.load_checkpoint(tmp_path)
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        assert c.load_checkpoint(tmp_path) == [1]
        assert {p.name for p in c.status().partitions} == {p["name"] for p in manifest["partitions"]}


PAUSE_BOUND = 0.25  # seconds a checkpoint may hold a server's loop here (2 busy cores)


def test_puts_and_gets_go_on_while_a_checkpoint_is_written(tmp_path: pathlib.Path, client: tqueue.Client, cluster) -> None:
    """256 MiB in 4,096 samples: the checkpoint holds each loop for less than PAUSE_BOUND, and
    puts and gets complete while its files are written."""
    name = f"busy/{tmp_path.name}"
    for k in range(16):
        client.put(name, {"x": torch.full((256, 64 << 10), k, dtype=torch.uint8)})
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (start, seconds) of each put + get

    def traffic() -> None:
        with tqueue.Client(cluster.address) as other:
            while not stop.is_set():
                t0 = time.monotonic()
                meta = other.put(f"{name}-live", {"y": torch.ones(4, 16)})
                other.get_data(other.get_meta(f"{name}-live", ["y"], 4, task="t", timeout=10))
                del meta
                latencies.append((t0, time.monotonic() - t0))

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        begin = time.monotonic()
        info = client.save_checkpoint(tmp_path)
        end = time.monotonic()
    finally:
        stop.set()
        worker.join(timeout=60)
        client.clear(name)  # 256 MiB on the module's units, and as many on disk
        client.clear(f"{name}-live")
        shutil.rmtree(tmp_path, ignore_errors=True)
    during = [s for t, s in latencies if begin <= t and t + s <= end]
    print(f"\ncheckpoint: {info.payload_bytes / 2**20:.0f} MiB in {info.seconds:.2f} s "
          f"({info.payload_bytes / info.seconds / 1e9:.2f} GB/s); loops held: controller {1e3 * info.controller_pause:.1f} ms, "
          f"units {1e3 * info.unit_pause:.1f} ms; {len(during)} put+get done meanwhile, slowest {max(during, default=0):.3f} s")
    assert info.payload_bytes >= 256 << 20
    assert info.pause < PAUSE_BOUND
    assert during, "no put and get completed while the checkpoint was written"


def test_a_checkpoint_moves_between_clusters_with_auth_on(tmp_path: pathlib.Path) -> None:
    """With CurveZMQ on, the controller's SaveUnit and LoadUnit reach the units under the
    cluster's key; a checkpoint of one cluster loads into another with keys of its own."""
    root = {"checkpoint_root": str(tmp_path)}  # required with auth: both clusters keep checkpoints there
    with tqueue.LocalCluster(num_storage_units=2, auth=True, controller=root) as old, old.client() as c:
        meta = c.put("secure", {"x": torch.arange(8, dtype=torch.float64).reshape(4, 2)})
        assert c.save_checkpoint("run/1", metadata="s").samples == 4
    assert (tmp_path / "run" / "1" / "manifest.json").is_file()
    with tqueue.LocalCluster(num_storage_units=1, auth=True, controller=root) as new, new.client() as c:
        assert c.load_checkpoint("run/1") == "s"
        got = c.get_meta("secure", ["x"], 4, task="t", timeout=10)
        assert got.indexes == meta.indexes
        assert c.get_data(got)["x"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


CK = "ck/prompts"  # in the checkpoint
LIVE = "live/other"  # created after it


def rows(first: int, n: int) -> list[dict]:
    return [{"x": torch.arange(4, dtype=torch.float32) + first + i, "big": torch.full((16 << 10,), first + i, dtype=torch.uint8)}
            for i in range(n)]


def serves(c: tqueue.Client, partition: str, written: list[dict]) -> tqueue.BatchMeta:
    """The partition's samples (read without a lease) are exactly ``written``, in index order."""
    meta = c.select(partition, ["x", "big"])
    assert meta.indexes == list(range(len(written)))
    check(c, meta, dict(enumerate(written)))
    return meta


def unit_bytes(c: tqueue.Client) -> int:
    return sum(u.nbytes for u in c.status().units)


def test_a_checkpoint_loads_into_a_running_cluster_beside_its_partitions(tmp_path: pathlib.Path) -> None:
    """A checkpoint of CK loads beside LIVE (made after it): LIVE untouched, its uid, bytes and
    the trainer's version as they were; CK back by key under a uid no live partition has; a
    live CK refuses the load, naming it, and nothing changes."""
    ck_rows, live_rows = rows(0, 6), rows(100, 3)
    with LoopCluster(num_storage_units=2) as cluster, tqueue.Client(cluster.address) as c:
        meta = c.put(CK, ck_rows)
        c.bind_keys(meta, [f"prompt-{i}" for i in range(6)])
        c.set_version(2)
        c.save_checkpoint(tmp_path, metadata={"step": 2})
        c.set_version(4)
        live = c.put(LIVE, live_rows)
        with pytest.raises(InvalidArgumentError, match=r"1 of the checkpoint's partitions exist in this cluster \('ck/prompts'\)"):
            c.load_checkpoint(tmp_path)
        assert {(p.name, p.uid) for p in c.status().partitions} == {(CK, meta.partition_uid), (LIVE, live.partition_uid)}
        serves(c, CK, ck_rows)
        c.clear(CK)  # as verl's save/load round trip: clear the keys, then load into the running queue
        assert c.load_checkpoint(tmp_path) == {"step": 2}
        status = c.status()
        assert status.version == 4  # a running cluster keeps its trainer's state
        uids = {p.name: p.uid for p in status.partitions}
        assert uids[LIVE] == live.partition_uid and uids[CK] not in (live.partition_uid, meta.partition_uid)
        assert serves(c, LIVE, live_rows).partition_uid == live.partition_uid
        found = c.lookup_keys(CK, ["prompt-4", "prompt-1"], fields=["x", "big"])
        assert found.indexes == [4, 1] and found.meta is not None and found.meta.partition_uid == uids[CK]
        check(c, found.meta, dict(enumerate(ck_rows)))
        loaded = serves(c, CK, ck_rows)
        # a sample is (partition uid, index): none of the loaded ones is a live one's
        assert not {(loaded.partition_uid, i) for i in loaded.indexes} & {(live.partition_uid, i) for i in live.indexes}
        assert c.put(LIVE, rows(103, 1)).indexes == [3]  # both take puts and serve on
        assert c.put(CK, rows(6, 1)).indexes == [6]
        assert sorted(c.get_meta(CK, ["x"], 7, task="t", timeout=10).indexes) == list(range(7))


def test_replace_swaps_a_live_partition_only_once_the_checkpoints_loaded(tmp_path: pathlib.Path) -> None:
    """replace=True: a load that fails on a unit (a payload file damaged in place) leaves the
    live CK and LIVE serving their bytes and nothing of the checkpoint on the units; one that
    succeeds serves the checkpoint's bytes and frees the live CK's (the units' bytes back)."""
    ck_rows, now_rows, live_rows = rows(0, 8), rows(50, 8), rows(100, 2)
    with LoopCluster(num_storage_units=2) as cluster, tqueue.Client(cluster.address) as c:
        assert len({u for half in (ck_rows[:4], ck_rows[4:]) for u in c.put(CK, half).units}) == 2
        c.save_checkpoint(tmp_path)
        c.clear(CK)
        old = c.put(CK, now_rows)  # as many bytes as the checkpoint's
        c.put(LIVE, live_rows)
        before = unit_bytes(c)
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        files = [f for u in manifest["units"] for f in u["files"] if f["field"] == "big"]
        assert len(files) == 2  # one on each unit: one loads, the other fails
        damaged = tmp_path / manifest["generation"] / files[1]["path"]
        data = damaged.read_bytes()
        damaged.write_bytes(b"\0" * len(data))  # the size the manifest says, not its bytes
        with pytest.raises(DataCorruptionError, match=r"p1-f1\.arrow \(field 'big' of partition 'ck/prompts', unit \d\) fails its CRC-32C"):
            c.load_checkpoint(tmp_path, replace=True)
        assert {p.name: p.uid for p in c.status().partitions}[CK] == old.partition_uid
        serves(c, CK, now_rows)
        serves(c, LIVE, live_rows)
        assert unit_bytes(c) == before  # what the other unit loaded was dropped
        damaged.write_bytes(data)
        c.load_checkpoint(tmp_path, replace=True)
        serves(c, CK, ck_rows)
        serves(c, LIVE, live_rows)
        # the replaced partition's payload freed on the units: what they hold is what they did
        # (its 128 KiB, not twice that), but for the bookkeeping of pieces cut otherwise
        assert abs(unit_bytes(c) - before) < 8 << 10
        with pytest.raises(tqueue.errors.PartitionClearedError):
            c.get_data(old)


# --- integers held narrow -------------------------------------------------------------------

SOCKETS = tqueue.ClientConfig(shm=False)  # over sockets: integer fields narrowed (pack_ints), held so


def moe_rows(n: int) -> dict[str, Any]:
    """Routed experts (int32 [tokens, 48, 8], ids under 128: held as int8) and positions (a
    dense int64 field, values under 1,000: held as int16)."""
    g = torch.Generator().manual_seed(5)
    return {
        "routed_experts": [torch.randint(0, 128, (60 + 23 * i, 48, 8), dtype=torch.int32, generator=g) for i in range(n)],
        "positions": torch.stack([torch.arange(2048, dtype=torch.int64) * (i + 1) % 1000 for i in range(n)]),  # dense
    }


def narrow_bytes(rows: dict[str, Any]) -> int:
    return sum(t.numel() for t in rows["routed_experts"]) + 2 * rows["positions"].numel()


def held_bytes(cluster: LoopCluster, client: tqueue.Client) -> int:
    """``status().units[0].nbytes`` once a heartbeat has brought the unit's own figure."""
    own = cluster.call(lambda: cluster.units[0].data.resident)
    for _ in range(20):
        cluster.advance(1.0)
        if client.status().units[0].nbytes == own:
            break
    return client.status().units[0].nbytes


def payload_files(folder: pathlib.Path) -> list[pathlib.Path]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [folder / manifest["generation"] / f["path"] for u in manifest["units"] for f in u["files"]]


def test_packed_integers_stay_narrow_through_a_checkpoint(tmp_path: pathlib.Path) -> None:
    """The payload files hold routed experts one byte an id and positions two bytes a value
    (the file about the narrow bytes, a quarter of the wide); the restored unit holds them as
    the saved one did (status()'s nbytes as before the save); reads give the field's dtype
    back, or one byte an id where asked (get_data(dtype=...))."""
    rows = moe_rows(12)
    narrow = narrow_bytes(rows)
    with LoopCluster(num_storage_units=1, clock=True) as old, tqueue.Client(old.address, config=SOCKETS) as c:
        c.put("moe", rows)
        before = held_bytes(old, c)
        assert old.call(lambda: old.units[0].data.nbytes) == narrow  # narrowed on the way: held so
        c.checkpoints.save(tmp_path / "ck")
    on_disk = sum(p.stat().st_size for p in payload_files(tmp_path / "ck"))
    wide = sum(t.nbytes for t in rows["routed_experts"]) + rows["positions"].nbytes
    print(f"\npayload files: {on_disk / 1e6:.2f} MB for {narrow / 1e6:.2f} MB held narrow ({wide / 1e6:.2f} MB wide)")
    assert on_disk < 1.3 * narrow + (32 << 10)
    with LoopCluster(num_storage_units=1, clock=True) as new, tqueue.Client(new.address, config=SOCKETS) as c:
        c.checkpoints.load(tmp_path / "ck")
        assert new.call(lambda: new.units[0].data.nbytes) == narrow
        assert held_bytes(new, c) == before
        meta = c.get_meta("moe", ["routed_experts", "positions"], 12, task="t", timeout=10)
        batch = c.get_data(meta)
        assert batch["positions"].dtype == torch.int64
        assert torch.equal(batch["positions"], rows["positions"][meta.indexes])
        for got, i in zip(batch["routed_experts"], meta.indexes):
            assert same(got, rows["routed_experts"][i])
        small = c.get_data(meta, dtype={"routed_experts": torch.uint8})
        for got, i in zip(small["routed_experts"], meta.indexes):
            assert got.dtype == torch.uint8 and torch.equal(got.int(), rows["routed_experts"][i])


def test_a_bit_flipped_in_a_narrow_value_is_caught_at_its_read_after_the_load(tmp_path: pathlib.Path) -> None:
    """A payload file changed with its checksums made good again (a crafter, or the unit's
    memory before the save): the load takes it, and the sample's own CRC-32C, of its wide
    values, catches the narrow value's flipped bit at the read; the other samples read back."""
    from tqueue.wire import _durable
    from tqueue.wire._crc import crc

    rows = moe_rows(4)
    with LoopCluster(num_storage_units=1) as old, tqueue.Client(old.address, config=SOCKETS) as c:
        c.put("moe", rows)
        c.checkpoints.save(tmp_path / "ck")
    folder = tmp_path / "ck"
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(f for u in manifest["units"] for f in u["files"] if f["field"] == "routed_experts")
    path = folder / manifest["generation"] / entry["path"]
    data = bytearray(path.read_bytes())
    data[data.index(rows["routed_experts"][2].to(torch.int8).numpy().tobytes()) + 1000] ^= 0x08
    path.write_bytes(bytes(data))
    entry.update(crc32c=crc(bytes(data)))
    manifest["crc32c"] = _durable.manifest_crc(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with LoopCluster(num_storage_units=1) as new, tqueue.Client(new.address, config=SOCKETS) as c:
        c.checkpoints.load(folder)
        meta = c.select("moe", ["routed_experts"])
        with pytest.raises(DataCorruptionError, match=r"field 'routed_experts' of samples \[2\]"):
            c.get_data(meta)
        good = c.get_data(meta.select([0, 1, 3]))
        for got, i in zip(good["routed_experts"], [0, 1, 3]):
            assert same(got, rows["routed_experts"][i])
