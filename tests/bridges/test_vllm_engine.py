"""The rollout driver against a real vLLM engine (the integration tier: ``pytest -m integration``
in a venv with the ``vllm`` extra; ``.ci/run`` installs it). The engine is vLLM's CPU build
running ``AsyncLLM`` on a tiny random Llama made here (tqueue/demos/tiny_model.py), float32,
nothing from a hub."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import time

import pytest
import torch

import tqueue
from tqueue.bridges import Rollouts, Trajectory, VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SHORT, LONG = 8, 160  # token budgets: the short requests finish; the long ones are the surplus
# the HTTP test's surplus: about 2 s of the server's work, against the tenths of a second between
# their first tokens and the abort
HTTP_LONG, HTTP_MAX_LEN = 3000, 3072  # long enough that the pause lands before a loaded server ends them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tqueue.demos.tiny_model import make

    return str(make(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module", autouse=True)
def engine_env(tmp_path_factory):
    """vLLM on these machines: offline, a 1 GiB KV cache, its temp files in a per-run folder."""
    scratch = tmp_path_factory.mktemp("vllm-tmp")
    env = {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(scratch / "inductor")),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # vLLM keeps alive the frame that first imports its engine arguments, and the frames that
    # called it: here, rather than a test's frame that holds an engine
    import vllm.engine.arg_utils  # noqa: F401

    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def start_engine(model_dir: str):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    )


# vLLM's engine client never closes its ZMQ context: collected (below), the context warns
@pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")
def test_over_sampling_against_a_real_engine_aborts_the_surplus_and_resumes_it_under_the_next_version(model_dir):
    """12 requests for a target of 8: the step seals at 8, the other 4 are aborted on the
    engine, come back as partials with their version, and resume in the next step under a new
    version, each resumed sample's token versions showing both segments."""

    async def main(llm):
        with tqueue.LocalCluster(num_storage_units=2) as cluster:
            async with tqueue.AsyncClient(cluster.address) as c:
                step0, step1, step2 = "step-0", "step-1", "step-2"
                await c.create_partition(step0, target=8, recycle_to=step1)
                await c.create_partition(step1, target=8, recycle_to=step2)
                engine = VLLMEngine(llm, sampling={"temperature": 1.0, "ignore_eos": True})
                driver = Rollouts(c, engine, max_new_tokens=LONG)
                await driver.set_version(0)
                prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34, 35]]
                report = await asyncio.wait_for(driver.step(step0, prompts, n=4, max_new_tokens=[SHORT, SHORT, LONG]), 600)
                assert (report.requests, report.stored, report.aborted, report.recycled) == (12, 8, 4, 4), report
                assert report.sealed and report.abort_seconds is not None and report.abort_seconds < 30, report
                assert llm.output_processor.get_num_unfinished_requests() == 0  # none left running on the engine
                batch = await c.get_data(step0, ["prompt_ids", "response_ids", "response_logprobs", "finish", "version_spans"], 8,
                                         task="train", timeout=30)
                assert sorted(p.tolist() for p in batch["prompt_ids"]) == sorted([prompts[0]] * 4 + [prompts[1]] * 4)
                for i in range(8):
                    assert len(batch["response_ids"][i]) == len(batch["response_logprobs"][i]) == SHORT
                    assert batch["finish"][i] == "length" and batch["version_spans"][i].tolist() == [[0, 0, SHORT]]
                    assert all(-30 < x < 0 for x in batch["response_logprobs"][i].tolist())
                partial_lengths = sorted(len(p.trajectory.response_ids) for p in driver._partials)
                assert len(partial_lengths) == 4 and all(0 < n < LONG for n in partial_lengths), partial_lengths
                assert all(p.trajectory.version_spans == [(0, 0, len(p.trajectory.response_ids))] for p in driver._partials)

                await driver.set_version(1)  # the trainer's next weights are on the engine
                started = time.monotonic()
                report = await asyncio.wait_for(driver.step(step1, [[41, 42]], n=4, max_new_tokens=[SHORT]), 600)
                assert (report.resumed, report.stored, report.aborted) == (4, 8, 0), report
                meta = await c.get_meta(step1, ["prompt_ids", "response_ids", "version_spans"], 8, task="train", timeout=30)
                batch = await c.get_data(meta)
                resumed = [i for i in range(8) if batch["prompt_ids"][i].tolist() == prompts[2]]
                assert len(resumed) == 4
                for i in range(8):
                    versions = batch.token_versions("response_ids")[i].tolist()
                    if i in resumed:
                        k = versions.index(1)
                        assert len(versions) == LONG and versions == [0] * k + [1] * (LONG - k) and 0 < k < LONG
                        assert batch["version_spans"][i].tolist() == [[0, 0, k], [1, k, LONG]]
                        assert meta.segments[i] == [[0, 0], [1, k]]
                    else:
                        assert versions == [1] * SHORT
                assert sorted(versions.index(1) for versions in (batch.token_versions("response_ids")[i].tolist() for i in resumed)) == partial_lengths
                print(f"step 1 took {time.monotonic() - started:.1f} s")

                # an abort asked before the engine holds the request (AsyncLLM.abort drops an id
                # it does not know) is asked again at the call's first output: the call ends aborted
                early = Trajectory(prompt_ids=[7, 8, 9])
                call = asyncio.ensure_future(engine.generate("early", early, LONG))
                await engine.abort(["early"])  # runs before the call has started
                await asyncio.wait_for(call, 60)
                assert early.finish == "abort" and 0 < len(early.response_ids) < LONG, (early.finish, len(early.response_ids))
                assert llm.output_processor.get_num_unfinished_requests() == 0 and len(engine._early) == 0

    async def with_engine():
        llm = start_engine(model_dir)  # in the loop that runs its output handler, and shut down there
        try:
            await main(llm)
        finally:
            llm.shutdown(timeout=30)

    asyncio.run(with_engine())
    gc.collect()  # AsyncLLM's reference cycles, while vLLM's modules are there: its __del__ shuts down again


STOPS = list(range(500, 1000))  # the agent tests' turns end at the first of these past MIN_TURN tokens
MIN_TURN = 3


class Recorded:
    """``AsyncLLM`` as ``VLLMEngine`` calls it, each call recorded from vLLM's own output: its
    input, ``max_tokens``, and the final ``CompletionOutput``'s tokens, sampled log-probs, finish
    and weight versions. The first call of prompt ``hold`` past its first turn is sampled with no
    stop tokens and, at its first output, the engine's scheduler is frozen (``pause_generation
    (mode="keep")``): the call is on the engine, mid-turn, until an abort ends it."""

    def __init__(self, llm, hold: list[int]):
        self.llm, self.hold = llm, hold
        self.calls: list[dict] = []
        self.parked = asyncio.Event()
        self.held = False

    async def generate(self, prompt, params, request_id):
        from vllm import SamplingParams

        ids = list(prompt["prompt_token_ids"])
        call = {"input": ids, "max_tokens": params.max_tokens}
        self.calls.append(call)
        hold = not self.held and ids[: len(self.hold)] == self.hold and len(ids) > len(self.hold)
        if hold:
            self.held = True
            params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=params.max_tokens, logprobs=0)
        final = None
        async for out in self.llm.generate(prompt, params, request_id=request_id):
            if hold and not self.parked.is_set():
                await self.llm.pause_generation(mode="keep", clear_cache=False)
                self.parked.set()
            final = out
            yield out
        choice = final.outputs[0]
        call["ids"] = [int(t) for t in choice.token_ids]
        call["logprobs"] = [float(choice.logprobs[i][t].logprob) for i, t in enumerate(call["ids"])]
        call["finish"] = choice.finish_reason
        call["versions"] = [(s.version, s.start, s.end) for s in choice.weight_versions or []]

    async def abort(self, rids):
        await self.llm.abort(rids)

    async def update_weight_version(self, version):
        await self.llm.update_weight_version(version)


@pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")
def test_multi_turn_agents_on_a_real_engine_mask_tool_turns_and_continue_a_turn_cut_at_the_seal(model_dir):
    """Two agents, the tool answering between assistant turns (each turn ends at a stop token,
    sampled past 3 tokens). Step 0, target 1: agent ``a`` runs 3 turns, the tool moving the
    weights on between them (versions 0, 1, 2), and fills the target; agent ``b``'s second turn
    is on the engine, mid-stream, at the seal: aborted, stored partial with the tokens it had,
    recycled. Step 1 (version 3) continues that same turn, then the tool loop (turn 3 under
    version 4). Read back, each sample is exactly its turns: the engine's tokens and log-probs
    with loss mask 1, the tool's with 0, its turn spans, version spans and token versions."""
    pa, pb = [11, 12, 13], [21, 22, 23, 24]
    answers = {(11, 1): [101, 102, 103], (11, 2): [111, 112], (21, 1): [201, 202, 203], (21, 2): [211, 212]}
    budget = 200
    A, T = 0, 1  # turn kinds: assistant, tool

    async def main(llm):
        recorded = Recorded(llm, hold=pb)
        b_in_tool, a_last = asyncio.Event(), asyncio.Event()
        seen = []
        with tqueue.LocalCluster(num_storage_units=1) as cluster:
            async with tqueue.AsyncClient(cluster.address) as c:
                await c.create_partition("agents-0", target=1, recycle_to="agents-1")
                await c.create_partition("agents-1")

                async def tool(group, traj):
                    key = (traj.prompt_ids[0], traj.turns)
                    seen.append((key, traj.finish, driver.version))
                    if key == (11, 1):  # b in its tool: no call of b runs while the weights move on
                        await asyncio.wait_for(b_in_tool.wait(), 120)
                        await driver.set_version(1)
                    elif key == (11, 2):
                        await driver.set_version(2)
                    elif key == (11, 3):  # a fills the target once b is mid-turn, frozen on the engine
                        a_last.set()
                        await asyncio.wait_for(recorded.parked.wait(), 120)
                    elif key == (21, 1):
                        b_in_tool.set()
                        await asyncio.wait_for(a_last.wait(), 120)
                    elif key == (21, 2):
                        await driver.set_version(4)
                    return answers.get(key)

                sampling = {"temperature": 1.0, "ignore_eos": True, "stop_token_ids": STOPS, "min_tokens": MIN_TURN}
                driver = Rollouts(c, VLLMEngine(recorded, sampling=sampling), max_new_tokens=budget, tool=tool)
                await driver.set_version(0)
                try:
                    report = await asyncio.wait_for(driver.step("agents-0", [pa, pb]), 120)
                finally:
                    await llm.resume_generation()
                assert report.sealed and (report.stored, report.aborted, report.recycled, report.tool_calls) == (1, 1, 1, 4), report
                assert llm.output_processor.get_num_unfinished_requests() == 0
                await driver.set_version(3)
                report = await asyncio.wait_for(driver.step("agents-1", []), 120)
                assert (report.resumed, report.stored, report.aborted, report.tool_calls) == (1, 1, 0, 2), report
                # the first turns end in either order; then a's tools, then b's in step 1, each turn ended "stop"
                assert sorted(seen[:2]) == [((11, 1), "stop", 0), ((21, 1), "stop", 0)], seen
                assert seen[2:] == [((11, 2), "stop", 1), ((11, 3), "stop", 2), ((21, 2), "stop", 3), ((21, 3), "stop", 4)], seen

                calls = {p[0]: [k for k in recorded.calls if k["input"][0] == p[0]] for p in (pa, pb)}
                assert [len(calls[11]), len(calls[21])] == [3, 4], recorded.calls
                a1, a2, a3 = calls[11]
                b1, cut, b2, b3 = calls[21]  # cut: b's second turn, aborted at the seal; b2 continues it
                # vLLM's turns: each ends at its first stop token past MIN_TURN, but the cut one
                for k in (a1, a2, a3, b1, b2, b3):
                    assert k["finish"] == "stop" and len(k["ids"]) > MIN_TURN and k["ids"][-1] >= 500, k
                    assert all(t < 500 for t in k["ids"][:-1]), k
                assert cut["finish"] == "abort" and 0 < len(cut["ids"]) < cut["max_tokens"], cut
                # each call under the version set before it (vLLM's weight_versions)
                for call, version in zip((a1, a2, a3, b1, cut, b2, b3), "0120234"):
                    assert call["versions"] == [(version, 0, len(call["ids"]))], call
                # a: turn, tool, turn, tool, turn; b: turn, tool, the cut turn continued (two calls), tool, turn
                turns = {11: [a1, answers[(11, 1)], a2, answers[(11, 2)], a3], 21: [b1, answers[(21, 1)], cut, b2, answers[(21, 2)], b3]}
                for p, prompt in ((11, pa), (21, pb)):
                    response, generated = [], 0
                    for part in turns[p]:
                        if isinstance(part, dict):  # sent prompt + the response so far, and the rest of the budget
                            assert part["input"] == prompt + response and part["max_tokens"] == budget - generated, (part, response)
                            generated += len(part["ids"])
                        response += part["ids"] if isinstance(part, dict) else part

                def concat(parts) -> dict[str, list]:
                    out: dict[str, list] = {"response_ids": [], "response_logprobs": [], "loss_mask": []}
                    for part in parts:  # the engine's tokens and log-probs, mask 1; a tool's tokens, 0.0, mask 0
                        ids = part["ids"] if isinstance(part, dict) else part
                        out["response_ids"] += ids
                        out["response_logprobs"] += part["logprobs"] if isinstance(part, dict) else [0.0] * len(ids)
                        out["loss_mask"] += [int(isinstance(part, dict))] * len(ids)
                    return out

                n1, n2, n3 = len(a1["ids"]), len(a2["ids"]), len(a3["ids"])
                e2, e3 = n1 + 3 + n2, n1 + 3 + n2 + 2 + n3  # where a's turns 2 and 3 end
                want_a = {
                    **concat(turns[11]),
                    "turn_spans": [[A, 0, n1], [T, n1, n1 + 3], [A, n1 + 3, e2], [T, e2, e2 + 2], [A, e2 + 2, e3]],
                    "version_spans": [[0, 0, n1], [1, n1 + 3, e2], [2, e2 + 2, e3]],
                    # each write a segment: turn 1; tool 1 and turn 2; tool 2 and turn 3
                    "token_versions": [0] * n1 + [1] * (3 + n2) + [2] * (2 + n3),
                    "segments": [[0, 0], [1, n1], [2, e2]],
                }
                m1, k, m2, m3 = len(b1["ids"]), len(cut["ids"]), len(b2["ids"]), len(b3["ids"])
                c0, c1 = m1 + 3, m1 + 3 + k + m2  # where b's second turn starts and ends
                want_b = {
                    **concat(turns[21]),
                    # the second turn is one turn of two version spans: the tokens it had at the seal, then step 1's
                    "turn_spans": [[A, 0, m1], [T, m1, c0], [A, c0, c1], [T, c1, c1 + 2], [A, c1 + 2, c1 + 2 + m3]],
                    "version_spans": [[0, 0, m1], [2, c0, c0 + k], [3, c0 + k, c1], [4, c1 + 2, c1 + 2 + m3]],
                    # writes: turn 1; tool 1 and the cut turn's tokens (at the seal); the turn's rest; tool 2 and turn 3
                    "token_versions": [0] * m1 + [2] * (3 + k) + [3] * m2 + [4] * (2 + m3),
                    "segments": [[0, 0], [2, m1], [3, c0 + k], [4, c1]],
                }

                for part, prompt, want in (("agents-0", pa, want_a), ("agents-1", pb, want_b)):
                    meta = await c.get_meta(part, ["prompt_ids", "response_ids", "response_logprobs", "loss_mask",
                                                   "turn_spans", "version_spans", "finish"], 1, task="train", timeout=30)
                    batch = await c.get_data(meta)
                    assert batch["prompt_ids"][0].tolist() == prompt and batch["finish"][0] == "stop"
                    assert torch.equal(batch["response_ids"][0], torch.tensor(want["response_ids"], dtype=torch.int64))
                    assert torch.equal(batch["response_logprobs"][0], torch.tensor(want["response_logprobs"], dtype=torch.float32))
                    assert torch.equal(batch["loss_mask"][0], torch.tensor(want["loss_mask"], dtype=torch.int8))
                    assert batch["turn_spans"][0].tolist() == want["turn_spans"]
                    assert batch["version_spans"][0].tolist() == want["version_spans"]
                    assert batch.token_versions("response_ids")[0].tolist() == want["token_versions"]
                    assert meta.segments[0] == want["segments"]

    async def with_engine():
        llm = start_engine(model_dir)
        try:
            await main(llm)
        finally:
            llm.shutdown(timeout=30)

    asyncio.run(with_engine())
    gc.collect()


def run_demo(*flags: str, steps: int, script: str = "") -> tuple[list[dict[str, str]], str]:
    """Run ``tqueue demo --engine vllm FLAGS`` (or ``script``) and check what a user sees:
    stdout is the summary table and nothing else, stderr has one progress line per step, and
    neither holds a traceback, at exit or before. Returns the table's rows (header to cell)
    and stderr."""
    import subprocess
    import sys

    argv = [sys.executable, "-c", script] if script else [sys.executable, "-m", "tqueue", "demo", "--engine", "vllm", *flags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for stream in (out.stdout, out.stderr):
        assert "Traceback" not in stream and "Exception ignored" not in stream, stream[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 + steps and all(line.startswith("|") and line.endswith("|") for line in lines), out.stdout
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    head, rule = cells[0], cells[1]
    assert head[0] == "step" and rule == ["---"] * len(head) and all(len(row) == len(head) for row in cells[2:]), out.stdout
    rows = [dict(zip(head, row)) for row in cells[2:]]
    assert [r["step"] for r in rows] == [str(k) for k in range(steps)]
    progress = re.findall(r"^tqueue demo: step (\d+) trained \((\d+) of (\d+)\): 16 samples, .*, OK, [\d.]+ s$", out.stderr, re.M)
    assert progress == [(str(k), str(k + 1), str(steps)) for k in range(steps)], out.stderr[-3000:]
    return rows, out.stderr


def test_the_demo_runs_the_main_job_with_a_real_engine():
    """``tqueue demo --engine vllm``: every step trains on exactly its target, the surplus is
    aborted and resumed, and the versions advance; the table alone on stdout, the engine's
    warnings (no INFO lines) and a line per step on stderr."""
    rows, err = run_demo("--steps", "3", steps=3)
    assert all(r["trained"] == "16" and r["result"] == "OK" for r in rows)  # trained per step
    assert int(rows[0]["aborted"]) > 0 and int(rows[1]["resumed"]) > 0  # aborted in step 0, resumed in step 1
    assert int(rows[2]["token versions"].split("..")[1]) >= 1  # the engine's tokens carry the versions the trainer advanced
    assert " INFO " not in err and "Loading safetensors checkpoint shards" not in err, err[-3000:]


VERBOSE = """
import argparse, sys
from tqueue.demos.engine import run_engine_demo
sys.exit(run_engine_demo(argparse.Namespace(engine="vllm", quick=True, steps=2, engine_groups=4, engine_group_size=4,
                                            over=1.5, trainer=None, verbose=True)))
"""


def test_the_demo_with_verbose_shows_the_engine_logs_on_stderr():
    """``verbose`` (``--verbose``, the flag ``add_engine_arguments`` gives ``tqueue demo``):
    vLLM's INFO lines, from this process and the engine's, and its loading bar, all on stderr."""
    _, err = run_demo(steps=2, script=VERBOSE)
    assert re.search(r"^\(EngineCore pid=\d+\) INFO ", err, re.M) and "[shutdown] MPClient: complete" in err, err[-3000:]
    assert "Loading safetensors checkpoint shards" in err


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """``vllm serve`` on 127.0.0.1 with its token-in/token-out API (``--enable-scale-out``) and
    ``/update_weight_version`` (dev mode); ready once it says so on its output."""
    import queue
    import socket
    import subprocess
    import sys
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
         "--enforce-eager", "--max-model-len", str(HTTP_MAX_LEN), "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out",
         "--seed", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        start_new_session=True,  # its engine processes are in its group: stopped with it, by its id
    )
    lines: queue.Queue[str] = queue.Queue()
    tail: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    deadline = time.monotonic() + 300
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            tail = (tail + [line])[-40:]
            if not line:
                raise AssertionError("vllm serve exited before it was ready:\n" + "".join(tail))
            if "Application startup complete" in line:
                break
        yield f"http://127.0.0.1:{port}"
    finally:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        # the pump reads to EOF, which comes once the server and the engine processes it started
        # are gone; closing the pipe under it made it raise in its thread, blamed on a later test
        pumping.join(timeout=60)
        assert proc.stdout is not None
        if not pumping.is_alive():
            proc.stdout.close()


def _signal_group(pgid: int, sig: int) -> None:
    """Signal the server's process group (its engine processes too); gone already is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def test_over_sampling_through_the_vllm_token_api(vllm_server):
    """The same scenario over vLLM's token-in/token-out HTTP API: the surplus aborted on the
    server by ``/inference/v1/abort_requests``, resumed under the next version.

    The step is sealed by another worker's puts, made once each of this step's 4 calls has
    streamed its first token and the server's generation is paused (``/pause?mode=keep``):
    the calls are then on the engine and cannot end first. (Sealed by short calls of the same
    step, the test lost a race on a loaded machine: the server had made all 160 tokens of the
    long calls, 0.35 s of work, before the shorts' puts sealed the step; and with 900 tokens
    and no pause, the server had made them all before this process had read the first ones; and
    with 900 tokens and the pause, once more in CI on 2026-12-03: now 3,000.) The cluster's heartbeat is 5 s: a server on the same 2 cores stalled
    every process here for over 3 s, the default window."""
    from tqueue.bridges import VLLMHTTPEngine

    class Watched(VLLMHTTPEngine):
        """Sets ``streaming`` once ``want`` calls have streamed an event."""

        def __init__(self, *args, want: int, **kw):
            super().__init__(*args, **kw)
            self.want, self.started, self.streaming = want, set(), asyncio.Event()

        async def stream(self, rid, path, body, what):
            async with contextlib.aclosing(super().stream(rid, path, body, what)) as events:
                async for event in events:
                    self.started.add(rid)
                    if len(self.started) >= self.want:
                        self.streaming.set()
                    yield event

    async def main():
        with tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": 5.0}) as cluster:
            async with tqueue.AsyncClient(cluster.address) as c, Watched(
                vllm_server, sampling={"temperature": 1.0, "ignore_eos": True}, want=4
            ) as engine:
                await c.create_partition("h-0", target=4, recycle_to="h-1")
                driver = Rollouts(c, engine, max_new_tokens=HTTP_LONG)
                await driver.set_version(3)
                step = asyncio.ensure_future(driver.step("h-0", [[8, 9]], n=4))
                await asyncio.wait_for(engine.streaming.wait(), 300)
                # the server's generation frozen (vLLM's RL API, dev mode): the calls cannot end
                # before the seal, however fast the server is against this process
                async with engine._http().post(f"{vllm_server}/pause", params={"mode": "keep"}) as resp:
                    assert resp.status == 200, await resp.text()
                other = {"prompt_ids": torch.tensor([1, 2]), "response_ids": torch.tensor([3, 4]), "finish": "length"}
                try:
                    await c.put("h-0", [other] * 4, version=3)  # another worker fills the step: it seals
                    report = await asyncio.wait_for(step, 300)
                finally:
                    async with engine._http().post(f"{vllm_server}/resume") as resp:
                        assert resp.status == 200, await resp.text()
                assert report.sealed and (report.stored, report.aborted, report.recycled) == (0, 4, 4), report
                assert report.abort_seconds is not None and report.abort_seconds < 10, report  # aborted, not cut at the bound
                lengths = sorted(len(p.trajectory.response_ids) for p in driver._partials)
                assert all(0 < n < HTTP_LONG for n in lengths), lengths
                await driver.set_version(4)
                report = await asyncio.wait_for(driver.step("h-1", [], n=1), 300)
                assert (report.resumed, report.stored) == (4, 4), report
                meta = await c.get_meta("h-1", ["response_ids", "version_spans"], 4, task="t", timeout=30)
                batch = await c.get_data(meta)
                for i in range(4):
                    spans = batch["version_spans"][i].tolist()
                    k = spans[0][2]
                    assert spans == [[3, 0, k], [4, k, HTTP_LONG]] and len(batch["response_ids"][i]) == HTTP_LONG
                    assert batch.token_versions("response_ids")[i].tolist() == [3] * k + [4] * (HTTP_LONG - k)

    asyncio.run(main())


def test_the_vllm_example_runs():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples" / "vllm_rollouts.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.splitlines() == [  # its own lines only: vLLM's logs go to stderr
        "step 0: stored 8, aborted 4, recycled 4, resumed 0",
        "step 0: token versions per sample [(0,)]",
        "step 1: stored 8, aborted 0, recycled 0, resumed 4",
        "step 1: token versions per sample [(0, 1), (1,)]",
    ], out.stdout


def test_the_whole_loop_with_megatron_ranks():
    """``tqueue demo --engine vllm --trainer megatron``: a real vLLM engine generating through
    the driver, megatron-core DP ranks on gloo consuming through StepReader and taking a
    stand-in step, the trainer's version advancing, over-sampling aborting, partials resuming."""
    rows, err = run_demo("--trainer", "megatron", "--steps", "3", steps=3)
    assert "tqueue demo: the trainer is 2 megatron-core data-parallel ranks on gloo, reading through StepReader" in err
    assert all(r["trained"] == "16" and r["result"] == "OK" for r in rows)  # each step trained on its target, checks passed
    assert all(int(r["micro-batches per rank"]) >= 1 and float(r["loss (stand-in)"]) > 0 for r in rows), rows
    assert int(rows[0]["aborted"]) > 0 and sum(int(r["resumed"]) for r in rows) > 0  # aborted surplus, resumed partials
    assert int(rows[2]["token versions"].split("..")[1]) >= 1  # tokens of advanced versions reach the trainer
    assert "Transformer Engine and Apex are not installed" not in err  # megatron-core's notice, quiet without --verbose
