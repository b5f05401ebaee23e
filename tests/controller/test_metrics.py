"""Prometheus metrics of the controller and the units, scraped over real HTTP and checked
against ``status()``."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import tqueue


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture(scope="module")
def metered():
    with tqueue.LocalCluster(num_storage_units=2, controller={"metrics_port": 0}, storage={"metrics_port": 0}) as c:
        yield c


def test_scraped_metrics_agree_with_status(metered, partition):
    async def main():
        async with tqueue.AsyncClient(metered.address) as c:
            await c.create_partition(partition, target=6)
            await c.set_version(2)
            await c.put(partition, {"x": torch.arange(4)}, version=1)
            await c.put(partition, {"x": torch.arange(4)}, version=2)  # crosses the target: 2 over
            meta = await c.get_meta(partition, ["x"], 3, task="train", timeout=5)
            await c.ack(meta)
            leased = await c.get_meta(partition, ["x"], 2, task="train", timeout=5)
            parked = asyncio.ensure_future(c.get_meta(partition, ["x"], 7, task="other-task", timeout=60))  # 6 ready
            async def parked_there():  # the controller's own report: the call is parked
                while not [w for w in (await c.status()).waiting if w.partition == partition]:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(parked_there(), 10)
            st = await c.status()
            got = scrape(st.metrics)
            p = {x.name: x for x in st.partitions}[partition]

            def m(name, **labels):
                return got[(name, tuple(sorted(labels.items())))]

            assert m("tqueue_partition_samples", partition=partition, state="committed") == p.samples == 8
            assert m("tqueue_partition_samples", partition=partition, state="ready") == p.ready == 6
            assert m("tqueue_excluded_samples", partition=partition, reason="over target") == p.reasons["over target"] == 2
            assert m("tqueue_partition_sealed", partition=partition) == 1
            t = p.tasks["train"]
            assert m("tqueue_task_samples", partition=partition, task="train", state="consumed") == t.consumed == 3
            assert m("tqueue_task_samples", partition=partition, task="train", state="leased") == t.leased == 2
            assert m("tqueue_partition_bytes", partition=partition) == p.nbytes
            assert m("tqueue_waiting", partition=partition, kind="get_meta", reason="not enough ready") == 1
            assert m("tqueue_version") == st.version == 2
            for u in st.units:
                assert m("tqueue_unit_bytes", unit=str(u.unit_id)) == u.nbytes
                assert m("tqueue_unit_alive", unit=str(u.unit_id)) == 1
                unit = scrape(u.metrics)
                assert unit[("tqueue_unit_stored_bytes", (("unit", str(u.unit_id)),))] == u.nbytes
                assert unit[("tqueue_unit_request_seconds_count", (("kind", "Store"),))] >= 1
            # staleness: the 5 samples served were 1 (version 1) or 0 (version 2) behind
            assert m("tqueue_served_staleness_count") >= 5
            assert m("tqueue_served_staleness_bucket", le="0") < m("tqueue_served_staleness_bucket", le="1")
            assert m("tqueue_request_seconds_count", kind="GetMeta") >= 2
            assert m("tqueue_request_seconds_count", kind="Grant") >= 2
            parked.cancel()
            await asyncio.gather(parked, return_exceptions=True)
            await c.ack(leased)

    asyncio.run(main())


def test_metrics_are_off_unless_asked_for(cluster, client):
    st = client.status()
    assert st.metrics == "" and all(u.metrics == "" for u in st.units)
