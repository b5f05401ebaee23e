"""Rollouts from an in-process vLLM engine into tqueue, over-sampling with abort and resume.

    pip install 'tqueue[vllm]'          # the CPU build: see docs/bridges.md
    python docs/examples/vllm_rollouts.py

The model is a tiny random Llama made on the spot (tqueue.bridges.tiny_model); point
``MODEL`` at a real one to generate text that means something.
"""

import asyncio
import os
import tempfile

import tqueue
from tqueue.bridges import Rollouts, VLLMEngine


async def rollouts(llm) -> None:
    with tqueue.LocalCluster(num_storage_units=2) as cluster:
        async with tqueue.AsyncClient(cluster.address) as client:
            for step in range(2):
                await client.create_partition(f"step-{step}", target=8, recycle_to=f"step-{step + 1}")
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


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tqueue.bridges.tiny_model import make

    with tempfile.TemporaryDirectory() as scratch:
        model = os.environ.get("MODEL") or str(make(os.path.join(scratch, "tiny")))
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=256))
        try:
            asyncio.run(rollouts(llm))
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
