"""A unit's payload in a checkpoint (storage/_checkpoint.py, its files storage/_payload_files.py): a snapshot of its columns, the
Arrow files written from it and loaded into another store give back every sample's bytes,
integers narrowed for the trip kept narrow (the file says their type), pieces overwritten
after the snapshot as they were before."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from tqueue.client._integrity import crcs_widened
from tqueue.errors import DataCorruptionError, InvalidArgumentError
from tqueue.storage import _payload_files
from tqueue.storage._checkpoint import UnitCheckpoints
from tqueue.storage._payload_files import FORMAT_VERSION, read_all, write_all
from tqueue.storage._store import PayloadStore
from tqueue.wire import FieldBlock, FieldSpec, UnitFile
from tqueue.wire._crc import crc
from tqueue.wire._durable import Place
from tqueue.wire._pack import PACKED

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
    files = write_all(_place(tmp_path), "unit-3", columns)
    assert sorted((f.field, f.rows) for f in files) == [("ids", 3), ("o", 3)]
    assert all((tmp_path / f.path).stat().st_size == f.nbytes for f in files)
    assert all(f.crc32c == crc((tmp_path / f.path).read_bytes()) for f in files)

    fresh = PayloadStore()
    for uid, name, indexes, block, frames in read_all(Place(str(tmp_path)), files, MAX_INDEX):
        fresh.write(uid, name, indexes, [block], frames).commit()
    block, data = _read(fresh, 9, "p", "ids", [0, 1, 2])
    assert block.shapes == [2, 1, 3] and block.packed == ["int8"]  # held narrow again, as before the save
    assert np.frombuffer(data, dtype=np.int8).tolist() == [1, -2, 3, 4, 5, -6]
    assert fresh.nbytes == 6 + 1 + 5  # the ids one byte each, as the store held them (not 48)
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
        files = write_all(_place(folder), "unit-0", checkpoints.snapshot([4], exclude))
        fresh = PayloadStore()
        for uid, name, indexes, block, frames in read_all(Place(str(folder)), files, MAX_INDEX):
            fresh.write(uid, name, indexes, [block], frames).commit()
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
    return write_all(_place(folder), "unit-3", UnitCheckpoints(store, None, lambda r: None).snapshot([9]))


def _load(folder: pathlib.Path, files: list[UnitFile]) -> PayloadStore:
    fresh = PayloadStore()
    for uid, name, indexes, block, frames in read_all(Place(str(folder)), files, MAX_INDEX):
        fresh.write(uid, name, indexes, [block], frames).commit()
    return fresh


def test_a_shared_value_is_in_the_file_once_and_comes_back_stored_once(tmp_path: pathlib.Path) -> None:
    store, want = _shared_store()
    [entry] = _save(store, tmp_path)
    assert entry.rows == 6 and entry.payload == 300 + 200 + 50  # each value once
    table = pa.ipc.open_file(tmp_path / entry.path).read_all()
    assert json.loads(table.schema.metadata[b"tqueue"])["version"] == FORMAT_VERSION == 3
    assert "packed" not in table.schema.names  # (no packed integers: the columns of version 2)
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
    monkeypatch.setattr(_payload_files, "BATCH_BYTES", 100)  # a batch per value
    store, want = _shared_store()
    [entry] = _save(store, tmp_path)
    reader = pa.ipc.open_file(tmp_path / entry.path)
    assert reader.num_record_batches == 3
    fresh = _load(tmp_path, [entry])
    assert fresh.nbytes == 550 and fresh.bytes_shared() == 800
    assert _read(fresh, 9, "p", "image", [5, 3, 4])[1] == want[5] + want[3] + want[4]


def test_equal_values_of_two_pieces_are_one_value_in_the_file(tmp_path: pathlib.Path) -> None:
    """A write not committed yet (its values not matched against the stored ones) and a
    packed value equal to a wide one, once widened: each one value in the file, the packed one
    in the narrowest form a piece holds it in (the wide holder's piece came first)."""
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
    assert files["image"].payload == 550 and files["ids"].payload == 40
    table = pa.ipc.open_file(tmp_path / files["ids"].path).read_all()
    assert table.column("packed").to_pylist() == ["int8"] * 3 and sorted(table.column("ref").to_pylist()) == [-1, 0, 0]
    fresh = _load(tmp_path, list(files.values()))
    assert fresh.nbytes == 550 + 40
    assert _read(fresh, 9, "p", "image", [6, 7, 0])[1] == b"a" * 300
    block, data = _read(fresh, 9, "p", "ids", [2, 0])
    assert block.packed == ["int8"] and block.value_of == [0, 0] and data == wide.astype(np.int8).tobytes()


def _rewritten(folder: pathlib.Path, entry: UnitFile, change: Any) -> UnitFile:
    """``entry``'s file with ``change`` applied to its one batch's columns (a dict), written as
    a crafter would: its size and CRC-32C in the entry."""
    return _rewrite(folder, entry, change)


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
        read_all(Place(str(tmp_path)), [bad], MAX_INDEX)


def test_a_bit_flipped_in_a_shared_values_file_is_caught(tmp_path: pathlib.Path) -> None:
    store, _ = _shared_store()
    [entry] = _save(store, tmp_path)
    path = tmp_path / entry.path
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"bb" * 100) + 7  # inside value b, held by samples 1 and 4
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DataCorruptionError, match=r"unit-3/p9-f0.arrow \(field 'image' of partition 'p', unit 3\) fails its CRC-32C"):
        read_all(Place(str(tmp_path)), [entry], MAX_INDEX)


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


# --- packed integers (version 3) ---------------------------------------------------------

EXPERTS = FieldSpec(kind="tensor", dtype="int32", layout="jagged", ndim=3)  # routed experts [tokens, 48, 8]
POSITIONS = FieldSpec(kind="tensor", dtype="int64", layout="dense", shape=(512,))


def _packed_store() -> tuple[PayloadStore, dict[str, list[np.ndarray]]]:
    """Partition 9 "p" of 8 samples: routed experts (int32, ids under 128) held as int8 for
    samples 0-5 (one piece, three frames, as a put over a socket leaves them) and wide for 6-7
    (a put with pack_ints off); positions (int64, under 500) as int16 for 0-5, wide for 6-7.
    Each sample's CRC-32C is of its wide bytes, as its producer computed it. Frames are numpy
    buffers, as a load leaves them (so the store's bookkeeping compares too)."""
    rng = np.random.default_rng(3)
    experts = [rng.integers(0, 128, (5 + 3 * i, 48, 8), dtype=np.int32) for i in range(8)]
    positions = [(np.arange(512) * (i + 1) % 500).astype(np.int64) for i in range(8)]
    store = PayloadStore()

    def block(name: str, spec: FieldSpec, values: list[np.ndarray], counts: list[int], packed: Any) -> FieldBlock:
        shapes = [d for v in values for d in v.shape] if spec.layout == "jagged" else None
        return FieldBlock(name=name, spec=spec, counts=counts, shapes=shapes, packed=packed,
                          crcs=[crc(v.tobytes()) for v in values])

    def joined(values: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate([v.reshape(-1) for v in values]).astype(dtype).view(np.uint8)

    store.write(9, "p", np.arange(6), [
        block("routed_experts", EXPERTS, experts[:6], [2, 2, 2], ["int8"] * 3),
        block("positions", POSITIONS, positions[:6], [6], ["int16"]),
    ], [*(joined(experts[k : k + 2], np.int8) for k in (0, 2, 4)), joined(positions[:6], np.int16)]).commit()
    store.write(9, "p", np.array([6, 7]), [
        block("routed_experts", EXPERTS, experts[6:], [2], None), block("positions", POSITIONS, positions[6:], [2], None),
    ], [joined(experts[6:], np.int32), joined(positions[6:], np.int64)]).commit()
    return store, {"routed_experts": experts, "positions": positions}


def _wide(store: PayloadStore, field: str, indexes: list[int]) -> tuple[FieldBlock, list[Any], np.ndarray]:
    """``field`` of ``indexes`` as the store serves it (its block and frames) and widened, as a
    reader's client widens it: the values in the field's dtype, back to back."""
    reply = store.read(9, "p", np.asarray(indexes, dtype=np.int64), [field])
    [block] = reply.blocks
    dtype = np.dtype(block.spec.dtype)
    packed = block.packed or [""] * len(reply.frames)
    wide = [np.frombuffer(f, dtype=PACKED[k] if k else dtype).astype(dtype) for f, k in zip(reply.frames, packed)]
    return block, list(reply.frames), np.concatenate(wide)


def test_packed_integers_stay_narrow_in_the_file_and_after_the_load(tmp_path: pathlib.Path) -> None:
    """The file holds each value as the store held it (routed experts one byte an id, positions
    two bytes), its ``packed`` column saying in which type; the load stores them so again: the
    store's bytes and bookkeeping as before the save (each piece back with its frames), every
    value exact once widened, every CRC-32C still that of the wide bytes."""
    store, want = _packed_store()
    files = {f.field: f for f in _save(store, tmp_path)}
    experts = want["routed_experts"]
    narrow = {"routed_experts": sum(e.size for e in experts[:6]) + 4 * sum(e.size for e in experts[6:]),
              "positions": 6 * 512 * 2 + 2 * 512 * 8}  # each byte as the store holds it
    for field, entry in files.items():
        assert entry.payload == narrow[field]
        assert (tmp_path / entry.path).stat().st_size < 1.3 * narrow[field] + (4 << 10)
    table = pa.ipc.open_file(tmp_path / files["routed_experts"].path).read_all()
    assert table.column("packed").to_pylist() == ["int8"] * 6 + [""] * 2
    assert table.schema.field("packed").type == pa.dictionary(pa.int8(), pa.string())

    fresh = _load(tmp_path, list(files.values()))
    assert fresh.nbytes == store.nbytes == sum(narrow.values()) and fresh.resident == store.resident
    for field, values in want.items():
        indexes = [7, 0, 3, 6, 1, 2, 5, 4]
        block, frames, wide = _wide(fresh, field, indexes)
        assert set(block.packed or ()) == {"", "int8" if field == "routed_experts" else "int16"}
        assert wide.tobytes() == b"".join(values[i].tobytes() for i in indexes)
        assert block.crcs == [crc(values[i].tobytes()) for i in indexes]
        assert crcs_widened(block, frames).tolist() == block.crcs  # what a reader's check computes
        if field == "routed_experts":
            assert block.shapes == [d for i in indexes for d in values[i].shape]


def test_the_files_widen_offline_with_pyarrow_and_numpy(tmp_path: pathlib.Path) -> None:
    """docs/api.md's recipe: a row's value in its ``packed`` type ("" the field's dtype), widened
    to the spec's dtype, is the sample."""
    store, want = _packed_store()
    for entry in _save(store, tmp_path):
        table = pa.ipc.open_file(pa.memory_map(str(tmp_path / entry.path))).read_all()
        spec = json.loads(table.schema.metadata[b"tqueue"])["spec"]
        for i, value, packed, shape in zip(*(table.column(n).to_pylist() for n in ("index", "value", "packed", "shape"))):
            got = np.frombuffer(value, dtype=packed or spec["dtype"]).astype(spec["dtype"]).reshape(shape)
            assert np.array_equal(got, want[entry.field][i]) and got.dtype == want[entry.field][i].dtype


def test_a_sample_appended_in_rows_of_several_widths_comes_back_in_one_they_fit(tmp_path: pathlib.Path) -> None:
    """Rows of a sample that appends grew are joined in the file: narrow where every row is
    packed alike, else in the narrowest type all its values fit; the CRC-32C of the whole is of
    the wide values."""
    spec = FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1)
    rows = {0: [np.arange(3), np.arange(2)], 1: [np.arange(4), np.array([300, -5, 7])], 2: [np.arange(2), np.array([1 << 40])]}
    store = PayloadStore()

    def put(k: int, narrow: list[Any], append: tuple[str, ...] = ()) -> None:
        values = [np.asarray(rows[i][k], dtype=np.int64) for i in range(3)]
        frames = [v.astype(t) if t else v for v, t in zip(values, narrow)]
        block = FieldBlock(name="ids", spec=spec, counts=[1, 1, 1], shapes=[len(v) for v in values],
                           packed=[str(t.__name__) if t else "" for t in narrow], crcs=[crc(v.tobytes()) for v in values])
        store.write(9, "p", np.arange(3), [block], [f.view(np.uint8) for f in frames], append=append).commit()

    put(0, [np.int8, np.int8, np.int8])
    put(1, [np.int8, np.int16, None], append=("ids",))
    [entry] = _save(store, tmp_path)
    table = pa.ipc.open_file(tmp_path / entry.path).read_all()
    assert dict(zip(table.column("index").to_pylist(), table.column("packed").to_pylist())) == {0: "int8", 1: "int16", 2: ""}
    fresh = _load(tmp_path, [entry])
    for i, parts in rows.items():
        whole = np.concatenate(parts).astype(np.int64)
        block, frames, wide = _wide(fresh, "ids", [i])
        assert wide.tolist() == whole.tolist() and block.crcs == [crc(whole.tobytes())]
        assert block.packed == (None if i == 2 else ["int8" if i == 0 else "int16"])
        if block.packed:
            assert crcs_widened(block, frames).tolist() == block.crcs
    assert fresh.nbytes == 5 + 7 * 2 + 3 * 8


def test_a_bit_flipped_in_a_narrow_value_is_caught(tmp_path: pathlib.Path) -> None:
    """On disk, by the file's CRC-32C; in a file rewritten with valid checksums (or a unit's
    memory before the save), by the sample's own CRC-32C of its wide values, as a reader checks
    it after the load: that sample alone fails."""
    store, want = _packed_store()
    entry = next(f for f in _save(store, tmp_path) if f.field == "routed_experts")
    path = tmp_path / entry.path
    good = path.read_bytes()
    at = good.index(want["routed_experts"][3].astype(np.int8).tobytes()) + 100  # inside sample 3's narrow ids
    data = bytearray(good)
    data[at] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(DataCorruptionError, match=r"p9-f0.arrow \(field 'routed_experts' of partition 'p', unit 3\) fails its CRC-32C"):
        read_all(Place(str(tmp_path)), [entry], MAX_INDEX)
    crafted = msgspec.structs.replace(entry, crc32c=crc(bytes(data)))
    fresh = _load(tmp_path, [crafted])
    block, frames, wide = _wide(fresh, "routed_experts", list(range(8)))
    got = crcs_widened(block, frames)
    assert np.flatnonzero(got != np.asarray(block.crcs)).tolist() == [3]


def _rewrite(folder: pathlib.Path, entry: UnitFile, change: Any, *, fields: Any = None, header: Any = None) -> UnitFile:
    """``entry``'s file rewritten as a crafter would, its one batch's columns (a dict) through
    ``change``; ``fields`` replaces schema fields by name, ``header`` changes its metadata."""
    path = folder / entry.path
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    assert reader.num_record_batches == 1
    batch = reader.get_batch(0)
    columns = {n: batch.column(n).to_pylist() for n in batch.schema.names}
    change(columns)
    meta = json.loads(reader.schema.metadata[b"tqueue"])
    if header is not None:
        header(meta)
    given = {**{f.name: f for f in reader.schema}, **(fields or {})}
    schema = pa.schema([given[n] for n in columns], metadata={"tqueue": json.dumps(meta)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pydict(columns, schema=schema))
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return msgspec.structs.replace(entry, nbytes=len(data), crc32c=crc(data))


def _narrow_file(folder: pathlib.Path, field: str) -> UnitFile:
    """A file of ``field`` of ``_packed_store()``'s samples 0 and 1 (both packed: one batch)."""
    _, want = _packed_store()
    values = want[field][:2]
    spec = EXPERTS if field == "routed_experts" else POSITIONS
    narrow = "int8" if field == "routed_experts" else "int16"
    store = PayloadStore()
    store.write(9, "p", np.arange(2), [FieldBlock(
        name=field, spec=spec, counts=[2], packed=[narrow], crcs=[crc(v.tobytes()) for v in values],
        shapes=[d for v in values for d in v.shape] if spec.layout == "jagged" else None,
    )], [np.concatenate([v.reshape(-1) for v in values]).astype(narrow).view(np.uint8)]).commit()
    [entry] = _save(store, folder)
    return entry


def _set_packed(row: int, value: Any) -> Any:
    return _set("packed", row, value)


@pytest.mark.parametrize(("field", "change", "match"), [
    ("positions", _set_packed(1, "int12"),
     r"sample 1 is packed as 'int12', which is not a type integers are packed in \(int8, uint8, int16, int32\)"),
    ("positions", _set_packed(1, "int64"), r"sample 1 is packed as 'int64', which is not a type integers are packed in \(int8, uint8, int16, int32\)"),
    ("routed_experts", _set_packed(0, "int32"),
     r"sample 0 is packed as 'int32', which a tensor field of dtype 'int32' cannot take \(not an integer type narrower than it\)"),
    ("positions", _set("value", 1, b"\1" * 1023), r"sample 1 holds 1023 bytes, not a whole number of int16 values \(2 bytes each\)"),
    ("positions", _set_packed(1, "int8"), r"sample 1 holds 1024 int8 values, its shape \[512\] 512"),
    ("positions", _set_packed(1, ""), r"sample 1 holds 128 int64 values, its shape \[512\] 512"),
    ("routed_experts", _set("shape", 1, [9, 48, 4]), r"sample 1 holds 3072 int8 values, its shape \[9, 48, 4\] 1728"),
])
def test_a_narrow_value_the_file_misdescribes_is_refused(tmp_path: pathlib.Path, field: str, change: Any, match: str) -> None:
    """A crafted file with valid checksums whose packed types or sizes are wrong: refused,
    naming the file, field, partition and sample, before anything is stored."""
    entry = _narrow_file(tmp_path, field)
    bad = _rewrite(tmp_path, entry, change)
    where = rf"unit-3/{entry.path.split('/')[1]} \(field '{field}' of partition 'p', unit 3\): "
    with pytest.raises(DataCorruptionError, match=where + match + ": the checkpoint is damaged"):
        read_all(Place(str(tmp_path)), [bad], MAX_INDEX)


def test_a_packed_column_where_none_can_be_is_refused(tmp_path: pathlib.Path) -> None:
    entry = _narrow_file(tmp_path, "positions")
    raw = (tmp_path / entry.path).read_bytes()
    cases = [  # (change, schema fields, header change, error, message)
        (lambda c: None, None, lambda h: h.update(version=2), pytest.raises(
            Exception, match=r"a packed column in a payload file of version 2")),
        (lambda c: c.update(packed=[3, 3]), {"packed": pa.field("packed", pa.int64())}, None,
         pytest.raises(Exception, match=r"a packed column of int64, not of type names")),
        (_set_packed(0, None), {"packed": pa.field("packed", pa.string())}, None,
         pytest.raises(Exception, match=r"samples without a packed type")),
        (lambda c: c.update(value=[b"\0" * 2048] * 2), None, lambda h: h["spec"].update(dtype="float32", kind="ndarray"),
         pytest.raises(DataCorruptionError, match=r"sample 0 is packed as 'int16', which a ndarray field of dtype 'float32' cannot take")),
    ]
    for change, fields, header, raises in cases:
        (tmp_path / entry.path).write_bytes(raw)
        bad = _rewrite(tmp_path, entry, change, fields=fields, header=header)
        with raises as caught:
            read_all(Place(str(tmp_path)), [bad], MAX_INDEX)
        assert isinstance(caught.value, InvalidArgumentError | DataCorruptionError)
        assert "field 'positions' of partition 'p', unit 3" in str(caught.value)


def test_a_batch_that_names_its_piece_wrongly_is_refused(tmp_path: pathlib.Path) -> None:
    entry = _narrow_file(tmp_path, "positions")
    path = tmp_path / entry.path
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, reader.schema) as writer:
        writer.write_batch(reader.get_batch(0), custom_metadata={"tqueue": '{"piece": "one"}'})
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    bad = msgspec.structs.replace(entry, nbytes=len(data), crc32c=crc(data))
    with pytest.raises(InvalidArgumentError, match=r"a record batch's metadata is not \{\"piece\": <int>\}"):
        read_all(Place(str(tmp_path)), [bad], MAX_INDEX)


def test_a_referring_row_packed_otherwise_than_its_value_is_refused(tmp_path: pathlib.Path) -> None:
    store = PayloadStore()
    ids = FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1)
    value = np.arange(40, dtype=np.int64)
    store.write(9, "p", np.arange(3), [FieldBlock(name="ids", spec=ids, counts=[1], shapes=[40], packed=["int8"],
                                                  crcs=[crc(value.tobytes())], value_of=[0, 0, 0])],
                [value.astype(np.int8).view(np.uint8)]).commit()
    [entry] = _save(store, tmp_path)
    assert pa.ipc.open_file(tmp_path / entry.path).read_all().column("ref").to_pylist() == [-1, 0, 0]
    bad = _rewritten(tmp_path, entry, _set_packed(2, "int16"))
    with pytest.raises(DataCorruptionError, match=r"sample 2 is packed as 'int16', the value it refers to as 'int8'"):
        read_all(Place(str(tmp_path)), [bad], MAX_INDEX)
    good = _rewritten(tmp_path, bad, _set_packed(2, "int8"))
    fresh = _load(tmp_path, [good])
    block, _, wide = _wide(fresh, "ids", [2, 1])
    assert fresh.nbytes == 40 and block.value_of == [0, 0] and wide.tolist() == value.tolist()


def test_a_payload_file_of_version_2_loads_its_integers_wide(tmp_path: pathlib.Path) -> None:
    """The layout version 2 wrote, built here by hand: integers widened to the field's dtype
    (no packed column), a shared field's values once with ``ref``; they load wide, as written."""
    values = [np.arange(6, dtype=np.int64) * k for k in range(3)]
    (tmp_path / "unit-3").mkdir()
    entries = []
    for k, (field, shared, rows, ref) in enumerate([("ids", False, values, None),
                                                     ("prompt", True, [values[1], b"", b""], [-1, 0, 0])]):
        header = {"format": "tqueue-payload", "version": 2, "partition": "p", "partition_uid": 9, "field": field,
                  "spec": {"kind": "tensor", "dtype": "int64", "layout": "jagged", "shape": [], "ndim": 1}}
        columns = {"index": [0, 1, 2], "value": [bytes(v) if isinstance(v, bytes) else v.tobytes() for v in rows],
                   "shape": [[6]] * 3, "crc": [crc(v.tobytes()) for v in (values if not shared else [values[1]] * 3)]}
        fields = [pa.field("index", pa.int64()), pa.field("value", pa.large_binary(), nullable=False),
                  pa.field("shape", pa.list_(pa.int64(), 1)), pa.field("crc", pa.int64())]
        if shared:
            header["shared"] = True
            columns["ref"] = ref
            fields.append(pa.field("ref", pa.int64()))
        schema = pa.schema(fields, metadata={"tqueue": json.dumps(header)})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(pa.RecordBatch.from_pydict(columns, schema=schema))
        data = sink.getvalue().to_pybytes()
        (tmp_path / "unit-3" / f"p9-f{k}.arrow").write_bytes(data)
        entries.append(UnitFile(path=f"unit-3/p9-f{k}.arrow", partition_uid=9, partition="p", field=field, rows=3,
                                nbytes=len(data), payload=sum(len(v) for v in columns["value"]), crc32c=crc(data)))
    fresh = _load(tmp_path, entries)
    assert fresh.nbytes == 3 * 48 + 48 and fresh.bytes_shared() == 2 * 48
    block, frames, wide = _wide(fresh, "ids", [2, 0, 1])
    assert not block.packed and wide.tolist() == [*values[2], *values[0], *values[1]]
    block, frames, wide = _wide(fresh, "prompt", [0, 1, 2])
    assert not block.packed and block.value_of == [0, 0, 0] and wide.tolist() == values[1].tolist()
