"""Multi-turn agents through the rollout driver: assistant turns from the engine, tool turns
from a callback (loss mask 0), one sample appended turn by turn, against the SGLang-shaped
server of tests/bridges/fake_sglang.py over real HTTP and a real local cluster, and through
``VLLMEngine`` over an in-process stand-in for vLLM's ``AsyncLLM``.

The model is a formula (fake_sglang.token, .logprob, .experts); its turns end with "stop" at
the sequence lengths in ``stop_at``. Every wait is on an event, none on a clock."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
import torch

import tqueue
from tqueue.bridges import Rollouts, SGLangEngine, VLLMEngine
from tqueue.errors import WaitTimeoutError

from .fake_sglang import LAYERS, PARK_AFTER, TOP_K, FakeSGLang, experts, logprob, token

A, T = 0, 1  # turn kinds: assistant, tool
FIELDS = ["prompt_ids", "response_ids", "response_logprobs", "loss_mask", "turn_spans", "version_spans", "finish"]


def build(prompt: list[int], turns: list[tuple]) -> dict[str, list]:
    """The sample ``turns`` make: ``("a", [(version, tokens), ...])``, an assistant turn of
    version segments, or ``("t", tokens)``, a tool turn."""
    ids, lps, mask, spans, vspans = [], [], [], [], []
    for kind, what in turns:
        start = len(ids)
        if kind == "a":
            for version, n in what:
                first = len(prompt) + len(ids)
                vspans.append([version, len(ids), len(ids) + n])
                ids += [token(first + i) for i in range(n)]
                lps += [logprob(first + i) for i in range(n)]
                mask += [1] * n
        else:
            ids += list(what)
            lps += [0.0] * len(what)
            mask += [0] * len(what)
        spans.append([A if kind == "a" else T, start, len(ids)])
    return {"response_ids": ids, "response_logprobs": lps, "loss_mask": mask, "turn_spans": spans, "version_spans": vspans}


def check(batch, i: int, want: dict[str, list], finish: str = "stop") -> None:
    for name, value in want.items():
        assert batch[name][i].tolist() == value, name
    assert batch["finish"][i] == finish


class Watched(SGLangEngine):
    """Sets ``aborting`` once the driver has asked for an abort (the step has stopped by then)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.aborting = asyncio.Event()

    async def abort(self, rids):
        self.aborting.set()
        await super().abort(rids)


def test_a_three_turn_agent_is_one_sample_with_exact_turns_and_versions(cluster, partition):
    """Turn 1 under version 0, a tool turn, turn 2 under version 1, a tool turn, turn 3 under
    version 2 (the tool moves the weights on, as a trainer would between turns). The sample is
    partial, never served, until the last turn; read back, every row is exact, the tool turns
    masked, and each token and routed-experts row has the version that produced it."""
    async def main():
        fake = FakeSGLang()
        fake.stop_at = {7, 15, 21}  # prompt 3 + turn 4 | + tool 3 + turn 5 | + tool 2 + turn 4
        url = await fake.start()
        outputs = {7: [5001, 5002, 5003], 15: [5004, 5005]}
        seen = []
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url, experts_shape=(LAYERS, TOP_K)) as engine:
                async def tool(group, traj):
                    seen.append((group, traj.length, traj.finish))
                    if traj.turns > 1:  # stored after its first turn, partial: no reader gets it
                        with pytest.raises(WaitTimeoutError):
                            await c.get_meta(partition, ["response_ids"], 1, task="peek", timeout=0)
                    await driver.set_version(driver.version + 1)
                    return outputs.get(traj.length)

                driver = Rollouts(c, engine, max_new_tokens=100, tool=tool)
                report = await asyncio.wait_for(driver.step(partition, [[11, 12, 13]]), 30)
                assert (report.requests, report.stored, report.tool_calls, report.aborted, report.turn_limited) == (1, 1, 3, 0, 0)
                assert seen == [(f"{partition}/0", 7, "stop"), (f"{partition}/0", 15, "stop"), (f"{partition}/0", 21, "stop")]
                assert report.versions == {0: 1}  # the oldest version of the sample

                meta = await c.get_meta(partition, [*FIELDS, "routed_experts"], 1, task="train", timeout=10)
                batch = await c.get_data(meta)
                want = build([11, 12, 13], [("a", [(0, 4)]), ("t", outputs[7]), ("a", [(1, 5)]), ("t", outputs[15]), ("a", [(2, 4)])])
                check(batch, 0, want)
                assert want["turn_spans"] == [[A, 0, 4], [T, 4, 7], [A, 7, 12], [T, 12, 14], [A, 14, 18]]
                # each write is a segment: turn 1; tool 1 + turn 2; tool 2 + turn 3
                assert meta.segments[0] == [[0, 0], [1, 4], [2, 12]]
                assert batch.token_versions("response_ids")[0].tolist() == [0] * 4 + [1] * 8 + [2] * 6
                # each call asked for routed experts from the rows held: the tool tokens' rows
                # came from the call after them
                assert [len(r["input_ids"]) for r in fake.requests] == [3, 10, 17]
                assert [r["routed_experts_start_len"] for r in fake.requests] == [0, 6, 14]
                rows = [0] * 6 + [1] * 8 + [2] * 6
                assert batch["routed_experts"][0].tolist() == [experts(p, v) for p, v in enumerate(rows)]
                assert batch.token_versions("routed_experts")[0].tolist() == rows
        finally:
            await fake.stop()

    asyncio.run(main())


def test_each_turn_appends_only_its_rows(cluster, partition):
    """Five turns of 40 assistant and 30 tool tokens: each write after the first sends the
    turn's rows alone (client payload and wire bytes), and the partition grows by no more;
    a write of whole fields would send up to five times as much."""
    turn, out, turns = 40, 30, 5
    stops = {3 + k * (turn + out) + turn for k in range(turns)}

    async def main():
        fake = FakeSGLang()
        fake.stop_at = stops
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url) as engine:
                async def tool(group, traj):
                    return list(range(7000, 7000 + out)) if traj.turns < turns else None

                writes = []
                complete = c.rollouts.complete

                async def measured(meta, columns, **kw):
                    sent, wire = c.stats.put_bytes, c.stats.wire_bytes
                    held = (await part_status(c, meta.partition)).nbytes
                    refused = await complete(meta, columns, **kw)
                    grown = (await part_status(c, meta.partition)).nbytes - held
                    writes.append((kw["append"], c.stats.put_bytes - sent, c.stats.wire_bytes - wire, grown))
                    return refused

                c.rollouts.complete = measured
                driver = Rollouts(c, engine, max_new_tokens=10_000, tool=tool)
                report = await asyncio.wait_for(driver.step(partition, [[1, 2, 3]]), 30)
                assert (report.stored, report.tool_calls) == (1, turns)
                rows = out + turn  # a tool turn and the assistant turn after it
                new = rows * (8 + 4 + 1) + 24 * (1 + 2)  # ids, log-probs, mask; a version span, two turn spans
                whole = lambda k: (k + 1) * rows * (8 + 4 + 1)  # noqa: E731 - the response fields after write k
                assert len(writes) == turns - 1
                for k, (append, sent, wire, grown) in enumerate(writes, 1):
                    assert set(append) == {"response_ids", "response_logprobs", "loss_mask", "version_spans", "turn_spans"}
                    assert sent <= new + 16 and wire <= sent, (k, sent, wire)  # the turn, and "stop"
                    assert 0 < grown <= new + 16, (k, grown)
                assert whole(turns - 1) > 4 * (new + 16)  # a rewrite of the whole fields would fail the checks
                batch = await c.get_data(partition, FIELDS, 1, task="train", timeout=10)
                assert len(batch["response_ids"][0]) == turns * turn + (turns - 1) * out
                assert batch["loss_mask"][0].sum().item() == turns * turn
                assert [k for k, _, _ in batch["turn_spans"][0].tolist()] == [A, T] * (turns - 1) + [A]
        finally:
            await fake.stop()

    asyncio.run(main())


async def part_status(c, name):
    return {p.name: p for p in (await c.status()).partitions}[name]


@pytest.mark.parametrize("abort", ["request", "close"])
def test_a_turn_aborted_mid_stream_at_the_seal_continues_in_the_next_step(cluster, partition, abort):
    """Step 0 under version 0, target 1, three agents:

    * ``a`` ends after one turn and fills the target: the partition seals;
    * ``b`` is in its second turn, 3 tokens streamed: aborted on the engine at the seal, its
      tool turn and 3 tokens stored partial, recycled to step 1;
    * ``c`` is in its tool callback at the seal: the tool's answer is kept, no call is sent.

    Step 1, under version 1, resumes both: ``b`` continues the same turn (one turn, two
    version spans), then the tool loop (a third turn); ``c`` starts its second turn. Each ends
    exact, tool turns masked, version spans and token versions those of the weights that
    produced each token; routed experts each from the call that computed them."""
    step0, step1 = f"{partition}-0", f"{partition}-1"
    pa, pb, pc = [1, 2, 3], [11, 12, 13], [21, 22, 23]
    outputs = {(tuple(pb), 7): [5001, 5002, 5003], (tuple(pb), 15): [5004, 5005], (tuple(pc), 7): [6001, 6002, 6003]}

    async def main():
        fake = FakeSGLang()
        fake.stop_at = {7, 15, 21}
        fake.park = lambda body: body["input_ids"][:3] == pb and len(body["input_ids"]) == 10  # b's 2nd turn, step 0
        url = await fake.start()
        c_in_tool = asyncio.Event()
        calls = []
        try:
            async with tqueue.AsyncClient(cluster.address) as c, Watched(url, abort=abort, experts_shape=(LAYERS, TOP_K)) as engine:
                await c.create_partition(step0, target=1, recycle_to=step1)
                await c.create_partition(step1)

                async def tool(group, traj):
                    prompt = tuple(traj.prompt_ids)
                    calls.append((prompt, traj.length, traj.version_spans[-1]))
                    if prompt == tuple(pa):  # once b is parked mid-turn and c is in here: a fills the target
                        await fake.parked_event.wait()
                        await c_in_tool.wait()
                    if prompt == tuple(pc) and traj.turns == 1:
                        c_in_tool.set()
                        await engine.aborting.wait()  # the step has stopped
                    return outputs.get((prompt, traj.length))

                driver = Rollouts(c, engine, max_new_tokens=100, tool=tool)
                report = await asyncio.wait_for(driver.step(step0, [pa, pb, pc]), 30)
                assert report.sealed and (report.stored, report.aborted, report.recycled, report.tool_calls) == (1, 1, 2, 3)
                assert driver.partials == 2 and fake.parked == 1
                stopped = fake.aborted if abort == "request" else fake.disconnected
                assert stopped == fake.parked_rids
                first = await c.get_data(step0, FIELDS, 1, task="train", timeout=10)
                check(first, 0, build(pa, [("a", [(0, 4)])]))
                with pytest.raises(WaitTimeoutError):  # partial in step 1 until resumed
                    await c.get_meta(step1, ["response_ids"], 1, task="train", timeout=0)

                await driver.set_version(1)
                sent = len(fake.requests)
                report = await asyncio.wait_for(driver.step(step1, []), 30)
                assert (report.resumed, report.stored, report.aborted, report.recycled, report.tool_calls) == (2, 2, 0, 0, 3)
                # b's second tool call saw its whole second turn, ended under version 1
                assert (tuple(pb), 15, (1, 10, 12)) in calls

                meta = await c.get_meta(step1, [*FIELDS, "routed_experts"], 2, task="train", timeout=10)
                batch = await c.get_data(meta)
                order = [tuple(p.tolist()) for p in batch["prompt_ids"]]
                b, cc = order.index(tuple(pb)), order.index(tuple(pc))
                want_b = build(pb, [("a", [(0, 4)]), ("t", outputs[(tuple(pb), 7)]), ("a", [(0, PARK_AFTER), (1, 2)]),
                                    ("t", outputs[(tuple(pb), 15)]), ("a", [(1, 4)])])
                check(batch, b, want_b)
                assert want_b["turn_spans"] == [[A, 0, 4], [T, 4, 7], [A, 7, 12], [T, 12, 14], [A, 14, 18]]  # one second turn
                assert want_b["version_spans"] == [[0, 0, 4], [0, 7, 10], [1, 10, 12], [1, 14, 18]]
                assert batch.token_versions("response_ids")[b].tolist() == [0] * 10 + [1] * 8
                want_c = build(pc, [("a", [(0, 4)]), ("t", outputs[(tuple(pc), 7)]), ("a", [(1, 5)])])
                check(batch, cc, want_c)
                assert batch.token_versions("response_ids")[cc].tolist() == [0] * 4 + [1] * 8  # its tool turn went with turn 2

                resumed = {tuple(r["input_ids"][:3]): r for r in fake.requests[sent:] if len(r["input_ids"]) in (10, 13)}
                assert resumed[tuple(pb)]["input_ids"] == pb + want_b["response_ids"][:10]  # b: prompt + all it had
                assert resumed[tuple(pc)]["input_ids"] == pc + want_c["response_ids"][:7]
                # b's rows: the aborted call's (held with an abort request; lost with a closed
                # stream, then computed by the resumed call from the rows held before it)
                held = 12 if abort == "request" else 6
                assert resumed[tuple(pb)]["routed_experts_start_len"] == held
                rows_b = [0] * held + [1] * (20 - held)
                assert batch["routed_experts"][b].tolist() == [experts(p, v) for p, v in enumerate(rows_b)]
                assert batch.token_versions("routed_experts")[b].tolist() == rows_b
                rows_c = [0] * 6 + [1] * 8
                assert batch["routed_experts"][cc].tolist() == [experts(p, v) for p, v in enumerate(rows_c)]
                assert batch.token_versions("routed_experts")[cc].tolist() == rows_c
        finally:
            await fake.stop()

    asyncio.run(main())


def test_a_tool_that_raises_fails_its_sample_by_name_and_the_step_goes_on(cluster, partition):
    """One agent's tool raises after its first turn (nothing stored yet), another's after its
    second (stored partial): each sample is reported failed to its group's policy, the step
    names them in its report and stores the third agent whole."""
    async def main():
        fake = FakeSGLang()
        fake.stop_at = {7, 15}
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url) as engine:
                await c.create_partition(partition, group_size=1, on_member_failure="drop_group")

                async def tool(group, traj):
                    if traj.prompt_ids[0] == 1 or (traj.prompt_ids[0] == 11 and traj.turns == 2):
                        raise ValueError(f"sandbox crashed on turn {traj.turns}")
                    return [900, 901, 902] if traj.turns == 1 else None

                driver = Rollouts(c, engine, max_new_tokens=100, tool=tool)
                report = await asyncio.wait_for(driver.step(partition, [[1, 2, 3], [11, 12, 13], [21, 22, 23]]), 30)
                assert (report.stored, report.tool_failed, report.failed, report.tool_calls) == (1, 2, 0, 3)
                assert sorted(report.errors) == [
                    f"step {partition!r}: the tool raised on a trajectory of group '{partition}/0': ValueError: sandbox crashed on turn 1",
                    f"step {partition!r}: the tool raised on a trajectory of group '{partition}/1': ValueError: sandbox crashed on turn 2",
                ]
                assert len(report.keys) == 3  # done with: a rerun sends none of them again
                st = await part_status(c, partition)
                # the stored partial is excluded by name; the other, never put, is a member its group lacks
                assert {k: n for k, n in st.reasons.items() if n} == {"failed: tool failed: ValueError": 1}
                batch = await c.get_data(partition, FIELDS, st.ready, task="train", timeout=10, policy="first_ready")
                assert [p.tolist() for p in batch["prompt_ids"]] == [[21, 22, 23]]
                check(batch, 0, build([21, 22, 23], [("a", [(0, 4)]), ("t", [900, 901, 902]), ("a", [(0, 5)])]))
        finally:
            await fake.stop()

    asyncio.run(main())


def test_max_turns_ends_the_trajectory_without_calling_the_tool(cluster, partition):
    """A tool that always answers: the trajectory ends after ``max_turns`` assistant turns,
    with a tool turn between each two."""
    async def main():
        fake = FakeSGLang()
        fake.stop_at = {5, 9, 13}  # 2-token turns, 2-token tool turns
        url = await fake.start()
        try:
            async with tqueue.AsyncClient(cluster.address) as c, SGLangEngine(url) as engine:
                asked = []

                async def tool(group, traj):
                    asked.append(traj.turns)
                    return [800, 801]

                driver = Rollouts(c, engine, max_new_tokens=100, tool=tool, max_turns=2)
                report = await asyncio.wait_for(driver.step(partition, [[1, 2, 3]]), 30)
                assert (report.stored, report.tool_calls, report.turn_limited) == (1, 1, 1) and asked == [1]
                batch = await c.get_data(partition, FIELDS, 1, task="train", timeout=10)
                check(batch, 0, build([1, 2, 3], [("a", [(0, 2)]), ("t", [800, 801]), ("a", [(0, 2)])]))
                assert len(fake.requests) == 2
        finally:
            await fake.stop()

    asyncio.run(main())


def test_the_budget_counts_assistant_tokens_and_a_tool_sees_a_plain_function():
    """``max_new_tokens`` is the assistant tokens' budget: each call gets what is left of it,
    the tool tokens taking none. A plain function is a tool too."""
    from tqueue.bridges import Trajectory

    class Engine:
        def __init__(self):
            self.asked = []

        async def generate(self, rid, traj, max_new_tokens):
            self.asked.append(max_new_tokens)
            n = min(3, max_new_tokens)
            traj.append([7] * n, [-1.0] * n, "stop" if n == 3 else "length", [(0, 0, n)])

        async def abort(self, rids):
            pass

        async def set_version(self, version):
            pass

    class Client:  # what the driver asks of a client here: a put, a complete, a seal never coming
        def __init__(self):
            self.rollouts = self
            self.writes = []
            self.never = asyncio.Event()

        async def wait_sealed(self, partition, timeout):
            await self.never.wait()

        async def put(self, partition, data, **kw):
            self.writes.append(("put", kw["partial"], data[0]["response_ids"].tolist()))
            return types.SimpleNamespace(status="ok", fates=None)

        async def complete(self, meta, columns, **kw):
            self.writes.append(("complete", kw["finished"], columns["response_ids"][0].tolist()))
            return []

    async def main():
        engine, client = Engine(), Client()
        driver = Rollouts(client, engine, max_new_tokens=8, tool=lambda group, traj: [1] * 10)
        report = await driver.step("p", [[5]])
        assert engine.asked == [8, 5, 2] and report.tool_calls == 2 and report.stored == 1
        assert client.writes == [("put", True, [7] * 3), ("complete", False, [1] * 10 + [7] * 3),
                                 ("complete", True, [1] * 10 + [7] * 2)]
        traj = Trajectory(prompt_ids=[5], turn_spans=[])
        assert traj.generated == 0 and traj.turns == 0

    asyncio.run(main())


class FakeAsyncLLM:
    """What ``VLLMEngine`` calls of vLLM's ``AsyncLLM``: ``generate`` streaming cumulative
    outputs shaped like vLLM's (``outputs[0]``: ``token_ids``, per-token ``logprobs``,
    ``finish_reason``, ``weight_versions`` on the final one), ``abort`` and
    ``update_weight_version``. The model is fake_sglang's formula."""

    def __init__(self, stop_at, park):
        self.stop_at, self.park = stop_at, park
        self.version = "0"
        self.aborts: dict[str, asyncio.Event] = {}
        self.parked = asyncio.Event()
        self.inputs: list[list[int]] = []

    async def update_weight_version(self, version):
        self.version = version

    async def abort(self, rids):
        for rid in rids:
            self.aborts.setdefault(rid, asyncio.Event()).set()

    async def generate(self, prompt, params, request_id):
        ids = list(prompt["prompt_token_ids"])
        self.inputs.append(ids)
        aborted = self.aborts.setdefault(request_id, asyncio.Event())
        parks, version, out, finish = self.park(ids), self.version, [], None
        while finish is None:
            if len(out) == params.max_tokens:
                finish = "length"
                break
            if aborted.is_set():
                finish = "abort"
                break
            if parks and len(out) == PARK_AFTER:
                self.parked.set()
                await aborted.wait()
                finish = "abort"
                break
            out.append(token(len(ids) + len(out)))
            if len(ids) + len(out) in self.stop_at:
                finish = "stop"
            yield self.output(ids, out, None, version)
        yield self.output(ids, out, finish, version)

    @staticmethod
    def output(ids, out, finish, version):
        lp = [{t: types.SimpleNamespace(logprob=logprob(len(ids) + i))} for i, t in enumerate(out)]
        spans = [types.SimpleNamespace(version=version, start=0, end=len(out))] if finish and out else None
        choice = types.SimpleNamespace(token_ids=list(out), logprobs=lp, finish_reason=finish, weight_versions=spans,
                                       routed_experts=None)
        return types.SimpleNamespace(outputs=[choice])


def test_the_vllm_engine_runs_the_same_loop_and_resumes_a_turn_aborted_mid_stream(cluster, partition, monkeypatch):
    """``VLLMEngine`` (over the stand-in ``AsyncLLM``; ``vllm`` itself, a stub with
    ``SamplingParams``): an agent's second turn aborted at the seal with 3 tokens, continued
    in the next step under version 1, then its tool loop ends it."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    step0, step1 = f"{partition}-0", f"{partition}-1"
    pa, pb = [1, 2, 3], [11, 12, 13]

    async def main():
        llm = FakeAsyncLLM({7, 15, 21}, park=lambda ids: ids[:3] == pb and len(ids) == 10 and llm.version == "0")
        engine = VLLMEngine(llm)
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.create_partition(step0, target=1, recycle_to=step1)
            await c.create_partition(step1)

            async def tool(group, traj):
                if traj.prompt_ids == pa:
                    await llm.parked.wait()
                    return None
                return {7: [5001, 5002, 5003], 15: [5004, 5005]}.get(traj.length)

            driver = Rollouts(c, engine, max_new_tokens=100, tool=tool)
            report = await asyncio.wait_for(driver.step(step0, [pa, pb]), 30)
            assert (report.stored, report.aborted, report.recycled) == (1, 1, 1)
            await driver.set_version(1)
            report = await asyncio.wait_for(driver.step(step1, []), 30)
            assert (report.resumed, report.stored, report.tool_calls) == (1, 1, 2)
            assert llm.inputs[-2] == pb + build(pb, [("a", [(0, 4)]), ("t", [5001, 5002, 5003]), ("a", [(0, 3)])])["response_ids"]
            batch = await c.get_data(step1, FIELDS, 1, task="train", timeout=10)
            want = build(pb, [("a", [(0, 4)]), ("t", [5001, 5002, 5003]), ("a", [(0, PARK_AFTER), (1, 2)]),
                              ("t", [5004, 5005]), ("a", [(1, 4)])])
            check(batch, 0, want)
            assert batch.token_versions("response_ids")[0].tolist() == [0] * 10 + [1] * 8
            assert torch.equal(batch["loss_mask"][0], torch.tensor(want["loss_mask"], dtype=torch.int8))

    asyncio.run(main())
