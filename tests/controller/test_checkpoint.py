"""A partition's image in a checkpoint (controller/_snapshot.py): captured, written as an
Arrow IPC file, read and rebuilt; leases come back ready, puts that never committed stay out,
samples move to the units that took their payload."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import pytest

from tqueue.controller.model._partition import GrantRecord, Options, Partition
from tqueue.controller.model._samples import AVAILABLE, COMMITTED, CONSUMED, EXCLUDED
from tqueue.controller.parts._snapshot import capture, read_image, rebuild, write_image
from tqueue.errors import InvalidArgumentError
from tqueue.wire import FieldSpec
from tqueue.wire._crc import crc


def _write(folder: pathlib.Path, name: str, image) -> tuple[int, int]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return write_image(fd, name, image)
    finally:
        os.close(fd)


def test_a_partition_comes_back_from_its_image(tmp_path: pathlib.Path) -> None:
    part = Partition("train/step-2", 7, Options(group_size=2, tasks=frozenset({"a"})))
    part.schema.add({
        "x": FieldSpec(kind="tensor", dtype="float32", layout="dense", shape=(2,)),
        "ids": FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1),
    })
    part.schema.lengths["ids"] = np.array([3, 4, 5, 0], dtype=np.int64)
    start = part.allocate(3, ["g0", "g0", 5], [1, 1, 2])
    part.commit(GrantRecord(1, 7, 0, start, 3, None, frozenset({"x", "ids"}), kept=3), 0)
    part.allocate(1, [5], None)  # granted, never committed
    part.samples.add_segment(np.array([2]), 3, 17)
    part.samples.add_segment(np.array([1, 2]), 4, 20, splice={"ids": np.array([2, 4])})
    task = part.task("a")
    task.take(np.array([0, 1]), 99)
    task.ack(np.array([0]), 99)  # 0 consumed, 1 still leased
    size, crc32c = _write(tmp_path, "p.arrow", capture(part))
    data = (tmp_path / "p.arrow").read_bytes()
    assert (size, crc32c) == (len(data), crc(data))
    back = rebuild(read_image(data, "p.arrow"), {0: 4}, max_samples=1 << 20, max_tasks=16)

    assert (back.name, back.uid, back.options, back.step) == (part.name, part.uid, part.options, 2)
    assert back.specs == part.specs and back.schema.bits == part.schema.bits
    s = back.samples
    assert s.n == 4 and s.unit[:3].tolist() == [4, 4, 4] and s.unit[3] == -1
    assert np.all(s.mask[:3] & COMMITTED) and s.mask[3] & EXCLUDED  # the put that never committed stays out
    assert s.version[:3].tolist() == [1, 1, 2] and s.version_max[2] == 4
    assert s.segments == {1: [(1, 0), (4, 20, (("ids", 2),))], 2: [(2, 0), (3, 17), (4, 20, (("ids", 4),))]}
    assert s.segments_of(np.array([2])) == [[[2, 0], [3, 17], [4, 20]]]
    assert s.splices_of(np.array([0, 1, 2])) == {"ids": [[0], [0, 2], [0, -1, 4]]}  # the splice rows come back
    assert s.groups.ids == ["g0", 5] and s.groups.members == [[0, 1], [2, 3]] and s.groups.order == [0]
    assert back.schema.lengths["ids"].tolist() == [3, 4, 5, 0]
    t = back.tasks["a"]
    assert t.state[:4].tolist() == [CONSUMED, AVAILABLE, AVAILABLE, AVAILABLE] and t.lo == 1
    assert (t.consumed, t.leased) == (1, 0)  # the lease in flight came back ready
    assert back.committed == 3 and back.complete == part.complete and back.in_flight == 0
    mask, _ = back.schema.field_mask(["x"])
    assert t.find_ready(mask, 2).tolist() == [1, 2]


def test_an_image_written_before_copies_were_named_copies_loads(tmp_path: pathlib.Path) -> None:
    """A checkpoint taken before the rename names a partition's copies ``replicas`` in its
    options: it still loads, with its copies; one that names neither gets the cluster's (0)."""
    part = Partition("two", 3, Options(copies=2))
    image = capture(part)
    assert image.header["options"]["copies"] == 2 and "replicas" not in image.header["options"]
    options = dict(image.header["options"])
    options["replicas"] = options.pop("copies")  # the old form, by hand
    _write(tmp_path, "old.arrow", dataclasses.replace(image, header={**image.header, "options": options}))
    back = rebuild(read_image((tmp_path / "old.arrow").read_bytes(), "old.arrow"), {}, max_samples=16, max_tasks=4)
    assert back.options.copies == 2 and back.twice
    del options["replicas"]  # older still: no copies at all
    _write(tmp_path, "older.arrow", dataclasses.replace(image, header={**image.header, "options": options}))
    back = rebuild(read_image((tmp_path / "older.arrow").read_bytes(), "older.arrow"), {}, max_samples=16, max_tasks=4)
    assert back.options.copies == 0


def test_a_file_that_is_not_an_image_is_refused(tmp_path: pathlib.Path) -> None:
    import pyarrow as pa

    path = tmp_path / "other.arrow"
    table = pa.table({"mask": pa.array([1], type=pa.uint64())})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    with pytest.raises(InvalidArgumentError, match="other.arrow: not a tqueue partition file"):
        read_image(path.read_bytes(), "other.arrow")


@pytest.mark.parametrize("segment", [[1, 2, [["ids", -1]]], [1, 2, [["ids"]]], [1, 2, [[3, 4]]], [1, 2, 3], [1]])
def test_an_image_whose_splice_rows_are_malformed_is_refused(tmp_path: pathlib.Path, segment) -> None:
    part = Partition("p", 3, Options())
    part.schema.add({"ids": FieldSpec(kind="tensor", dtype="int64", layout="jagged", ndim=1)})
    part.schema.lengths["ids"] = np.array([3], dtype=np.int64)
    start = part.allocate(1, None, [1])
    part.commit(GrantRecord(1, 3, 0, start, 1, None, frozenset({"ids"}), kept=1), 0)
    image = capture(part)
    _write(tmp_path, "p.arrow", dataclasses.replace(image, header={**image.header, "segments": [[0, [[1, 0], segment]]]}))
    with pytest.raises(InvalidArgumentError, match=r"p.arrow: (a rollout segment of sample 0 is not|not a valid partition header)"):
        read_image((tmp_path / "p.arrow").read_bytes(), "p.arrow")
