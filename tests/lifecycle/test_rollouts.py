"""The rollout lifecycle, one test per real scenario: versions per segment, partial rollouts
with splicing, postpone and prefetch, over-sampling with abort, padding, atomic updates."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError, SchemaError, WaitTimeoutError

# Servers of this module's own, served in this process (tests/conftest.py): its tests set the
# trainer's version, which is the cluster's.
OWN_CLUSTER = True


def status(client, partition):
    return {p.name: p for p in client.status().partitions}[partition]


def test_three_engine_calls_three_segments_and_staleness_uses_the_oldest(client, partition):
    """slime's weight_versions / AReaL's per-token versions: a trajectory resumed twice."""
    meta = client.put(partition, {"resp": [torch.tensor([1, 2, 3])], "logp": [torch.full((3,), -1.0)]}, version=1, partial=True)
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["resp"], 1, task="train", timeout=0)  # partial: never served
    client.complete(meta, {"resp": [torch.tensor([4, 5, 6, 7])], "logp": [torch.full((4,), -2.0)]},
                    version=2, first_token=3, append=["resp", "logp"], finished=False)
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["resp"], 1, task="train", timeout=0)  # still unfinished
    client.complete(meta, {"resp": [torch.tensor([8, 9])], "logp": [torch.full((2,), -3.0)]},
                    version=3, first_token=7, append=["resp", "logp"])
    got = client.get_meta(partition, ["resp", "logp"], 1, task="train", timeout=5)
    assert got.segments == [[[1, 0], [2, 3], [3, 7]]]
    assert (got.versions, got.versions_max) == ([1], [3])
    batch = client.get_data(got)
    assert batch["resp"][0].tolist() == list(range(1, 10))
    assert batch["logp"][0].tolist() == [-1.0] * 3 + [-2.0] * 4 + [-3.0] * 2
    assert batch.token_versions("resp")[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 3, 3]
    client.set_version(4)
    client.put(partition, {"resp": [torch.tensor([0])], "logp": [torch.zeros(1)]}, version=3)
    # the bound counts the oldest segment: version 1 is 3 behind, version 3 only 1
    fresh = client.get_meta(partition, ["resp"], 1, task="strict", max_staleness=2, timeout=5)
    assert fresh.indexes == [1]
    assert status(client, partition).tasks["strict"].refused == 1


def test_routed_experts_spliced_across_two_resumes(client, partition):
    """verl #6029 / #6046: each segment keeps the routing its own weights produced."""
    prompt, layers, top_k = 5, 2, 2

    def experts(rows, value):  # the engine returns [tokens, layers, top_k] for the whole sequence
        return [torch.full((rows, layers, top_k), value, dtype=torch.int32)]

    meta = client.put(partition, {"resp": [torch.arange(3)], "experts": experts(prompt + 3, 1)}, version=1, partial=True)
    client.complete(meta, {"resp": [torch.arange(3, 7)], "experts": experts(prompt + 7, 2)}, version=2,
                    first_token=3, append=["resp"], splice={"experts": prompt + 3}, lengths=[prompt + 7], finished=False)
    client.complete(meta, {"resp": [torch.arange(7, 9)], "experts": experts(prompt + 9, 3)}, version=3,
                    first_token=7, append=["resp"], splice={"experts": prompt + 7}, lengths=[prompt + 9])
    batch = client.get_data(client.get_meta(partition, ["resp", "experts"], 1, task="t", timeout=5))
    routed = batch["experts"][0]
    assert routed.shape == (prompt + 9, layers, top_k)  # exactly prompt + response rows
    per_row = routed[:, 0, 0].tolist()
    assert per_row == [1] * (prompt + 3) + [2] * 4 + [3] * 2  # each segment's own weights
    with pytest.raises(SchemaError, match=r"would have 14 rows after the splice; its sequence has 15 tokens"):
        client.complete(client.put(partition, {"resp": [torch.arange(1)], "experts": experts(6, 1)}, partial=True),
                        {"resp": [torch.arange(1)], "experts": experts(14, 2)}, version=2, first_token=1,
                        append=["resp"], splice={"experts": 6}, lengths=[15])


def test_the_splice_rows_follow_a_sample_postponed_and_are_refused_when_malformed(client, partition):
    """The controller keeps each splice's first row with its segment: a postponed sample takes
    them along, and its next splice adds one; rows that do not fit are refused by name."""
    later = f"{partition}-later"
    one = [torch.full((6, 2, 2), 0, dtype=torch.int32)]
    meta = client.put(partition, {"resp": [torch.arange(2)], "experts": one}, version=0, partial=True)
    client.complete(meta, {"resp": [torch.arange(2, 4)], "experts": [torch.full((8, 2, 2), 1, dtype=torch.int32)]},
                    version=1, first_token=2, append=["resp"], splice={"experts": 5}, finished=False)
    moved = client.postpone(meta, later)
    client.complete(moved, {"resp": [torch.arange(4, 5)], "experts": [torch.full((9, 2, 2), 2, dtype=torch.int32)]},
                    version=2, first_token=4, append=["resp"], splice={"experts": 7})
    got = client.get_meta(later, ["resp", "experts"], 1, task="t", timeout=5)
    assert got.splices == {"experts": [[0, 5, 7]]}
    batch = client.get_data(got)
    assert batch.token_versions("experts")[0].tolist() == batch["experts"][0][:, 0, 0].tolist() == [0] * 5 + [1, 1, 2, 2]
    fresh = client.put(partition, {"resp": [torch.arange(2)], "experts": one}, version=0, partial=True)
    with pytest.raises(InvalidArgumentError, match=r"field 'experts' of partition '.*' is spliced at one row >= 0 per sample \(1\)"):
        client.complete(fresh, {"resp": [torch.arange(1)], "experts": one}, version=1, first_token=2, append=["resp"],
                        splice={"experts": [1, 2]})

    async def raw(**splice_args):  # what complete() would never send
        async with tqueue.AsyncClient(client.address) as c:
            await c._puts.update(fresh, {"resp": [torch.arange(1)]}, append=["resp"], **splice_args)

    with pytest.raises(SchemaError, match=r"field 'experts' is spliced but the write has no values of it"):
        asyncio.run(raw(segment=(1, 2), splice={"experts": [3]}))
    with pytest.raises(InvalidArgumentError, match=r"splice rows come with a version segment"):
        asyncio.run(raw(splice={"resp": [3]}))
    with pytest.raises(InvalidArgumentError, match=r"field 'resp' of partition '.*': splice rows are one row >= 0 per sample \(1\)"):
        asyncio.run(raw(segment=(1, 2), splice={"resp": [-3]}))


def test_postpone_and_prefetch_across_partitions(client, partition):
    """verl #2101: unfinished rollouts move to the next step; a short step prefetches."""
    step0, step1 = f"{partition}-0", f"{partition}-1"
    client.create_partition(step0, prefetch=step1)
    done = client.put(step0, {"resp": [torch.full((4,), i) for i in range(6)]}, version=0)
    unfinished = client.put(step0, {"resp": [torch.full((2,), 100 + i) for i in range(2)]}, version=0, partial=True)
    moved = client.postpone(unfinished, step1)
    assert moved.partition == step1 and len(moved) == 2
    client.put(step1, {"resp": [torch.full((4,), 50 + i) for i in range(4)]}, version=1)
    client.seal(step0)  # the rollout of step 0 is over: 6 ready, 8 wanted
    batch = client.get_data(step0, ["resp"], 8, task="train", timeout=10)
    firsts = sorted(int(r[0]) for r in batch["resp"])
    assert firsts == [0, 1, 2, 3, 4, 5, 50, 51]  # 2 prefetched from step 1
    assert status(client, step1).reasons == {"prefetched into %r" % step0: 2}
    assert status(client, step0).reasons == {"postponed to %r" % step1: 2}
    # the postponed samples finish in step 1, their first tokens kept
    client.complete(moved, {"resp": [torch.tensor([7]), torch.tensor([8])]}, version=1, first_token=2, append=["resp"])
    rest = client.get_data(step1, ["resp"], 4, task="train", timeout=10)
    assert sorted(r.tolist() for r in rest["resp"]) == [[52] * 4, [53] * 4, [100, 100, 7], [101, 101, 8]]
    assert done.partition == step0


def test_over_sampling_seals_at_the_target_and_aborted_rows_stay_out(cluster, partition):
    """verl #2929: 160 requests for a target of 128; 32 are aborted and never counted."""

    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.create_partition(partition, target=128)
            waiter = asyncio.ensure_future(c.sealed(partition, timeout=60))

            async def rollout(i: int):
                reward = 1.0 if i < 128 else 1000.0  # the surplus would skew the mean
                return await c.put(partition, {"tokens": [torch.full((8,), i)], "rewards": torch.tensor([reward])}, if_sealed="discard")

            first = [await rollout(i) for i in range(128)]
            await asyncio.wait_for(waiter, 10)  # producers learn of the seal without polling
            late = await asyncio.gather(*(rollout(i) for i in range(128, 160)))
            assert all(m.status == "ok" for m in first) and first[-1].indexes == [127]
            assert [m.status for m in late] == ["aborted"] * 32 and all(m.sealed for m in late)
            st = {p.name: p for p in (await c.status()).partitions}[partition]
            assert (st.samples, st.ready, st.sealed) == (128, 128, True)
            assert st.reasons == {"discarded after seal": 32}
            stats = await c.field_stats(partition, "rewards")
            assert (stats.count, stats.mean) == (128, 1.0)
            batch = await c.get_data(partition, ["tokens", "rewards"], 128, task="train", timeout=5)
            assert sorted(int(t[0]) for t in batch["tokens"]) == list(range(128))

    asyncio.run(main())


def test_commits_racing_past_the_target_are_aborted_and_late_puts_recycled(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            nxt = f"{partition}-next"
            await c.create_partition(partition, target=10, recycle_to=nxt)
            metas = await asyncio.gather(*(c.put(partition, {"x": torch.tensor([i])}) for i in range(16)))
            live = [m for m in metas if m.status == "ok"]
            st = {p.name: p for p in (await c.status()).partitions}[partition]
            assert st.ready == 10 and st.sealed
            over = st.reasons.get("over target", 0)
            recycled = [m for m in metas if m.status == "recycled"]
            assert over + len(recycled) == 6 and len(live) == 10 + over
            late = await c.put(partition, {"x": torch.tensor([99])}, if_sealed="discard")
            assert late.status == "recycled" and late.partition == nxt == late.recycled_to
            with pytest.raises(WaitTimeoutError):
                await c.get_meta(nxt, ["x"], 1, task="t", timeout=0)  # recycled as partial

    asyncio.run(main())


def test_padding_makes_a_drained_partition_divide_evenly(client, partition):
    client.put(partition, {"x": torch.arange(1, 11), "ids": [torch.ones(i + 1) for i in range(10)], "s": [str(i) for i in range(10)]})
    with pytest.raises(WaitTimeoutError):  # not sealed: more may come, no padding yet
        client.get_meta(partition, ["x"], 3, task="t", dp_rank=0, dp_size=4, round=0, pad=True, timeout=0)
    client.seal(partition)
    metas = [client.get_meta(partition, ["x", "ids", "s"], 3, task="t", dp_rank=r, dp_size=4, round=0, pad=True, timeout=5)
             for r in range(4)]
    assert [len(m) for m in metas] == [3, 3, 3, 3] and sum(m.pads for m in metas) == 2
    for m in metas:
        batch = client.get_data(m, jagged={"ids": "padded"})
        pad = batch.is_pad
        assert pad.tolist() == [i < 0 for i in m.indexes]
        assert (batch["x"][pad] == 0).all() and (batch.lengths("ids")[pad] == 0).all()
        assert [s for s, p in zip(batch["s"], pad.tolist()) if p] == [None] * int(pad.sum())
        assert sorted(batch["x"][~pad].tolist()) == sorted(i + 1 for i in m.indexes if i >= 0)


def test_updates_are_atomic_per_sample_across_units(cluster, partition):
    """A reader racing an update gets every field old or every field new, never a mix."""

    async def main():
        async with tqueue.AsyncClient(cluster.address) as writer, tqueue.AsyncClient(cluster.address) as reader:
            units: set[int] = set()
            count = 0
            while len(units) < 2:  # samples on both units
                m = await writer.put(partition, {"a": torch.zeros(4, 1 << 16), "b": torch.zeros(4, 1 << 16)})
                units.update(m.units)
                count += 4
            meta = await writer.get_meta(partition, ["a", "b"], count, task="w", timeout=5)
            rounds = 30

            async def write():
                for k in range(1, rounds + 1):
                    value = torch.full((len(meta), 1 << 16), float(k))
                    await writer.update(meta, {"a": value, "b": value.clone()})

            async def read():
                seen = set()
                while not done.is_set():
                    batch = await reader.get_data(meta, ["a", "b"])
                    a, b = batch["a"][:, 0], batch["b"][:, 0]
                    assert torch.equal(a, b), (a, b)
                    seen.update(a.tolist())
                return seen

            done = asyncio.Event()
            reading = asyncio.ensure_future(read())
            await write()
            done.set()
            seen = await reading
            assert len(seen) > 1  # the reads really raced the writes
            after = await writer.get_meta(partition, ["a"], len(meta), task="check", timeout=5)
            assert set(after.revisions) == {rounds}  # each update stamped every sample once

    asyncio.run(main())


def test_target_in_groups_aborts_groups_past_it(client, partition):
    client.create_partition(partition, group_size=2, target_groups=2)
    for g in ("a", "b", "c"):
        client.put(partition, {"x": torch.zeros(2)}, groups=g, if_sealed="discard")
    client.sealed(partition, timeout=5)
    st = status(client, partition)
    assert st.sealed and st.ready == 4 and st.reasons == {"discarded after seal": 2}  # "c" came after the seal
    meta = client.get_meta(partition, ["x"], 4, task="t", policy="groups", timeout=5)
    assert sorted(set(meta.groups)) == ["a", "b"]


def test_postpone_whole_groups(client, partition):
    nxt = f"{partition}-next"
    meta = client.put(partition, {"x": torch.arange(6)}, groups=["a", "a", "b", "b", "c", "c"])
    moved = client.postpone(meta.select([1, 4]), nxt, whole_groups=True)  # one member each of a, c
    assert sorted(moved.groups) == ["a", "a", "c", "c"]
    assert sorted(client.get_data(nxt, ["x"], 4, task="t", timeout=5, policy="first_ready")["x"].tolist()) == [0, 1, 4, 5]
    assert client.get_meta(partition, ["x"], 2, task="t", timeout=5, policy="first_ready").groups == ["b", "b"]


@pytest.mark.parametrize("spliced", [True, False], ids=["spliced", "rewritten"])
def test_token_versions_of_a_whole_sequence_field_from_its_splices_or_the_prompt(client, partition, spliced):
    """Segment offsets count response tokens; routed experts also hold the prompt's rows.
    Spliced by ``complete(splice=)``, the controller keeps the row each segment starts at and
    each row gets the version that computed it; written whole at each resume, the prompt
    lengths place the segments."""
    prompt, layers, top_k = 3, 2, 2

    def experts(rows, value):
        return [torch.full((rows, layers, top_k), value, dtype=torch.int32)]

    def whole(rows, keep, value):
        return [torch.cat([torch.full((keep, layers, top_k), 0, dtype=torch.int32),
                           torch.full((rows - keep, layers, top_k), value, dtype=torch.int32)])]

    meta = client.put(partition, {"resp": [torch.arange(2)], "experts": experts(prompt + 2, 0)}, version=0, partial=True)
    if spliced:
        client.complete(meta, {"resp": [torch.arange(2, 4)], "experts": experts(prompt + 4, 1)}, version=1,
                        first_token=2, append=["resp"], splice={"experts": prompt + 2}, finished=False)
        client.complete(meta, {"resp": [torch.arange(4, 5)], "experts": experts(prompt + 5, 2)}, version=2,
                        first_token=4, append=["resp"], splice={"experts": prompt + 4})
    else:
        second = whole(prompt + 4, prompt + 2, 1)
        client.complete(meta, {"resp": [torch.arange(2, 4)], "experts": second}, version=1,
                        first_token=2, append=["resp"], finished=False)
        third = [torch.cat([second[0], torch.full((1, layers, top_k), 2, dtype=torch.int32)])]
        client.complete(meta, {"resp": [torch.arange(4, 5)], "experts": third}, version=2, first_token=4, append=["resp"])
    got = client.get_meta(partition, ["resp", "experts"], 1, task="t", timeout=5)
    batch = client.get_data(got)
    values = batch["experts"][0][:, 0, 0].tolist()
    assert values == [0, 0, 0, 0, 0, 1, 1, 2]
    assert batch.token_versions("resp")[0].tolist() == [0, 0, 1, 1, 2]  # response-aligned
    if spliced:
        assert got.splices == {"experts": [[0, prompt + 2, prompt + 4]]}
        assert batch.token_versions("experts")[0].tolist() == values
        with pytest.raises(InvalidArgumentError, match=r"token_versions\('experts'\): the rows each segment starts at are recorded"):
            batch.token_versions("experts", prompt_lengths=prompt)
        return
    assert got.splices is None
    assert batch.token_versions("experts", prompt_lengths=prompt)[0].tolist() == values
    assert batch.token_versions("experts", prompt_lengths=[prompt])[0].tolist() == values
    with pytest.raises(InvalidArgumentError, match=r"field 'experts' of sample \d+ has 8 rows, fewer than its prompt length 9"):
        batch.token_versions("experts", prompt_lengths=9)
    with pytest.raises(InvalidArgumentError, match=r"got 2 prompt lengths for 1 samples"):
        batch.token_versions("experts", prompt_lengths=[3, 3])


def test_a_put_crossing_the_target_is_told_which_samples_are_kept(client, partition):
    client.create_partition(partition, target=8)
    first = client.put(partition, {"x": torch.arange(5)})
    second = client.put(partition, {"x": torch.arange(5, 10)})
    assert (first.status, first.fates) == ("ok", None)
    assert (second.status, second.fates) == ("trimmed", ["ok"] * 3 + ["aborted"] * 2)
    assert (first.sealed, second.sealed) == (False, True)  # the put that sealed it says so
    st = status(client, partition)
    assert (st.ready, st.sealed, st.reasons) == (8, True, {"over target": 2})
    meta = client.get_meta(partition, ["x"], 8, task="t", timeout=5)
    kept = [i for i, f in zip(second.indexes, second.fates) if f == "ok"]
    assert sorted(meta.indexes) == first.indexes + kept  # every sample told "ok" is served


def test_concurrent_producers_are_told_ok_exactly_for_the_samples_served(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.create_partition(partition, target=8)
            metas = await asyncio.gather(*(c.put(partition, {"x": torch.tensor([i])}, if_sealed="discard") for i in range(16)))
            ok = sorted(i for m in metas if m.status == "ok" for i in m.indexes)
            assert [m.status for m in metas].count("aborted") == 8
            assert any(m.sealed for m in metas if m.status == "ok")  # the last commit sealed it
            served = await c.get_meta(partition, ["x"], 8, task="t", timeout=5)
            assert sorted(served.indexes) == ok and len(ok) == 8

    asyncio.run(main())


def test_a_late_put_the_recycle_partition_refuses_too_is_aborted(client, partition):
    nxt = f"{partition}-next"
    client.create_partition(nxt)
    client.put(nxt, {"x": torch.tensor([0])})
    client.seal(nxt)
    client.create_partition(partition, target=1, recycle_to=nxt)
    client.put(partition, {"x": torch.tensor([1])})
    late = client.put(partition, {"x": torch.tensor([2])}, if_sealed="discard")
    assert (late.status, late.indexes) == ("aborted", [])
    assert status(client, partition).reasons == {"discarded after seal": 1}


def test_partitions_that_recycle_into_each_other_abort_a_late_put_instead_of_looping(client, partition):
    """Found by the controller's fuzzer: two sealed partitions whose recycle targets are each
    other sent a late put round the loop until the controller's stack ran out."""
    a, b = f"{partition}-a", f"{partition}-b"
    client.create_partition(a, target=1, recycle_to=b)
    client.create_partition(b, target=1, recycle_to=a)
    client.put(a, {"x": torch.tensor([1])})
    client.put(b, {"x": torch.tensor([2])})
    late = client.put(a, {"x": torch.tensor([3])}, if_sealed="discard")
    assert (late.status, late.indexes) == ("aborted", [])
    assert status(client, a).reasons == {"discarded after seal": 1}
    assert status(client, b).reasons == {"discarded after seal": 1}


def test_completing_partials_takes_places_of_the_target_and_is_refused_once_it_is_full(client, partition):
    """A resumed rollout that finishes after its step filled up stays partial (not dropped as
    over target): the caller learns which and moves them on."""
    nxt = f"{partition}-next"
    client.create_partition(partition, target=2, recycle_to=nxt)
    early = client.put(partition, {"resp": [torch.arange(2)]}, version=0, partial=True)
    late = client.put(partition, {"resp": [torch.arange(3)]}, version=0, partial=True)
    assert client.complete(early, {"resp": [torch.tensor([7])]}, version=1, first_token=2, append=["resp"]) == []
    client.put(partition, {"resp": [torch.arange(4)]}, version=1)  # the second place: sealed
    assert status(client, partition).sealed
    refused = client.complete(late, {"resp": [torch.tensor([8])]}, version=1, first_token=3, append=["resp"])
    assert refused == late.indexes
    assert status(client, partition).reasons == {"completion refused: target reached": 1}
    moved = client.postpone(late, nxt)
    assert client.complete(moved, {"resp": [torch.tensor([8])]}, version=1, first_token=3, append=["resp"]) == []
    batch = client.get_data(nxt, ["resp"], 1, task="train", timeout=5)
    assert batch["resp"][0].tolist() == [0, 1, 2, 8]  # the refused tokens were not written
    batch = client.get_data(partition, ["resp"], 2, task="train", timeout=5)
    assert sorted(r.tolist() for r in batch["resp"]) == [[0, 1, 2, 3], [0, 1, 7]]


@pytest.mark.parametrize(
    "shm, rows",
    [(False, 1), (True, 1), (False, 1 << 19)],  # inline frames; the arena; a bulk stream (16 MiB)
    ids=["socket", "arena", "bulk"],
)
def test_a_put_that_reaches_the_target_exactly_returns_sealed(cluster, partition, shm, rows):
    config = tqueue.ClientConfig(shm=shm, shm_min_bytes=0)
    with tqueue.Client(cluster.address, config=config) as c:
        c.create_partition(partition, target=4)
        meta = c.put(partition, {"x": torch.ones(4, rows, dtype=torch.float64)})
        assert (meta.status, meta.sealed) == ("ok", True)
        assert c.put(partition, {"x": torch.arange(1)}, if_sealed="discard").sealed
