"""SGLang ``/generate`` responses, shaped exactly as SGLang 0.5.23 returns them (see
tqueue/bridges/sglang.py), become the standard rollout fields; a partial rollout resumed twice
splices its routed experts at the row each call started from."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from tqueue.bridges import Trajectory, from_generate
from tqueue.errors import InvalidArgumentError, SchemaError

LAYERS, TOP_K = 3, 2


def response(ids, *, finish, versions=None, experts=None, first_logprob=-0.5):
    """An SGLang /generate response for ``ids`` (JSON shapes: tuples are lists)."""
    meta = {
        "id": "r1",
        "finish_reason": finish,
        "prompt_tokens": 4,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[first_logprob - i, t, f"<{t}>"] for i, t in enumerate(ids)],
    }
    if versions is not None:
        meta["weight_versions"] = [{"version": str(v), "start": s, "end": e} for v, s, e in versions]
        meta["weight_version"] = str(versions[-1][0])
    if experts is not None:
        meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(experts, dtype=np.int32).tobytes()).decode()
    return {"text": "...", "output_ids": list(ids), "meta_info": meta}


def rows(count, mark):
    """Routed-expert rows that say which call made them."""
    return np.full((count, LAYERS, TOP_K), mark, dtype=np.int32)


@pytest.mark.parametrize(
    "reason, finish",
    [({"type": "stop", "matched": 2}, "stop"), ({"type": "length", "length": 3}, "length"),
     ({"type": "abort", "message": "aborted", "status_code": 200, "err_type": None}, "abort"),
     ({"type": "something new"}, "error")],
)
def test_finish_reasons_logprobs_and_version_spans(reason, finish):
    t = from_generate(response([7, 8, 9], finish=reason, versions=[(3, 0, 2), (4, 2, 3)]), [1, 2, 3, 4])
    assert t.finish == finish
    assert t.response_ids == [7, 8, 9] and t.response_logprobs == [-0.5, -1.5, -2.5]
    assert t.version_spans == [(3, 0, 2), (4, 2, 3)] and t.version == 3
    fields = t.fields()
    assert fields["version_spans"].tolist() == [[3, 0, 2], [4, 2, 3]]
    assert fields["loss_mask"].dtype == torch.int8 and fields["loss_mask"].tolist() == [1, 1, 1]


def test_a_resumed_rollout_splices_its_routed_experts_at_each_start_row():
    prompt = [1, 2, 3, 4]
    # call 1: 3 tokens under version 5, aborted at the seal; rows [0, 6) of 4 + 3 - 1
    t = from_generate(
        response([10, 11, 12], finish={"type": "abort"}, versions=[(5, 0, 3)], experts=rows(6, 1)),
        prompt, experts_shape=(LAYERS, TOP_K),
    )
    assert t.routed_experts.shape == (6, LAYERS, TOP_K) and t.finish == "abort"
    # call 2 resumes from prompt + 3 tokens under version 6, rows from 6: [6, 8)
    from_generate(
        response([13, 14], finish={"type": "abort"}, versions=[(6, 0, 2)], experts=rows(2, 2)),
        prompt + t.response_ids, trajectory=t, experts_shape=(LAYERS, TOP_K), routed_experts_start_len=6,
    )
    # call 3 asks for rows from 5 (one recomputed), two more tokens under version 7: [5, 10)
    from_generate(
        response([15, 16], finish={"type": "stop", "matched": 16}, versions=[(7, 0, 2)], experts=rows(5, 3)),
        prompt + t.response_ids, trajectory=t, experts_shape=(LAYERS, TOP_K), routed_experts_start_len=5,
    )
    assert t.response_ids == [10, 11, 12, 13, 14, 15, 16] and t.finish == "stop"
    assert t.version_spans == [(5, 0, 3), (6, 3, 5), (7, 5, 7)] and t.version == 5
    experts = t.fields()["routed_experts"]
    assert experts.shape == (len(prompt) + 7 - 1, LAYERS, TOP_K)  # exactly prompt + response - 1 rows
    assert experts[:, 0, 0].tolist() == [1, 1, 1, 1, 1, 3, 3, 3, 3, 3]  # each row from the call that made it last


def test_bad_responses_are_refused_by_name():
    prompt = [1, 2]
    with pytest.raises(SchemaError, match=r"output_token_logprobs\[1\] is for token 99, output_ids\[1\] is 8"):
        bad = response([7, 8], finish={"type": "stop"})
        bad["meta_info"]["output_token_logprobs"][1][1] = 99
        from_generate(bad, prompt)
    with pytest.raises(SchemaError, match="return_logprob=true"):
        bad = response([7], finish={"type": "stop"})
        del bad["meta_info"]["output_token_logprobs"]
        from_generate(bad, prompt)
    with pytest.raises(SchemaError, match="the request had not finished"):
        from_generate(response([7], finish=None), prompt)
    with pytest.raises(SchemaError, match=r"weight version 'v2' is not an integer"):
        from_generate(response([7], finish={"type": "stop"}, versions=[("v2", 0, 1)]), prompt)
    with pytest.raises(InvalidArgumentError, match=r"experts_shape=\(layers, top_k\) is needed"):
        from_generate(response([7], finish={"type": "stop"}, experts=rows(2, 1)), prompt)
    with pytest.raises(SchemaError, match=r"expected 2 rows \(positions 0 to 1\)"):
        from_generate(response([7], finish={"type": "stop"}, experts=rows(3, 1)), prompt, experts_shape=(LAYERS, TOP_K))
    with pytest.raises(SchemaError, match="routed experts start at row 1 but none are held"):
        from_generate(response([7], finish={"type": "stop"}, experts=rows(1, 1)), prompt,
                      experts_shape=(LAYERS, TOP_K), routed_experts_start_len=1)
    with pytest.raises(SchemaError, match="not base64"):
        bad = response([7], finish={"type": "stop"})
        bad["meta_info"]["routed_experts"] = "@@@"
        from_generate(bad, prompt, experts_shape=(LAYERS, TOP_K))


def test_trajectories_round_trip_through_tqueue_bit_exact(client, partition):
    prompt = [5, 6, 7]
    trajectories = []
    for g in range(2):
        for k in range(2):
            ids = [100 + 10 * g + k, 200 + k]
            t = from_generate(
                response(ids, finish={"type": "stop"}, versions=[(g, 0, 2)], experts=rows(4, 10 * g + k), first_logprob=-0.25 * k),
                prompt, experts_shape=(LAYERS, TOP_K),
            )
            t.extra["reward"] = float(g + k)
            trajectories.append(t)
    meta = client.put(partition, [t.fields() for t in trajectories], groups=[0, 0, 1, 1],
                      version=[t.version for t in trajectories])
    batch = client.get_data(meta)
    for i, t in enumerate(trajectories):
        want = t.fields()
        for name in ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "version_spans", "routed_experts"):
            got = batch[name][i]
            assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name
        assert batch["finish"][i] == "stop" and batch["reward"][i] == t.extra["reward"]
    assert isinstance(trajectories[0], Trajectory)
