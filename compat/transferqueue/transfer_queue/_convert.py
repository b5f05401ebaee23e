"""Between TransferQueue's shapes (``TensorDict``, its ``BatchMeta``) and tqueue's (a mapping of
per-sample fields, ``tqueue.wire.BatchMeta``, ``tqueue.Batch``).

Storage rule: a tensor field whose samples are scalars is a dense tqueue field; any other
tensor field is stored jagged (one tensor per sample), because TransferQueue returns every such
field as a nested tensor and lets its per-sample shape change from one put to the next. A
field's ``is_nested`` is TransferQueue's: False until two of the partition's samples had
different shapes (tqueue's jagged spec keeps the one shape until then).
Non-tensor values are tqueue object fields: MessagePack values, and lists and dicts of them
whose leaves may be tensors and numpy arrays (a VLM sample's ``{"pixel_values": ...}``, None
for a text-only one); tqueue refuses other objects at ``put`` with ``FieldTypeError`` naming
the field, the sample and the path inside the value.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import tqueue
from transfer_queue.metadata import BatchMeta

logger = logging.getLogger(__name__)

_WHERE = "_tq"  # per-sample backend meta: [partition uid, storage unit]


def rows(td: TensorDict) -> int:
    return int(td.batch_size[0]) if len(td.batch_size) else 0


def to_fields(td: TensorDict) -> dict[str, Any]:
    """A ``TensorDict`` of B rows as tqueue's per-field values."""
    n = rows(td)
    out: dict[str, Any] = {}
    for name in map(str, td.keys()):  # flat keys: a nested TensorDict is refused below
        value = td.get(name)
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[name] = [t.contiguous() for t in value.unbind(0)]
        elif isinstance(value, torch.Tensor):
            out[name] = value if value.dim() == 1 else [t.contiguous() for t in value.unbind(0)]
        elif isinstance(value, NonTensorStack):
            out[name] = [_scalar(v) for v in value.tolist()]
        elif isinstance(value, NonTensorData):
            data = value.data
            # a sequence of one value per row is per sample, as TransferQueue reads it; else one
            # value for every row
            per_row = isinstance(data, list | tuple | np.ndarray) and len(data) == n
            out[name] = [_scalar(v) for v in data] if per_row else [_scalar(data)] * n
        elif isinstance(value, TensorDict):
            raise tqueue.FieldTypeError(
                f"field {name!r} is a nested TensorDict: tqueue fields are flat; put its keys as "
                f"fields of their own (e.g. '{name}.{next(iter(value.keys()), 'x')}')"
            )
        else:
            out[name] = list(value)
    return out


def _scalar(value: Any) -> Any:
    """A numpy scalar as a plain number; arrays, tensors and containers travel as they are."""
    return value.item() if isinstance(value, np.generic) else value


def plain(value: Any) -> Any:
    """numpy scalars and arrays inside non-tensor values as MessagePack values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def to_tensordict(batch: Any, names: list[str], size: int) -> TensorDict:
    """A tqueue ``Batch`` packed as TransferQueue packs its batches: per-sample scalars stacked,
    other tensors as a jagged nested tensor (strided where more than one dimension varies),
    non-tensors as a ``NonTensorStack``."""
    out: dict[str, Any] = {}
    for name in names:
        value = batch[name]
        if isinstance(value, torch.Tensor):
            out[name] = value.clone() if value.dim() == 1 else _nested(list(value.unbind(0)))
        elif isinstance(value, np.ndarray):
            out[name] = torch.from_numpy(value.copy())
        elif value and all(isinstance(v, torch.Tensor) for v in value):
            out[name] = _nested([v.clone() for v in value])
        else:
            out[name] = NonTensorStack(*value, batch_size=[size]) if size else NonTensorStack(batch_size=[0])
    return TensorDict(out, batch_size=[size])


def _nested(parts: list[torch.Tensor]) -> Any:
    try:
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    except (RuntimeError, ValueError):
        return torch.nested.as_nested_tensor(parts, layout=torch.strided)


def spec_schema(spec: tqueue.FieldSpec) -> dict[str, Any]:
    """One field's entry of TransferQueue's ``field_schema`` from tqueue's ``FieldSpec``."""
    if spec.kind == "object":
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    dtype = getattr(torch, spec.dtype, None)
    if spec.layout == "jagged" and not spec.shape:  # shapes have varied in the partition
        return {"dtype": dtype, "shape": None, "is_nested": True, "is_non_tensor": False}
    return {"dtype": dtype, "shape": torch.Size(spec.shape or (1,)), "is_nested": False, "is_non_tensor": False}


def to_meta(meta: tqueue.wire.BatchMeta, fields: list[str] | None = None) -> BatchMeta:
    """TransferQueue's ``BatchMeta`` for a tqueue meta; each sample remembers its partition's uid
    and its unit, and each field tqueue's spec, so ``get_data`` can be asked for any
    selection of it, in any process."""
    names = list(meta.fields if fields is None else fields)
    specs = {n: meta.schema[n] for n in names if n in meta.schema}
    backend = [
        {_WHERE: [meta.partition_uid, unit], **{n: _spec_list(s) for n, s in specs.items()}} for unit in meta.units
    ]
    return BatchMeta(
        global_indexes=list(meta.indexes),
        partition_ids=[meta.partition] * len(meta.indexes),
        field_schema={n: spec_schema(s) for n, s in specs.items()},
        production_status=np.ones(len(meta.indexes), dtype=np.int8),
        _custom_backend_meta=backend,
    )


def _spec_list(spec: tqueue.FieldSpec) -> list[Any]:
    return [spec.kind, spec.dtype, spec.layout, list(spec.shape), spec.ndim]


def from_meta(meta: BatchMeta) -> list[tqueue.wire.BatchMeta]:
    """tqueue metas (one per partition) for a TransferQueue ``BatchMeta`` that came from tqueue."""
    return [m for m, _ in split(meta)]


def split(meta: BatchMeta) -> list[tuple[tqueue.wire.BatchMeta, list[int]]]:
    """A TransferQueue ``BatchMeta`` that came from tqueue as tqueue metas, one per partition,
    each with the rows of ``meta`` it holds (in order)."""
    by_partition: dict[tuple[str, int], list[int]] = {}
    for row, backend in enumerate(meta._custom_backend_meta):
        where = backend.get(_WHERE)
        if where is None:
            raise ValueError(
                f"sample {meta.global_indexes[row]} of this BatchMeta was not returned by tqueue "
                "(a put or get_meta): tqueue can read only samples it handed out"
            )
        by_partition.setdefault((meta.partition_ids[row], int(where[0])), []).append(row)
    out = []
    for (partition, uid), picked in by_partition.items():
        first = meta._custom_backend_meta[picked[0]]
        schema = {
            n: tqueue.FieldSpec(kind=v[0], dtype=v[1], layout=v[2], shape=tuple(v[3]), ndim=v[4])
            for n, v in first.items()
            if n != _WHERE
        }
        tq_meta = tqueue.wire.BatchMeta(
            partition=partition,
            partition_uid=uid,
            indexes=[meta.global_indexes[r] for r in picked],
            units=[int(meta._custom_backend_meta[r][_WHERE][1]) for r in picked],
            fields=[n for n in meta.field_names if n in schema],
            schema=schema,
        )
        out.append((tq_meta, picked))
    return out


def take_rows(fields: dict[str, Any], picked: list[int]) -> dict[str, Any]:
    """The rows ``picked`` of tqueue per-field values (from :func:`to_fields`)."""
    return {
        n: v[torch.as_tensor(picked, dtype=torch.long)] if isinstance(v, torch.Tensor) else [v[r] for r in picked]
        for n, v in fields.items()
    }


def merge(parts: list[tuple[TensorDict, list[int]]], names: list[str], size: int) -> TensorDict:
    """One ``TensorDict`` of ``size`` rows from the batches of several partitions, each with
    the rows it fills, packed as :func:`to_tensordict` packs one."""
    out: dict[str, Any] = {}
    for name in names:
        items: list[Any] = [None] * size
        kinds = set()
        for td, picked in parts:
            if name not in td.keys():
                raise ValueError(f"field {name!r} is missing from some of this BatchMeta's partitions")
            value = td.get(name)
            if isinstance(value, torch.Tensor) and not value.is_nested:
                kinds.add("scalar")
                values = list(value.unbind(0))
            elif isinstance(value, torch.Tensor):
                kinds.add("tensor")
                values = list(value.unbind(0))
            else:
                kinds.add("object")
                values = value.tolist()
            for r, v in zip(picked, values):
                items[r] = v
        if kinds == {"scalar"}:
            out[name] = torch.stack(items)
        elif "object" not in kinds:
            out[name] = _nested([t.reshape(1) if t.dim() == 0 else t for t in items])
        else:
            out[name] = NonTensorStack(*items, batch_size=[size])
    return TensorDict(out, batch_size=[size])


def tolerant_put(client: tqueue.Client, partition: str, data: dict[str, Any], write: Any) -> Any:
    """``write(data)``; if tqueue refuses it because a tensor field's dtype differs from the
    partition's, and every value converts to the partition's dtype and back unchanged, write
    the converted values (TransferQueue lets a field's dtype drift; a tqueue field has one)."""
    try:
        return write(data)
    except tqueue.SchemaError as exc:
        status = client.status()
        part = next((p for p in status.partitions if p.name == partition), None)
        cast = None if part is None else _cast_exactly(data, part.fields)
        if cast is None:
            raise
        logger.warning("transfer_queue: %s; the values convert exactly, so they are written as the field's dtype", exc)
        return write(cast)


def _cast_exactly(data: dict[str, Any], specs: dict[str, tqueue.FieldSpec]) -> dict[str, Any] | None:
    out = dict(data)
    changed = False
    for name, value in data.items():
        spec = specs.get(name)
        dtype = getattr(torch, spec.dtype, None) if spec is not None and spec.kind == "tensor" else None
        if not isinstance(dtype, torch.dtype):
            continue
        parts = [value] if isinstance(value, torch.Tensor) else value
        if not all(isinstance(p, torch.Tensor) for p in parts) or all(p.dtype == dtype for p in parts):
            continue
        converted = [p.to(dtype) for p in parts]
        if not all(torch.equal(c.to(p.dtype), p) for c, p in zip(converted, parts)):
            return None
        out[name] = converted[0] if isinstance(value, torch.Tensor) else converted
        changed = True
    return out if changed else None
