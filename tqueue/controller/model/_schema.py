"""A partition's schema, free of IO: its fields' specs and bits, the fields it declares, and
the length of each sample of its jagged tensor fields (for balancing by tokens).

A jagged tensor field's spec says whether its shapes have varied so far: its ``shape`` is the
one shape every sample granted so far has, or ``()`` once two differ (or none was seen). That
is one way only: a field whose shapes varied stays so, whatever is removed later."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ...errors import SchemaError, UnknownFieldError
from ...wire import FieldBlock, FieldSpec
from ._samples import COMMITTED, Moved, grow

MAX_FIELDS = 61


class Schema:
    """The fields of partition ``name``: each one's logical spec and bit in a sample's mask.
    ``declared``: the only fields it accepts (None: any)."""

    __slots__ = ("name", "declared", "specs", "bits", "lengths")

    def __init__(self, name: str, declared: frozenset[str] | None) -> None:
        self.name = name
        self.declared = declared
        self.specs: dict[str, FieldSpec] = {}
        self.bits: dict[str, np.uint64] = {}
        self.lengths: dict[str, np.ndarray] = {}  # jagged tensor fields: size of dim 0

    def check_blocks(self, blocks: Sequence[FieldBlock], count: int) -> dict[str, FieldSpec]:
        """Validate a write's fields against the partition; return the specs it would add."""
        added: dict[str, FieldSpec] = {}
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise SchemaError(f"partition {self.name!r}: a field is listed twice in {names}")
        for block in blocks:
            name = block.name
            if not isinstance(name, str) or not name:
                raise SchemaError(f"partition {self.name!r}: field names are non-empty strings")
            if self.declared is not None and name not in self.declared:
                raise UnknownFieldError(
                    f"field {name!r} is not declared for partition {self.name!r}; "
                    f"declared: {sorted(self.declared)}"
                )
            if block.spec.layout == "jagged" and block.spec.kind != "object":
                if block.shapes is None or len(block.shapes) != count * block.spec.ndim:
                    raise SchemaError(
                        f"field {name!r} of partition {self.name!r}: jagged field needs "
                        f"{count} per-sample shapes of {block.spec.ndim} dims"
                    )
            old = self.specs.get(name)
            if old is None:
                added[name] = _logical(block, count)
            else:
                _check_compatible(self.name, name, old, block)
        if len(self.specs) + len(added) > MAX_FIELDS:
            raise SchemaError(
                f"partition {self.name!r} would have {len(self.specs) + len(added)} fields; "
                f"at most {MAX_FIELDS} are supported"
            )
        return added

    def record(self, added: dict[str, FieldSpec], blocks: Sequence[FieldBlock], count: int,
               where: slice | np.ndarray, n: int) -> None:
        """Record a write ``check_blocks`` passed: the fields it adds, the shapes it gives,
        the lengths of its samples at ``where`` (of ``n``)."""
        self.add(added)
        self.note_shapes(blocks, count)
        self.record_lengths(blocks, where, n)

    def add(self, specs: dict[str, FieldSpec]) -> None:
        """Add new fields' specs; a jagged field already here whose one shape differs from
        the new spec's is marked varied."""
        for name, spec in specs.items():
            old = self.specs.get(name)
            if old is not None:
                if old.layout == "jagged" and old.shape and tuple(spec.shape) != tuple(old.shape):
                    self.specs[name] = _varied(old)
                continue
            self.specs[name] = spec
            self.bits[name] = np.uint64(1 << len(self.bits))

    def note_shapes(self, blocks: Sequence[FieldBlock], count: int) -> None:
        """Mark varied the jagged fields this write gives a shape other than their one shape."""
        for block in blocks:
            old = self.specs.get(block.name)
            if old is None or old.layout != "jagged" or not old.shape:
                continue
            if _one_shape(block, count) != tuple(old.shape):
                self.specs[block.name] = _varied(old)

    def record_lengths(self, blocks: Sequence[FieldBlock], where: slice | np.ndarray, n: int) -> None:
        """Remember dim 0 of each sample of jagged tensor fields (for token balancing)."""
        for block in blocks:
            spec = self.specs.get(block.name)
            if spec is None or spec.kind == "object" or spec.layout != "jagged" or spec.ndim == 0:
                continue
            arr = self.lengths.get(block.name)
            arr = grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), n)
            if block.spec.layout == "dense":
                arr[where] = block.spec.shape[0] if block.spec.shape else 1
            else:
                shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, block.spec.ndim)
                arr[where] = shapes[:, 0]
            self.lengths[block.name] = arr

    def field_mask(self, fields: Iterable[str]) -> tuple[np.uint64, list[str]]:
        """Bitmask of ``fields`` plus the committed bit, and the fields never written yet."""
        mask = COMMITTED
        missing = []
        for name in fields:
            bit = self.bits.get(name)
            if bit is None:
                if self.declared is not None and name not in self.declared:
                    raise UnknownFieldError(
                        f"field {name!r} is not declared for partition {self.name!r}; "
                        f"declared: {sorted(self.declared)}"
                    )
                missing.append(name)
            else:
                mask |= bit
        return mask, missing

    def check_moved(self, moved: Moved) -> dict[str, FieldSpec]:
        """The specs samples moving in would add; refused if they disagree with these."""
        names = [n for n, has in moved.has.items() if has.any()]
        for name in names:
            old, new = self.specs.get(name), moved.fields[name]
            if old is not None and _varied(old) != _varied(new):
                raise SchemaError(
                    f"field {name!r} is {old} in partition {self.name!r} but {new} where the samples come from"
                )
        if self.declared is not None and set(names) - self.declared:
            raise UnknownFieldError(f"fields {sorted(set(names) - self.declared)} are not declared for partition {self.name!r}")
        return {n: moved.fields[n] for n in names}

    def land_lengths(self, idx: np.ndarray, lengths: dict[str, np.ndarray], n: int) -> None:
        for name, values in lengths.items():
            if name in self.specs:
                arr = self.lengths.get(name)
                arr = grow(arr if arr is not None else np.zeros(1024, dtype=np.int64), n)
                arr[idx] = values
                self.lengths[name] = arr

    def balance_lengths(self, indexes: np.ndarray, fields: Sequence[str]) -> np.ndarray:
        """Tokens per sample for balancing: the sum of dim 0 over the jagged fields asked
        (pad rows, index -1, weigh nothing)."""
        real = indexes >= 0
        safe = np.where(real, indexes, 0)
        total = np.zeros(len(indexes), dtype=np.int64)
        for name in fields:
            arr = self.lengths.get(name)
            if arr is not None:
                total += np.where(real, arr[safe], 0)
        if not total.any():
            total = real.astype(np.int64)
        return total


def _logical(block: FieldBlock, count: int) -> FieldSpec:
    spec = block.spec
    if spec.layout == "dense":
        return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="dense", shape=tuple(spec.shape))
    shape = () if spec.kind == "object" else (_one_shape(block, count) or ())
    return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", shape=shape, ndim=spec.ndim)


def _one_shape(block: FieldBlock, count: int) -> tuple[int, ...] | None:
    """The one shape every sample of a tensor block has, or None where they differ (or there
    are none, or they have no dimensions)."""
    spec = block.spec
    if spec.layout == "dense":
        return tuple(spec.shape) if spec.shape and count else None
    if not spec.ndim or not count or not block.shapes:
        return None
    shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, spec.ndim)
    if not (shapes == shapes[0]).all():
        return None
    return tuple(int(d) for d in shapes[0])


def _varied(spec: FieldSpec) -> FieldSpec:
    """A jagged spec with no one shape (a dense one as it is)."""
    if spec.layout != "jagged" or not spec.shape:
        return spec
    return FieldSpec(kind=spec.kind, dtype=spec.dtype, layout="jagged", ndim=spec.ndim)


def _check_compatible(partition: str, name: str, old: FieldSpec, block: FieldBlock) -> None:
    new = block.spec
    where = f"field {name!r} of partition {partition!r}"
    if new.kind != old.kind:
        raise SchemaError(f"{where} holds {old.kind} values; this write has {new.kind} values")
    if new.dtype != old.dtype:
        raise SchemaError(f"{where} has dtype {old.dtype}; this write has dtype {new.dtype}")
    if old.kind == "object":
        return
    if old.layout == "dense":
        if new.layout == "dense":
            if tuple(new.shape) != tuple(old.shape):
                raise SchemaError(
                    f"{where} has per-sample shape {tuple(old.shape)}; this write has "
                    f"{tuple(new.shape)}"
                )
            return
        shapes = np.asarray(block.shapes, dtype=np.int64).reshape(-1, new.ndim)
        want = np.asarray(old.shape, dtype=np.int64)
        if new.ndim != len(old.shape):
            raise SchemaError(
                f"{where} has per-sample shape {tuple(old.shape)}; this write's samples have "
                f"{new.ndim} dimensions"
            )
        bad = np.flatnonzero(~np.all(shapes == want, axis=1))
        if len(bad):
            raise SchemaError(
                f"{where} has per-sample shape {tuple(old.shape)}; sample {int(bad[0])} of "
                f"this write has shape {tuple(int(d) for d in shapes[bad[0]])}"
            )
        return
    ndim = len(new.shape) if new.layout == "dense" else new.ndim
    if ndim != old.ndim:
        raise SchemaError(
            f"{where} has samples of {old.ndim} dimensions; this write's have {ndim}"
        )
