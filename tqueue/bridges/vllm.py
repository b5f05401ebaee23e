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

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._extras import require
from ..errors import EngineError, SchemaError
from ._aborts import EarlyAborts
from ._fields import Trajectory
from ._http import HTTPEngine

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


class VLLMEngine:
    """A driver's engine (:class:`~tqueue.bridges.Engine`) over an in-process
    ``vllm.v1.engine.async_llm.AsyncLLM``.

    Each call is ``AsyncLLM.generate`` of a ``TokensPrompt`` with ``logprobs=0`` (the sampled
    token's log-prob), read from its final output by :func:`from_completion`; ``abort`` is
    ``AsyncLLM.abort``, after which the call ends with ``finish_reason="abort"`` and the
    tokens it had; ``set_version`` is ``AsyncLLM.update_weight_version``, so that outputs
    carry ``weight_versions`` spans. ``sampling`` are more ``SamplingParams`` options.
    """

    def __init__(self, llm: Any, *, sampling: Mapping[str, Any] | None = None) -> None:
        self.llm = llm
        self.sampling = dict(sampling or {})
        self._vllm = require("vllm", "vllm", by="VLLMEngine")
        self._early = EarlyAborts(horizon=24 * 3600.0)

    async def generate(self, rid: str, trajectory: Trajectory, max_new_tokens: int) -> None:
        """:meth:`tqueue.bridges.Engine.generate`."""
        params = self._vllm.SamplingParams(**{**self.sampling, "max_tokens": max_new_tokens, "logprobs": 0})
        prompt = {"prompt_token_ids": trajectory.prompt_ids + trajectory.response_ids}
        final = None
        try:
            async for out in self.llm.generate(prompt, params, request_id=rid):
                if final is None and self._early.asked(rid):  # asked before the engine held it: again
                    await self.llm.abort([rid])
                final = out
        finally:
            self._early.forget(rid)
        if final is None or not final.outputs:
            raise EngineError(f"vLLM request {rid} ended without an output")
        start = trajectory.experts_start
        from_completion(final.outputs[0], trajectory.prompt_ids, trajectory=trajectory, routed_experts_prompt_start=start)

    async def abort(self, rids: Sequence[str]) -> None:
        """:meth:`tqueue.bridges.Engine.abort`; one asked before a call's first output is
        asked again at that output (``AsyncLLM.abort`` drops an id it does not hold yet)."""
        self._early.ask(rids)
        await self.llm.abort(list(rids))

    async def set_version(self, version: int) -> None:
        """:meth:`tqueue.bridges.Engine.set_version`."""
        await self.llm.update_weight_version(str(version))


class VLLMHTTPEngine(HTTPEngine):
    """A driver's engine over vLLM's token-in/token-out HTTP API at ``url``
    (``POST /inference/v1/generate``, vLLM 0.32; ``vllm serve --enable-scale-out``), streamed.

    Each stream event's choice carries the new ``token_ids`` and ``logprobs.content`` (one
    ``{"token_id", "logprob"}`` per token); the last one ``finish_reason`` and
    ``weight_versions``. ``abort="request"`` uses ``POST /inference/v1/abort_requests``;
    ``abort="close"`` closes the stream (vLLM aborts a request whose client went away) and
    keeps the tokens received. ``sampling`` goes into every request's ``sampling_params``.
    """

    def __init__(
        self,
        url: str,
        *,
        sampling: Mapping[str, Any] | None = None,
        abort: str = "request",
        headers: Mapping[str, str] | None = None,
        timeout: float = 3600.0,
    ) -> None:
        super().__init__(url, abort=abort, headers=headers, timeout=timeout)
        self.sampling = dict(sampling or {})
        self._server_ids: dict[str, str] = {}  # the server prefixes ids ("generate-tokens-"); aborts name its id

    async def generate(self, rid: str, trajectory: Trajectory, max_new_tokens: int) -> None:
        """:meth:`tqueue.bridges.Engine.generate`."""
        body = {
            "request_id": rid,
            "token_ids": trajectory.prompt_ids + trajectory.response_ids,
            "sampling_params": {**self.sampling, "max_tokens": max_new_tokens, "logprobs": 0},
            "stream": True,
        }
        what = f"vLLM request {rid} at {self.url}"
        out = _Streamed()
        try:
            async with contextlib.aclosing(self.stream(rid, "/inference/v1/generate", body, what)) as stream:
                async for event in stream:
                    if isinstance(event, dict) and isinstance(event.get("request_id"), str):
                        self._server_ids.setdefault(rid, event["request_id"])
                    if isinstance(event, dict) and "error" in event:
                        raise EngineError(f"{what}: {event['error']}")
                    out.add(event, what)
        finally:
            self._server_ids.pop(rid, None)
        if out.finish_reason is None:
            if not self.closed(rid):
                raise EngineError(f"{what}: the stream ended before the request finished")
            out.finish_reason = "abort"
        else:
            self.closed(rid)
        start = trajectory.experts_start
        from_completion(out, trajectory.prompt_ids, trajectory=trajectory, routed_experts_prompt_start=start)

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """``POST /inference/v1/abort_requests`` naming the server's ids."""
        # a request not yet streaming has no server id: vLLM 0.32 names it "generate-tokens-" + ours
        ids = [self._server_ids.get(rid, f"generate-tokens-{rid}") for rid in rids]
        async with self._http().post(f"{self.url}/inference/v1/abort_requests", json={"request_ids": ids}) as resp:
            if resp.status != 200:
                raise EngineError(f"aborting vLLM requests at {self.url}: HTTP {resp.status}")

    async def set_version(self, version: int) -> None:
        """Tell the server its weights are ``version`` (``POST /update_weight_version``,
        served by ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``)."""
        async with self._http().post(f"{self.url}/update_weight_version", json={"new_version": str(version)}) as resp:
            if resp.status != 200:
                raise EngineError(
                    f"setting the weight version at {self.url}: HTTP {resp.status} (vllm serve offers "
                    f"/update_weight_version with VLLM_SERVER_DEV_MODE=1): {(await resp.text())[:300]}"
                )


class _Logprob:
    __slots__ = ("logprob",)

    def __init__(self, logprob: float) -> None:
        self.logprob = logprob


class _Span:
    __slots__ = ("end", "start", "version")

    def __init__(self, span: Mapping[str, Any]) -> None:
        self.version, self.start, self.end = span["version"], span["start"], span["end"]


class _Streamed:
    """A streamed choice gathered into what :func:`from_completion` reads."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, _Logprob]] = []
        self.finish_reason: str | None = None
        self.weight_versions: list[_Span] | None = None
        self.routed_experts: np.ndarray | None = None

    def add(self, event: Any, what: str) -> None:
        try:
            choice = event["choices"][0]
            ids = [int(t) for t in choice.get("token_ids") or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids):
                raise EngineError(f"{what}: an event has {len(content)} log-probs for {len(ids)} tokens")
            self.token_ids += ids
            self.logprobs += [{int(c["token_id"]): _Logprob(float(c["logprob"]))} for c in content]
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
            if choice.get("weight_versions"):
                self.weight_versions = [_Span(s) for s in choice["weight_versions"]]
            if choice.get("routed_experts"):
                import base64
                import io

                self.routed_experts = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"{what}: an event is not a token-API choice ({type(exc).__name__}: {exc})") from None
