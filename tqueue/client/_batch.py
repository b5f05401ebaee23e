"""What a read gives its caller: a :class:`Batch` of fields, presented as its
:class:`~tqueue.client._ask.Options` say. tqueue/client/_assemble.py builds it from what the
storage units sent."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from .._extras import require
from ..errors import InvalidArgumentError, UnknownFieldError, did_you_mean
from ..wire import BatchMeta
from . import _micro
from ._ask import Options


class Batch(Mapping[str, Any]):
    """A read-only mapping from field name to the field's values for a batch of samples.

    Dense tensor fields are ``[B, ...]`` tensors; jagged ones are lists of per-sample
    tensors, or padded / nested tensors when asked; object fields are lists. A field's type
    depends on the field, never on which samples this batch happened to hold.
    """

    def __init__(
        self, meta: BatchMeta, values: dict[str, Any], lengths: dict[str, torch.Tensor], options: Options | None = None
    ) -> None:
        self._meta = meta
        self._values = values
        self._lengths = lengths
        self._options = options or Options()

    @property
    def meta(self) -> BatchMeta:
        return self._meta

    def replaced(self, values: dict[str, Any]) -> Batch:
        """This batch with ``values`` instead (the same meta, lengths and options)."""
        return Batch(self._meta, values, self._lengths, self._options)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self._meta.indexes)

    def __getitem__(self, field: str) -> Any:
        return self._values[field]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def is_pad(self) -> torch.Tensor:
        """Bool ``[B]``: which rows are padding (all-zero tensors, None objects)."""
        return torch.tensor([i < 0 for i in self._meta.indexes], dtype=torch.bool)

    def token_versions(
        self, field: str, *, prompt_lengths: int | Sequence[int] | torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Per sample, the policy version that produced each row of a jagged field; -1 where
        unknown.

        Read from the sample's segments ``(version, first_token)``, whose ``first_token``
        counts response tokens (0: the first generated token), as every token offset in
        tqueue does. A field whose rows are response tokens (the tokens, their log-probs)
        maps row ``r`` to response token ``r``: leave ``prompt_lengths`` out.

        A field spliced at each resume by ``complete(splice=...)`` (routed experts
        ``[prompt + response - 1, layers, top_k]``, as the rollout driver stores them) maps
        each segment from the row its call computed first, which the controller keeps with
        the segment (``meta.splices``; a batch that holds a ``<field>_splices`` field, one int
        per segment, written by the caller, is read as such a record): each row gets the
        version of the call that computed it. A resumed call computes the row of the last token it was given, so the
        boundary row is the new segment's; where a call's rows were lost (a closed stream),
        the call that recomputed them has them.

        A field with one row per sequence position, prompt first, and no recorded splices
        needs ``prompt_lengths`` (one for every sample, or one per sample): row ``r`` is then
        response token ``r - prompt_length``, and the prompt's rows belong to the segment
        that starts at response token 0 (the weights that prefilled it)."""
        values = self._values[field]
        meta = self._meta
        splices = (meta.splices or {}).get(field)
        if splices is None:
            splices = self._values.get(f"{field}_splices")
        if splices is not None and prompt_lengths is not None:
            raise InvalidArgumentError(
                f"token_versions({field!r}): the rows each segment starts at are recorded (complete(splice=), "
                f"or the batch's {field}_splices); prompt lengths are for fields without them"
            )
        prompts = _prompt_lengths(prompt_lengths, len(values), field)
        out = []
        for i, value in enumerate(values):
            n = len(value)
            prompt = prompts[i]
            if prompt > n:
                raise InvalidArgumentError(
                    f"field {field!r} of sample {meta.indexes[i]} has {n} rows, fewer than its prompt length {prompt}"
                )
            versions = torch.full((n,), -1, dtype=torch.int64)
            segments = meta.segments[i] if meta.segments is not None else None
            if segments is None and meta.versions is not None:
                segments = [[meta.versions[i], 0]]
            segments = segments or []
            rows = splices[i] if splices is not None else None
            if rows is not None and len(rows) != len(segments):
                raise InvalidArgumentError(
                    f"field {field!r} of sample {meta.indexes[i]}: {len(rows)} recorded splices "
                    f"({field}_splices) for {len(segments)} version segments"
                )
            for j, (version, first) in enumerate(segments):
                if rows is not None:
                    if int(rows[j]) >= 0:  # -1: the segment computed none of its rows
                        versions[int(rows[j]) :] = version
                else:
                    versions[prompt + first if first > 0 else 0 :] = version
            out.append(versions)
        return out

    def micro_batches(
        self,
        fields: Sequence[str] | None = None,
        *,
        form: _micro.Form = "padded",
        pad_to_multiple_of: int = 1,
        pad_value: _micro.PadValue | Mapping[str, _micro.PadValue] = 0,
        padding_side: Literal["right", "left"] = "right",
    ) -> list[_micro.MicroBatch]:
        """The batch cut into the micro-batches of ``meta.micro_batch_indices`` (the
        controller's plan; the whole batch as one without), each a :class:`MicroBatch` of
        ``fields`` (default: all).

        ``form="padded"``: each jagged field ``[b, L, ...]``, padded with ``pad_value`` (one
        value, or one per field) on ``padding_side`` to the micro-batch's own longest sample,
        rounded up to ``pad_to_multiple_of``; ``mb.lengths()``, ``mb.attention_mask()``.
        ``form="packed"``: each jagged field ``[T, ...]``, its samples back to back, each padded
        at its end to a multiple of ``pad_to_multiple_of``; ``mb.cu_seqlens()`` (int32
        ``[b + 1]``), ``mb.cu_seqlens_padded()``, ``mb.position_ids()``, ``mb.max_seqlen()``,
        ``mb.packed_seq_kwargs()`` for megatron-core's ``PackedSeqParams``. Megatron wants a
        multiple of TP (sequence parallel), ``2 * CP * TP`` with context parallelism.
        ``mb.unpad(field)`` gives each sample's rows back. Jagged fields fetched ``padded`` or
        ``nested`` are cut back into their samples first (one copy either way)."""
        names = list(self._values) if fields is None else ([fields] if isinstance(fields, str) else list(fields))
        for name in names:
            if name not in self._values:
                raise UnknownFieldError(
                    f"field {name!r} is not in this batch{did_you_mean(name, self._values)}; fields: {sorted(self._values)}"
                )
        values = {name: self._samples(name) for name in names}
        return _micro.shape(
            self._meta, values, fields=names, form=form, pad_to_multiple_of=pad_to_multiple_of,
            pad_value=pad_value, padding_side=padding_side,
        )

    def _samples(self, field: str) -> Any:
        """A jagged field as per-sample values, however it was fetched; any other as it is."""
        value = self._values[field]
        if isinstance(value, torch.Tensor) and value.is_nested:
            return list(value.unbind())
        lengths = self._lengths.get(field)
        if lengths is None or not isinstance(value, (torch.Tensor, np.ndarray)):
            return value
        width = value.shape[1] if value.ndim > 1 else 0
        left = self._options.padding_side == "left"
        return [value[i, width - n :] if left else value[i, :n] for i, n in enumerate(lengths.tolist())]

    def lengths(self, field: str) -> torch.Tensor:
        """Per-sample length (size of dimension 0) of a jagged tensor field, int64 ``[B]``."""
        try:
            return self._lengths[field]
        except KeyError:
            raise InvalidArgumentError(
                f"field {field!r} is not a jagged field of this batch with a length"
            ) from None

    def to_tensordict(self) -> Any:
        """A ``tensordict.TensorDict`` with batch size ``[B]`` (needs ``tensordict``)."""
        td = require("tensordict", "tensordict", by="Batch.to_tensordict")
        out = td.TensorDict({}, batch_size=[self.size])
        for name, value in self._values.items():
            if isinstance(value, torch.Tensor):
                out[name] = value
            elif value and isinstance(value[0], torch.Tensor) and value[0].dim() >= 1 and not self._objects(name):
                out[name] = torch.nested.as_nested_tensor(list(value), layout=torch.jagged)
            elif isinstance(value, np.ndarray):
                out[name] = torch.from_numpy(value)
            else:
                out[name] = td.NonTensorStack.from_list(list(value))
        return out

    def _objects(self, field: str) -> bool:
        """Whether ``field`` is an object field: its values may be tensors beside other values."""
        spec = self._meta.schema.get(field)
        return spec is not None and spec.kind == "object"

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {_describe(v)}" for k, v in self._values.items())
        return f"Batch(partition={self._meta.partition!r}, size={self.size}, {{{parts}}})"


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        if v.is_nested:
            return f"nested {v.dtype}"
        return f"{v.dtype}{list(v.shape)}"
    if isinstance(v, np.ndarray):
        return f"ndarray {v.dtype}{list(v.shape)}"
    return f"list[{len(v)}]"


def _prompt_lengths(given: int | Sequence[int] | torch.Tensor | None, count: int, field: str) -> list[int]:
    """Per sample, the rows of ``field`` before its first response token."""
    if given is None:
        return [0] * count
    if isinstance(given, int):
        out = [given] * count
    else:
        out = [int(p) for p in (given.tolist() if isinstance(given, torch.Tensor) else given)]
    if len(out) != count:
        raise InvalidArgumentError(f"token_versions({field!r}) got {len(out)} prompt lengths for {count} samples")
    if any(p < 0 for p in out):
        raise InvalidArgumentError(f"token_versions({field!r}): prompt lengths must be >= 0, got {out}")
    return out
