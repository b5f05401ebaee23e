"""Checkpoints with authentication on: confined to the servers' checkpoint root, never
following a link, deleting or replacing nothing they did not write; a crafted manifest
refused before anything is sized by it; a bit flipped on disk refused as DataCorruptionError
naming the file; a load that fails leaves nothing resident. Real processes: one cluster of 2
units (auth on, a root) for the module."""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
import torch

import tqueue
from tqueue.errors import DataCorruptionError, InvalidArgumentError, PermissionDeniedError
from tqueue.transport import _auth
from tqueue.wire import _durable
from tqueue.wire._crc import crc

FAST = 2.0  # seconds a refusal may take here (2 busy cores): it reads no payload


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the checkpoint root, a folder outside it)."""
    return tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("outside")


@pytest.fixture(scope="module")
def cluster(places: tuple[pathlib.Path, pathlib.Path]) -> Iterator[tqueue.LocalCluster]:
    root = {"checkpoint_root": str(places[0])}
    with tqueue.LocalCluster(num_storage_units=2, auth=True, controller=root) as c:
        yield c


@pytest.fixture
def c(cluster: tqueue.LocalCluster) -> Iterator[tqueue.Client]:
    with cluster.client() as client:
        yield client


def resident(c: tqueue.Client) -> list[int]:
    return [u.nbytes for u in sorted(c.status().units, key=lambda u: u.unit_id)]


def peak_rss(pid: int) -> int:
    """Peak resident bytes of a process (VmHWM)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def saved(c: tqueue.Client, root: pathlib.Path, name: str, partition: str) -> dict[str, Any]:
    """A checkpoint ``name`` of ``partition`` (8 samples over both units), the partition
    cleared after it; its manifest."""
    for half in range(2):
        c.put(partition, {"x": torch.full((4, 64), 0xA0 + half, dtype=torch.uint8)})
    c.save_checkpoint(name)
    c.clear(partition)
    return json.loads((root / name / "manifest.json").read_text())


def rewrite(root: pathlib.Path, name: str, manifest: dict[str, Any]) -> None:
    """The manifest as a crafter writes it: with a valid CRC-32C of its own."""
    manifest = {**manifest, "crc32c": _durable.manifest_crc(manifest)}
    (root / name / "manifest.json").write_text(json.dumps(manifest))


def flip(path: pathlib.Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_names_outside_the_root_are_refused(c: tqueue.Client, places: tuple[pathlib.Path, pathlib.Path]) -> None:
    root, outside = places
    with pytest.raises(PermissionDeniedError, match=r"checkpoint '/.*': .*checkpoint root .* not an absolute path"):
        c.save_checkpoint(outside)
    with pytest.raises(PermissionDeniedError, match=r"checkpoint '/.*': .*not an absolute path"):
        c.load_checkpoint(outside)
    for name in ("..", "../outside", "a/../../x"):
        with pytest.raises(PermissionDeniedError, match=r"may not contain '\.\.'"):
            c.save_checkpoint(name)
    (root / "link").symlink_to(outside, target_is_directory=True)  # a link below the root: not followed
    with pytest.raises(PermissionDeniedError, match="checkpoint link: link is a symbolic link or not a folder"):
        c.save_checkpoint("link")
    with pytest.raises(PermissionDeniedError, match="checkpoint link/x: link is a symbolic link"):
        c.load_checkpoint("link/x")
    assert list(outside.iterdir()) == []


def test_only_what_a_checkpoint_wrote_is_deleted_or_replaced(
    c: tqueue.Client, places: tuple[pathlib.Path, pathlib.Path]
) -> None:
    root, outside = places
    mine = root / "mine"
    foreign = [mine / "gen-theirs", mine / "gen-20200101T000000000000-abcd1234"]  # the second as ours are named
    for folder in foreign:
        folder.mkdir(parents=True)
        (folder / "data.bin").write_bytes(b"keep me")
    c.put("confined/a", {"x": torch.zeros(2, 3)})
    first = c.save_checkpoint("mine").generation
    second = c.save_checkpoint("mine").generation
    assert sorted(p.name for p in mine.iterdir()) == sorted(["manifest.json", second, *(f.name for f in foreign)])
    assert first != second and all((f / "data.bin").read_bytes() == b"keep me" for f in foreign)

    theirs = root / "theirs"
    theirs.mkdir()
    (theirs / "manifest.json").write_text('{"owner": "someone else"}')
    with pytest.raises(InvalidArgumentError, match="checkpoint theirs: the folder holds a manifest.json that is not a tqueue"):
        c.save_checkpoint("theirs")
    assert [p.name for p in theirs.iterdir()] == ["manifest.json"]
    assert (theirs / "manifest.json").read_text() == '{"owner": "someone else"}'

    victim = outside / "victim"
    victim.write_text("untouched")
    linked = root / "linked"
    linked.mkdir()
    (linked / "manifest.json").symlink_to(victim)  # a manifest that is a link: refused, not replaced
    with pytest.raises(InvalidArgumentError, match="checkpoint linked: the folder holds a manifest.json that is not"):
        c.save_checkpoint("linked")
    (mine / "manifest.json.tmp").symlink_to(victim)  # the temporary name a fixed-name writer would follow
    c.save_checkpoint("mine")
    assert victim.read_text() == "untouched" and (mine / "manifest.json.tmp").is_symlink()
    assert not [p for p in mine.iterdir() if p.name.endswith(".tmp") and p.name != "manifest.json.tmp"]
    c.clear("confined/a")


def test_the_temporary_name_is_random_and_created_exclusively(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: a link planted at the temporary name between its choice and its open is
    refused by O_EXCL | O_NOFOLLOW (the name is known here only by fixing the random draw)."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    folder = tmp_path / "ck"
    folder.mkdir()
    monkeypatch.setattr(secrets, "token_hex", lambda n: "f" * (2 * n))
    (folder / f"manifest.json.{'f' * 16}.tmp").symlink_to(victim)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            _durable.commit_manifest(fd, {"format": _durable.FORMAT, "generation": "gen-x-0"}, "ck")
    finally:
        os.close(fd)
    assert victim.read_text() == "untouched" and not (folder / "manifest.json").exists()


def test_a_root_is_enforced_without_auth_and_required_with_it(tmp_path: pathlib.Path) -> None:
    root = str(tmp_path)
    with pytest.raises(PermissionDeniedError, match="not an absolute path"):
        _durable.asked("/etc", "/home/u", root)
    with pytest.raises(PermissionDeniedError, match="not a folder under the checkpoint root"):
        _durable.confined("/etc/gen-x", root)  # a path from the controller, on a unit with a root
    assert _durable.asked("run/1", "/home/u", root).path == os.path.join(root, "run", "1")
    assert _durable.asked("run", "/home/u", "").path == "/home/u/run"  # no root: any path, as before
    keys = _auth.generate(tempfile.mkdtemp(dir=tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tqueue", "controller", "--auth-dir", str(keys)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "checkpoint_root (--checkpoint-root)" in proc.stderr, proc.stderr


CRAFTED = [
    pytest.param(lambda m: {**m, "generation": "../outside"}, r"\$\.generation", id="generation-outside"),
    pytest.param(lambda m: {**m, "units": [{**m["units"][0], "unit_id": 2**29}]}, r"\$\.units\[0\]\.unit_id", id="unit-id-2**29"),
    pytest.param(lambda m: {**m, "partitions": [{**m["partitions"][0], "nbytes": -1}]}, r"\$\.partitions\[0\]\.nbytes", id="negative-size"),
    pytest.param(lambda m: {**m, "partitions": [{**m["partitions"][0], "path": "../../outside/p.arrow"}]}, r"\$\.partitions\[0\]\.path", id="path-outside"),
    pytest.param(lambda m: {**m, "units": [{**m["units"][0], "files": [{**m["units"][0]["files"][0], "path": "unit-0/../../x.arrow"}]}]},
                 r"\$\.units\[0\]\.files\[0\]\.path", id="unit-file-outside"),
]


@pytest.mark.parametrize(("craft", "where"), CRAFTED)
def test_a_crafted_manifest_is_refused_before_anything_is_sized_by_it(
    c: tqueue.Client, cluster: tqueue.LocalCluster, places: tuple[pathlib.Path, pathlib.Path], craft: Any, where: str,
) -> None:
    root, outside = places
    (outside / "gen-x").mkdir(exist_ok=True)
    name = f"crafted-{secrets.token_hex(3)}"
    manifest = saved(c, root, name, f"confined/{name}")
    before, peaks = resident(c), [peak_rss(pid) for pid in cluster.pids]
    rewrite(root, name, craft(manifest))
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match=rf"checkpoint {name}: manifest.json is not a valid manifest: .*{where}") as err:
        c.load_checkpoint(name)
    assert time.monotonic() - started < FAST
    assert str(outside) not in str(err.value) and not re.search(r"\d+ bytes|exists", str(err.value))  # of no file outside
    assert resident(c) == before and f"confined/{name}" not in {p.name for p in c.status().partitions}
    assert all(peak_rss(pid) < peak + (64 << 20) for pid, peak in zip(cluster.pids, peaks))


def _rewrite_payload(path: pathlib.Path, index: int) -> tuple[int, int]:
    """A payload file rewritten with its first sample's index set to ``index``: valid Arrow,
    a valid CRC; its size and CRC-32C."""
    table = pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()
    idx = table.column("index").to_pylist()
    table = table.set_column(0, table.schema.field("index"), pa.array([index, *idx[1:]], type=pa.int64()))
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    data = path.read_bytes()
    return len(data), crc(data)


def test_a_load_that_fails_on_one_unit_leaves_nothing_resident(
    c: tqueue.Client, places: tuple[pathlib.Path, pathlib.Path]
) -> None:
    """One unit's file holds an index past max_index (its CRC valid: a crafter's): the other
    unit has loaded its file by then; both hold what they held before, and status says so."""
    root, _ = places
    manifest = saved(c, root, "rollback", "confined/rollback")
    before = resident(c)
    unit = next(u for u in manifest["units"] if u["files"])
    entry = unit["files"][0]
    entry["nbytes"], entry["crc32c"] = _rewrite_payload(root / "rollback" / manifest["generation"] / entry["path"], 1 << 40)
    rewrite(root, "rollback", manifest)
    with pytest.raises(InvalidArgumentError, match=rf"checkpoint rollback/gen-\S+: {entry['path']} \(field 'x' .*\): sample indexes outside"):
        c.load_checkpoint("rollback")
    assert resident(c) == before and "confined/rollback" not in {p.name for p in c.status().partitions}


def _mask_offset(path: pathlib.Path) -> int:
    """Where the first sample's mask lies in a partition file."""
    buf = pa.py_buffer(path.read_bytes())
    batch = pa.ipc.open_file(pa.BufferReader(buf)).get_batch(0)
    return batch.column("mask").buffers()[1].address - buf.address


def test_a_bit_flipped_on_disk_is_refused_naming_the_file(
    c: tqueue.Client, places: tuple[pathlib.Path, pathlib.Path]
) -> None:
    root, _ = places
    manifest = saved(c, root, "rot", "confined/rot")
    gen = root / "rot" / manifest["generation"]
    before = resident(c)

    payload = gen / manifest["units"][0]["files"][0]["path"]
    data = payload.read_bytes()
    at = max(data.find(bytes([0xA0]) * 64), data.find(bytes([0xA1]) * 64))  # the samples of one put
    flip(payload, at + 5)  # one bit of one sample's bytes
    with pytest.raises(DataCorruptionError, match=r"checkpoint rot/gen-\S+: unit-\d/p\d+-f0\.arrow \(field 'x' of partition 'confined/rot', unit \d\) fails its CRC-32C"):
        c.load_checkpoint("rot")
    assert resident(c) == before and "confined/rot" not in {p.name for p in c.status().partitions}
    flip(payload, at + 5)

    part = gen / manifest["partitions"][0]["path"]
    at = _mask_offset(part)
    flip(part, at)  # one bit of a sample's mask
    with pytest.raises(DataCorruptionError, match=r"checkpoint rot: gen-\S+/partitions/p\d+\.arrow \(partition 'confined/rot'\) fails its CRC-32C"):
        c.load_checkpoint("rot")
    flip(part, at)

    text = (root / "rot" / "manifest.json").read_text()
    (root / "rot" / "manifest.json").write_text(text.replace('"samples": 8', '"samples": 9'))
    with pytest.raises(DataCorruptionError, match="checkpoint rot: manifest.json fails its CRC-32C"):
        c.load_checkpoint("rot")
    (root / "rot" / "manifest.json").write_text(text)
    assert resident(c) == before
    c.load_checkpoint("rot")  # as written: loads
    meta = c.get_meta("confined/rot", ["x"], 8, task="t", timeout=10)
    assert sorted(c.get_data(meta)["x"][:, 0].tolist()) == [0xA0] * 4 + [0xA1] * 4
    c.clear("confined/rot")


def test_a_checkpoint_written_before_checksums_loads_unverified(
    c: tqueue.Client, places: tuple[pathlib.Path, pathlib.Path]
) -> None:
    """The documented choice (docs/reliability.md, Checkpoints): a version-1 manifest, without
    checksums, loads as it did, its files not verified."""
    root, _ = places
    manifest = saved(c, root, "old", "confined/old")
    old = {k: v for k, v in manifest.items() if k != "crc32c"}
    old["version"] = 1
    for p in old["partitions"]:
        del p["crc32c"]
    for u in old["units"]:
        for f in u["files"]:
            del f["crc32c"]
    (root / "old" / "manifest.json").write_text(json.dumps(old))
    c.load_checkpoint("old")
    meta = c.get_meta("confined/old", ["x"], 8, task="t", timeout=10)
    assert sorted(c.get_data(meta)["x"][:, 0].tolist()) == [0xA0] * 4 + [0xA1] * 4
    c.clear("confined/old")


def test_a_crafted_partition_file_is_refused_before_it_is_rebuilt(
    c: tqueue.Client, cluster: tqueue.LocalCluster, places: tuple[pathlib.Path, pathlib.Path]
) -> None:
    """A partition file with a valid CRC (a crafter's) whose unit column names unit 2**29 (a
    rebuild would size a table by it: 1 GiB), or whose header claims 2**40 samples."""
    root, _ = places
    manifest = saved(c, root, "part", "confined/part")
    entry = manifest["partitions"][0]
    path = root / "part" / manifest["generation"] / entry["path"]
    table = pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()
    header = json.loads(table.schema.metadata[b"tqueue"])
    units = table.column("unit").to_pylist()
    crafted = {
        "column 'unit' holds values outside": table.set_column(
            table.schema.get_field_index("unit"), "unit", pa.array([2**29, *units[1:]], type=pa.int64())),
        "past max_partition_samples": table.replace_schema_metadata({"tqueue": json.dumps({**header, "n": 2**40})}),
    }
    before, peaks = resident(c), [peak_rss(pid) for pid in cluster.pids]
    for what, bad in crafted.items():
        with pa.ipc.new_file(str(path), bad.schema) as w:
            w.write_table(bad)
        data = path.read_bytes()
        rewrite(root, "part", {**manifest, "partitions": [{**entry, "nbytes": len(data), "crc32c": crc(data)}]})
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match=rf"checkpoint part: gen-\S+/partitions/p\d+\.arrow \(partition 'confined/part'\): .*{what}"):
            c.load_checkpoint("part")
        assert time.monotonic() - started < FAST
    assert resident(c) == before and all(peak_rss(pid) < peak + (64 << 20) for pid, peak in zip(cluster.pids, peaks))
