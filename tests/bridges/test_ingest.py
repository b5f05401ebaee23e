"""HTTP ingestion over real HTTP (aiohttp on 127.0.0.1) into a real local cluster: concurrent
posters read back bit-exact, records that differ in optional fields in one body, 429 with
Retry-After under a full budget, 401, 409, every 422 naming its record and field, 413, the
trainer's version and weights learned from the controller (long-poll and server-sent events),
no task left after stop."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import torch

import tqueue
from tqueue.bridges._fields import FIELDS
from tqueue.bridges.ingest import MSGPACK, Ingest
from tqueue.errors import UnavailableError

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


DROP = object()  # a change that removes the field


def b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.tobytes()).decode()


def changed(record: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = {**record, **change}
    return {k: v for k, v in out.items() if v is not DROP}


def sglang_changed(key: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    record = sglang_record(key, [1, 2], 3, 0)
    change(record["sglang"])
    return record


def no_output_ids(response: dict[str, Any]) -> None:
    del response["output_ids"]


def one_logprob_short(response: dict[str, Any]) -> None:
    response["meta_info"]["output_token_logprobs"].pop()


def logprob_text(response: dict[str, Any]) -> None:
    response["meta_info"]["output_token_logprobs"][0][0] = "x"


BAD = [
    pytest.param({"response_ids": [1, "two"]}, "response_ids", r"^record 1 \(key 'bad/1'\): Expected `int`, got `str` at response_ids\[1\]$", id="wrong-type"),
    pytest.param({"key": DROP}, "key", r"^record 1: Object missing required field `key`$", id="missing-key"),
    pytest.param({"surprise": 1}, "surprise", r"Object contains unknown field `surprise`$", id="unknown-field"),
    pytest.param({"finish": "done"}, "finish", r"Invalid enum value 'done' at finish$", id="enum"),
    pytest.param({"version_spans": [[0, 2]]}, "version_spans", r"Expected `array` of length 3, got 2 at version_spans\[0\]$", id="span-arity"),
    pytest.param({"response_logprobs": [-0.5]}, "response_logprobs",
                 r"^record 1 \(key 'bad/1'\) of partition '.*': 1 log-probs for 2 response tokens$", id="logprobs-count"),
    pytest.param({"response_logprobs": DROP}, "response_logprobs", r"has response_ids and response_logprobs", id="no-logprobs"),
    pytest.param({"version_spans": [[0, 0, 9]]}, "version_spans", r"the span \[0, 9\) of version 0 lies outside the 2 response tokens", id="span-outside"),
    pytest.param({"loss_mask": [1]}, "loss_mask", r"1 loss_mask values for 2 response tokens", id="mask-length"),
    pytest.param({"loss_mask": [1, 2]}, "loss_mask", r"loss_mask values are 0 or 1", id="mask-values"),
    pytest.param({"routed_experts": "!!not base64"}, "routed_experts", r"routed_experts is not base64", id="not-base64"),
    pytest.param({"routed_experts": b64(np.zeros((1, LAYERS, TOP_K), np.uint16))}, "routed_experts",
                 r"routed_experts holds 8 bytes; 2 rows \(one per token but the last\) of 2 x 2 uint16 are 16", id="expert-rows"),
    pytest.param({"routed_experts_shape": DROP}, "routed_experts_shape", r"routed_experts needs routed_experts_shape", id="no-experts-shape"),
    pytest.param({"routed_experts_start": 1}, "routed_experts_start", r"routed_experts_start is for resumes", id="experts-start"),
    pytest.param({"extra": {"finish": 1.0}}, "extra.finish", r"extra field 'finish' is a standard field", id="extra-standard"),
    pytest.param({"extra": {"reward": 1.0}}, "extra.reward", r"extra field 'reward' is a standard field", id="extra-reward"),
    pytest.param({"extra": {"score": [1.5, "x"]}}, "extra.score", r"Expected `float`, got `str` at extra.score\[1\]$", id="extra-value"),
    pytest.param({"extra": {"score": 1.5, "source": "fleet-a"}}, "extra.score",
                 r"field 'score' is float64 of 0 dimensions, record 0's is float64 of 1 dimensions", id="extra-type-differs"),
    pytest.param({"routed_experts": b64(np.zeros((2, LAYERS, TOP_K), np.uint8)), "routed_experts_dtype": "uint8"}, "routed_experts",
                 r"field 'routed_experts' is uint8 of 3 dimensions, record 0's is uint16 of 3 dimensions", id="experts-dtype-differs"),
    pytest.param({"version_spans": DROP}, "version",
                 r"record 1 \(key 'bad/1'\) has no version while others of the body do", id="no-version"),
    pytest.param({"sglang": sglang_record("x", [1], 2, 0)["sglang"]}, "sglang", r"either an SGLang response .* not both", id="sglang-and-tokens"),
    pytest.param(lambda key: sglang_changed(key, logprob_text), "sglang.meta_info.output_token_logprobs",
                 r"Expected `float`, got `str` at sglang.meta_info.output_token_logprobs\[0\]\[0\]$", id="sglang-type"),
    pytest.param(lambda key: sglang_changed(key, no_output_ids), "sglang.output_ids",
                 r"Object missing required field `output_ids` at sglang$", id="sglang-missing"),
    pytest.param(lambda key: sglang_changed(key, one_logprob_short), "sglang",
                 r"2 output_token_logprobs for 3 output_ids", id="sglang-content"),
]


@pytest.mark.parametrize("change, field, message", BAD)
def test_a_bad_record_gets_422_naming_the_record_and_its_field_and_nothing_is_stored(cluster, partition, change, field, message):
    """Record 1 of a body breaks the schema: the 422 names record 1 and its field (the
    record's key when it has one); nothing of the body is stored, and its keys stay free."""
    async def main(session, server, client):
        good = token_record("ok/0", [1], 2, 0, 0.0)
        bad = change("bad/1") if callable(change) else changed(token_record("bad/1", [1], 2, 0, 0.0), change)
        status, answer, _ = await post(session, partition, {"records": [good, bad]}, msgpack=True)
        assert status == 422, answer
        assert re.search(message, answer["error"]), answer
        assert (answer["record"], answer["field"], answer.get("key")) == (1, field, bad.get("key")), answer
        assert partition not in {p.name for p in (await client.status()).partitions}
        status, _, _ = await post(session, partition, good)  # its key was not taken by the refused body
        assert status == 200

    run(main, cluster.address)


def test_a_body_that_is_no_record_gets_422_naming_no_record(cluster, partition):
    """A fault outside any one record: ``record`` is null and ``field`` names the part of the
    request (the body, its records, a query parameter); a record that is not an object is
    named with a null field."""
    async def main(session, server, client):
        url = f"/v1/partitions/{partition}/trajectories"
        for data, kind, field in [(b"{not json", "application/json", "body"), (b"\xc1", MSGPACK, "body"),
                                  (b'"a string"', "application/json", "body"), (b'{"records": []}', "application/json", "records"),
                                  (b'{"records": {"key": "x"}}', "application/json", "records")]:
            async with session.post(url, data=data, headers={"Content-Type": kind}) as resp:
                answer = await resp.json()
                assert (resp.status, answer["record"], answer["field"]) == (422, None, field), answer
        status, answer, _ = await post(session, partition, {"records": [token_record("ok/0", [1], 2, 0, 0.0), "x"]})
        assert (status, answer["record"], answer["field"]) == (422, 1, None), answer
        assert answer["error"] == "record 1 is a string, not an object"
        for path, params, field in [("/v1/version", {"timeout": "soon"}, "timeout"), ("/v1/version", {"timeout": "5000"}, "timeout"),
                                    ("/v1/version", {"after": "x"}, "after"),
                                    (f"/v1/partitions/{partition}/sealed", {"timeout": "-1"}, "timeout")]:
            async with session.get(path, params=params) as resp:
                answer = await resp.json()
                assert (resp.status, answer["record"], answer["field"]) == (422, None, field), answer
        assert partition not in {p.name for p in (await client.status()).partitions}

    run(main, cluster.address)


def test_a_record_the_partition_refuses_gets_422_naming_it_and_what_was_stored(cluster, partition):
    """A fault found when the put reaches the partition (a field it does not declare, a type
    other than the one it holds) names the record and its field too. A body of two field
    sets is stored with two puts: when the second fails, the first's records are stored and
    listed in ``accepted`` (their keys taken), the others' keys stay free."""
    async def main(session, server, client):
        declared = [*FIELDS, "key", "score", "source"]  # no reward
        await client.create_partition(partition, fields=declared)
        plain = {k: v for k, v in token_record("p/0", [1], 2, 0, 0.0).items() if k != "reward"}
        rewarded = token_record("p/1", [1], 2, 0, 1.0)
        status, answer, _ = await post(session, partition, {"records": [plain, rewarded]})
        assert status == 422, answer
        assert (answer["record"], answer["field"], answer["key"]) == (1, "reward", "p/1")
        assert "field 'reward' is not declared" in answer["error"]
        assert answer["accepted"] == [{"key": "p/0", "partition": partition, "index": 0, "status": "ok"}]
        assert (await post(session, partition, plain))[0] == 409  # stored: its key is taken
        assert (await post(session, partition, {**rewarded, "reward": None}))[0] == 200  # refused: its key is free

        other = f"{partition}-types"
        assert (await post(session, other, token_record("t/0", [1], 2, 0, 0.0)))[0] == 200  # score: a list
        status, answer, _ = await post(session, other, changed(token_record("t/1", [1], 2, 0, 0.0), {"extra": {"score": 2.0}}))
        assert status == 422 and (answer["record"], answer["field"], answer["key"]) == (0, "extra.score", "t/1"), answer
        assert "accepted" not in answer

    run(main, cluster.address)


def test_records_that_differ_in_optional_fields_are_stored_from_one_body_and_read_back_exact(cluster, partition):
    """``reward``, ``extra`` entries and ``routed_experts`` given by some records of a body and
    not others: one put per field set, every record stored, and each sample holds exactly the
    fields its record gave (a read of a field finds exactly the records that had it)."""
    async def main(session, server, client):
        full = [token_record(f"o/{i}", [1, i], 3, 0, float(i), "int32") for i in range(6)]
        records = [
            full[0],
            {k: v for k, v in full[1].items() if k not in ("reward", "extra", "routed_experts", "routed_experts_shape")},
            {**{k: v for k, v in full[2].items() if k not in ("routed_experts", "routed_experts_shape")}, "extra": {"source": "fleet-b"}},
            {**{k: v for k, v in full[3].items() if k != "reward"}, "extra": {"score": [0.5]}},
            full[4],
            sglang_record("o/5", [1, 5], 3, 0),  # int32 experts, reward, no extra
        ]
        status, answer, _ = await post(session, partition, {"records": records}, msgpack=True)
        assert status == 200, answer
        assert [a["key"] for a in answer["accepted"]] == [r["key"] for r in records]
        assert {a["status"] for a in answer["accepted"]} == {"ok"} and len({a["index"] for a in answer["accepted"]}) == 6

        async def having(field: str, count: int) -> dict[str, Any]:
            """The ``count`` stored samples with ``field``, by key; no other sample has it."""
            batch = await client.get_data(partition, ["key", field], count, task=f"read-{field}", timeout=10)
            with pytest.raises(tqueue.errors.WaitTimeoutError):
                await client.get_meta(partition, ["key", field], 1, task=f"read-{field}", timeout=0)
            return dict(zip(batch["key"], batch[field]))

        by_key = {r["key"]: r for r in records}
        ids = await having("response_ids", 6)
        assert {k: v.tolist() for k, v in ids.items()} == {k: r.get("response_ids") or r["sglang"]["output_ids"] for k, r in by_key.items()}
        assert {k: float(v) for k, v in (await having("reward", 4)).items()} == {k: r["reward"] for k, r in by_key.items() if "reward" in r}
        experts = await having("routed_experts", 4)
        assert sorted(experts) == ["o/0", "o/3", "o/4", "o/5"]
        for key, rows in experts.items():
            sent = by_key[key].get("routed_experts") or by_key[key]["sglang"]["meta_info"]["routed_experts"]
            assert rows.dtype == torch.int32 and rows.numpy().tobytes() == base64.b64decode(sent)
        assert {k: v.tolist() for k, v in (await having("score", 3)).items()} == {"o/0": [1.5, 2.5], "o/3": [0.5], "o/4": [1.5, 2.5]}
        assert await having("source", 3) == {"o/0": "fleet-a", "o/2": "fleet-b", "o/4": "fleet-a"}

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

        waiting = parks(server)
        parked = asyncio.ensure_future(session.get("/v1/version", params={"after": "3", "timeout": "60"}))
        await asyncio.wait_for(waiting.wait(), 10)  # the poll is parked in the server
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


def test_a_trainers_set_version_answers_a_long_poll_parked_before_it_with_the_weights(cluster, partition):
    """No in-process call: the trainer's own client says the version and where its weights
    are; the server learns both from the controller and answers a long poll that was parked
    before (a handshake: the poll is in the server's wait when the trainer speaks)."""
    async def main(session, server, client):
        now = (await client.status()).version
        async with session.get("/v1/version") as resp:  # the controller's version, at once
            assert (await resp.json())["version"] == now
        parked = parks(server)
        poll = asyncio.ensure_future(session.get("/v1/version", params={"after": str(now), "timeout": "60"}))
        await asyncio.wait_for(parked.wait(), 10)
        assert not poll.done()
        async with tqueue.AsyncClient(cluster.address) as trainer:
            await trainer.set_version(now + 7, weights="s3://bucket/run/step-7")
            resp = await asyncio.wait_for(poll, 10)
            assert await resp.json() == {"version": now + 7, "where": "s3://bucket/run/step-7", "changed": True}
            resp.release()
            await trainer.set_version(now + 1, weights="s3://bucket/run/old")  # an older version changes nothing
            status = await trainer.status()
            assert (status.version, status.weights) == (now + 7, "s3://bucket/run/step-7")

    run(main, cluster.address)


def test_a_controller_that_cannot_tell_the_version_gets_503_and_a_later_wait_follows_again(cluster, partition):
    async def main(session, server, client):
        async with session.get("/v1/version") as resp:
            assert resp.status == 200
        real = client.rollouts.wait_version

        async def unreachable(*args, **kwargs):
            raise UnavailableError("the controller did not answer")

        client.rollouts.wait_version = unreachable
        server._follower.cancel()  # the follower ends; the next wait starts one, which fails
        await asyncio.gather(server._follower, return_exceptions=True)
        async with session.get("/v1/version", params={"after": str(server.version), "timeout": "60"}) as resp:
            answer = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"] == "1", answer
            assert answer["error"] == "the trainer's version cannot be learned from the controller: the controller did not answer"
        async with session.get("/v1/events") as events:  # what it knew, then why it stops, then the end
            assert [kind for kind, _ in [x async for x in sse(events)]] == ["version", "error"]
        client.rollouts.wait_version = real
        now = (await client.status()).version
        await client.set_version(now + 1, weights="s3://w/next")
        async with session.get("/v1/version", params={"after": str(now), "timeout": "60"}) as resp:
            assert await resp.json() == {"version": now + 1, "where": "s3://w/next", "changed": True}

    run(main, cluster.address)


def parks(server: Ingest) -> asyncio.Event:
    """An event set when a request of ``server`` parks (a long poll, a stream): the handshake
    that says a wait is in the server before the test changes what it waits for."""
    parked = asyncio.Event()
    real = server._parked

    async def spy(work):
        parked.set()
        return await real(work)

    server._parked = spy
    return parked


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
        assert (status, answer["record"], answer["field"]) == (422, None, "body"), answer

    run(main, cluster.address)


def test_tqueue_ingest_from_a_shell(cluster, partition, tmp_path):
    """``tqueue ingest ADDR --token-file F``: serves until SIGTERM, then exits cleanly; a token
    is required unless --no-auth. The trainer's ``set_version`` (its own client, nothing
    in-process) reaches the fleet through it: an open event stream and a long poll."""
    import os
    import subprocess
    import sys

    from tests.servers import server

    refused = subprocess.run([sys.executable, "-m", "tqueue", "ingest", cluster.address], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "TQUEUE_INGEST_TOKEN"})
    assert refused.returncode == 2 and "a bearer token (--token-file, or $TQUEUE_INGEST_TOKEN), or --no-auth" in refused.stderr
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")

    def url_of(line: str) -> str:
        assert line.startswith("tqueue ingest: serving http://127.0.0.1:"), line
        return line.split()[3]

    with server("ingest", cluster.address, "--port", "0", "--token-file", str(token), ready=url_of) as url:

        async def main():
            async with aiohttp.ClientSession(url, headers=AUTH) as session, tqueue.AsyncClient(cluster.address) as trainer:
                status, answer, _ = await post(session, partition, token_record("cli/0", [1, 2], 3, 0, 1.0))
                assert status == 200 and answer["accepted"][0]["status"] == "ok"
                now = await trainer.status()
                async with session.get("/v1/events") as events:
                    stream = sse(events)
                    # the first event is the version now: the stream waits for the next one
                    assert await asyncio.wait_for(anext(stream), 10) == (
                        "version", {"version": now.version, "where": now.weights, "changed": True})
                    now = now.version
                    poll = asyncio.ensure_future(session.get("/v1/version", params={"after": str(now), "timeout": "60"}))
                    await trainer.set_version(now + 7, weights="s3://bucket/run/step-7")
                    pointer = {"version": now + 7, "where": "s3://bucket/run/step-7", "changed": True}
                    assert await asyncio.wait_for(anext(stream), 10) == ("version", pointer)
                    resp = await asyncio.wait_for(poll, 10)
                    assert await resp.json() == pointer
                    resp.release()

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
