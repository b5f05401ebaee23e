"""The rollout driver against an SGLang-shaped server over real HTTP (tests/bridges/fake_sglang.py:
SGLang itself needs CUDA kernels; its stream format is reproduced from its source), and a real
local cluster: over-sampling aborts the surplus on the engine, partial rollouts come back in
the next step under a new version, routed experts spliced."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import Counter

import numpy as np
import pytest
import torch

import tqueue
from tqueue.bridges import Rollouts, SGLangEngine
from tqueue.errors import EngineError, InvalidArgumentError

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
    """A refused connection is worth retrying: tried again ``error_retries`` times, then the
    step fails, naming the request, with its report on the error."""
    async def main():
        async with SGLangEngine("http://127.0.0.1:9") as engine, tqueue.AsyncClient(cluster.address) as c:
            driver = Rollouts(c, engine, max_new_tokens=4, error_retries=2, backoff=0)
            with pytest.raises(EngineError, match=r"SGLang request tq-\w+-\d{12} at http://127.0.0.1:9: ClientConnectorError") as info:
                await driver.step(partition, [[1, 2]])
            report = info.value.report
            assert (report.requests, report.stored, report.failed, report.retried) == (1, 0, 1, 2)
            assert info.value.__cause__ is not None and info.value.__cause__.retryable

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


async def part_status(c, name):
    return {p.name: p for p in (await c.status()).partitions}[name]


async def per_prompt(c, partition, task):
    """How many samples of each prompt a consumer gets from the partition."""
    ready = (await part_status(c, partition)).ready
    batch = await c.get_data(partition, ["prompt_ids"], ready, task=task, timeout=10, policy="first_ready")
    return Counter(tuple(p.tolist()) for p in batch["prompt_ids"])


@pytest.mark.parametrize(
    "policy, how, error_retries",
    [
        pytest.param("drop_group", "error", 3, id="drop_group-error-event"),
        pytest.param("mask_member", "drop", 0, id="mask_member-dropped-connection"),
    ],
)
def test_a_failed_call_ends_the_step_whole_and_a_rerun_stores_each_request_once(cluster, partition, policy, how, error_retries):
    """6 requests (3 groups of 2): 2 finish, the 3rd fails, 3 are running. The step aborts
    those 3 on the engine, raises with a report, leaves nothing running nor anything to be
    stored later, and reports the failed member to its group. The rerun sends the 3 aborted
    requests only, and each prompt ends up stored once per sample."""
    async def main():
        fake = FakeSGLang(hold=(2, 6), fail={3: how})
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url, experts_shape=(LAYERS, TOP_K)) as engine:
                await c.create_partition(partition, group_size=2, on_member_failure=policy)
                driver = Rollouts(c, engine, max_new_tokens=BUDGET, error_retries=error_retries, backoff=0)
                with pytest.raises(EngineError, match=rf"step '{partition}': 1 of 6 requests failed \(first: SGLang request tq-[0-9a-f-]+ at {re.escape(url)}") as info:
                    await asyncio.wait_for(driver.step(partition, PROMPTS, n=2), 60)
                report = info.value.report
                assert (report.requests, report.stored, report.aborted, report.failed, report.retried, report.skipped) == (6, 2, 3, 1, 0, 0)
                assert len(report.errors) == 1 and len(report.keys) == 3  # 2 stored, 1 failed
                assert fake.running == 0 and fake.parked == 3 and fake.parked_rids <= fake.aborted  # aborted on the engine
                finished, failed, cut = (fake.requests[:2], fake.requests[2], fake.requests[3:6])
                assert fake.failed == [failed["input_ids"]]

                # nothing is stored after step() raised: wake whatever is parked, then a round trip
                before = (await part_status(c, partition)).samples
                fake.release()
                await c.put(f"{partition}-handshake", {"x": torch.zeros(1)})
                assert (await part_status(c, partition)).samples == before == 2

                # the failed member reached its group's policy
                st = await part_status(c, partition)
                failing = tuple(failed["input_ids"])
                mate_stored = failing in {tuple(r["input_ids"]) for r in finished}
                dropped = {"member failed: engine call failed": 1} if policy == "drop_group" and mate_stored else {}
                assert st.reasons == dropped  # drop_group: its stored mate is out

                # the rerun sends only the 3 requests cut short; each is stored once
                fake.hold, fake.fail = None, {}
                again = await asyncio.wait_for(driver.step(partition, PROMPTS, n=2), 60)
                assert (again.requests, again.skipped, again.stored, again.failed, again.aborted) == (3, 3, 3, 0, 0)
                assert len(again.keys) == 6
                assert sorted(r["input_ids"] for r in fake.requests[6:]) == sorted(r["input_ids"] for r in cut)
                st = await part_status(c, partition)
                assert st.samples == 5  # one per request, the failed one aside
                if policy == "drop_group" and not mate_stored:
                    dropped = {"group aborted": 1}  # the mate, sent by the rerun, came too late for its group
                assert st.reasons == dropped
                counts = await per_prompt(c, partition, "count")
                want = {tuple(p): 2 for p in PROMPTS} | {failing: 0 if policy == "drop_group" else 1}
                assert counts == {p: k for p, k in want.items() if k}
                whole = 2 if policy == "drop_group" else 3  # the failed member's group is dropped, or complete without it
                groups = await c.get_meta(partition, ["prompt_ids"], 2 * whole, task="train", policy="groups", timeout=10)
                assert len(set(groups.groups)) == whole and len(groups) == 2 * whole - (policy == "mask_member")
                assert await driver.step(partition, PROMPTS, n=2) == dataclasses.replace(again, requests=0, skipped=6, stored=0, versions={})
        finally:
            await fake.stop()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["503", "500", "drop"])
def test_an_error_worth_retrying_is_retried_after_a_backoff(cluster, partition, how):
    async def main():
        fake = FakeSGLang(fail={1: how})
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url) as engine:
                driver = Rollouts(c, engine, max_new_tokens=BUDGET, backoff=0.01)
                report = await asyncio.wait_for(driver.step(partition, PROMPTS, n=1), 60)
                assert (report.requests, report.stored, report.retried, report.failed) == (3, 3, 1, 0)
                assert len(fake.requests) == 4 and fake.failed == [fake.requests[0]["input_ids"]]
                assert await per_prompt(c, partition, "count") == {tuple(p): 1 for p in PROMPTS}
        finally:
            await fake.stop()

    asyncio.run(main())


def test_calls_the_engine_does_not_abort_are_cancelled_at_the_abort_bound(cluster, partition):
    async def main():
        fake = FakeSGLang(hold=(2, 6), fail={3: "error"})
        fake.ignore_aborts = True
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url) as engine:
                driver = Rollouts(c, engine, max_new_tokens=BUDGET, abort_timeout=0.2)
                with pytest.raises(EngineError) as info:
                    await asyncio.wait_for(driver.step(partition, PROMPTS, n=2), 60)
                report = info.value.report
                assert (report.stored, report.aborted, report.failed) == (2, 3, 1)
                assert report.abort_seconds is not None and report.abort_seconds >= 0.2
                await asyncio.wait_for(fake.idle.wait(), 10)  # their connections closed: the engine let them go
                assert fake.disconnected == fake.parked_rids and len(fake.parked_rids) == 3
                assert (await part_status(c, partition)).samples == 2
        finally:
            await fake.stop()

    asyncio.run(main())


@pytest.mark.parametrize("abort", ["request", "close"])
def test_an_abort_asked_before_the_engine_holds_the_request_is_not_lost(abort):
    """SGLang and vLLM drop an abort of a request they do not hold yet, and a request is theirs
    only once its handler has added it, after the call was sent. An abort asked in that window
    is asked again at the call's first event (``abort="request"``), or closes the stream as
    it opens (``"close"``): the call ends aborted, not at its budget. (The real vLLM engine's
    in-process form of the same race: tests/bridges/test_vllm_engine.py.)"""
    from tqueue.bridges import Trajectory

    async def main():
        fake = FakeSGLang()
        fake.admit = asyncio.Event()
        url = await fake.start()
        try:
            async with SGLangEngine(url, abort=abort) as engine:
                traj = Trajectory(prompt_ids=[5, 6, 7])
                call = asyncio.ensure_future(engine.generate("r-1", traj, 1000))
                await asyncio.wait_for(fake.waiting_event.wait(), 10)  # sent; not on the engine yet
                await engine.abort(["r-1"])
                assert fake.dropped == ({"r-1"} if abort == "request" else set())
                fake.admit.set()
                await asyncio.wait_for(call, 30)
                await asyncio.wait_for(fake.idle.wait(), 10)
                assert traj.finish == "abort"
                if abort == "request":  # asked again at the first event: the engine aborts it there
                    assert fake.aborted == {"r-1"} and fake.disconnected == set()
                    assert traj.response_ids == [token(3 + i) for i in range(PARK_AFTER)]
                else:  # closed as it opened: nothing streamed
                    assert fake.disconnected == {"r-1"} and traj.response_ids == []
                assert len(engine._early) == 0  # forgotten once the call ended
        finally:
            await fake.stop()

    asyncio.run(main())


@pytest.mark.parametrize("abort", ["request", "close"])
def test_token_versions_of_routed_experts_are_those_of_the_calls_that_computed_them(cluster, partition, abort):
    """A rollout aborted after 3 tokens under version 0, resumed under version 1. With an
    abort request, the first call's rows are kept and the resumed call computes from the row
    of the last token it was given (P + 3 - 1): that row is version 1. A closed stream
    returns no rows (SGLang sends them in its last event): the resumed call computes every
    row, all version 1. ``token_versions`` says so from the splices the controller recorded,
with nothing written beside the field."""
    async def main():
        fake = FakeSGLang(hold=(1, 2))
        url = await fake.start()
        step0, step1 = f"{partition}-0", f"{partition}-1"
        prompt = [11, 12, 13]
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url, abort=abort, experts_shape=(LAYERS, TOP_K)) as engine:
                await c.create_partition(step0, target=1, recycle_to=step1)
                await c.create_partition(step1, target=1)
                driver = Rollouts(c, engine, max_new_tokens=BUDGET)
                report = await asyncio.wait_for(driver.step(step0, [prompt], n=2), 60)
                assert (report.stored, report.aborted, report.recycled) == (1, 1, 1)
                await driver.set_version(1)
                fake.hold = None
                report = await asyncio.wait_for(driver.step(step1, []), 60)
                assert (report.resumed, report.stored) == (1, 1)

                fields = ["response_ids", "routed_experts"]
                fresh = await c.get_data(step0, fields, 1, task="t", timeout=10)
                assert fresh.meta.splices is None and set(fresh) == set(fields)  # nothing written beside
                assert fresh.token_versions("routed_experts")[0].tolist() == [0] * (len(prompt) + BUDGET - 1)

                batch = await c.get_data(step1, fields, 1, task="t", timeout=10)
                held = abort == "request"
                rows = batch["routed_experts"][0]
                assert rows.tolist() == expected(prompt, [(0, PARK_AFTER), (1, BUDGET - PARK_AFTER)], held=held)["experts"]
                boundary = len(prompt) + PARK_AFTER - 1  # the row of the last token the first call generated
                assert batch.meta.splices == {"routed_experts": [[0, boundary if held else 0]]}  # the controller's record
                versions = batch.token_versions("routed_experts")[0].tolist()
                assert versions == [row[0][0] // 10_000 for row in rows.tolist()]  # the version each row was computed with
                assert versions == ([0] * boundary + [1] * (BUDGET - PARK_AFTER) if held else [1] * (len(prompt) + BUDGET - 1))
                assert batch.token_versions("response_ids")[0].tolist() == [0] * PARK_AFTER + [1] * (BUDGET - PARK_AFTER)
                with pytest.raises(InvalidArgumentError, match=r"the rows each segment starts at are recorded"):
                    batch.token_versions("routed_experts", prompt_lengths=len(prompt))
        finally:
            await fake.stop()

    asyncio.run(main())
