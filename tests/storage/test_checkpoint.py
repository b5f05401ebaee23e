"""A unit's payload in a checkpoint (storage/_checkpoint.py): a snapshot of its columns, the
Arrow files written from it and loaded into another store give back every sample's bytes,
integers narrowed for the trip widened back, pieces overwritten after the snapshot as they
were before."""

from __future__ import annotations

import pathlib

import numpy as np

from tqueue.storage._checkpoint import UnitCheckpoints, _read_all, _write_all
from tqueue.storage._store import PayloadStore
from tqueue.wire import FieldBlock, FieldSpec
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
