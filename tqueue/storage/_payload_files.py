"""The Arrow IPC files of a unit's checkpoint, written and read in the checkpoint thread:
the format is described in :mod:`._checkpoint`, which takes the snapshot and installs what
is read."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Final

import msgspec
import numpy as np

from ..errors import DataCorruptionError, InvalidArgumentError, TQueueError
from ..wire import FieldBlock, FieldSpec, UnitFile, _crc, _durable, _shared
from ..wire._layout import int_dtype, itemsize
from ..wire._messages import PackedType
from ..wire._pack import PACKED, width_of
from ._store import Piece

FORMAT: Final = "tqueue-payload"
FORMAT_VERSION: Final = 3  # 3: packed integers kept narrow (``packed``); 2: a field shared by content holds
# each value once (``ref``); 1: each sample's bytes in its own row (2 and 1 are read too)
READ_VERSIONS: Final = (1, 2, 3)
PACKED_NAMES: Final[tuple[PackedType, ...]] = ("", *PACKED)  # the ``packed`` column's dictionary, code k: name k
BATCH_BYTES: Final = 64 << 20  # a run of samples longer than this is cut into several record batches


@dataclasses.dataclass
class ColumnSnapshot:
    """One field of one partition as the snapshot found it: sample ``indexes`` held by
    ``pieces[pids[i]]`` at row ``rows[i]``."""

    uid: int
    partition: str
    field: str
    indexes: np.ndarray
    pids: np.ndarray
    rows: np.ndarray
    pieces: dict[int, Piece]
    shared: bool = False  # a field shared by content: loaded back, each value is stored once again
    chains: dict[int, list[tuple[int, Piece]]] = dataclasses.field(default_factory=dict)
    """Samples appends grew: their rows after the first ((row, piece) each), joined in the file."""


# --- files (in the checkpoint thread) -------------------------------------------------


def write_all(place: _durable.Place, folder: str, columns: list[ColumnSnapshot]) -> list[UnitFile]:
    import pyarrow as pa

    gen_fd = _durable.open_folder(place)  # the controller made it, with its marker
    try:
        os.mkdir(folder, dir_fd=gen_fd)  # new: a folder already there is not this checkpoint's
        fd = _durable.subfolder(gen_fd, folder, place.name)
        try:
            files = [_write_file(pa, fd, folder, col, k) for col, k in _numbered(columns)]
            _durable.fsync_dir(fd)
        finally:
            os.close(fd)
        _durable.fsync_dir(gen_fd)
    finally:
        os.close(gen_fd)
    return files


def _numbered(columns: list[ColumnSnapshot]) -> list[tuple[ColumnSnapshot, int]]:
    per_partition: dict[int, int] = {}
    out = []
    for col in columns:
        k = per_partition[col.uid] = per_partition.get(col.uid, -1) + 1
        out.append((col, k))
    return out


def _write_file(pa: Any, dir_fd: int, folder: str, col: ColumnSnapshot, k: int) -> UnitFile:
    name = f"p{col.uid}-f{k}.arrow"
    spec = _file_spec(col)
    header = {
        "format": FORMAT, "version": FORMAT_VERSION, "partition": col.partition, "partition_uid": col.uid,
        "field": col.field, "spec": {"kind": spec.kind, "dtype": spec.dtype, "layout": spec.layout,
                                     "shape": list(spec.shape), "ndim": spec.ndim},
    }
    if col.shared:
        header["shared"] = True
    columns_ = [pa.field("index", pa.int64()), pa.field("value", pa.large_binary(), nullable=False)]
    ndim = spec.ndim if spec.layout == "jagged" else len(spec.shape)
    with_shape = spec.kind != "object" and bool(ndim)
    if with_shape:
        columns_.append(pa.field("shape", pa.list_(pa.int64(), ndim)))
    columns_.append(pa.field("crc", pa.int64()))  # each sample's CRC-32C as its producer computed it (-1: none)
    with_packed = _any_packed(col)
    if with_packed:  # per row: "" (the field's dtype) or the narrower integer type its value is in
        columns_.append(pa.field("packed", pa.dictionary(pa.int8(), pa.string())))
    names = pa.array(PACKED_NAMES, type=pa.string())
    refs = col.shared  # (the store refuses appends to a field shared by content: it has no chains)
    if refs:
        columns_.append(pa.field("ref", pa.int64()))  # -1: the row carries its value, else the row that does
    schema = pa.schema(columns_, metadata={"tqueue": json.dumps(header)})
    rows = payload = 0
    with _durable.Summed(dir_fd, name) as sink:
        with pa.ipc.new_file(sink, schema) as writer:
            for piece, indexes, data, offsets, shapes, crcs, codes, *ref in _shared_runs(col, ndim) if refs else _runs(col):
                arrays = [
                    pa.array(indexes, type=pa.int64()),
                    pa.Array.from_buffers(pa.large_binary(), len(indexes), [None, pa.py_buffer(offsets), pa.py_buffer(data)]),
                ]
                if with_shape:
                    arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(shapes.reshape(-1), type=pa.int64()), ndim))
                arrays.append(pa.array(crcs, type=pa.int64()))
                if with_packed:
                    arrays.append(pa.DictionaryArray.from_arrays(pa.array(codes, type=pa.int8()), names))
                if refs:
                    arrays.append(pa.array(ref[0], type=pa.int64()))
                batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
                if piece is None:  # (a batch of its own: a field shared by content, a sample appends grew)
                    writer.write_batch(batch)
                else:  # the batches of one piece (its frames) go back as one piece
                    writer.write_batch(batch, custom_metadata={"tqueue": json.dumps({"piece": piece})})
                rows += len(indexes)
                payload += int(offsets[-1])
        sink.sync()
    return UnitFile(
        path=f"{folder}/{name}", partition_uid=col.uid, partition=col.partition, field=col.field, rows=rows,
        nbytes=sink.size, payload=payload, crc32c=sink.crc,
    )


def _file_spec(col: ColumnSnapshot) -> FieldSpec:
    """The field's spec as its file says it: dense where every piece is dense of one shape
    (as a read of all of them would be), else jagged (each sample's shape in ``shape``)."""
    specs = [p.spec for p in col.pieces.values()]
    first = specs[0]
    if first.kind == "object":
        return FieldSpec(kind="object", dtype=first.dtype, layout="jagged")
    shapes = {tuple(s.shape) if s.layout == "dense" else None for s in specs}
    if len(shapes) == 1 and (shape := next(iter(shapes))) is not None and not col.chains:
        return FieldSpec(kind=first.kind, dtype=first.dtype, layout="dense", shape=shape)
    ndim = first.ndim if first.layout == "jagged" else len(first.shape)
    return FieldSpec(kind=first.kind, dtype=first.dtype, layout="jagged", ndim=ndim)


def _code(piece: Piece, f: int) -> int:
    """The ``packed`` code of frame ``f`` of ``piece``: 0 where its bytes are in the field's
    dtype, else the narrower integer type's (``PACKED_NAMES``)."""
    narrow = piece.packed[f] if piece.packed else ""
    if not narrow:
        return 0
    wide = int_dtype(piece.spec)
    if wide is None or PACKED[narrow].itemsize >= wide.itemsize:  # (int32 "packed" as int32: the same bytes)
        return 0
    return PACKED_NAMES.index(narrow)


def _any_packed(col: ColumnSnapshot) -> bool:
    """Whether a piece the file reads from holds a frame of packed integers (the file then has
    a ``packed`` column)."""
    pieces = [*col.pieces.values(), *(q for segs in col.chains.values() for _, q in segs)]
    return any(_code(p, f) for p in pieces if p.packed for f in range(len(p.packed)))


def _runs(col: ColumnSnapshot) -> Any:
    """(the piece's number, indexes, values back to back, int64 offsets, shapes [n, ndim],
    CRC-32Cs, packed codes) per run: the samples of one frame of one piece, cut at BATCH_BYTES,
    as the piece holds them (packed integers narrow: their CRC-32C is of the wide bytes, as
    readers get them); a sample appends grew: a run of its own (number None)."""
    plain = ~np.isin(col.indexes, np.fromiter(col.chains, dtype=np.int64, count=len(col.chains))) if col.chains \
        else np.ones(len(col.indexes), dtype=bool)
    order = np.flatnonzero(plain)[np.argsort(col.pids[plain], kind="stable")]  # by piece, each in index order
    cuts = np.flatnonzero(np.diff(col.pids[order])) + 1
    for number, chunk in enumerate(np.split(order, cuts) if len(order) else ()):
        piece = col.pieces[int(col.pids[chunk[0]])]
        indexes, rows = col.indexes[chunk], col.rows[chunk]
        frame_of = piece.frame_of[rows]
        for f in np.unique(frame_of).tolist():
            at = frame_of == f
            for run in _cut(piece, f, indexes[at], rows[at]):
                yield (number, *run)
    for k in np.flatnonzero(~plain).tolist():  # a sample appends grew: its rows joined
        i = int(col.indexes[k])
        yield (None, *_joined(i, [(int(col.rows[k]), col.pieces[int(col.pids[k])]), *col.chains[i]]))


def _shared_runs(col: ColumnSnapshot, ndim: int) -> Any:
    """The runs of a field shared by content (see the module's docstring): each distinct
    value once, in the row of its first holder (by index), its other holders after it with
    ``ref`` naming that row; a batch is cut at BATCH_BYTES between values, never inside a
    value's holders. Equal values of several pieces (a write not committed, a move's: neither
    matched against the stored values; a packed one and a wide one) are one value too, in the
    narrowest form a piece holds it in. Yields (None: no piece's, indexes, carried values back
    to back, int64 offsets, shapes [n, ndim], CRC-32Cs, packed codes (a referring row: its
    value's), refs)."""
    pairs = col.pids * (1 << 32) + col.rows
    stored, inverse = np.unique(pairs, return_inverse=True)  # each row a piece stores, once
    inverse = inverse.reshape(-1)
    pids, rows = stored >> 32, stored & 0xFFFFFFFF
    content = np.empty(len(stored), dtype=np.int64)  # the file's value of each stored row
    crc_of = np.full(len(stored), -1, dtype=np.int64)
    values = _Values(ndim)
    cuts = np.flatnonzero(np.diff(pids)) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(stored)]):
        piece = col.pieces[int(pids[a])]
        content[a:b] = values.add(piece, rows[a:b])
        if piece.crcs is not None:
            crc_of[a:b] = piece.crcs[rows[a:b]]
    held = content[inverse]  # per sample: its value
    order = np.lexsort((col.indexes, held))  # by value, each value's holders by index
    held = held[order]
    n = values.count
    firsts = np.searchsorted(held, np.arange(n + 1))  # where each value's holders start
    sizes, shape_of, codes = values.sizes(), values.shapes(), values.codes()
    ends = np.cumsum(sizes)
    start = 0
    while start < n:
        stop = max(int(np.searchsorted(ends, ends[start] - sizes[start] + BATCH_BYTES, side="right")), start + 1)
        a, b = int(firsts[start]), int(firsts[stop])
        mine = held[a:b]
        first = firsts[mine]
        ref = np.where(np.arange(a, b) == first, -1, first - a)
        offsets = np.concatenate(([0], np.cumsum(np.where(ref < 0, sizes[mine], 0)))).astype(np.int64)
        yield (None, col.indexes[order[a:b]], values.data(start, stop), offsets, shape_of[mine], crc_of[inverse[order[a:b]]],
               codes[mine], ref)
        start = stop


class _Values:
    """The distinct values of a shared field's file, found as the store finds them (digest,
    size and shape, a dense piece's too, then the bytes; the store's own key where it indexed
    the row), packed integers compared widened (equal to a value held wide, or in another
    width); each value kept as where a piece holds it, in the fewest bytes one does."""

    def __init__(self, ndim: int) -> None:
        self.ndim = ndim
        self.count = 0
        self._seen: dict[Any, list[int]] = {}
        self._pieces: list[Piece] = []
        self._at: list[tuple[int, int, int, int]] = []  # per value: piece, frame, offset, size (as stored)
        self._shapes: list[tuple[int, ...]] = []
        self._codes: list[int] = []  # per value: the packed code of the frame it is taken from

    def add(self, piece: Piece, rows: np.ndarray) -> np.ndarray:
        """The value of each of ``piece``'s ``rows`` (new ones added; one held narrower here
        than where it was found first is taken from here)."""
        p = len(self._pieces)
        self._pieces.append(piece)
        views = [memoryview(f).cast("B") for f in piece.frames]
        known = {row: key for key, row in piece.keys} if piece.keys else {}  # the store's, where it indexed them
        dense = tuple(piece.spec.shape) if piece.shapes is None and piece.spec.kind != "object" else ()
        if piece.shapes is not None:
            shapes = [tuple(s) for s in piece.shapes[rows].tolist()]
        else:  # (an object field's file has no shape column: zeros)
            shapes = [dense if dense and self.ndim else (0,) * self.ndim] * len(rows)
        codes = [_code(piece, f) for f in range(len(piece.frames))]
        out = np.empty(len(rows), dtype=np.int64)
        for k, (row, f, o, z) in enumerate(zip(rows.tolist(), piece.frame_of[rows].tolist(),
                                                piece.offsets[rows].tolist(), piece.sizes[rows].tolist())):
            data = views[f][o : o + z]
            if piece.packed and piece.packed[f]:  # compared widened: equal to a value stored wide
                data = memoryview(_widened(piece, f, np.frombuffer(data, dtype=np.uint8)))
                key = (_shared.digest(data), len(data), "", shapes[k] if piece.shapes is not None else ())
            else:
                key = known.get(row) or (_shared.digest(data), z, "", shapes[k] if piece.shapes is not None else ())
            candidates = self._seen.setdefault((key, dense), [])
            match = next((v for v in candidates if _shared.equal(self._stored(v), data)), -1)
            if match < 0:
                match = self.count
                self.count += 1
                self._at.append((p, f, o, z))
                self._shapes.append(shapes[k])
                self._codes.append(codes[f])
                candidates.append(match)
            elif z < self._at[match][3]:  # held narrower here: the file takes it from here
                self._at[match] = (p, f, o, z)
                self._codes[match] = codes[f]
            out[k] = match
        return out

    def _stored(self, v: int) -> memoryview:
        """Value ``v``'s bytes widened, as readers get them back (what equal values share)."""
        p, f, o, z = self._at[v]
        piece = self._pieces[p]
        data = memoryview(piece.frames[f]).cast("B")[o : o + z]
        return memoryview(_widened(piece, f, np.frombuffer(data, dtype=np.uint8))) if piece.packed and piece.packed[f] else data

    def sizes(self) -> np.ndarray:
        """Each value's size in the file (as stored: packed integers narrow)."""
        return np.fromiter((at[3] for at in self._at), dtype=np.int64, count=self.count)

    def shapes(self) -> np.ndarray:
        return np.asarray(self._shapes, dtype=np.int64).reshape(self.count, self.ndim)

    def codes(self) -> np.ndarray:
        """Each value's packed code (``PACKED_NAMES``)."""
        return np.asarray(self._codes, dtype=np.int8)

    def data(self, start: int, stop: int) -> np.ndarray:
        """Values ``start`` to ``stop`` back to back as the file holds them (as stored): one
        slice per stretch of them back to back in one frame."""
        parts = []
        at = self._at[start:stop]
        k = 0
        while k < len(at):
            p, f, o, z = at[k]
            end = o + z
            k += 1
            while k < len(at) and at[k][:2] == (p, f) and at[k][2] == end:
                end += at[k][3]
                k += 1
            parts.append(np.frombuffer(self._pieces[p].frames[f], dtype=np.uint8)[o:end])
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _widened(piece: Piece, f: int, data: np.ndarray) -> np.ndarray:
    """Bytes of frame ``f`` of ``piece`` as readers get them back: integers narrowed for the
    trip widened back to the field's dtype (a copy), anything else as it is."""
    narrow = piece.packed[f] if piece.packed else ""
    if not narrow:
        return data
    return np.frombuffer(data, dtype=PACKED[narrow]).astype(int_dtype(piece.spec)).view(np.uint8)


def _joined(index: int, segments: list[tuple[int, Piece]]) -> Any:
    """One run of a sample made of rows of several pieces: their bytes back to back (packed
    rows narrow where all are packed alike; else widened, then narrowed to the type every
    value fits), its shape (dim 0 summed) and the CRC-32C of the whole widened, once each
    row's own is checked."""
    parts, wides, codes, shapes, whole, checked = [], [], [], [], -1, True
    wide_dtype = None
    for row, piece in segments:
        f = int(piece.frame_of[row])
        [(_, data, _, shape, crcs, code)] = list(_cut(piece, f, np.asarray([index]), np.asarray([row])))
        data = np.ascontiguousarray(data)
        wide = _widened(piece, f, data) if code[0] else data  # what the CRC-32C covers
        if int(crcs[0]) >= 0 and _crc.crc(wide) != int(crcs[0]):
            raise DataCorruptionError(f"sample {index}: the bytes of one of its appended rows fail their CRC-32C")
        checked = checked and int(crcs[0]) >= 0
        whole = _crc.crc(wide) if whole < 0 else _crc.extend(whole, wide)
        parts.append(data)
        wides.append(wide)
        codes.append(int(code[0]))
        shapes.append(shape[0])
        if wide_dtype is None:
            wide_dtype = int_dtype(piece.spec)
    shape = np.asarray(shapes[0]).copy()
    shape[0] = sum(int(x[0]) for x in shapes)
    code = codes[0] if len(set(codes)) == 1 else 0
    if len(set(codes)) > 1:  # rows of several widths: the one type all of them fit
        assert wide_dtype is not None  # (only integer fields are packed)
        values = np.concatenate(wides).view(wide_dtype)
        name = width_of([values])
        code = PACKED_NAMES.index(name) if name else 0
        parts = [values.astype(PACKED[name]).view(np.uint8) if name else values.view(np.uint8)]
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return (np.asarray([index], dtype=np.int64), data, np.asarray([0, len(data)], dtype=np.int64), shape.reshape(1, -1),
            np.asarray([whole if checked else -1], dtype=np.int64), np.asarray([code], dtype=np.int8))


def _cut(piece: Piece, f: int, indexes: np.ndarray, rows: np.ndarray) -> Any:
    frame = np.frombuffer(piece.frames[f], dtype=np.uint8)
    offs, sizes = piece.offsets[rows], piece.sizes[rows]
    code = _code(piece, f)  # integers narrowed for the trip stay narrow: the packed column says how
    if piece.shapes is not None:
        shapes = piece.shapes[rows]
    else:
        shapes = np.tile(np.asarray(piece.spec.shape, dtype=np.int64), (len(rows), 1))
    crcs = piece.crcs[rows] if piece.crcs is not None else np.full(len(rows), -1, dtype=np.int64)
    ends = np.cumsum(sizes)
    start = 0
    while start < len(rows):
        stop = int(np.searchsorted(ends, ends[start] - sizes[start] + BATCH_BYTES, side="right"))
        stop = max(stop, start + 1)
        o, s = offs[start:stop], sizes[start:stop]
        if len(o) == 1 or np.all(o[1:] == o[:-1] + s[:-1]):
            data = frame[int(o[0]) : int(o[-1] + s[-1])]  # consecutive: a view, no copy
        else:
            data = np.concatenate([frame[int(a) : int(a + b)] for a, b in zip(o, s)])
        offsets = np.concatenate(([0], np.cumsum(s))).astype(np.int64)
        yield indexes[start:stop], data, offsets, shapes[start:stop], crcs[start:stop], np.full(stop - start, code, np.int8)
        start = stop


_Write = tuple[int, str, np.ndarray, FieldBlock, list[np.ndarray]]


def read_all(place: _durable.Place, files: list[UnitFile], max_index: int) -> list[_Write]:
    """Every file's batches as writes; nothing is installed until all of them are read."""
    import pyarrow as pa

    out: list[_Write] = []
    gen_fd = _durable.open_folder(place)
    folders: dict[str, int] = {}
    try:
        for entry in files:
            folder, name = entry.path.split("/")
            if folder not in folders:
                folders[folder] = _durable.subfolder(gen_fd, folder, place.name)
            where = _Where(place.name, entry)
            data = _durable.read_file(folders[folder], name, place.name)
            if len(data) != entry.nbytes:
                raise DataCorruptionError(f"{where}: has {len(data)} bytes, the manifest says {entry.nbytes}: "
                                          "the checkpoint is damaged")
            _durable.verify(data, entry.crc32c, place.name, entry.path, where.detail)
            try:
                out.extend(_read_file(pa, data, entry, where, max_index))
            except (pa.ArrowException, ValueError, TypeError, IndexError, OverflowError) as exc:
                if isinstance(exc, TQueueError):
                    raise
                raise InvalidArgumentError(f"{where}: not a readable payload file: {exc}") from None
            del data
    finally:
        for fd in [*folders.values(), gen_fd]:
            os.close(fd)
    return out


@dataclasses.dataclass
class _Where:
    """A payload file, as an error names it."""

    checkpoint: str
    entry: UnitFile

    @property
    def detail(self) -> str:
        e = self.entry
        return f" (field {e.field!r} of partition {e.partition!r}, {e.path.split('/')[0].replace('-', ' ')})"

    def __str__(self) -> str:
        return f"checkpoint {self.checkpoint}: {self.entry.path}{self.detail}"


def _read_file(pa: Any, data: Any, entry: UnitFile, where: _Where, max_index: int) -> list[_Write]:
    """One payload file's record batches as writes, each index checked against ``max_index``."""
    reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(data)))
    header = _header(reader.schema, where)
    if header.get("partition_uid") != entry.partition_uid or header.get("field") != entry.field:
        raise InvalidArgumentError(f"{where}: holds {header.get('field')!r} of partition uid {header.get('partition_uid')}, "
                                   f"the manifest says {entry.field!r} of uid {entry.partition_uid}")
    try:
        spec = msgspec.convert(header.get("spec"), FieldSpec)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"{where}: the field's spec is not one: {exc}") from None
    out: list[_Write] = []
    rows = 0
    piece: list[tuple[np.ndarray, FieldBlock, list[np.ndarray]]] = []  # the batches of one piece so far
    number = None
    for i in range(reader.num_record_batches):
        batch, custom = reader.get_batch_with_custom_metadata(i)
        batch.validate(full=True)  # offsets inside their buffers, lengths as declared
        rows += batch.num_rows
        if rows > entry.rows:
            raise InvalidArgumentError(f"{where}: holds more than the {entry.rows} samples the manifest says")
        write = _batch(batch, spec, entry.field, where, max_index, shared=header.get("shared") is True,
                       version=header["version"])
        mine = _piece_number(custom, where)
        if piece and (mine is None or mine != number):
            out.append((entry.partition_uid, entry.partition, *_one_write(piece, where)))
            piece = []
        piece.append(write)
        number = mine
    if piece:
        out.append((entry.partition_uid, entry.partition, *_one_write(piece, where)))
    if rows != entry.rows:
        raise InvalidArgumentError(f"{where}: holds {rows} samples, the manifest says {entry.rows}")
    return out


def _piece_number(custom: Any, where: _Where) -> int | None:
    """A batch's piece (version 3: its custom metadata ``tqueue``, ``{"piece": k}``), or None."""
    raw = (custom or {}).get(b"tqueue")
    if raw is None:
        return None
    try:
        number = json.loads(raw).get("piece")
    except (ValueError, AttributeError):
        number = ""
    if type(number) is not int:
        raise InvalidArgumentError(f"{where}: a record batch's metadata is not {{\"piece\": <int>}}: {bytes(raw)[:80]!r}")
    return int(number)


def _one_write(
    batches: list[tuple[np.ndarray, FieldBlock, list[np.ndarray]]], where: _Where,
) -> tuple[np.ndarray, FieldBlock, list[np.ndarray]]:
    """Batches of one piece (none shared by content) as one write: their frames, one after
    another."""
    if len(batches) == 1:
        return batches[0]
    blocks = [b for _, b, _ in batches]
    if any(b.value_of is not None for b in blocks):
        raise InvalidArgumentError(f"{where}: record batches of values shared by content marked as one piece")
    first = blocks[0]
    block = FieldBlock(name=first.name, spec=first.spec, counts=[c for b in blocks for c in b.counts])
    if first.shapes is not None:
        block.shapes = [d for b in blocks for d in b.shapes or ()]
    if first.sizes is not None:
        block.sizes = [z for b in blocks for z in b.sizes or ()]
    if any(b.crcs is not None for b in blocks):
        block.crcs = [c for b in blocks for c in (b.crcs if b.crcs is not None else [-1] * sum(b.counts))]
    if any(b.packed is not None for b in blocks):
        wide: list[PackedType] = [""]
        block.packed = [k for b in blocks for k in (b.packed if b.packed is not None else wide * len(b.counts))]
    return np.concatenate([i for i, _, _ in batches]), block, [f for _, _, frames in batches for f in frames]


def _header(schema: Any, where: _Where) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(b"tqueue")
    try:
        header = json.loads(raw) if raw is not None else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InvalidArgumentError(f"{where}: not a tqueue payload file")
    if header.get("version") not in READ_VERSIONS or type(header.get("version")) is not int:
        raise InvalidArgumentError(f"{where}: a payload file of version {header.get('version')!r}; this unit reads versions "
                                   f"{', '.join(map(str, READ_VERSIONS))}")
    return header


def _batch(
    batch: Any, spec: FieldSpec, field: str, where: _Where, max_index: int, *, shared: bool = False,
    version: int = FORMAT_VERSION,
) -> tuple[np.ndarray, FieldBlock, list[np.ndarray]]:
    """A record batch as a write: its indexes, its block, its frames (a copy of its values, a
    frame per run of them in one width, packed integers as narrow as the file holds them; of a
    field shared by content, of each distinct value once: the block says which sample holds
    which)."""
    n = batch.num_rows
    names = batch.schema.names
    if names[:2] != ["index", "value"] or str(batch.schema.field("value").type) != "large_binary":
        raise InvalidArgumentError(f"{where}: columns {names}, not index and value")
    indexes = batch.column("index").to_numpy(zero_copy_only=False).astype(np.int64)
    if n and (int(indexes.min()) < 0 or int(indexes.max()) >= max_index):
        raise InvalidArgumentError(f"{where}: sample indexes outside [0, {max_index}) (StorageConfig.max_index)")
    values = batch.column("value")
    if values.null_count:
        raise InvalidArgumentError(f"{where}: samples without a value")
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[values.offset : values.offset + n + 1]
    frame = np.frombuffer(data_buf, dtype=np.uint8)[int(offsets[0]) : int(offsets[-1])] if n else np.zeros(0, np.uint8)
    sizes = np.diff(offsets)
    block = FieldBlock(name=field, spec=spec, counts=[n])
    if spec.kind == "object":
        block.sizes = sizes.tolist()
    elif spec.layout == "jagged":
        if spec.ndim:
            if "shape" not in names:
                raise InvalidArgumentError(f"{where}: a jagged field without its shape column")
            block.shapes = batch.column("shape").flatten().to_numpy(zero_copy_only=False).astype(np.int64).tolist()
        else:
            block.shapes = []
    if "crc" in names:  # each sample's CRC-32C, kept so that readers check the restored bytes too
        crcs = batch.column("crc").to_numpy(zero_copy_only=False).astype(np.int64)
        if n and (int(crcs.min()) < -1 or int(crcs.max()) > 0xFFFFFFFF):
            raise InvalidArgumentError(f"{where}: a sample checksum outside [-1, 2**32)")
        block.crcs = crcs.tolist() if (crcs >= 0).any() else None
    codes = _packed_codes(batch, spec, indexes, where, version) if "packed" in names else np.zeros(n, dtype=np.int8)
    ref = batch.column("ref").to_numpy(zero_copy_only=False).astype(np.int64) if "ref" in names else None
    _check_sizes(block, indexes, sizes, codes, ref is None or ref == -1, where)  # (a referring row: _referred)
    if ref is not None:  # each value once, its other holders referring to its row
        if not shared or version < 2:
            raise InvalidArgumentError(f"{where}: a ref column in a file that holds no values shared by content")
        sizes, codes = _referred(ref, block, indexes, sizes, codes, where)
    elif shared and version >= 2 and n:
        raise InvalidArgumentError(f"{where}: a field shared by content without its ref column")
    elif shared and n:  # version 1: each sample's bytes (none packed); equal ones stored once again
        block, parts, _ = _shared.shrink(block, [frame])
        block.counts = [sum(block.counts)]
        return indexes, block, [np.concatenate([np.frombuffer(f, dtype=np.uint8) for f in parts])]
    return indexes, block, _frames(block, frame, sizes, codes)


def _name(code: int, spec: FieldSpec) -> str:
    return PACKED_NAMES[code] or spec.dtype


def _packed_codes(batch: Any, spec: FieldSpec, indexes: np.ndarray, where: _Where, version: int) -> np.ndarray:
    """The ``packed`` column (version 3) as each row's code (``PACKED_NAMES``), every name in it
    checked: a narrower integer type than the field's."""
    import pyarrow as pa

    if version < 3:
        raise InvalidArgumentError(f"{where}: a packed column in a payload file of version {version}")
    column = batch.column("packed")
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.dictionary_encode()
    if not pa.types.is_dictionary(column.type) or not (
        pa.types.is_string(column.type.value_type) or pa.types.is_large_string(column.type.value_type)
    ):
        raise InvalidArgumentError(f"{where}: a packed column of {column.type}, not of type names")
    if column.null_count:
        raise InvalidArgumentError(f"{where}: samples without a packed type (\"\": the field's own dtype)")
    at = column.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    given = column.dictionary.to_pylist()
    wide = int_dtype(spec) if spec.kind != "object" else None
    lut = np.zeros(len(given), dtype=np.int8)
    for k in np.unique(at).tolist():
        name = given[k]
        sample = int(indexes[int(np.argmax(at == k))])
        if name not in PACKED_NAMES:
            raise DataCorruptionError(f"{where}: sample {sample} is packed as {name!r}, which is not a type integers "
                                      f"are packed in ({', '.join(PACKED)}): the checkpoint is damaged")
        if name and (wide is None or PACKED[name].itemsize >= wide.itemsize):
            raise DataCorruptionError(f"{where}: sample {sample} is packed as {name!r}, which a {spec.kind} field of "
                                      f"dtype {spec.dtype!r} cannot take (not an integer type narrower than it): "
                                      "the checkpoint is damaged")
        lut[k] = PACKED_NAMES.index(name)
    return lut[at]


def _check_sizes(
    block: FieldBlock, indexes: np.ndarray, sizes: np.ndarray, codes: np.ndarray, rows: Any, where: _Where,
) -> None:
    """Each of ``rows`` (a mask: the rows that carry a value) holds its shape's values, in its
    packed type or the field's dtype, and nothing else."""
    spec = block.spec
    n = len(sizes)
    if spec.kind == "object" or not n:
        return
    if spec.layout == "dense":
        shapes = np.tile(np.asarray(spec.shape, dtype=np.int64), (n, 1))
    else:
        shapes = np.asarray(block.shapes, dtype=np.int64)
        if len(shapes) != n * spec.ndim:
            raise InvalidArgumentError(f"{where}: a shape column of {len(shapes) // n} dimensions, the field's spec "
                                       f"says {spec.ndim}")
        shapes = shapes.reshape(n, spec.ndim)
        if shapes.size and int(shapes.min()) < 0:
            raise InvalidArgumentError(f"{where}: a negative dimension in the shape column")
    count = np.prod(shapes, axis=1, dtype=np.int64)
    items = np.asarray([itemsize(spec), *(dt.itemsize for dt in PACKED.values())], dtype=np.int64)[codes]
    for bad, what in (
        (rows & (sizes % items != 0), lambda k: f"holds {int(sizes[k])} bytes, not a whole number of "
                                                f"{_name(int(codes[k]), spec)} values ({int(items[k])} bytes each)"),
        (rows & (sizes != count * items), lambda k: f"holds {int(sizes[k] // items[k])} {_name(int(codes[k]), spec)} "
                                                    f"values, its shape {shapes[k].tolist()} {int(count[k])}"),
    ):
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise DataCorruptionError(f"{where}: sample {int(indexes[k])} {what(k)}: the checkpoint is damaged")


def _frames(block: FieldBlock, data: np.ndarray, sizes: np.ndarray, codes: np.ndarray) -> list[np.ndarray]:
    """``data`` (the block's values back to back: ``sizes`` bytes each, in the packed type of
    ``codes``) copied, as a frame per run of values in one type (``block.counts`` and
    ``block.packed`` set to say so)."""
    whole = data.copy()
    n = len(sizes)
    if not n:
        block.counts = [0]
        return [whole]
    cuts = (np.flatnonzero(np.diff(codes)) + 1).tolist()
    starts, stops = [0, *cuts], [*cuts, n]
    ends = np.concatenate(([0], np.cumsum(sizes)))
    block.counts = [b - a for a, b in zip(starts, stops)]
    if codes.any():
        block.packed = [PACKED_NAMES[int(codes[a])] for a in starts]
    return [whole[int(ends[a]) : int(ends[b])] for a, b in zip(starts, stops)]


def _referred(
    ref: np.ndarray, block: FieldBlock, indexes: np.ndarray, sizes: np.ndarray, codes: np.ndarray, where: _Where,
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of a field shared by content (version 2 on) as one write: each row that carries
    a value gives one (its bytes are the frame: a referring row carries none), each sample
    holds its row's or the one its ``ref`` names. Every reference is checked first. Returns
    each value's size and packed code."""
    n = len(indexes)
    own = ref == -1
    target = np.where(own, np.arange(n), ref)
    outside = (ref < -1) | (ref >= n)
    target[outside] = 0
    for bad, what in (
        (outside, ", which is not there"),
        (~own & ~own[target], ", which carries no value"),  # itself, or a row that refers too
        (~own & (sizes != 0), " and carries bytes of its own"),
    ):
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise DataCorruptionError(f"{where}: sample {int(indexes[k])} refers to row {int(ref[k])} of its record "
                                      f"batch{what}: the checkpoint is damaged")
    differ = codes != codes[target]
    if differ.any():
        k = int(np.flatnonzero(differ)[0])
        raise DataCorruptionError(f"{where}: sample {int(indexes[k])} is packed as {PACKED_NAMES[int(codes[k])]!r}, "
                                  f"the value it refers to as {PACKED_NAMES[int(codes[target[k]])]!r}: the checkpoint "
                                  "is damaged")
    carried = np.flatnonzero(own)
    rank = np.cumsum(own) - 1  # a carrying row's value
    held = rank[target]
    if block.shapes:
        ndim = len(block.shapes) // n
        shapes = np.asarray(block.shapes, dtype=np.int64).reshape(n, ndim)
        differ = (shapes != shapes[target]).any(axis=1)
        if differ.any():
            k = int(np.flatnonzero(differ)[0])
            raise DataCorruptionError(f"{where}: sample {int(indexes[k])} has shape {shapes[k].tolist()}, the value "
                                      f"it refers to {shapes[target[k]].tolist()}: the checkpoint is damaged")
        block.shapes = shapes[carried].reshape(-1).tolist()
    if block.sizes is not None:
        block.sizes = sizes[carried].tolist()
    if block.crcs is not None:  # a value's CRC-32C: its holders' (those computed agree)
        crcs = np.asarray(block.crcs, dtype=np.int64)
        value_crc = np.full(len(carried), -1, dtype=np.int64)
        np.maximum.at(value_crc, held, crcs)
        differ = (crcs >= 0) & (crcs != value_crc[held])
        if differ.any():
            k = int(np.flatnonzero(differ)[0])
            raise DataCorruptionError(f"{where}: sample {int(indexes[k])} has a CRC-32C other than the value it "
                                      f"refers to: the checkpoint is damaged")
        block.crcs = value_crc.tolist()
    block.value_of = held.tolist()
    return sizes[carried], codes[carried]
