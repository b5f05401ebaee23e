"""A partition's metadata in a checkpoint, and back: free of sockets.

:func:`capture` copies what the controller knows of a partition (its per-sample arrays and
the rest as JSON-able values) on the controller's loop; it copies arrays and builds a few
lists, so it costs time in proportion to the partition's samples, never to their bytes.
:func:`write_image` and :func:`read_image` (in a thread) keep it as one Apache Arrow IPC file:
a row per sample, columns ``mask`` (the field bits and the committed, excluded and partial
flags of ``_samples``), ``unit``, ``version``, ``version_max``, ``revision``, ``group``,
``task/<name>`` (that task's state of each sample: 0 available, 1 leased, 2 consumed, 3
refused) and ``length/<field>`` (dim 0 of each sample of a jagged tensor field); everything
else (options, field specs in bit order, counters, groups, rollout segments) is JSON in the
schema's metadata ``tqueue``. :func:`write_image` gives the file's size and CRC-32C (for the
manifest); :func:`read_image` takes the file's bytes (checked against them by the caller)
and bounds every number in them before anything is sized by one: rows at most
``max_samples``, tasks at most ``max_tasks``, units within the ids a controller gives,
groups, task states and lengths within their ranges. :func:`rebuild` makes a
:class:`Partition` of an image, with leases given back (a leased sample is available again)
and puts that never committed excluded.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Final

import msgspec
import numpy as np

from ...errors import InvalidArgumentError
from ...wire import FieldSpec
from ...wire._durable import MAX_UNIT_ID, Summed
from ..model._keyindex import KeyIndex
from ..model._partition import Options, Partition
from ..model._samples import AVAILABLE, COMMITTED, EXCLUDED, LEASED, Groups, Segment

FORMAT: Final = "tqueue-partition"
FORMAT_VERSION: Final = 1
_SAMPLE_ARRAYS: Final = ("mask", "unit", "version", "version_max", "revision", "group")


@dataclasses.dataclass
class Image:
    """A partition as a checkpoint holds it: per-sample ``arrays`` (all of length ``n``) and
    the JSON ``header``."""

    header: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def uid(self) -> int:
        return int(self.header["uid"])

    @property
    def name(self) -> str:
        return str(self.header["name"])


def capture(part: Partition) -> Image:
    """``part`` as it is now (copies: the partition goes on changing)."""
    n = part.n
    s = part.samples
    arrays = {name: getattr(s, name)[:n].copy() for name in _SAMPLE_ARRAYS}
    for task, state in part.tasks.items():
        arrays[f"task/{task}"] = state.state[:n].copy()
    for field, lengths in part.schema.lengths.items():
        arrays[f"length/{field}"] = _fit(lengths, n)
    opts = part.options
    g = s.groups
    header = {
        "format": FORMAT, "version": FORMAT_VERSION, "name": part.name, "uid": part.uid, "n": n,
        "options": {
            "fields": sorted(opts.fields) if opts.fields is not None else None,
            "tasks": sorted(opts.tasks) if opts.tasks is not None else None,
            "group_size": opts.group_size, "on_member_failure": opts.on_member_failure,
            "auto_free": opts.auto_free, "target": opts.target, "target_groups": opts.target_groups,
            "recycle_to": opts.recycle_to, "prefetch": opts.prefetch, "step": opts.step,
            "copies": opts.copies, "dedup": sorted(opts.dedup),
        },
        "fields": [[name, msgspec.to_builtins(part.specs[name])] for name in part.schema.bits],  # in bit order
        "committed": part.committed, "excluded": part.excluded, "lost": part.lost, "reasons": dict(part.reasons),
        "sealed": part.sealed, "complete": part.complete, "groups_done": part.groups_done,
        "tasks": {
            name: {"consumed": t.consumed, "refused": t.refused, "expired": t.expired, "lost": t.lost, "leased": t.leased}
            for name, t in part.tasks.items()
        },
        "has_groups": s.has_groups,
        "groups": {
            "ids": list(g.ids), "committed": list(g.committed), "failed": list(g.failed),
            "aborted": list(g.aborted), "complete": list(g.complete), "order": list(g.order),
        },
        "segments": [[i, [_segment_out(seg) for seg in segs]] for i, segs in s.segments.items()],
        "keys": part.keys.encode() if part.keys is not None else None,
    }
    return Image(header, arrays)


def _fit(arr: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    k = min(n, len(arr))
    out[:k] = arr[:k]
    return out


def write_image(dir_fd: int, name: str, image: Image) -> tuple[int, int]:
    """Write ``image`` to the new file ``name`` in ``dir_fd`` and fsync it; its size in bytes
    and CRC-32C."""
    import pyarrow as pa

    names = list(image.arrays)
    table = pa.table([pa.array(image.arrays[k]) for k in names], names=names)
    table = table.replace_schema_metadata({"tqueue": json.dumps(image.header)})
    with Summed(dir_fd, name) as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        sink.sync()
    return sink.size, sink.crc


def read_image(data: Any, what: str, *, max_samples: int = 1 << 40, max_tasks: int = 1 << 20) -> Image:
    """The image in a partition file's bytes ``data`` (``what`` names the file in errors),
    every number bounded (``InvalidArgumentError`` naming the file and the value)."""
    import pyarrow as pa

    def bad(text: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{what}: {text}")

    try:
        reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(data)))
        raw = (reader.schema.metadata or {}).get(b"tqueue")
        header = json.loads(raw) if raw is not None else None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise bad("not a tqueue partition file")
        if header.get("version") != FORMAT_VERSION:
            raise bad(f"a partition file of version {header.get('version')!r}; this controller reads {FORMAT_VERSION}")
        msgspec.convert(header, _Header)
        n = header["n"]
        if n > max_samples:
            raise bad(f"{n} samples, past max_partition_samples={max_samples}")
        if len(header["tasks"]) > max_tasks:
            raise bad(f"{len(header['tasks'])} tasks, past max_tasks_per_partition={max_tasks}")
        if reader.num_record_batches > n + 1 or sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches)) != n:
            raise bad(f"its columns do not all have {n} rows")
        table = reader.read_all()
        table.validate(full=True)
        arrays = {name: table.column(name).to_numpy().copy() for name in table.column_names}
    except msgspec.ValidationError as exc:
        raise bad(f"not a valid partition header: {exc}") from None
    except (pa.ArrowException, ValueError, TypeError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise bad(f"not a readable partition file: {exc}") from None
    _check_arrays(header, arrays, bad)
    return Image(header, arrays)


class _Groups(msgspec.Struct):
    ids: list[Any]
    committed: list[int]
    failed: list[int]
    aborted: list[bool]
    complete: list[bool]
    order: list[int]


class _Header(msgspec.Struct):
    """What :func:`rebuild` reads of an image's header, typed (other keys are ignored)."""

    name: str
    uid: Annotated[int, msgspec.Meta(ge=1)]
    n: Annotated[int, msgspec.Meta(ge=0)]
    options: dict[str, Any]
    fields: Annotated[list[tuple[str, FieldSpec]], msgspec.Meta(max_length=64)]  # a bit of a uint64 mask each
    committed: int
    excluded: int
    lost: int
    reasons: dict[str, int]
    sealed: bool
    complete: int
    groups_done: int
    tasks: dict[str, dict[str, int]]
    has_groups: bool
    groups: _Groups
    segments: list[tuple[int, list[list[Any]]]]  # [version, first_token] or [.., [[field, row], ...]]
    keys: Any = None


def _check_arrays(header: dict[str, Any], arrays: dict[str, np.ndarray], bad: Any) -> None:
    n = header["n"]
    groups = header["groups"]
    if any(len(groups[k]) != len(groups["ids"]) for k in ("committed", "failed", "aborted", "complete")):
        raise bad("its groups' lists differ in length")
    if len(groups["ids"]) > max(n, 1) or len(header["segments"]) > n:
        raise bad("more groups or rollout segments than samples")
    want = {*_SAMPLE_ARRAYS, *(f"task/{t}" for t in header["tasks"])}
    lengths = {f"length/{name}" for name, _ in header["fields"]}
    if not want <= set(arrays) or not set(arrays) <= want | lengths:
        raise bad(f"columns {sorted(arrays)}, expected {sorted(want)} and lengths of its fields")
    for name, a in arrays.items():
        if a.dtype.kind not in "iu" or len(a) != n:
            raise bad(f"column {name!r} is not {n} integers")
    ranges = {"unit": (-1, MAX_UNIT_ID), "group": (-1, len(groups["ids"]) - 1)}
    ranges.update({f"task/{t}": (0, 3) for t in header["tasks"]})
    ranges.update({name: (0, 1 << 62) for name in lengths & set(arrays)})
    for name, (lo, hi) in ranges.items():
        a = arrays[name]
        if n and (int(a.min()) < lo or int(a.max()) > hi):
            raise bad(f"column {name!r} holds values outside [{lo}, {hi}]")
    for i, segs in header["segments"]:
        if not 0 <= i < n:
            raise bad(f"a rollout segment of sample {i}, outside [0, {n})")
        if not all(_segment_ok(seg) for seg in segs):
            raise bad(f"a rollout segment of sample {i} is not [version, first_token] with its splice rows")


def _segment_out(seg: Segment) -> list[Any]:
    return [seg[0], seg[1]] if len(seg) == 2 else [seg[0], seg[1], [list(r) for r in seg[2]]]


def _segment_ok(seg: list[Any]) -> bool:
    ints = len(seg) in (2, 3) and all(type(x) is int for x in seg[:2])
    rows = seg[2] if len(seg) == 3 else []
    return ints and isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and type(r[1]) is int and r[1] >= 0 for r in rows
    )


def _segment_in(seg: list[Any]) -> Segment:
    if len(seg) == 2:
        return (int(seg[0]), int(seg[1]))
    return (int(seg[0]), int(seg[1]), tuple((str(f), int(r)) for f, r in seg[2]))


def _copies(options: dict[str, Any]) -> int:
    """A partition's copies, as its image's options name them: ``copies``, or ``replicas`` in
    an image written before the rename (0: the cluster's)."""
    copies: int = options.get("copies", options.get("replicas", 0))
    return copies


def rebuild(image: Image, units: dict[int, int], *, max_samples: int, max_tasks: int) -> Partition:
    """The partition of ``image``, its samples' units renamed by ``units`` (old id -> new)."""
    h, a = image.header, image.arrays
    o = h["options"]
    options = Options(
        fields=frozenset(o["fields"]) if o["fields"] is not None else None,
        tasks=frozenset(o["tasks"]) if o["tasks"] is not None else None,
        group_size=o["group_size"], on_member_failure=o["on_member_failure"], auto_free=o["auto_free"],
        target=o["target"], target_groups=o["target_groups"], recycle_to=o["recycle_to"], prefetch=o["prefetch"],
        step=o["step"], copies=_copies(o), dedup=frozenset(o.get("dedup", ())),
    )
    part = Partition(image.name, image.uid, options, max_samples=max_samples, max_tasks=max_tasks)
    part.schema.add({name: msgspec.convert(spec, FieldSpec) for name, spec in h["fields"]})
    n = int(h["n"])
    s = part.samples
    s.n = n
    for name in _SAMPLE_ARRAYS:
        setattr(s, name, a[name].astype(getattr(s, name).dtype, copy=True))
    top = max([*units, int(a["unit"].max()) if n else 0, 0])  # unit ids are bounded (read_image)
    table = np.full(top + 2, -1, dtype=np.int16)
    for old, new in units.items():
        table[old] = new
    s.unit = table[s.unit.astype(np.int64)]  # -1 (never placed) maps to the last entry: -1
    s.second_unit = np.full(len(s.unit), -1, dtype=np.int16)  # a checkpoint holds one copy of each sample
    # a put that never committed never will (the cluster that granted it is gone)
    s.mask[(s.mask & COMMITTED) == 0] |= EXCLUDED
    s.segments = {int(i): [_segment_in(seg) for seg in segs] for i, segs in h["segments"]}
    _rebuild_groups(s.groups, h["groups"], s.group)
    s.has_groups = bool(h["has_groups"])
    for field in part.schema.bits:
        if f"length/{field}" in a:
            part.schema.lengths[field] = a[f"length/{field}"].astype(np.int64, copy=True)
    for name, counts in h["tasks"].items():
        task = part.task(name)
        task.ensure(len(s.mask))
        state = a[f"task/{name}"]
        task.state[:n] = np.where(state == LEASED, AVAILABLE, state)  # leases in flight come back ready
        task.consumed, task.refused, task.expired, task.lost = (
            counts["consumed"], counts["refused"], counts["expired"], counts["lost"]
        )
        free = np.flatnonzero(task.state[:n] == AVAILABLE)
        task.lo = int(free[0]) if len(free) else n
    part.committed, part.excluded, part.lost = h["committed"], h["excluded"], h["lost"]
    part.reasons.update(h["reasons"])
    part.sealed, part.complete, part.groups_done = h["sealed"], h["complete"], h["groups_done"]
    if h.get("keys"):
        part.keys = KeyIndex.decode(h["keys"])
    return part


def _rebuild_groups(groups: Groups, saved: dict[str, Any], of: np.ndarray) -> None:
    if not saved["ids"]:
        return
    for gid in saved["ids"]:
        groups.of(gid)
    groups.committed[:] = saved["committed"]
    groups.failed[:] = saved["failed"]
    groups.aborted[:] = saved["aborted"]
    groups.complete[:] = saved["complete"]
    groups.order[:] = saved["order"]
    members = np.flatnonzero(of >= 0)
    ordered = members[np.argsort(of[members], kind="stable")]  # by group, each in index order
    bounds = np.searchsorted(of[ordered], np.arange(len(saved["ids"]) + 1))
    for g in range(len(saved["ids"])):
        groups.members[g] = ordered[bounds[g] : bounds[g + 1]].tolist()
