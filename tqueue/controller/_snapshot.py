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
schema's metadata ``tqueue``. :func:`rebuild` makes a :class:`Partition` of an image, with
leases given back (a leased sample is available again) and puts that never committed
excluded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Final

import msgspec
import numpy as np

from ..errors import ProtocolError
from ..wire import FieldSpec
from ._keyindex import KeyIndex
from ._partition import Options, Partition
from ._samples import COMMITTED, EXCLUDED, Groups
from ._serving import AVAILABLE, LEASED

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
            "replicas": opts.replicas,
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
        "segments": [[i, [list(seg) for seg in segs]] for i, segs in s.segments.items()],
        "keys": part.keys.encode() if part.keys is not None else None,
    }
    return Image(header, arrays)


def _fit(arr: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    k = min(n, len(arr))
    out[:k] = arr[:k]
    return out


def write_image(path: str, image: Image) -> int:
    """Write ``image`` to ``path`` and fsync it; its size in bytes."""
    import pyarrow as pa

    names = list(image.arrays)
    table = pa.table([pa.array(image.arrays[k]) for k in names], names=names)
    table = table.replace_schema_metadata({"tqueue": json.dumps(image.header)})
    with open(path, "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        sink.flush()
        os.fsync(sink.fileno())
    return os.path.getsize(path)


def read_image(path: str) -> Image:
    import pyarrow as pa

    with pa.memory_map(path) as source:
        table = pa.ipc.open_file(source).read_all()
        raw = (table.schema.metadata or {}).get(b"tqueue")
        try:
            header = json.loads(raw) if raw is not None else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ProtocolError(f"{path} is not a tqueue partition file")
        if header.get("version") != FORMAT_VERSION:
            raise ProtocolError(f"{path} is a partition file of version {header.get('version')}; this controller reads {FORMAT_VERSION}")
        arrays = {name: table.column(name).to_numpy().copy() for name in table.column_names}
    if any(len(a) != header["n"] for a in arrays.values()):
        raise ProtocolError(f"{path}: its columns do not all have {header['n']} rows")
    return Image(header, arrays)


def rebuild(image: Image, units: dict[int, int], *, max_samples: int, max_tasks: int) -> Partition:
    """The partition of ``image``, its samples' units renamed by ``units`` (old id -> new)."""
    h, a = image.header, image.arrays
    o = h["options"]
    options = Options(
        fields=frozenset(o["fields"]) if o["fields"] is not None else None,
        tasks=frozenset(o["tasks"]) if o["tasks"] is not None else None,
        group_size=o["group_size"], on_member_failure=o["on_member_failure"], auto_free=o["auto_free"],
        target=o["target"], target_groups=o["target_groups"], recycle_to=o["recycle_to"], prefetch=o["prefetch"],
        step=o["step"], replicas=o.get("replicas", 0),
    )
    part = Partition(image.name, image.uid, options, max_samples=max_samples, max_tasks=max_tasks)
    part.schema.add({name: msgspec.convert(spec, FieldSpec) for name, spec in h["fields"]})
    n = int(h["n"])
    s = part.samples
    s.n = n
    for name in _SAMPLE_ARRAYS:
        setattr(s, name, a[name].astype(getattr(s, name).dtype, copy=True))
    table = np.full(max([*units, *a["unit"].tolist(), 0]) + 2, -1, dtype=np.int16)
    for old, new in units.items():
        table[old] = new
    s.unit = table[s.unit.astype(np.int64)]  # -1 (never placed) maps to the last entry: -1
    s.replica = np.full(len(s.unit), -1, dtype=np.int16)  # a checkpoint holds one copy of each sample
    # a put that never committed never will (the cluster that granted it is gone)
    s.mask[(s.mask & COMMITTED) == 0] |= EXCLUDED
    s.segments = {int(i): [(int(v), int(t)) for v, t in segs] for i, segs in h["segments"]}
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
