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

import asyncio
import base64
import binascii
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import EngineError, InvalidArgumentError, SchemaError
from ._fields import Trajectory
from ._http import HTTPEngine

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


class SGLangEngine(HTTPEngine):
    """A driver's engine (:class:`~tqueue.bridges.Engine`) over SGLang's HTTP API at ``url``:
    one server, a router, or an opaque fleet behind one endpoint.

    Each call is a streaming ``POST /generate`` of token ids with ``return_logprob``; its last
    event is the response read by :func:`from_generate`. ``abort="request"`` aborts with
    ``POST /abort_request {"rid"}`` (the stream then ends with ``finish_reason`` abort);
    ``abort="close"`` closes the stream instead, for endpoints that route requests to engines
    the caller cannot name (SGLang aborts a request whose client went away), and keeps the
    tokens and log-probs of the last event; SGLang sends routed experts and
    ``weight_versions`` in the final event only, so a closed call has no routed experts (the
    call that resumes it computes every row) and one span, of the last event's
    ``weight_version``. ``experts_shape`` = ``(num_hidden_layers,
    num_experts_per_tok)`` asks for routed experts. ``sampling_params`` go into every
    request; ``headers`` into every HTTP call (an ``Authorization``, say).
    """

    def __init__(
        self,
        url: str,
        *,
        sampling_params: Mapping[str, Any] | None = None,
        abort: str = "request",
        experts_shape: tuple[int, int] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 3600.0,
    ) -> None:
        super().__init__(url, abort=abort, headers=headers, timeout=timeout)
        self.sampling_params = dict(sampling_params or {})
        self.experts_shape = experts_shape

    async def generate(self, rid: str, trajectory: Trajectory, max_new_tokens: int) -> None:
        """:meth:`tqueue.bridges.Engine.generate`."""
        start = trajectory.experts_start
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": trajectory.prompt_ids + trajectory.response_ids,
            "sampling_params": {**self.sampling_params, "max_new_tokens": max_new_tokens},
            "return_logprob": True,
            "stream": True,
        }
        if self.experts_shape is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = start
        what = f"SGLang request {rid} at {self.url}"
        last: dict[str, Any] | None = None
        try:
            async with contextlib.aclosing(self.stream(rid, "/generate", body, what)) as stream:
                async for event in stream:
                    if isinstance(event, list):  # n > 1 answers a list; the driver sends n = 1
                        event = event[0]
                    if not isinstance(event, dict):
                        raise EngineError(f"{what}: a streamed event is {type(event).__name__}, not an object")
                    if "error" in event and "output_ids" not in event:
                        raise EngineError(f"{what}: {event['error']}")
                    last = event
        finally:
            closed = self.closed(rid)
        if last is None or (last.get("meta_info") or {}).get("finish_reason") is None:
            if not closed:
                raise EngineError(f"{what}: the stream ended before the request finished", retryable=True)
            last = _aborted(last)
        from_generate(
            last, trajectory.prompt_ids, trajectory=trajectory, experts_shape=self.experts_shape,
            routed_experts_start_len=start,
        )

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """``POST /abort_request`` for each request."""
        await asyncio.gather(*(self.post("/abort_request", {"rid": r}, f"aborting SGLang request {r}") for r in rids))

    async def set_version(self, version: int) -> None:
        """Tell the server its weights are ``version`` (``POST /update_weight_version``), so
        that its responses' ``weight_versions`` say so."""
        body = {"new_version": str(version), "abort_all_requests": False}
        await self.post("/update_weight_version", body, "setting the weight version")


def _aborted(last: Mapping[str, Any] | None) -> dict[str, Any]:
    """A response for a stream closed before it finished: the tokens of its last event."""
    if last is None:
        return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
    meta = dict(last.get("meta_info") or {})
    meta["finish_reason"] = {"type": "abort", "message": "stream closed"}
    return {**last, "meta_info": meta}
