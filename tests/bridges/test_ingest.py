"""HTTP ingestion over real HTTP (aiohttp on 127.0.0.1) into a real local cluster: concurrent
posters read back bit-exact, 429 with Retry-After under a full budget, 401, 409, 422 naming the
field, 413, version long-poll and server-sent events, no task left after stop."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import torch

import tqueue
from tqueue.bridges.ingest import Ingest

from .fake_sglang import LAYERS, TOP_K, experts, logprob, token

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def run(main: Callable[..., Awaitable[Any]], address: str, **options: Any) -> Any:
    """``main(session, server, client)`` with an ingestion server over a client of ``address``."""

    async def outer() -> Any:
        async with tqueue.AsyncClient(address) as client:
            server = Ingest(client, token=TOKEN, experts_shape=(LAYERS, TOP_K), **options)
            before = asyncio.all_tasks()
            url = await server.start()
            try:
                async with aiohttp.ClientSession(url, headers=AUTH) as session:
                    return await main(session, server, client)
            finally:
                await server.stop()
                await asyncio.sleep(0)  # let cancelled handlers finish their last step
                # the server's tasks, not the client's own (its batched release of arena holds)
                left = {t for t in asyncio.all_tasks() - before
                        if not t.done() and not t.get_coro().__qualname__.startswith("Connections.")}
                assert not left, left

    return asyncio.run(outer())


def token_record(key: str, prompt: list[int], n: int, version: int, reward: float, dtype: str = "uint16") -> dict[str, Any]:
    rows = np.arange((len(prompt) + n - 1) * LAYERS * TOP_K, dtype=dtype).reshape(-1, LAYERS, TOP_K) + version
    return {
        "key": key, "group": key.split("/")[0], "prompt_ids": prompt, "response_ids": [7 + i for i in range(n)],
        "response_logprobs": [-0.1 * (i + 1) for i in range(n)], "loss_mask": [1] * (n - 1) + [0],
        "finish": "length", "version_spans": [[version, 0, n]], "reward": reward,
        "routed_experts": base64.b64encode(rows.tobytes()).decode(), "routed_experts_dtype": dtype,
        "routed_experts_shape": [LAYERS, TOP_K], "extra": {"score": [1.5, 2.5], "source": "fleet-a"},
    }


def sglang_record(key: str, prompt: list[int], n: int, version: int) -> dict[str, Any]:
    positions = range(len(prompt), len(prompt) + n)
    rows = np.array([experts(p, version) for p in range(len(prompt) + n - 1)], dtype=np.int32)
    response = {
        "text": "", "output_ids": [token(p) for p in positions],
        "meta_info": {
            "id": key, "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[logprob(p), token(p), None] for p in positions],
            "weight_version": str(version), "weight_versions": [{"version": str(version), "start": 0, "end": n}],
            "routed_experts": base64.b64encode(rows.tobytes()).decode(),
        },
    }
    return {"key": key, "group": key.split("/")[0], "prompt_ids": prompt, "sglang": response, "reward": 0.5}


async def post(session: aiohttp.ClientSession, partition: str, body: Any, *, msgpack: bool = False, headers=None):
    if msgpack:
        data, kind = msgspec.msgpack.encode(body), "application/msgpack"
    else:
        data, kind = json.dumps(body).encode(), "application/json"
    if len(data) > (1 << 20):  # aiohttp sends large bodies from a file-like object
        data = io.BytesIO(data)
    async with session.post(f"/v1/partitions/{partition}/trajectories", data=data,
                            headers={"Content-Type": kind, **(headers or {})}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def test_concurrent_posters_are_read_back_bit_exact(cluster, partition):
    async def main(session, server, client):
        async def poster(p: int) -> list[dict[str, Any]]:
            sent = []
            for i in range(10):
                key, prompt = f"g{p}/{i}", [p + 1, i + 1, 3]
                # int32 experts like SGLang's: a partition holds one dtype per field
                record = (token_record(key, prompt, 4 + i % 3, p, float(p * 10 + i), "int32") if i % 2
                          else sglang_record(key, prompt, 3 + i % 4, p))
                body = {"records": [record]} if i % 3 else record
                status, answer, _ = await post(session, partition, body, msgpack=p % 2 == 1)
                assert status == 200, answer
                assert answer["accepted"][0]["key"] == key and answer["accepted"][0]["status"] == "ok"
                sent.append(record)
            return sent

        sent = [r for batch in await asyncio.gather(*(poster(p) for p in range(8))) for r in batch]
        fields = ["key", "prompt_ids", "response_ids", "response_logprobs", "loss_mask", "finish", "version_spans",
                  "routed_experts"]
        batch = await client.get_data(partition, fields, 80, task="check", timeout=10)
        meta = batch.meta
        by_key = {k: i for i, k in enumerate(batch["key"])}
        assert sorted(by_key) == sorted(r["key"] for r in sent)
        for r in sent:
            i = by_key[r["key"]]
            assert batch["prompt_ids"][i].tolist() == r["prompt_ids"]
            assert meta.groups[i] == r["group"]
            if "sglang" in r:
                meta_info = r["sglang"]["meta_info"]
                assert batch["response_ids"][i].tolist() == r["sglang"]["output_ids"]
                want = torch.tensor([lp for lp, _, _ in meta_info["output_token_logprobs"]], dtype=torch.float32)
                assert torch.equal(batch["response_logprobs"][i], want)
                assert batch["finish"][i] == "stop"
                assert batch["routed_experts"][i].numpy().tobytes() == base64.b64decode(meta_info["routed_experts"])
            else:
                assert batch["response_ids"][i].tolist() == r["response_ids"]
                assert torch.equal(batch["response_logprobs"][i], torch.tensor(r["response_logprobs"], dtype=torch.float32))
                assert batch["loss_mask"][i].tolist() == r["loss_mask"] and batch["finish"][i] == "length"
                assert batch["version_spans"][i].tolist() == r["version_spans"]
                got = batch["routed_experts"][i]
                assert got.dtype == torch.int32 and got.numpy().tobytes() == base64.b64decode(r["routed_experts"])
        extra = await client.get_data(partition, ["key", "reward", "score", "source"], 40, task="extra", timeout=10)
        for i, key in enumerate(extra["key"]):
            r = next(x for x in sent if x["key"] == key)
            assert float(extra["reward"][i]) == r["reward"] and extra["score"][i].tolist() == [1.5, 2.5]
            assert extra["score"][i].dtype == torch.float64 and extra["source"][i] == "fleet-a"

    run(main, cluster.address)


def test_a_full_staleness_budget_answers_429_with_retry_after_until_the_trainer_consumes(partition):
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        async def main(session, server, client):
            await client.set_staleness(max_staleness=0, batch_size=4)  # version 0: 4 samples
            await server.publish(0, "s3://weights/step-0")
            records = [token_record(f"a/{i}", [1, 2], 3, 0, 1.0) for i in range(6)]
            status, answer, _ = await post(session, partition, {"records": records[:4]})
            assert status == 200 and [a["status"] for a in answer["accepted"]] == ["ok"] * 4
            status, answer, headers = await post(session, partition, records[4])
            assert status == 429 and headers["Retry-After"] == "1" and answer["reason"] == "staleness"
            assert "staleness" in answer["error"]
            assert {p.name: p.samples for p in (await client.status()).partitions}[partition] == 4  # nothing stored
            # the trainer consumes the step and moves on: room for the next version's samples
            batch = await client.get_data(partition, ["response_ids"], 4, task="train", timeout=10)
            await client.ack(batch.meta)
            await server.publish(1, "s3://weights/step-1")
            status, answer, _ = await post(session, partition, records[4])  # the same key: it was not taken
            assert status == 200 and answer["accepted"][0]["key"] == "a/4"

        run(main, cluster.address)


def test_a_full_memory_budget_answers_429_until_the_trainer_frees_it(partition):
    with tqueue.LocalCluster(num_storage_units=1, controller={"capacity_bytes": 12_000}) as cluster:
        async def main(session, server, client):
            big = token_record("m/0", list(range(200)), 200, 0, 0.0)
            status, answer, _ = await post(session, partition, big)
            assert status == 200, answer
            status, answer, headers = await post(session, partition, {**big, "key": "m/1"})
            assert status == 429 and answer["reason"] == "memory" and headers["Retry-After"] == "1"
            batch = await client.get_data(partition, ["response_ids"], 1, task="train", timeout=10)
            await client.ack(batch.meta)
            await client.clear(partition)  # consumed: the trainer frees the step
            status, answer, _ = await post(session, partition, {**big, "key": "m/1"})
            assert status == 200, answer

        run(main, cluster.address, retry_after=0.2)


def test_a_wrong_or_missing_token_gets_401_and_nothing_is_stored(cluster, partition):
    async def main(session, server, client):
        for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}, {"Authorization": f"Bearer {TOKEN}x"}):
            status, answer, resp_headers = await post(session, partition, token_record("x/0", [1], 2, 0, 0.0), headers=headers)
            assert status == 401 and resp_headers["WWW-Authenticate"] == "Bearer", answer
        async with session.get("/v1/version", headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401
        async with session.get("/healthz", headers={"Authorization": ""}) as resp:
            assert resp.status == 200
        assert partition not in {p.name for p in (await client.status()).partitions}

    run(main, cluster.address)


def test_a_duplicate_key_gets_409_and_concurrent_duplicates_store_one(cluster, partition):
    async def main(session, server, client):
        record = token_record("d/0", [1, 2], 2, 0, 0.0)
        assert (await post(session, partition, record))[0] == 200
        status, answer, _ = await post(session, partition, record)
        assert status == 409 and answer["key"] == "d/0" and "already posted" in answer["error"]
        status, answer, _ = await post(session, partition, {"records": [token_record("d/1", [1], 2, 0, 0.0)] * 2})
        assert status == 409 and answer["key"] == "d/1"
        racing = await asyncio.gather(*(post(session, partition, token_record("d/2", [3], 2, 0, 0.0)) for _ in range(5)))
        assert sorted(s for s, _, _ in racing) == [200, 409, 409, 409, 409]
        assert {p.name: p.samples for p in (await client.status()).partitions}[partition] == 2

    run(main, cluster.address)


@pytest.mark.parametrize(
    "change, field, message",
    [
        ({"response_ids": [1, "two"]}, "records[0].response_ids[1]", r"Expected `int`, got `str`"),
        ({"response_logprobs": [-0.5]}, None, r"record 0 \(key 'bad/0'\) of partition '.*': 1 log-probs for 2 generated tokens"),
        ({"routed_experts": "!!not base64"}, None, r"routed_experts is not base64"),
        ({"finish": "done"}, "records[0].finish", r"Invalid enum value 'done' at records\[0\]\.finish"),
        ({"surprise": 1}, "records[0]", r"Object contains unknown field `surprise`"),
        ({"version_spans": [[0, 0, 9]]}, None, r"weight-version span \[0, 9\) lies outside the call's 2 tokens"),
        ({"extra": {"finish": 1.0}}, "extra.finish", r"extra field 'finish' is a standard field"),
    ],
)
def test_a_bad_record_gets_422_naming_the_field_and_nothing_is_stored(cluster, partition, change, field, message):
    async def main(session, server, client):
        good = token_record("ok/0", [1], 2, 0, 0.0)
        bad = {**token_record("bad/0", [1], 2, 0, 0.0), **change}
        status, answer, _ = await post(session, partition, {"records": [bad, good]})
        assert status == 422, answer
        import re

        assert re.search(message, answer["error"]), answer
        if field is not None:
            assert answer["field"] == field
        assert partition not in {p.name for p in (await client.status()).partitions}
        status, _, _ = await post(session, partition, good)  # its key was not taken by the refused body
        assert status == 200

    run(main, cluster.address)


def test_a_body_over_the_limit_gets_413_and_nothing_is_stored(cluster, partition):
    async def main(session, server, client):
        record = token_record("big/0", list(range(5000)), 3, 0, 0.0)
        del record["routed_experts"]
        status, answer, _ = await post(session, partition, record)
        assert status == 413 and answer == {"error": "the body exceeds 16384 bytes"}
        status, answer, _ = await post(session, partition, {"records": [token_record(f"n/{i}", [1], 1, 0, 0.0) for i in range(9)]})
        assert status == 413 and "at most 8" in answer["error"]
        assert partition not in {p.name for p in (await client.status()).partitions}

    run(main, cluster.address, max_body=16 << 10, max_records=8)


def test_version_long_poll_and_events_tell_the_fleet_without_polling(cluster, partition):
    async def main(session, server, client):
        await server.publish(3, "s3://w/3")
        async with session.get("/v1/version", params={"after": "2"}) as resp:
            assert await resp.json() == {"version": 3, "where": "s3://w/3", "changed": True}
        async with session.get("/v1/version", params={"after": "3", "timeout": "0.2"}) as resp:
            assert await resp.json() == {"version": 3, "where": "s3://w/3", "changed": False}

        parked = asyncio.ensure_future(session.get("/v1/version", params={"after": "3", "timeout": "60"}))
        await asyncio.wait_for(until_waiting(server), 10)  # the poll is parked in the server
        assert not parked.done()
        await server.publish(4, "s3://w/4")
        resp = await asyncio.wait_for(parked, 10)
        assert await resp.json() == {"version": 4, "where": "s3://w/4", "changed": True}
        resp.release()

        await client.create_partition(partition, target=2)
        sealed = asyncio.ensure_future(session.get(f"/v1/partitions/{partition}/sealed", params={"timeout": "60"}))
        async with session.get("/v1/events", params={"partitions": partition}) as events:
            stream = sse(events)
            assert await anext(stream) == ("version", {"version": 4, "where": "s3://w/4", "changed": True})
            await server.publish(5, "s3://w/5")
            assert await anext(stream) == ("version", {"version": 5, "where": "s3://w/5", "changed": True})
            for i in range(2):
                assert (await post(session, partition, token_record(f"e/{i}", [1], 2, 5, 0.0)))[0] == 200
            assert await asyncio.wait_for(anext(stream), 10) == ("sealed", {"partition": partition})
        resp = await asyncio.wait_for(sealed, 10)
        assert await resp.json() == {"partition": partition, "sealed": True}
        resp.release()
        # a stream still open when the server stops is ended by it (run() checks no task is left)
        events = await session.get("/v1/events")
        assert (await anext(sse(events)))[0] == "version"
        events.release()

    run(main, cluster.address)


async def until_waiting(server: Ingest) -> None:
    while not server._waits:  # the handler registers its wait before it parks
        await asyncio.sleep(0.01)


async def sse(resp: aiohttp.ClientResponse):
    kind = None
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("event: "):
            kind = text[7:]
        elif text.startswith("data: "):
            yield kind, json.loads(text[6:])


def test_a_poster_that_leaves_mid_put_does_not_cut_the_put_short(cluster, partition):
    """The put runs to its end: the key's fate is known (stored, so a retry is a 409, not a
    second copy). The put is held at a gate so that the poster leaves while it is in flight."""

    async def main(session, server, client):
        entered, gate = asyncio.Event(), asyncio.Event()
        real = client.put

        async def held(*args, **kwargs):
            entered.set()
            await gate.wait()
            return await real(*args, **kwargs)

        client.put = held
        poster = asyncio.ensure_future(post(session, partition, token_record("left/0", [1], 2, 0, 0.0)))
        await asyncio.wait_for(entered.wait(), 10)
        poster.cancel()  # the poster goes away: its connection closes
        await asyncio.gather(poster, return_exceptions=True)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*server._puts), 10)
        client.put = real
        assert {p.name: p.samples for p in (await client.status()).partitions}[partition] == 1
        status, answer, _ = await post(session, partition, token_record("left/0", [1], 2, 0, 0.0))
        assert status == 409 and answer["key"] == "left/0"

    run(main, cluster.address)


def test_a_body_of_another_type_gets_415(cluster, partition):
    async def main(session, server, client):
        async with session.post(f"/v1/partitions/{partition}/trajectories", data=b"key=1",
                                headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 415 and "application/json or application/msgpack" in (await resp.json())["error"]
        status, answer, _ = await post(session, partition, b"\xc1".decode("latin-1"))  # JSON of a string: not a record
        assert status == 422, answer

    run(main, cluster.address)


def test_tqueue_ingest_from_a_shell(cluster, partition, tmp_path):
    """``tqueue ingest ADDR --token-file F``: serves until SIGTERM, then exits cleanly; a token
    is required unless --no-auth."""
    import os
    import subprocess
    import sys

    from tests.servers import server

    refused = subprocess.run([sys.executable, "-m", "tqueue", "ingest", cluster.address], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "TQUEUE_INGEST_TOKEN"})
    assert refused.returncode == 2 and "give a bearer token (--token-file, or $TQUEUE_INGEST_TOKEN), or --no-auth" in refused.stderr
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")

    def url_of(line: str) -> str:
        assert line.startswith("tqueue ingest: serving http://127.0.0.1:"), line
        return line.split()[3]

    with server("ingest", cluster.address, "--port", "0", "--token-file", str(token), ready=url_of) as url:

        async def main():
            async with aiohttp.ClientSession(url, headers=AUTH) as session:
                status, answer, _ = await post(session, partition, token_record("cli/0", [1, 2], 3, 0, 1.0))
                assert status == 200 and answer["accepted"][0]["status"] == "ok"

        asyncio.run(main())
    with tqueue.Client(cluster.address) as c:
        assert c.get_data(partition, ["key"], 1, task="t", timeout=10)["key"] == ["cli/0"]


def test_a_large_body_is_validated_beside_the_loop_and_stored_whole(cluster, partition):
    """Bodies over 1 MiB are decoded and validated off the event loop (which serves others
    meanwhile); the records are stored as any others."""
    async def main(session, server, client):
        records = [{**token_record(f"big/{i}", list(range(500)), 500, 0, 0.0), "routed_experts": None} for i in range(160)]
        body = {"records": records}
        assert len(msgspec.msgpack.encode(body)) > (1 << 20)
        status, answer, _ = await post(session, partition, body, msgpack=True)
        assert status == 200 and [a["status"] for a in answer["accepted"]] == ["ok"] * 160
        batch = await client.get_data(partition, ["key", "response_ids"], 160, task="t", timeout=10)
        assert sorted(batch["key"]) == sorted(r["key"] for r in records)
        assert all(ids.tolist() == list(range(7, 507)) for ids in batch["response_ids"])

    run(main, cluster.address)
