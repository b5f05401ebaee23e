"""The rollout driver against an SGLang-shaped server over real HTTP (tests/bridges/fake_sglang.py:
SGLang itself needs CUDA kernels; its stream format is reproduced from its source), and a real
local cluster: over-sampling aborts the surplus on the engine, partial rollouts come back in
the next step under a new version, routed experts spliced."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tqueue
from tqueue.bridges import Rollouts, SGLangEngine
from tqueue.errors import EngineError

from .fake_sglang import LAYERS, PARK_AFTER, TOP_K, FakeSGLang, experts, logprob, token

PROMPTS = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]  # 3 groups x 4 samples = 12 requests
BUDGET = 6


def expected(prompt: list[int], segments: list[tuple[int, int]], held: bool = True) -> dict[str, list]:
    """What the model produces for ``prompt``: ``segments`` of (version, tokens). ``held``: the
    aborted call returned its routed experts (an abort request does; a closed stream loses
    them, and the resumed call recomputes every row)."""
    ids, lps, rows, spans = [], [], [], []
    for seg, (version, count) in enumerate(segments):
        first = len(prompt) + len(ids)
        start = first - 1 if seg and held else 0  # a resumed call recomputes from the last held row
        rows = rows[:start] + [experts(p, version) for p in range(start, first + count - 1)]
        spans.append([version, len(ids), len(ids) + count])
        ids += [token(first + i) for i in range(count)]
        lps += [logprob(first + i) for i in range(count)]
    return {"ids": ids, "logprobs": lps, "experts": rows, "spans": spans}


@pytest.mark.parametrize("abort", ["request", "close"])
def test_over_sampling_aborts_the_surplus_and_partials_resume_under_the_next_version(cluster, partition, abort):
    async def main():
        fake = FakeSGLang(hold=(8, 12))
        url = await fake.start()
        step0, step1, step2 = (f"{partition}-{i}" for i in range(3))
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(
                url, abort=abort, experts_shape=(LAYERS, TOP_K), sampling_params={"temperature": 1.0}
            ) as engine:
                await c.create_partition(step0, target=8, recycle_to=step1)
                await c.create_partition(step1, target=8, recycle_to=step2)
                driver = Rollouts(c, engine, max_new_tokens=BUDGET)
                await driver.set_version(0)
                report = await asyncio.wait_for(driver.step(step0, PROMPTS, n=4), 60)
                assert (report.requests, report.stored, report.aborted, report.recycled, report.discarded) == (12, 8, 4, 4, 0)
                assert report.sealed and report.abort_seconds is not None and report.abort_seconds < 10
                stopped = fake.aborted if abort == "request" else fake.disconnected
                assert len(stopped) == 4 and fake.parked == 4  # the 4 parked requests, aborted on the engine
                assert driver.partials == 4

                batch = await c.get_data(step0, ["prompt_ids", "response_ids", "finish", "routed_experts"], 8, task="t", timeout=10)
                for i in range(8):
                    prompt = batch["prompt_ids"][i].tolist()
                    want = expected(prompt, [(0, BUDGET)])
                    assert batch["response_ids"][i].tolist() == want["ids"] and batch["finish"][i] == "length"
                    assert batch["routed_experts"][i].tolist() == want["experts"]

                # the next step: new weights; the 4 partials resume, 4 fresh requests fill the target
                await driver.set_version(1)
                fake.hold = None
                report = await asyncio.wait_for(driver.step(step1, [[41, 42, 43, 44, 45]], n=4), 60)
                assert (report.resumed, report.stored, report.aborted) == (4, 8, 0)
                fields = ["prompt_ids", "response_ids", "response_logprobs", "loss_mask", "version_spans", "routed_experts", "finish"]
                meta = await c.get_meta(step1, fields, 8, task="t", timeout=10)
                batch = await c.get_data(meta)
                resumed = 0
                for i in range(8):
                    prompt = batch["prompt_ids"][i].tolist()
                    segments = [(0, PARK_AFTER), (1, BUDGET - PARK_AFTER)] if prompt != [41, 42, 43, 44, 45] else [(1, BUDGET)]
                    resumed += len(segments) == 2
                    want = expected(prompt, segments, held=abort == "request")
                    assert batch["response_ids"][i].tolist() == want["ids"]
                    assert batch["response_logprobs"][i].tolist() == want["logprobs"]  # float32-exact
                    assert batch["loss_mask"][i].tolist() == [1] * BUDGET
                    assert batch["version_spans"][i].tolist() == want["spans"]
                    assert batch["finish"][i] == "length"
                    routed = batch["routed_experts"][i]
                    assert routed.dtype.__str__() == "torch.int32" and routed.shape == (len(prompt) + BUDGET - 1, LAYERS, TOP_K)
                    assert routed.tolist() == want["experts"]  # each row from the call that produced it
                    tokens = batch.token_versions("response_ids")[i].tolist()
                    assert tokens == [v for v, n in segments for _ in range(n)]
                assert resumed == 4
                # the resumed calls were sent prompt + response so far, experts asked from the last held row
                resumes = [r for r in fake.requests[12:] if r["input_ids"] != [41, 42, 43, 44, 45]]
                starts = {r["routed_experts_start_len"] - len(r["input_ids"]) for r in resumes}
                assert len(resumes) == 4 and starts == ({-1} if abort == "request" else {-len(r["input_ids"]) for r in resumes})
        finally:
            await fake.stop()

    asyncio.run(main())


def test_an_engine_error_names_the_request(cluster, partition):
    async def main():
        async with SGLangEngine("http://127.0.0.1:9") as engine, tqueue.AsyncClient(cluster.address) as c:
            driver = Rollouts(c, engine, max_new_tokens=4)
            with pytest.raises(EngineError, match=r"SGLang request tq-\w+-0 at http://127.0.0.1:9: ClientConnectorError"):
                await driver.step(partition, [[1, 2]])

    asyncio.run(main())


def test_a_stream_that_ends_unfinished_is_an_engine_error():
    async def main():
        from aiohttp import web

        async def handler(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b'data: {"text": "", "output_ids": [5], "meta_info": {"finish_reason": null}}\n\n')
            return resp

        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with SGLangEngine(f"http://127.0.0.1:{port}") as engine:
                traj = tqueue.bridges.Trajectory(prompt_ids=[1])
                with pytest.raises(EngineError, match=r"request r1 .* ended before the request finished"):
                    await engine.generate("r1", traj, 4)
                assert traj.response_ids == []
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_expected_rows_follow_the_splice_rule():
    """The test's own model of the splice: a resumed segment replaces rows from its start."""
    want = expected([1, 2], [(0, 3), (1, 2)])
    assert np.array(want["experts"]).shape == (2 + 5 - 1, LAYERS, TOP_K)
    assert [r[0][0] // 10_000 for r in want["experts"]] == [0, 0, 0, 0, 1, 1]
