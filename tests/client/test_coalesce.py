"""Coalesced puts (``ClientConfig.coalesce_puts``): concurrent puts of one client to one
partition that wait in the same turn of its loop go as one put; each caller gets its own
samples, stored, and its own failure."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

import tqueue
from tqueue.errors import FieldTypeError

from ..servers import LoopCluster

PATHS = {"socket": False, "shm": True}


def _config(shm: bool) -> tqueue.ClientConfig:
    return dataclasses.replace(tqueue.ClientConfig(), coalesce_puts=True, shm=shm, shm_min_bytes=0)


def _sample(i: int) -> dict:
    return {
        "ids": torch.full((3, 5), i, dtype=torch.int64),  # dense
        "resp": [torch.arange(i + 1, dtype=torch.float32) for _ in range(3)],  # jagged
        "text": [f"caller {i} row {r}" for r in range(3)],  # objects
        "reward": torch.tensor([i, i + 0.5, i + 0.25]),
    }


@pytest.mark.parametrize("path", list(PATHS))
def test_concurrent_puts_go_as_one_and_each_caller_gets_its_own_samples(cluster, partition, path):
    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(PATHS[path])) as c:
            metas = await asyncio.gather(*(c.put(partition, _sample(i), groups=f"g{i}", version=i) for i in range(8)))
            stores = c.stats.puts
            got = [await c.get_data(m) for m in metas]
            return metas, stores, got

    metas, stores, got = asyncio.run(main())
    assert stores < 8  # at least two of them went as one (all 8 wait in one turn: one store)
    indexes = [i for m in metas for i in m.indexes]
    assert sorted(indexes) == list(range(24)) and all(len(m) == 3 for m in metas)
    for i, (m, batch) in enumerate(zip(metas, got)):
        assert m.status == "ok" and m.fates is None
        assert m.groups == [f"g{i}"] * 3 and m.versions == [i] * 3
        assert torch.equal(batch["ids"], torch.full((3, 5), i, dtype=torch.int64))
        assert [t.tolist() for t in batch["resp"]] == [list(range(i + 1))] * 3
        assert list(batch["text"]) == [f"caller {i} row {r}" for r in range(3)]
        assert batch["reward"].tolist() == [i, i + 0.5, i + 0.25]


def test_puts_of_other_fields_or_shapes_go_apart_and_each_succeeds(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(False)) as c:
            return await asyncio.gather(
                c.put(partition, {"x": torch.zeros(2, 4)}),
                c.put(partition, {"x": torch.ones(2, 4)}),
                c.put(f"{partition}-b", {"x": torch.zeros(2, 7)}),
                c.put(partition, {"x": torch.ones(1, 4), "y": ["a"]}),
            )

    a, b, other, wider = asyncio.run(main())
    assert sorted(a.indexes + b.indexes + wider.indexes) == list(range(5))
    assert other.partition == f"{partition}-b" and other.indexes == [0, 1]
    assert wider.fields == ["x", "y"]


def test_a_caller_whose_data_is_refused_fails_alone(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(False)) as c:
            return await asyncio.gather(
                c.put(partition, {"o": ["fine"]}),
                c.put(partition, {"o": [object()]}),
                c.put(partition, {"o": ["also fine"]}),
                return_exceptions=True,
            )

    ok1, bad, ok2 = asyncio.run(main())
    assert isinstance(bad, FieldTypeError) and "field 'o'" in str(bad)
    assert sorted(ok1.indexes + ok2.indexes) == [0, 1]


def test_a_put_that_crosses_the_target_trims_the_callers_past_it(cluster, partition):
    """A target of 10: four puts of 4 as one put keep 10 samples; the first two callers'
    puts are whole ("ok"), the third keeps 2 ("trimmed", its fates per sample), and the fourth,
    wholly past the target, is "aborted" with no samples, as a put of its own would be (found
    running the whole suite with coalescing on: it said "trimmed", every fate "aborted")."""

    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(False)) as c:
            await c.create_partition(partition, target=10)
            return await asyncio.gather(*(c.put(partition, {"x": torch.full((4,), i)}, if_sealed="discard") for i in range(4)))

    metas = asyncio.run(main())
    assert [m.status for m in metas] == ["ok", "ok", "trimmed", "aborted"]
    assert metas[2].fates == ["ok", "ok", "aborted", "aborted"]
    assert (metas[3].indexes, metas[3].units, metas[3].fates) == ([], [], None)
    assert all(m.sealed for m in metas)


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "alone"])
def test_callers_past_the_target_are_recycled_as_puts_of_their_own(cluster, partition, coalesce):
    """A target of 10 with ``recycle_to``: of four puts of 4, the third is trimmed and the
    fourth, wholly past the target, is recycled into the next partition as partial samples,
    coalesced or not, with the same counts in ``status().reasons`` (before, the coalesced
    fourth caller was stored past the target and aborted: its rollout was lost to the next step)."""
    late = f"{partition}-next"

    async def main():
        config = dataclasses.replace(_config(False), coalesce_puts=coalesce)
        async with tqueue.AsyncClient(cluster.address, config=config) as c:
            await c.create_partition(partition, target=10, recycle_to=late)
            puts = [c.put(partition, {"x": torch.full((4,), i)}, if_sealed="discard") for i in range(4)]
            metas = await (asyncio.gather(*puts) if coalesce else _one_by_one(puts))
            st = {p.name: p for p in (await c.status()).partitions}
            recycled = await c.get_data(metas[3])
            return metas, st, recycled, c.stats.puts

    metas, st, recycled, stores = asyncio.run(main())
    assert [m.status for m in metas] == ["ok", "ok", "trimmed", "recycled"]
    assert metas[2].fates == ["ok", "ok", "aborted", "aborted"]
    assert (metas[3].partition, metas[3].recycled_to, metas[3].indexes) == (late, late, [0, 1, 2, 3])
    assert recycled["x"].tolist() == [3] * 4
    assert st[partition].reasons == {"over target": 2, "recycled after seal": 4}  # sealed once the third committed
    assert (st[late].samples, st[late].reasons) == (4, {})
    assert stores == (2 if coalesce else 4)  # the three callers up to the target as one put, the fourth apart


async def _one_by_one(puts):
    return [await p for p in puts]


def test_a_put_to_a_sealed_partition_is_aborted_for_every_caller(cluster, partition):
    """Three coalesced puts to a sealed partition: each caller that chose ``if_sealed="discard"``
    gets its own "aborted" meta, and the one that did not gets PartitionSealedError."""

    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(False)) as c:
            await c.create_partition(partition, target=2)
            await c.put(partition, {"x": torch.arange(2)})
            puts = [c.put(partition, {"x": torch.arange(2)}, if_sealed="discard") for _ in range(2)]
            puts.append(c.put(partition, {"x": torch.arange(3)}))
            return await asyncio.gather(*puts, return_exceptions=True)

    *metas, refused = asyncio.run(main())
    assert [(m.status, m.indexes) for m in metas] == [("aborted", [])] * 2
    assert isinstance(refused, tqueue.PartitionSealedError)
    assert f"put of 3 sample(s) (fields ['x']) to partition {partition!r} stored nothing" in str(refused)


def test_a_request_made_after_coalesced_puts_goes_after_them(cluster, partition):
    """Puts waiting in the loop's turn for company go out at once when the client makes
    another request, and before it: a seal made after them finds them put (before, the seal
    went first and every one of them was refused). tests/controller/test_admission.py, run
    with TQUEUE_COALESCE_PUTS=1, holds the same for a status after a put that waits."""

    async def main():
        async with tqueue.AsyncClient(cluster.address, config=_config(False)) as c:
            puts = [asyncio.ensure_future(c.put(partition, _sample(i))) for i in range(4)]
            await asyncio.sleep(0)  # the puts are made: each waits for this turn's company
            assert c.stats.puts == 0
            await c.seal(partition)
            metas = await asyncio.gather(*puts, return_exceptions=True)
            status = {p.name: p for p in (await c.status()).partitions}[partition]
            return metas, status

    metas, status = asyncio.run(main())
    assert [m.status for m in metas] == ["ok"] * 4, metas
    assert status.sealed and status.ready == 12


def test_puts_that_every_caller_gave_up_on_are_withdrawn(cluster, partition):
    """Puts waiting for memory at the controller, coalesced, all cancelled: withdrawn, as one
    put alone is (nothing is stored, and memory freed later is not granted to them)."""
    small = dataclasses.replace(_config(False), put_timeout=30.0)
    with LoopCluster(num_storage_units=1, controller={"capacity_bytes": 4 << 20}) as own:

        async def bounded():
            async with tqueue.AsyncClient(own.address, config=small) as c:
                await c.put(f"{partition}-fill", {"x": torch.zeros(1, 896 * 1024)})  # 3.5 MiB of 4
                # 3 x 256 KiB, as one put: 768 KiB, more than is free, less than the whole
                puts = [asyncio.ensure_future(c.put(partition, {"x": torch.zeros(1, 64 * 1024)})) for _ in range(3)]
                for _ in range(1000):  # until the controller holds the coalesced put, parked for memory
                    if any(w.partition == partition for w in (await c.status()).waiting):
                        break
                else:
                    raise AssertionError("the put never waited at the controller")
                for p in puts:
                    p.cancel()
                results = await asyncio.gather(*puts, return_exceptions=True)
                # the last caller to give up waited for the coalesced put's withdrawal
                assert not [t for t in c._puts._tasks if not t.done()], "the coalesced put went on after every caller gave up"
                parked = [w for w in (await c.status()).waiting if w.partition == partition]
                await c.clear(f"{partition}-fill")  # memory for them now: nothing may take it
                await c.put(f"{partition}-fill", {"x": torch.zeros(1, 896 * 1024)})  # and the memory is all there
                after = await c.status()
                held = [p.samples for p in after.partitions if p.name == partition]
                return results, parked, held, c.stats.puts

        results, parked, held, stores = asyncio.run(bounded())
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert parked == []  # withdrawn from the controller once every caller gave up
    assert held in ([], [0]) and stores == 2  # none of theirs was stored: the filler, twice


def test_on_by_default_and_off_each_put_goes_alone(cluster, partition, monkeypatch):
    """Coalescing is the default (ClientConfig and the environment's); TQUEUE_COALESCE_PUTS=0
    or ``coalesce_puts=False`` sends each put alone."""
    assert tqueue.ClientConfig().coalesce_puts and tqueue.ClientConfig.from_env().coalesce_puts
    monkeypatch.setenv("TQUEUE_COALESCE_PUTS", "0")
    assert not tqueue.ClientConfig.from_env().coalesce_puts

    async def main(config):
        async with tqueue.AsyncClient(cluster.address, config=config) as c:
            metas = await asyncio.gather(*(c.put(partition, _sample(i)) for i in range(4)))
            return sorted(i for m in metas for i in m.indexes), c.stats.puts

    assert asyncio.run(main(tqueue.ClientConfig.from_env())) == (list(range(12)), 4)
    assert asyncio.run(main(tqueue.ClientConfig()))[1] == 1  # four waiting in one turn: one put


@pytest.mark.parametrize("path", list(PATHS))
def test_a_unit_killed_under_a_coalesced_put_costs_no_caller_its_samples(path):
    """The unit a coalesced put was granted is SIGKILLed just before the put's bytes go to it:
    the put is placed again on the other unit, and every caller gets its own samples, stored
    once and exact."""
    with tqueue.LocalCluster(2) as cluster:

        async def main():
            async with tqueue.AsyncClient(cluster.address, config=_config(PATHS[path])) as c:
                conns = c._conns
                pick = conns.choose
                killed: list[int] = []

                def choose(info):
                    route = pick(info)
                    store = route.store

                    async def store_after_a_kill(put, msg):
                        if not killed:  # the first store of the run: its unit dies first
                            pid = cluster.pids[1 + cluster.unit_addresses.index(info.address)]
                            proc = next(p for p in cluster._procs if p.pid == pid)
                            proc.kill()
                            await asyncio.to_thread(proc.wait, 10)
                            killed.append(info.unit_id)
                        return await store(put, msg)

                    route.store = store_after_a_kill
                    return route

                conns.choose = choose
                metas = await asyncio.gather(*(c.put("p", _sample(i), timeout=60) for i in range(8)))
                got = [await c.get_data(m) for m in metas]
                status = next(p for p in (await c.status()).partitions if p.name == "p")
                return metas, got, killed, status, c.stats.puts

        metas, got, killed, status, stores = asyncio.run(main())
    assert len(killed) == 1 and stores < 8  # the callers went together
    # the dropped grant's indexes are not given out again: the put is stored once, under new ones
    assert len({i for m in metas for i in m.indexes}) == 24 and all(len(m) == 3 for m in metas)
    assert status.samples == status.ready == 24 and status.lost == 0
    for i, (m, batch) in enumerate(zip(metas, got)):
        assert m.status == "ok" and set(m.units) != {killed[0]}
        assert torch.equal(batch["ids"], torch.full((3, 5), i, dtype=torch.int64))
        assert [t.tolist() for t in batch["resp"]] == [list(range(i + 1))] * 3
        assert list(batch["text"]) == [f"caller {i} row {r}" for r in range(3)]
