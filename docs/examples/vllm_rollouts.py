"""Rollouts from an in-process vLLM engine into tqueue, over-sampling with abort and resume.

    pip install -e '.[vllm]'            # from a checkout; the CPU build: see docs/bridges.md
    python docs/examples/vllm_rollouts.py

The model is a tiny random Llama made on the spot (tqueue.demos.tiny_model); point
``MODEL`` at a real one to generate text that means something. vLLM's logs go to stderr, its
warnings only (set ``VLLM_LOGGING_LEVEL=INFO`` to see more).
"""

import asyncio
import gc
import os
import tempfile

# read when vLLM is imported, here and in the engine's processes
for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                   "VLLM_LOGGING_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)

# imported here, not in a function that holds the engine: vLLM keeps the frame that first imports
# its engine arguments alive, and with it the frames that called it
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

import tqueue  # noqa: E402
from tqueue.bridges import Rollouts, VLLMEngine  # noqa: E402
from tqueue.demos.tiny_model import make  # noqa: E402


async def rollouts(llm) -> None:
    with tqueue.LocalCluster(num_storage_units=2) as cluster:
        async with tqueue.AsyncClient(cluster.address) as client:
            for step in range(2):
                await client.create_partition(f"step-{step}", over_sampling=tqueue.OverSampling(samples=8, recycle_to=f"step-{step + 1}"))
            driver = Rollouts(client, VLLMEngine(llm, sampling={"temperature": 1.0, "ignore_eos": True}), max_new_tokens=96)
            for step in range(2):
                await driver.set_version(step)
                # 8 short and 4 long requests: the long ones are the surplus when the step seals
                prompts, budgets = ([[11, 12], [21, 22], [31, 32]], [8, 8, 96]) if step == 0 else ([[41, 42]], [8])
                report = await driver.step(f"step-{step}", prompts, n=4, max_new_tokens=budgets)
                print(f"step {step}: stored {report.stored}, aborted {report.aborted}, "
                      f"recycled {report.recycled}, resumed {report.resumed}")
                batch = await client.get_data(f"step-{step}", ["response_ids"], 8, task="train", timeout=120)
                versions = sorted({tuple(sorted(set(v.tolist()))) for v in batch.token_versions("response_ids")})
                print(f"step {step}: token versions per sample {versions}")
                await client.ack(batch.meta)


async def with_engine(model: str) -> None:
    # made and shut down in the loop that runs the engine's output handler
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=256))
    try:
        await rollouts(llm)
    finally:
        llm.shutdown(timeout=30)  # the engine's processes take longer than vLLM's default 5 s to exit here


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        model = os.environ.get("MODEL") or str(make(os.path.join(scratch, "tiny")))
        asyncio.run(with_engine(model))
    gc.collect()  # AsyncLLM's reference cycles: its __del__ fails if it is left for interpreter exit


if __name__ == "__main__":
    main()
