"""The runnable examples of docs/examples/ run as written: the SGLang one against the
SGLang-shaped server of fake_sglang.py (SGLang itself needs CUDA kernels), the ingestion one
on its own; the vLLM one runs in the integration tier (test_vllm_engine.py)."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import threading

import pytest

from .fake_sglang import FakeSGLang

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples"


def run_example(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_ingestion_example_runs():
    out = run_example("ingest_fleet.py")
    assert "fleet runs version 7 from file:///checkpoints/step-7" in out
    assert "posted: 200 ['ok', 'ok', 'ok', 'ok']" in out
    assert "posted again: 409 key 'prompt-0/0' of partition 'step-7' was already posted" in out
    assert "trainer got: ['prompt-0/0', 'prompt-0/1', 'prompt-0/2', 'prompt-0/3'] [[10, 11, 12], [11, 11, 12], [12, 11, 12], [40, 41]]" in out


@pytest.mark.parametrize("flag", [[], pytest.param(["--close"], marks=pytest.mark.slow)])
def test_the_sglang_example_runs_against_an_sglang_shaped_server(flag):
    ready = threading.Event()
    done: asyncio.Event | None = None
    fake: FakeSGLang | None = None
    loop = asyncio.new_event_loop()

    def serve() -> None:
        nonlocal done, fake

        async def main() -> None:
            nonlocal done, fake
            done = asyncio.Event()
            fake = FakeSGLang(hold=(8, 12))
            await fake.start()
            ready.set()
            await done.wait()
            await fake.stop()

        loop.run_until_complete(main())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ready.wait(30)
        assert fake is not None
        # the second step runs unheld: 4 fresh requests and the 4 resumed ones
        out = run_example("sglang_rollouts.py", fake.url, *flag)
    finally:
        if done is not None:
            loop.call_soon_threadsafe(done.set)
        thread.join(30)
        loop.close()
    assert "step 0: stored 8, aborted 4, recycled 4, resumed 0" in out
    assert "step 0: trained on 8 samples, 0 generated under two versions" in out
    assert "step 1: stored 8, aborted 0, recycled 0, resumed 4" in out
    assert "step 1: trained on 8 samples, 4 generated under two versions" in out
