"""SGLang: a ``/generate`` response as tqueue's standard rollout fields.

The formats, as SGLang 0.5.23 returns them (see docs/bridges.md for the source lines):

* the response is ``{"text", "output_ids", "meta_info"}``;
* ``meta_info.finish_reason`` is ``{"type": "stop", "matched": ...}``, ``{"type": "length",
  "length": n}`` or ``{"type": "abort", "message": ...}`` (``None`` while unfinished);
* ``meta_info.output_token_logprobs`` is a list of ``(logprob, token_id, text)``;
* ``meta_info.weight_versions`` is a list of ``{"version", "start", "end"}`` over the call's
  output tokens, ``meta_info.weight_version`` the last one's version;
* ``meta_info.routed_experts`` is base64 of raw int32, rows ``[routed_experts_start_len,
  seqlen - 1)`` of ``num_hidden_layers x num_experts_per_tok``.

No SGLang import is needed to read them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, SchemaError
from ._fields import Trajectory

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def from_generate(
    response: Mapping[str, Any],
    prompt_ids: Sequence[int],
    *,
    trajectory: Trajectory | None = None,
    experts_shape: tuple[int, int] | None = None,
    routed_experts_start_len: int = 0,
) -> Trajectory:
    """The trajectory of one ``/generate`` response to ``prompt_ids``.

    To resume a partial rollout, pass the ``trajectory`` it continues (the call was sent
    ``prompt + response so far`` as its input): the new tokens are appended, and routed
    experts (with ``experts_shape`` = ``(num_hidden_layers, num_experts_per_tok)``), which
    SGLang returns from ``routed_experts_start_len``, are spliced there.
    """
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise SchemaError("an SGLang /generate response has a meta_info object")
    ids = response.get("output_ids")
    if not isinstance(ids, list):
        raise SchemaError("an SGLang /generate response has output_ids, a list of token ids")
    traj = trajectory if trajectory is not None else Trajectory(prompt_ids=[int(t) for t in prompt_ids])
    logprobs = _logprobs(meta, ids)
    spans = _spans(meta, len(ids))
    experts = None
    if meta.get("routed_experts") is not None:
        if experts_shape is None:
            raise InvalidArgumentError("routed_experts came back: experts_shape=(layers, top_k) is needed to read them")
        experts = _experts(meta["routed_experts"], experts_shape)
    traj.append(ids, logprobs, _finish(meta.get("finish_reason")), spans, experts, routed_experts_start_len)
    return traj


def _finish(reason: Any) -> str:
    if reason is None:
        raise SchemaError("finish_reason is None: the request had not finished")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    return _FINISH.get(kind, "error") if isinstance(kind, str) else "error"


def _logprobs(meta: Mapping[str, Any], ids: list[Any]) -> list[float]:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SchemaError("meta_info has no output_token_logprobs: send the request with return_logprob=true")
    if len(entries) != len(ids):
        raise SchemaError(f"{len(entries)} output_token_logprobs for {len(ids)} output_ids")
    out = []
    for i, (entry, token) in enumerate(zip(entries, ids)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SchemaError(f"output_token_logprobs[{i}] is {entry!r}, not (logprob, token_id, text)")
        if entry[1] != token:
            raise SchemaError(f"output_token_logprobs[{i}] is for token {entry[1]}, output_ids[{i}] is {token}")
        out.append(float(entry[0]))
    return out


def _version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SchemaError(f"weight version {value!r} is not an integer (tqueue versions are the trainer's step)") from None


def _spans(meta: Mapping[str, Any], count: int) -> list[tuple[int, int, int]]:
    spans = meta.get("weight_versions")
    if spans:
        return [(_version(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    if meta.get("weight_version") is not None and count:
        return [(_version(meta["weight_version"]), 0, count)]
    return []


def _experts(encoded: str, shape: tuple[int, int]) -> np.ndarray:
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SchemaError(f"routed_experts is not base64: {exc}") from None
    flat = np.frombuffer(raw, dtype=np.int32)
    per_row = shape[0] * shape[1]
    if per_row <= 0 or len(flat) % per_row:
        raise SchemaError(f"routed_experts holds {len(flat)} int32 values, not rows of {shape[0]} x {shape[1]}")
    return flat.reshape(-1, shape[0], shape[1])
