"""A rollout fleet that pushes over HTTP: an ingestion server in front of a local cluster,
posters that send token-level records and an SGLang response, a trainer that reads them.

    python docs/examples/ingest_fleet.py

In production the server runs as ``tqueue ingest CONTROLLER_ADDRESS --token-file FILE`` and
the fleet posts to it from anywhere; see docs/ingest.md.
"""

import asyncio

import aiohttp

import tqueue
from tqueue.bridges.ingest import Ingest

TOKEN = "example-token"


async def fleet(url: str) -> None:
    """What an engine worker does: post each finished trajectory, with its key and group."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(url, headers=headers) as http:
        async with http.get("/v1/version") as resp:
            pointer = await resp.json()  # which weights to run, and where they are
        print("fleet runs version", pointer["version"], "from", pointer["where"])
        records = [
            {"key": f"prompt-0/{i}", "group": "prompt-0", "prompt_ids": [1, 2, 3], "response_ids": [10 + i, 11, 12],
             "response_logprobs": [-0.5, -0.25, -0.125], "finish": "stop", "version": pointer["version"], "reward": float(i)}
            for i in range(3)
        ]
        records.append({  # an SGLang /generate response, as SGLang returns it
            "key": "prompt-0/3", "group": "prompt-0", "prompt_ids": [1, 2, 3], "reward": 1.0,
            "sglang": {"text": "", "output_ids": [40, 41], "meta_info": {
                "finish_reason": {"type": "length", "length": 2},
                "output_token_logprobs": [[-1.0, 40, None], [-2.0, 41, None]],
                "weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 2}]}},
        })
        async with http.post("/v1/partitions/step-7/trajectories", json={"records": records}) as resp:
            print("posted:", resp.status, [a["status"] for a in (await resp.json())["accepted"]])
        async with http.post("/v1/partitions/step-7/trajectories", json=records[0]) as resp:
            print("posted again:", resp.status, (await resp.json())["error"])


async def main() -> None:
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        async with tqueue.AsyncClient(cluster.address) as client:
            server = Ingest(client, token=TOKEN)
            url = await server.start()
            await server.publish(7, "file:///checkpoints/step-7")  # the trainer published its weights
            await client.create_partition("step-7", grouping=tqueue.Grouping(4))  # GRPO groups of 4: released whole
            await fleet(url)
            batch = await client.get_data("step-7", ["key", "response_ids", "reward"], 4, task="train", timeout=10)
            print("trainer got:", sorted(batch["key"]), sorted(t.tolist() for t in batch["response_ids"]))
            await server.stop()


if __name__ == "__main__":
    asyncio.run(main())
