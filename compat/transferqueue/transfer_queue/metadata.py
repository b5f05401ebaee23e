"""TransferQueue's metadata objects: ``BatchMeta`` (columnar, per sample) and ``KVBatchMeta``.

Plain Python, picklable (trainers ship metas to their workers through Ray), with TransferQueue
0.1.11's constructor, attributes and operations. A ``BatchMeta`` that came from a tqueue
cluster also carries, per sample, where tqueue keeps it (``_custom_backend_meta``); the
operations keep that aligned with the samples.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

READY = 1


def _same_value(a: Any, b: Any) -> bool:
    """Equality that also holds for tensors and arrays (whose ``==`` is elementwise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object whose == cannot answer is not the same value
        return False


def _merge_extra_info(infos: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """Union of the chunks' extra_info; a key with two different values is refused."""
    keys = [set(info) for info in infos]
    if any(k != keys[0] for k in keys[1:]):
        logger.warning("%s.concat: extra_info key sets differ across chunks, performing union of keys.", what)
    merged: dict[str, Any] = {}
    for index, info in enumerate(infos):
        for key, value in info.items():
            if key not in merged:
                merged[key] = value
            elif not _same_value(merged[key], value):
                raise ValueError(
                    f"{what}.concat: extra_info key '{key}' has conflicting values across chunks "
                    f"and cannot be merged: first={merged[key]!r}, chunk[{index}]={value!r}"
                )
    return merged


def _rows(td: Any) -> int:
    return int(td.batch_size[0]) if len(td.batch_size) else 0


def extract_field_schema(data: Any) -> dict[str, dict[str, Any]]:
    """Each field's schema as TransferQueue records it: dtype and per-sample shape (a 1-D field
    has shape ``(1,)``), ``is_nested``, ``is_non_tensor`` and, for nested fields, every sample's
    shape in ``per_sample_shapes``."""
    rows = _rows(data)
    schema: dict[str, dict[str, Any]] = {}
    if rows == 0:
        return schema
    for name, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            parts = value.unbind()
            if len(parts) != rows:
                raise ValueError(
                    f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={rows}, "
                    f"got nested tensor composed of {len(parts)} tensors"
                )
            schema[name] = {
                "dtype": parts[0].dtype,
                "shape": parts[0].shape,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": [tuple(p.shape) for p in parts],
            }
        elif isinstance(value, torch.Tensor):
            if value.shape[0] != rows:
                raise ValueError(
                    f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={rows}, "
                    f"got value.shape[0]={value.shape[0]}"
                )
            shape = value.shape[1:] if value.dim() > 1 else torch.Size([1])
            schema[name] = {"dtype": value.dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}
        else:
            if len(value) != rows:
                raise ValueError(
                    f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={rows}, "
                    f"got len(value)={len(value)}"
                )
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


class SampleView:
    """One sample of a ``BatchMeta``, read-only (its mappings are ``MappingProxyType``)."""

    __slots__ = ("_meta", "_row")

    def __init__(self, meta: BatchMeta, row: int) -> None:
        self._meta = meta
        self._row = row

    @property
    def global_index(self) -> int:
        return self._meta.global_indexes[self._row]

    @property
    def partition_id(self) -> str:
        return self._meta.partition_ids[self._row]

    @property
    def production_status(self) -> int:
        return int(self._meta.production_status[self._row])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._meta.custom_meta[self._row])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        """Each field's schema for this sample: a nested field's ``shape`` is this sample's."""
        out = {}
        for name, spec in self._meta.field_schema.items():
            spec = dict(spec)
            shapes = spec.pop("per_sample_shapes", None)
            if shapes is not None:
                spec["shape"] = shapes[self._row]
            out[name] = MappingProxyType(spec)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, fields={list(self._meta.field_schema)})"
        )


class SampleViews:
    """``BatchMeta.samples``: indexable, sized and iterable, one ``SampleView`` per sample."""

    __slots__ = ("_meta",)

    def __init__(self, meta: BatchMeta) -> None:
        self._meta = meta

    def __len__(self) -> int:
        return self._meta.size

    def __getitem__(self, row: int) -> SampleView:
        return SampleView(self._meta, row)

    def __iter__(self) -> Iterator[SampleView]:
        return (SampleView(self._meta, row) for row in range(len(self)))


class BatchMeta:
    """A batch's samples: ``global_indexes`` and ``partition_ids`` (one per sample), the
    ``field_schema`` of its fields, ``production_status`` (int8, 1 = ready), batch-level
    ``extra_info``, per-sample ``custom_meta``, and per-sample ``_custom_backend_meta`` (where
    the storage keeps each sample)."""

    __slots__ = (
        "global_indexes",
        "partition_ids",
        "field_schema",
        "production_status",
        "extra_info",
        "custom_meta",
        "_custom_backend_meta",
        "_size",
        "_field_names",
        "_is_ready",
    )

    def __init__(
        self,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: np.ndarray | None = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: list[dict[str, Any]] | None = None,
        _custom_backend_meta: list[dict[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = list(global_indexes)
        self.partition_ids = list(partition_ids)
        size = len(self.global_indexes)
        if len(self.partition_ids) != size:
            raise ValueError(
                f"Length mismatch: global_indexes has {size}, partition_ids has {len(self.partition_ids)}"
            )
        self.field_schema = {name: dict(spec) for name, spec in (field_schema or {}).items()}
        for name, spec in self.field_schema.items():
            shapes = spec.get("per_sample_shapes")
            if shapes is not None and len(shapes) != size:
                raise ValueError(f"Field '{name}' per_sample_shapes length {len(shapes)} != batch_size {size}")
        if production_status is None:
            self.production_status = np.zeros(size, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if len(self.production_status) != size:
                raise ValueError(f"production_status length {len(self.production_status)} != batch_size {size}")
        self.extra_info = dict(extra_info or {})
        self.custom_meta = self._per_sample(custom_meta, size, "custom_meta")
        self._custom_backend_meta = self._per_sample(_custom_backend_meta, size, "_custom_backend_meta")
        self._size = size
        self._refresh()

    @staticmethod
    def _per_sample(values: list[dict[str, Any]] | None, size: int, name: str) -> list[dict[str, Any]]:
        if not values:
            return [{} for _ in range(size)]
        if len(values) != size:
            raise ValueError(f"{name} length {len(values)} != batch_size {size}")
        return [dict(v) for v in values]

    def _refresh(self) -> None:
        self._field_names = sorted(self.field_schema)
        self._is_ready = self._size > 0 and bool(np.all(self.production_status == READY))

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, slot) for slot in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip(self.__slots__, state):
            # Ray's zero-copy deserialisation hands numpy arrays back read-only
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()
            setattr(self, slot, value)

    # -- read-only views -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return getattr(self, "_size", 0)

    @property
    def field_names(self) -> list[str]:
        return getattr(self, "_field_names", [])

    @property
    def samples(self) -> SampleViews:
        return SampleViews(self)

    @property
    def is_ready(self) -> bool:
        return getattr(self, "_is_ready", False)

    def __len__(self) -> int:
        return self.size

    def _spec(self, field_name: str) -> dict[str, Any]:
        try:
            return self.field_schema[field_name]
        except KeyError:
            raise KeyError(f"Field '{field_name}' not found in field_schema") from None

    def get_dtypes(self, field_name: str) -> list[Any]:
        return [self._spec(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        spec = self._spec(field_name)
        shapes = spec.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [spec.get("shape")] * self.size

    # -- extra_info (batch level) and custom_meta (per sample) -----------------------------------

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, theirs in zip(self.custom_meta, custom_meta):
            mine.update(theirs)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``tensor_dict`` (one row per sample of this batch), in place."""
        rows = _rows(tensor_dict)
        if rows == 0:
            return self
        if rows != self.size:
            raise ValueError(f"add_fields batch size mismatch: self.size={self.size} vs tensor_dict={rows}")
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = READY
        self._refresh()
        return self

    # -- selections --------------------------------------------------------------------------------

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        rows = list(sample_indices)
        if any(r < 0 or r >= self.size for r in rows):
            raise ValueError(f"Sample indices must be in range [0, {self.size})")
        schema = {}
        for name, spec in self.field_schema.items():
            spec = copy.deepcopy(spec)
            if spec.get("per_sample_shapes") is not None:
                spec["per_sample_shapes"] = [spec["per_sample_shapes"][r] for r in rows]
            schema[name] = spec
        return BatchMeta(
            global_indexes=[self.global_indexes[r] for r in rows],
            partition_ids=[self.partition_ids[r] for r in rows],
            field_schema=schema,
            production_status=self.production_status[rows],
            extra_info=self.extra_info,
            custom_meta=[copy.deepcopy(self.custom_meta[r]) for r in rows],
            _custom_backend_meta=[copy.deepcopy(self._custom_backend_meta[r]) for r in rows],
        )

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        """The same samples with only the named fields (names this batch lacks are skipped)."""
        wanted = set(field_names)
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema={n: copy.deepcopy(self.field_schema[n]) for n in field_names if n in self.field_schema},
            production_status=self.production_status.copy(),
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            _custom_backend_meta=[
                {k: v for k, v in m.items() if k.startswith("_") or k in wanted} for m in self._custom_backend_meta
            ],
        )

    def copy(self) -> BatchMeta:
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema=copy.deepcopy(self.field_schema),
            production_status=self.production_status.copy(),
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            _custom_backend_meta=copy.deepcopy(self._custom_backend_meta),
        )

    def __getitem__(self, item: int | np.integer | slice) -> BatchMeta:
        if isinstance(item, slice):
            return self.select_samples(list(range(*item.indices(self.size))))
        if isinstance(item, int | np.integer):
            row = int(item) + self.size if item < 0 else int(item)
            if not 0 <= row < self.size:
                raise IndexError("BatchMeta index out of range")
            return self.select_samples([row])
        raise TypeError(f"Indexing with {type(item)} is not supported.")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` consecutive pieces, the first ``size % chunks`` one sample longer."""
        if self.size < chunks:
            logger.warning("Chunk size %d > number of samples in BatchMeta %d: some chunks are empty.", chunks, self.size)
        out, start = [], 0
        for bounds in _chunk_sizes(self.size, chunks):
            out.append(self.select_samples(list(range(start, start + bounds))))
            start += bounds
        return out

    def chunk_by_partition(self) -> list[BatchMeta]:
        rows: dict[str, list[int]] = {}
        for row, partition in enumerate(self.partition_ids):
            rows.setdefault(partition, []).append(row)
        return [self.select_samples(r) for r in rows.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """The fields of both (``other``'s win where both have one) for the same samples."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise ValueError(
                f"BatchMeta.union: global_indexes do not match. self.global_indexes={self.global_indexes}, "
                f"other.global_indexes={other.global_indexes}"
            )
        if self.partition_ids != other.partition_ids:
            raise ValueError(
                f"BatchMeta.union: partition_ids do not match. self.partition_ids={self.partition_ids}, "
                f"other.partition_ids={other.partition_ids}"
            )
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema=schema,
            production_status=np.bitwise_and(self.production_status, other.production_status),
            extra_info={**self.extra_info, **other.extra_info},
            custom_meta=[{**copy.deepcopy(a), **copy.deepcopy(b)} for a, b in zip(self.custom_meta, other.custom_meta)],
            _custom_backend_meta=[
                {**copy.deepcopy(a), **copy.deepcopy(b)}
                for a, b in zip(self._custom_backend_meta, other._custom_backend_meta)
            ],
        )

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the chunks' samples, in order; empty chunks are skipped. With ``validate``
        every chunk must have the same fields with the same dtypes."""
        chunks = [c for c in data or [] if c and c.size > 0]
        if not chunks:
            logger.warning("No BatchMeta chunks to concatenate: returning an empty BatchMeta.")
            return cls.empty()
        if validate:
            _check_same_fields(chunks)
        schema: dict[str, dict[str, Any]] = {}
        for name, spec in chunks[0].field_schema.items():
            specs = [c.field_schema.get(name, {}) for c in chunks]
            nested = any(s.get("is_nested", False) for s in specs)
            merged = {
                "dtype": spec.get("dtype"),
                "shape": None if nested else spec.get("shape"),
                "is_nested": nested,
                "is_non_tensor": spec.get("is_non_tensor", False),
            }
            if nested or any(s.get("per_sample_shapes") for s in specs):
                merged["per_sample_shapes"] = [
                    shape
                    for c, s in zip(chunks, specs)
                    for shape in (s.get("per_sample_shapes") or [s.get("shape")] * c.size)
                ]
            schema[name] = merged
        return cls(
            global_indexes=[i for c in chunks for i in c.global_indexes],
            partition_ids=[p for c in chunks for p in c.partition_ids],
            field_schema=schema,
            production_status=np.concatenate([c.production_status for c in chunks]),
            extra_info=_merge_extra_info([c.extra_info for c in chunks], "BatchMeta"),
            custom_meta=[m for c in chunks for m in c.custom_meta],
            _custom_backend_meta=[m for c in chunks for m in c._custom_backend_meta],
        )

    def reorder(self, indices: list[int]) -> None:
        """Put the samples in the order of ``indices`` (a permutation of ``range(size)``), in place."""
        rows = list(indices)
        if len(rows) != self.size:
            raise ValueError(f"Indices length {len(rows)} mismatch batch size {self.size}")
        if len(set(rows)) != self.size:
            raise ValueError("Indices contain duplicates")
        if any(r < 0 or r >= self.size for r in rows):
            raise ValueError(f"Reorder indices must be in range [0, {self.size})")
        self.global_indexes = [self.global_indexes[r] for r in rows]
        self.partition_ids = [self.partition_ids[r] for r in rows]
        self.production_status = self.production_status[rows]
        for spec in self.field_schema.values():
            if spec.get("per_sample_shapes") is not None:
                spec["per_sample_shapes"] = [spec["per_sample_shapes"][r] for r in rows]
        self.custom_meta = [self.custom_meta[r] for r in rows]
        self._custom_backend_meta = [self._custom_backend_meta[r] for r in rows]

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls(global_indexes=[], partition_ids=[], extra_info=extra_info)

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, is_ready={self.is_ready}, "
            f"global_indexes={self.global_indexes}, extra_info={self.extra_info})"
        )


def _chunk_sizes(n: int, chunks: int) -> list[int]:
    base, extra = divmod(n, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def _check_same_fields(chunks: list[BatchMeta]) -> None:
    names = chunks[0].field_names
    for index, c in enumerate(chunks):
        if c.field_names != names:
            raise ValueError(
                f"BatchMeta.concat: field_names mismatch at chunk[{index}]. Expected {names}, got {c.field_names}. "
                f"Extra in chunk: {set(c.field_names) - set(names)}, Missing from chunk: {set(names) - set(c.field_names)}"
            )
    for name in names:
        dtype = chunks[0].field_schema[name].get("dtype")
        for index, c in enumerate(chunks[1:], start=1):
            if c.field_schema[name].get("dtype") != dtype:
                raise ValueError(
                    f"Field '{name}' dtype mismatch in concat: chunk[0]={dtype}, "
                    f"chunk[{index}]={c.field_schema[name].get('dtype')}"
                )


@dataclasses.dataclass
class KVBatchMeta:
    """Keys of one partition with their tags (one dict per key), the fields they hold and
    batch-level ``extra_info``."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("Got duplicated keys.")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError("Got duplicated fields.")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def _like(self, keys: list[str], tags: list[dict[str, Any]]) -> KVBatchMeta:
        return KVBatchMeta(keys=keys, tags=tags, partition_id=self.partition_id, fields=self.fields, extra_info=self.extra_info)

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError("Contain duplicate keys.")
        missing = set(keys_to_select) - set(self.keys)
        if missing:
            raise RuntimeError(f"Keys {missing} not found in current batch.")
        where = {key: i for i, key in enumerate(self.keys)}
        return self._like(list(keys_to_select), [self.tags[where[k]] for k in keys_to_select])

    def reorder(self, indexes: list[int]) -> None:
        if len(indexes) != self.size:
            raise ValueError(
                f"Attempted to reorder with indexes length {len(indexes)} that does not match the batch size {self.size}."
            )
        if len(set(indexes)) != len(indexes):
            raise ValueError("Contain duplicate indexes.")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        if self.size < chunks:
            logger.warning("Chunk size %d > number of samples in this batch %d: some chunks are empty.", chunks, self.size)
        out, start = [], 0
        for n in _chunk_sizes(self.size, chunks):
            out.append(self._like(self.keys[start : start + n], self.tags[start : start + n]))
            start += n
        return out

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        chunks = [c for c in data or [] if c and c.size > 0]
        if not chunks:
            logger.warning("No KVBatchMeta chunks to concatenate: returning an empty KVBatchMeta.")
            return cls()
        first = chunks[0]
        for c in chunks:
            if c.fields is not None and set(c.fields) != set(first.fields or ()):
                raise ValueError("Field names do not match for concatenation.")
            if c.partition_id != first.partition_id:
                raise ValueError("Partition do not match for concatenation.")
        extra = _merge_extra_info([c.extra_info or {} for c in chunks], "KVBatchMeta")
        return cls(
            keys=[k for c in chunks for k in c.keys],
            tags=[t for c in chunks for t in c.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra or None,
        )


__all__ = ["BatchMeta", "KVBatchMeta", "SampleView", "extract_field_schema"]
