"""vLLM: a ``CompletionOutput`` as tqueue's standard rollout fields.

The formats, as vLLM 0.33.0 defines them (see docs/bridges.md for the source lines):

* ``CompletionOutput.token_ids``: the generated tokens of this call;
* ``logprobs``: one ``dict[token_id, Logprob]`` per generated token (the sampled id and its
  top-k), ``Logprob.logprob`` a float;
* ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``"repetition"``;
* ``weight_versions``: ``WeightVersionSpan(version, start, end)`` over the output tokens, set on
  the final output only;
* ``routed_experts``: ``np.ndarray [rows, layers, top_k]`` (uint8, or uint16 past 256
  experts), rows from ``SamplingParams.routed_experts_prompt_start`` to ``seqlen - 1``.

The objects are read by attribute, so nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import SchemaError
from ._fields import Trajectory

# "repetition": vLLM stopped a sequence that repeated itself; it ended on the engine's terms
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error", "repetition": "stop"}


def from_completion(
    output: Any,
    prompt_ids: Sequence[int],
    *,
    trajectory: Trajectory | None = None,
    routed_experts_prompt_start: int = 0,
) -> Trajectory:
    """The trajectory of one finished ``CompletionOutput`` for ``prompt_ids``; with
    ``trajectory``, the call that resumes it (sent ``prompt + response so far``): tokens are
    appended and routed experts spliced at ``routed_experts_prompt_start``."""
    ids = [int(t) for t in output.token_ids]
    traj = trajectory if trajectory is not None else Trajectory(prompt_ids=[int(t) for t in prompt_ids])
    reason = output.finish_reason
    if reason is None:
        raise SchemaError("finish_reason is None: the output is not the final one")
    spans = [_span(s) for s in (getattr(output, "weight_versions", None) or [])]
    experts = getattr(output, "routed_experts", None)
    traj.append(
        ids, _logprobs(output.logprobs, ids), _FINISH.get(str(reason), "error"), spans,
        None if experts is None else np.asarray(experts), routed_experts_prompt_start,
    )
    return traj


def _logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    if logprobs is None:
        raise SchemaError("the output has no logprobs: sample with SamplingParams(logprobs=0)")
    if len(logprobs) != len(ids):
        raise SchemaError(f"{len(logprobs)} logprob entries for {len(ids)} token_ids")
    out = []
    for i, (entry, token) in enumerate(zip(logprobs, ids)):
        if not isinstance(entry, Mapping) or token not in entry:
            raise SchemaError(f"logprobs[{i}] holds no entry for the sampled token {token}")
        out.append(float(entry[token].logprob))
    return out


def _span(span: Any) -> tuple[int, int, int]:
    try:
        version = int(span.version)
    except (TypeError, ValueError):
        raise SchemaError(f"weight version {span.version!r} is not an integer (tqueue versions are the trainer's step)") from None
    return version, int(span.start), int(span.end)
