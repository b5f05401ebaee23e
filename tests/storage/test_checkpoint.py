"""A unit's payload in a checkpoint (storage/_checkpoint.py): a snapshot of its columns, the
Arrow files written from it and loaded into another store give back every sample's bytes,
integers narrowed for the trip widened back, pieces overwritten after the snapshot as they
were before."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from tqueue.errors import DataCorruptionError
from tqueue.storage import _checkpoint
from tqueue.storage._checkpoint import FORMAT_VERSION, UnitCheckpoints, _read_all, _write_all
from tqueue.storage._store import PayloadStore
from tqueue.wire import FieldBlock, FieldSpec, UnitFile
from tqueue.wire._crc import crc
from tqueue.wire._durable import Place

MAX_INDEX = 1 << 20


def _place(folder: pathlib.Path) -> Place:
    folder.mkdir(parents=True, exist_ok=True)  # the generation's folder: the controller makes it
    return Place(str(folder))


def _read(store: PayloadStore, uid: int, name: str, field: str, indexes: list[int]) -> tuple[FieldBlock, bytes]:
    reply = store.read(uid, name, np.asarray(indexes, dtype=np.int64), [field])
    return reply.blocks[0], b"".join(bytes(f) for f in reply.frames)


def test_the_payload_comes_back_from_its_files(tmp_path: pathlib.Path) -> None:
    store = PayloadStore()
    ids = FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1)
    narrow = np.array([1, -2, 3, 4, 5, -6], dtype=np.int8)  # 3 samples of 2, 1, 3 int64 values, sent as int8
    store.write(9, "p", np.array([0, 1, 2]), [FieldBlock(name="ids", spec=ids, counts=[3], shapes=[2, 1, 3], packed=["int8"])],
                [narrow.tobytes()]).commit()
    obj = FieldSpec(kind="object", layout="jagged")
    store.write(9, "p", np.array([0, 1, 2]), [FieldBlock(name="o", spec=obj, counts=[1, 2], sizes=[1, 2, 3])],
                [b"a", b"bbccc"]).commit()
    columns = UnitCheckpoints(store, None, lambda r: None).snapshot([9, 404])
    # overwritten after the snapshot: the snapshot keeps the piece it saw
    store.write(9, "p", np.array([1]), [FieldBlock(name="o", spec=obj, counts=[1], sizes=[1])], [b"z"]).commit()
    files = _write_all(_place(tmp_path), "unit-3", columns)
    assert sorted((f.field, f.rows) for f in files) == [("ids", 3), ("o", 3)]
    assert all((tmp_path / f.path).stat().st_size == f.nbytes for f in files)
    assert all(f.crc32c == crc((tmp_path / f.path).read_bytes()) for f in files)

    fresh = PayloadStore()
    for uid, name, indexes, block, frame in _read_all(Place(str(tmp_path)), files, MAX_INDEX):
        fresh.write(uid, name, indexes, [block], [frame]).commit()
    block, data = _read(fresh, 9, "p", "ids", [0, 1, 2])
    assert block.shapes == [2, 1, 3] and not block.packed
    assert np.frombuffer(data, dtype=np.int64).tolist() == [1, -2, 3, 4, 5, -6]
    block, data = _read(fresh, 9, "p", "o", [2, 0, 1])
    assert block.sizes == [3, 1, 2] and data == b"cccabb"


def test_a_write_the_controller_had_not_committed_is_left_out(tmp_path: pathlib.Path) -> None:
    """An update installed on the unit but not committed at the controller's copy (say, one
    the controller will refuse) is seen through: the snapshot holds the samples as they were.
    A new put not committed leaves no record on the unit (every put would pay for one): its
    samples are in the snapshot, which the controller's copy does not know, so a restore
    never serves them."""
    store = PayloadStore()
    spec = FieldSpec(kind="ndarray", dtype="uint8", layout="dense", shape=(2,))
    store.write(4, "p", np.array([0, 1, 2]), [FieldBlock(name="x", spec=spec, counts=[3])], [b"aabbcc"], grant=1).commit()
    store.write(4, "p", np.array([2, 0]), [FieldBlock(name="x", spec=spec, counts=[1, 1])], [b"ZZ", b"XX"], grant=2)
    store.write(4, "p", np.array([3]), [FieldBlock(name="x", spec=spec, counts=[1])], [b"nn"], grant=3)
    assert sorted(store.installed) == [2]
    checkpoints = UnitCheckpoints(store, None, lambda r: None)
    for exclude, want in (([2, 3], b"aabbccnn"), ([], b"XXbbZZnn")):
        folder = tmp_path / f"e{len(exclude)}"
        files = _write_all(_place(folder), "unit-0", checkpoints.snapshot([4], exclude))
        fresh = PayloadStore()
        for uid, name, indexes, block, frame in _read_all(Place(str(folder)), files, MAX_INDEX):
            fresh.write(uid, name, indexes, [block], [frame]).commit()
        held = fresh.partitions[4].columns["x"]
        n = int((held.piece_of[: held.top] > 0).sum())
        assert _read(fresh, 4, "p", "x", list(range(n)))[1] == want


# --- values shared by content ------------------------------------------------------------

IMAGE = FieldSpec(kind="ndarray", dtype="uint8", layout="jagged", ndim=1)


def _shared_store() -> tuple[PayloadStore, list[bytes]]:
    """Partition 9 "p", field "image" shared by content: samples 0-5 hold values a, b, a, c,
    b, a (three values, each stored once), each with its CRC-32C."""
    store = PayloadStore()
    values = [b"a" * 300, b"bb" * 100, b"c" * 50]
    held = [0, 1, 0, 2, 1, 0]
    block = FieldBlock(name="image", spec=IMAGE, counts=[3], shapes=[len(v) for v in values],
                       crcs=[crc(v) for v in values], value_of=held)
    store.write(9, "p", np.arange(6), [block], [b"".join(values)]).commit()
    return store, [values[k] for k in held]


def _save(store: PayloadStore, folder: pathlib.Path) -> list[UnitFile]:
    return _write_all(_place(folder), "unit-3", UnitCheckpoints(store, None, lambda r: None).snapshot([9]))


def _load(folder: pathlib.Path, files: list[UnitFile]) -> PayloadStore:
    fresh = PayloadStore()
    for uid, name, indexes, block, frame in _read_all(Place(str(folder)), files, MAX_INDEX):
        fresh.write(uid, name, indexes, [block], [frame]).commit()
    return fresh


def test_a_shared_value_is_in_the_file_once_and_comes_back_stored_once(tmp_path: pathlib.Path) -> None:
    store, want = _shared_store()
    [entry] = _save(store, tmp_path)
    assert entry.rows == 6 and entry.payload == 300 + 200 + 50  # each value once
    table = pa.ipc.open_file(tmp_path / entry.path).read_all()
    assert json.loads(table.schema.metadata[b"tqueue"])["version"] == FORMAT_VERSION == 2
    ref = np.asarray(table.column("ref"))
    assert sorted(ref.tolist()) == [-1, -1, -1, 0, 0, 3]  # a, a, a then b, b then c: rows of their batch
    every = table.column("value").take(np.where(ref < 0, np.arange(len(ref)), ref))  # pyarrow alone reads it
    assert dict(zip(table.column("index").to_pylist(), every.to_pylist())) == dict(enumerate(want))

    fresh = _load(tmp_path, [entry])
    assert fresh.nbytes == store.nbytes == 550 and fresh.bytes_shared() == store.bytes_shared() == 2 * 300 + 200
    block, data = _read(fresh, 9, "p", "image", list(range(6)))
    assert block.value_of == [0, 1, 0, 2, 1, 0] and block.crcs == [crc(v) for v in want[:2] + want[3:4]]
    assert data == want[0] + want[1] + want[3]


def test_a_value_s_holders_are_never_split_between_batches(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkpoint, "BATCH_BYTES", 100)  # a batch per value
    store, want = _shared_store()
    [entry] = _save(store, tmp_path)
    reader = pa.ipc.open_file(tmp_path / entry.path)
    assert reader.num_record_batches == 3
    fresh = _load(tmp_path, [entry])
    assert fresh.nbytes == 550 and fresh.bytes_shared() == 800
    assert _read(fresh, 9, "p", "image", [5, 3, 4])[1] == want[5] + want[3] + want[4]


def test_equal_values_of_two_pieces_are_one_value_in_the_file(tmp_path: pathlib.Path) -> None:
    """A write not committed yet (its values not matched against the stored ones) and a
    packed value equal to a wide one, once widened: each one value in the file."""
    store, want = _shared_store()
    again = FieldBlock(name="image", spec=IMAGE, counts=[1], shapes=[300], value_of=[0, 0])
    store.write(9, "p", np.array([6, 7]), [again], [b"a" * 300], grant=5)  # installed, not committed
    ids = FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1)
    wide = np.arange(40, dtype=np.int64)
    store.write(9, "p", np.array([0, 1]), [FieldBlock(name="ids", spec=ids, counts=[1], shapes=[40], value_of=[0, 0])],
                [wide.tobytes()]).commit()
    store.write(9, "p", np.array([2]), [FieldBlock(name="ids", spec=ids, counts=[1], shapes=[40], packed=["int8"],
                                                   value_of=[0])], [wide.astype(np.int8).tobytes()]).commit()
    assert store.nbytes == 550 + 300 + 320 + 40
    files = {f.field: f for f in _save(store, tmp_path)}
    assert files["image"].payload == 550 and files["ids"].payload == 320
    fresh = _load(tmp_path, list(files.values()))
    assert fresh.nbytes == 550 + 320
    assert _read(fresh, 9, "p", "image", [6, 7, 0])[1] == b"a" * 300
    assert _read(fresh, 9, "p", "ids", [2, 0])[1] == wide.tobytes()


def _rewritten(folder: pathlib.Path, entry: UnitFile, change: Any) -> UnitFile:
    """``entry``'s file with ``change`` applied to its one batch's columns (a dict), written as
    a crafter would: its size and CRC-32C in the entry."""
    path = folder / entry.path
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    assert reader.num_record_batches == 1
    batch = reader.get_batch(0)
    columns = {n: batch.column(n).to_pylist() for n in batch.schema.names}
    change(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, reader.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pydict(columns, schema=reader.schema))
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return msgspec.structs.replace(entry, nbytes=len(data), crc32c=crc(data))


def _set(column: str, row: int, value: Any) -> Any:
    def change(columns: dict[str, list[Any]]) -> None:
        columns[column][row] = value
    return change


@pytest.mark.parametrize(("change", "match"), [
    (_set("ref", 4, 9), r"sample 4 refers to row 9 of its record batch, which is not there"),
    (_set("ref", 4, -2), r"sample 4 refers to row -2 of its record batch, which is not there"),
    (_set("ref", 4, 4), r"sample 4 refers to row 4 of its record batch, which carries no value"),
    (_set("ref", 4, 1), r"sample 4 refers to row 1 of its record batch, which carries no value"),
    (_set("value", 4, b"b" * 200), r"sample 4 refers to row 3 of its record batch and carries bytes of its own"),
    (_set("shape", 4, [199]), r"sample 4 has shape \[199\], the value it refers to \[200\]"),
    (_set("crc", 4, 12345), r"sample 4 has a CRC-32C other than the value it refers to"),
])
def test_a_reference_to_a_value_that_is_not_there_is_refused(tmp_path: pathlib.Path, change: Any, match: str) -> None:
    """Rows 0-5 of the file: samples 0, 2, 5 (value a: row 0 carries it), 1, 4 (b: row 3),
    3 (c: row 5); a crafted file with valid checksums whose references are wrong is refused,
    naming the field, the partition and the sample."""
    store, _ = _shared_store()
    [entry] = _save(store, tmp_path)
    assert pa.ipc.open_file(tmp_path / entry.path).get_batch(0).column("index").to_pylist() == [0, 2, 5, 1, 4, 3]
    bad = _rewritten(tmp_path, entry, change)
    with pytest.raises(DataCorruptionError, match=r"unit-3/p9-f0.arrow \(field 'image' of partition 'p', unit 3\): " + match):
        _read_all(Place(str(tmp_path)), [bad], MAX_INDEX)


def test_a_bit_flipped_in_a_shared_values_file_is_caught(tmp_path: pathlib.Path) -> None:
    store, _ = _shared_store()
    [entry] = _save(store, tmp_path)
    path = tmp_path / entry.path
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"bb" * 100) + 7  # inside value b, held by samples 1 and 4
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DataCorruptionError, match=r"unit-3/p9-f0.arrow \(field 'image' of partition 'p', unit 3\) fails its CRC-32C"):
        _read_all(Place(str(tmp_path)), [entry], MAX_INDEX)


def test_a_payload_file_of_version_1_with_shared_values_loads(tmp_path: pathlib.Path) -> None:
    """The layout version 1 wrote, built here by hand: every holder's bytes in its own row;
    the load stores each value once again."""
    _, want = _shared_store()
    header = {"format": "tqueue-payload", "version": 1, "partition": "p", "partition_uid": 9, "field": "image",
              "spec": {"kind": "ndarray", "dtype": "uint8", "layout": "jagged", "shape": [], "ndim": 1}, "shared": True}
    schema = pa.schema([pa.field("index", pa.int64()), pa.field("value", pa.large_binary(), nullable=False),
                        pa.field("shape", pa.list_(pa.int64(), 1)), pa.field("crc", pa.int64())],
                       metadata={"tqueue": json.dumps(header)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pydict({
            "index": list(range(6)), "value": want, "shape": [[len(v)] for v in want], "crc": [crc(v) for v in want],
        }, schema=schema))
    data = sink.getvalue().to_pybytes()
    (tmp_path / "unit-3").mkdir()
    (tmp_path / "unit-3" / "p9-f0.arrow").write_bytes(data)
    entry = UnitFile(path="unit-3/p9-f0.arrow", partition_uid=9, partition="p", field="image", rows=6,
                     nbytes=len(data), payload=sum(map(len, want)), crc32c=crc(data))
    fresh = _load(tmp_path, [entry])
    assert fresh.nbytes == 550 and fresh.bytes_shared() == 800
    block, got = _read(fresh, 9, "p", "image", list(range(6)))
    assert block.value_of == [0, 1, 0, 2, 1, 0] and got == want[0] + want[1] + want[3]


def test_dense_and_object_fields_shared_by_content_come_back(tmp_path: pathlib.Path) -> None:
    store = PayloadStore()
    dense = FieldSpec(kind="ndarray", dtype="float32", layout="dense", shape=(2, 3))
    rows = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    obj = FieldSpec(kind="object", layout="jagged")
    store.write(9, "p", np.arange(5), [
        FieldBlock(name="d", spec=dense, counts=[2], value_of=[0, 1, 1, 0, 1]),
        FieldBlock(name="o", spec=obj, counts=[2], sizes=[3, 5], value_of=[1, 1, 0, 1, 0]),
    ], [rows.tobytes(), b"abcdefgh"]).commit()
    files = _save(store, tmp_path)
    assert sorted((f.field, f.payload) for f in files) == [("d", 48), ("o", 8)]
    fresh = _load(tmp_path, files)
    assert fresh.nbytes == store.nbytes == 56 and fresh.bytes_shared() == store.bytes_shared()
    block, data = _read(fresh, 9, "p", "d", [4, 0, 1, 2, 3])
    assert block.spec.layout == "dense" and block.spec.shape == (2, 3) and block.value_of == [0, 1, 0, 0, 1]
    assert data == rows[1].tobytes() + rows[0].tobytes()
    block, data = _read(fresh, 9, "p", "o", [0, 2, 1])
    assert block.sizes == [5, 3] and block.value_of == [0, 1, 0] and data == b"defghabc"
