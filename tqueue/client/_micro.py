"""Micro-batches shaped for a trainer: each padded to its own longest sample, or packed.

The controller decides which samples of a share go together (``meta.micro_batch_indices``,
the same count on every data-parallel rank); this module builds each micro-batch's tensors
from the share's per-sample values:

* ``form="padded"``: a jagged field becomes ``[b, L, ...]``, ``L`` the micro-batch's longest
  sample rounded up to ``pad_to_multiple_of`` (so a micro-batch of short samples is short);
  :meth:`MicroBatch.lengths` and :meth:`MicroBatch.attention_mask` unpad it.
* ``form="packed"``: a jagged field becomes ``[T, ...]``, the samples back to back, each
  padded at its end to a multiple of ``pad_to_multiple_of``; :meth:`MicroBatch.cu_seqlens`
  (int32 ``[b + 1]``, the real lengths), :meth:`MicroBatch.cu_seqlens_padded` (where each
  sample starts), :meth:`MicroBatch.position_ids` (restarting at each sample) and
  :meth:`MicroBatch.max_seqlen` are what megatron-core's ``PackedSeqParams(qkv_format="thd")``
  (:meth:`MicroBatch.packed_seq_kwargs`) and flash-attention's varlen functions take.

Megatron wants sequences padded to a multiple of the tensor-parallel size under sequence
parallelism, and of ``2 * CP * TP`` under context parallelism (each sequence is cut into
``2 * CP`` chunks for the causal load balance, each split over TP), as verl's
``preprocess_packed_seqs`` aligns them: in packed form every sequence is padded to the
multiple, in padded form every row.

A pad row (index -1) is a sample of length 0. Dense fields are the micro-batch's rows, object
fields lists. Tensors stay on the device the values are on.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..errors import InvalidArgumentError, UnknownFieldError, did_you_mean
from ..wire import BatchMeta

Form = Literal["padded", "packed"]
FORMS = ("padded", "packed")
PadValue = float | int | bool


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a jagged field's samples lie in the micro-batch's tensor."""

    lengths: list[int]  # real rows of each sample
    taken: list[int]  # rows each sample takes: packed, its length rounded up; padded, the row width
    left: bool  # padded at the left (padded form only)
    device: torch.device


class MicroBatch(Mapping[str, Any]):
    """One micro-batch of a share: a read-only mapping from field name to value, shaped as
    ``form`` says (module docs), with what it takes to unpad or unpack it.

    Methods that take ``field`` (``lengths``, ``cu_seqlens`` ...) default to the jagged fields
    of the micro-batch when they all have the same lengths (the fields of one sequence); name
    the field otherwise."""

    def __init__(
        self, meta: BatchMeta, positions: list[int], values: dict[str, Any], layouts: dict[str, _Layout], form: Form
    ) -> None:
        self._meta = meta
        self._positions = positions
        self._values = values
        self._layouts = layouts
        self._form = form

    @property
    def meta(self) -> BatchMeta:
        """The meta of this micro-batch's samples (``meta.select`` of the share's)."""
        return self._meta

    @property
    def positions(self) -> list[int]:
        """Positions of its samples in the share (a list of ``meta.micro_batch_indices``)."""
        return self._positions

    @property
    def form(self) -> Form:
        return self._form

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self._positions)

    @property
    def is_pad(self) -> torch.Tensor:
        """Bool ``[b]``: which samples are pad rows."""
        return torch.tensor([i < 0 for i in self._meta.indexes], dtype=torch.bool)

    def __getitem__(self, field: str) -> Any:
        return self._values[field]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {list(v.shape) if hasattr(v, 'shape') else f'list[{len(v)}]'}" for k, v in self._values.items()
        )
        return f"MicroBatch(form={self._form!r}, size={self.size}, {{{shapes}}})"

    def lengths(self, field: str | None = None) -> torch.Tensor:
        """Int64 ``[b]``: each sample's real rows of a jagged field."""
        lay = self._layout(field)
        return torch.tensor(lay.lengths, dtype=torch.int64, device=lay.device)

    def attention_mask(self, field: str | None = None) -> torch.Tensor:
        """Bool ``[b, L]`` (padded form): True where a row is the sample's, False at padding."""
        lay = self._layout(field, "attention_mask", "padded")
        width = lay.taken[0] if lay.taken else 0
        cols = torch.arange(width, device=lay.device)
        lens = torch.tensor(lay.lengths, dtype=torch.int64, device=lay.device).unsqueeze(1)
        return cols >= width - lens if lay.left else cols < lens

    def position_ids(self, field: str | None = None) -> torch.Tensor:
        """Int64 position of each row in its sample: packed, ``[T]``, restarting at 0 at each
        sample (its padding goes on counting); padded, ``[b, L]``, 0 at each sample's first
        row (left padding: 0 on the padding before it)."""
        lay = self._layout(field)
        taken = torch.tensor(lay.taken, dtype=torch.int64, device=lay.device)
        if self._form == "packed":
            starts = torch.cumsum(taken, 0) - taken
            total = int(sum(lay.taken))
            return torch.arange(total, device=lay.device) - torch.repeat_interleave(starts, taken, output_size=total)
        width = lay.taken[0] if lay.taken else 0
        cols = torch.arange(width, device=lay.device).repeat(len(lay.lengths), 1)
        if not lay.left:
            return cols
        lens = torch.tensor(lay.lengths, dtype=torch.int64, device=lay.device).unsqueeze(1)
        return (cols - (width - lens)).clamp(min=0)

    def cu_seqlens(self, field: str | None = None) -> torch.Tensor:
        """Int32 ``[b + 1]``: cumulative real lengths, from 0."""
        lay = self._layout(field)
        return _cumulative(lay.lengths, lay.device)

    def cu_seqlens_padded(self, field: str | None = None) -> torch.Tensor:
        """Int32 ``[b + 1]``: where each sample starts in the field's rows (padded form: the
        field flattened to ``[b * L, ...]``), and the total at the end."""
        lay = self._layout(field)
        return _cumulative(lay.taken, lay.device)

    def max_seqlen(self, field: str | None = None) -> int:
        """The most rows a sample takes (packed: with its padding; padded: ``L``)."""
        return max(self._layout(field).taken, default=0)

    def packed_seq_kwargs(self, field: str | None = None, *, real_lengths: bool = False) -> dict[str, Any]:
        """Keyword arguments of megatron-core's ``PackedSeqParams`` for the ``thd`` format:
        ``PackedSeqParams(**mb.packed_seq_kwargs())``. ``cu_seqlens_q_padded``/``_kv_padded``
        say where each sample starts; ``cu_seqlens_q``/``_kv`` are the same offsets (each
        sample's padding then ends its segment, which a causal mask keeps from its real rows),
        as verl and NeMo-RL pass them, or with ``real_lengths`` the real lengths, Transformer
        Engine's convention for padded sequences (with a ``padding_causal`` mask). With
        ``pad_to_multiple_of=1`` both are the same."""
        starts, longest = self.cu_seqlens_padded(field), self.max_seqlen(field)
        seqs = self.cu_seqlens(field) if real_lengths else starts
        return {
            "qkv_format": "thd", "cu_seqlens_q": seqs, "cu_seqlens_kv": seqs, "cu_seqlens_q_padded": starts,
            "cu_seqlens_kv_padded": starts, "max_seqlen_q": longest, "max_seqlen_kv": longest,
        }

    def unpad(self, field: str) -> list[Any]:
        """The samples of a jagged field, each its real rows (views)."""
        lay = self._layout(field)
        value = self._values[field]
        if self._form == "packed":
            starts = np.concatenate(([0], np.cumsum(lay.taken)))
            return [value[int(s) : int(s) + n] for s, n in zip(starts, lay.lengths)]
        width = lay.taken[0] if lay.taken else 0
        return [value[i, width - n :] if lay.left else value[i, :n] for i, n in enumerate(lay.lengths)]

    def _layout(self, field: str | None, what: str = "", form: Form | None = None) -> _Layout:
        if form is not None and self._form != form:
            raise InvalidArgumentError(f"{what} is for form={form!r}; this micro-batch is {self._form!r}")
        if field is not None:
            lay = self._layouts.get(field)
            if lay is None:
                raise InvalidArgumentError(
                    f"field {field!r} is not a jagged field of this micro-batch{did_you_mean(field, self._layouts)}; "
                    f"jagged: {sorted(self._layouts)}"
                )
            return lay
        if not self._layouts:
            raise InvalidArgumentError(f"this micro-batch has no jagged field (fields: {sorted(self._values)})")
        names = list(self._layouts)
        first = self._layouts[names[0]]
        for name in names[1:]:
            if self._layouts[name].lengths != first.lengths:
                raise InvalidArgumentError(
                    f"fields {names[0]!r} and {name!r} differ in length in this micro-batch: name the field"
                )
        return first


def shape(
    meta: BatchMeta,
    values: Mapping[str, Any],
    *,
    fields: Sequence[str] | None = None,
    form: Form = "padded",
    pad_to_multiple_of: int = 1,
    pad_value: PadValue | Mapping[str, PadValue] = 0,
    padding_side: Literal["right", "left"] = "right",
) -> list[MicroBatch]:
    """The micro-batches of ``meta.micro_batch_indices`` (one of the whole batch without),
    built from ``values``: per field, a list of per-sample tensors or arrays for a jagged field,
    a ``[B, ...]`` tensor or array for a dense one, a list for an object field."""
    check_options(form, pad_to_multiple_of, padding_side)
    names = list(values) if fields is None else ([fields] if isinstance(fields, str) else list(fields))
    for name in names:
        if name not in values:
            raise UnknownFieldError(f"field {name!r} is not in this batch{did_you_mean(name, values)}; fields: {sorted(values)}")
    size = len(meta.indexes)
    groups = meta.micro_batch_indices or [list(range(size))]
    jagged = {name for name in names if _is_jagged(meta, name, values[name])}
    # an object field's values stay values, tensors among them too (nested values)
    objects = {name for name in names if (spec := meta.schema.get(name)) is not None and spec.kind == "object"}
    out = []
    for rows in groups:
        mb_values: dict[str, Any] = {}
        layouts: dict[str, _Layout] = {}
        for name in names:
            value = values[name]
            if name in jagged:
                fill = pad_value.get(name, 0) if isinstance(pad_value, Mapping) else pad_value
                samples = [value[i] for i in rows]
                mb_values[name], layouts[name] = _shape_field(name, samples, form, pad_to_multiple_of, fill, padding_side)
            elif isinstance(value, torch.Tensor):
                mb_values[name] = value.index_select(0, torch.tensor(rows, dtype=torch.int64, device=value.device))
            elif isinstance(value, np.ndarray):
                mb_values[name] = value[rows]
            elif name not in objects and value and all(isinstance(value[i], torch.Tensor) and value[i].dim() == 0 for i in rows):
                mb_values[name] = torch.stack([value[i] for i in rows])  # a jagged field of scalars
            else:
                mb_values[name] = [value[i] for i in rows]
        out.append(MicroBatch(meta.select(rows), list(rows), mb_values, layouts, form))
    return out


def check_options(form: str, pad_to_multiple_of: int, padding_side: str = "right") -> None:
    """InvalidArgumentError for options :func:`shape` cannot follow (checked before a read
    leases anything)."""
    if form not in FORMS:
        raise InvalidArgumentError(f"form is one of {list(FORMS)}, got {form!r}")
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise InvalidArgumentError(f"pad_to_multiple_of must be an integer >= 1, got {pad_to_multiple_of!r}")
    if padding_side not in ("right", "left"):
        raise InvalidArgumentError(f"padding_side is 'right' or 'left', got {padding_side!r}")
    if form == "packed" and padding_side == "left":
        raise InvalidArgumentError("form='packed' pads each sample at its end; padding_side='left' is for form='padded'")


def _is_jagged(meta: BatchMeta, name: str, value: Any) -> bool:
    """A field of per-sample tensors (or arrays) of at least one dimension."""
    spec = meta.schema.get(name)
    if spec is not None and (spec.kind == "object" or spec.layout == "dense" or spec.ndim == 0):
        return False
    if not isinstance(value, (list, tuple)) or not value:
        return False
    return all(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim >= 1 for v in value)


def _shape_field(
    name: str, samples: list[Any], form: Form, multiple: int, fill: PadValue, side: str
) -> tuple[Any, _Layout]:
    first = samples[0]
    trail = tuple(first.shape[1:])
    for s in samples:
        if tuple(s.shape[1:]) != trail:
            raise InvalidArgumentError(
                f"field {name!r}: samples differ beyond their first dimension ({tuple(first.shape)} and "
                f"{tuple(s.shape)}); a micro-batch cannot pad or pack them"
            )
    lengths = [int(s.shape[0]) for s in samples]
    if form == "packed":
        taken = [-(-n // multiple) * multiple for n in lengths]
        out = _full(first, (sum(taken), *trail), fill)
        at = 0
        for s, n, t in zip(samples, lengths, taken):
            out[at : at + n] = s
            at += t
    else:
        width = -(-max(lengths, default=0) // multiple) * multiple
        taken = [width] * len(samples)
        out = _full(first, (len(samples), width, *trail), fill)
        for i, (s, n) in enumerate(zip(samples, lengths)):
            if n and side == "left":
                out[i, width - n :] = s
            elif n:
                out[i, :n] = s
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    return out, _Layout(lengths, taken, side == "left" and form == "padded", device)


def _full(like: Any, shape: tuple[int, ...], fill: PadValue) -> Any:
    if isinstance(like, torch.Tensor):
        return torch.full(shape, fill, dtype=like.dtype, device=like.device)
    return np.full(shape, fill, dtype=like.dtype)


def _cumulative(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
