"""Rollouts from an SGLang server (or a router, or an opaque fleet behind one URL) into tqueue,
over-sampling: each step asks for 12 samples, keeps the first 8, aborts the rest on the server
and resumes them in the next step under the trainer's new weights.

    python docs/examples/sglang_rollouts.py http://127.0.0.1:30000 [--close]

``--close`` aborts by closing the stream, for endpoints whose engines cannot be named.
"""

import asyncio
import sys

import tqueue
from tqueue.bridges import Rollouts, SGLangEngine


async def main(url: str, abort: str) -> None:
    with tqueue.LocalCluster(num_storage_units=2) as cluster:
        async with tqueue.AsyncClient(cluster.address) as client, SGLangEngine(
            url, abort=abort, sampling_params={"temperature": 1.0}
        ) as engine:
            for step in range(2):  # each step seals at 8 samples; late ones go on to the next
                await client.create_partition(f"step-{step}", over_sampling=tqueue.OverSampling(samples=8, recycle_to=f"step-{step + 1}"))
            driver = Rollouts(client, engine, max_new_tokens=6)
            prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
            for step in range(2):
                await driver.set_version(step)  # the engine now runs the trainer's weights of this step
                report = await driver.step(f"step-{step}", prompts if step == 0 else prompts[:1], n=4)
                print(f"step {step}: stored {report.stored}, aborted {report.aborted}, "
                      f"recycled {report.recycled}, resumed {report.resumed}")
                batch = await client.get_data(f"step-{step}", ["response_ids", "version_spans"], 8, task="train", timeout=60)
                mixed = sum(1 for s in batch["version_spans"] if len(s) > 1)
                print(f"step {step}: trained on {len(batch.meta)} samples, {mixed} generated under two versions")
                await client.ack(batch.meta)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "close" if "--close" in sys.argv else "request"))
