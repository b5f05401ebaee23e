"""Prometheus metrics of the controller and the units, scraped over real HTTP: values agree
with ``status()``; cumulative counts are counters that outlive their partitions, bounded in
their labels; the URLs name the advertised host, not a wildcard; docs/operations.md lists
every metric as a scrape shows it."""

from __future__ import annotations

import asyncio
import pathlib
import re
import types
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import tqueue
from tqueue.controller.server._prometheus import OTHER, Totals
from tqueue.wire import PartitionStatus, TaskStatus

DOCS = pathlib.Path(__file__).parents[2] / "docs" / "operations.md"


def scrape_text(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def kinds(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Each family as a scrape shows it: its name (a counter's with ``_total``), type and labels."""
    out = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        out[name] = (family.type, frozenset(labels))
    return out


@pytest.fixture(scope="module")
def metered():
    with tqueue.LocalCluster(num_storage_units=2, controller={"metrics_port": 0}, storage={"metrics_port": 0}) as c:
        yield c


@asynccontextmanager
async def busy(c: tqueue.AsyncClient, partition: str) -> AsyncIterator[Any]:
    """A partition with samples committed, excluded (over target), consumed and leased, and a
    get_meta parked on it, so that every family has samples; yields the leased meta."""
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
    try:
        yield leased
    finally:
        parked.cancel()
        await asyncio.gather(parked, return_exceptions=True)
        await c.ack(leased)


def test_scraped_metrics_agree_with_status(metered, partition):
    async def main():
        async with tqueue.AsyncClient(metered.address) as c, busy(c, partition):
            st = await c.status()
            got = scrape(st.metrics)
            p = {x.name: x for x in st.partitions}[partition]

            def m(name, **labels):
                return got[(name, tuple(sorted(labels.items())))]

            assert m("tqueue_partition_committed_samples_total", partition=partition) == p.samples == 8
            assert m("tqueue_partition_samples", partition=partition, state="ready") == p.ready == 6
            assert m("tqueue_partition_excluded_samples_total", partition=partition, reason="over target") == 2
            assert p.reasons["over target"] == 2
            assert m("tqueue_partition_sealed", partition=partition) == 1
            t = p.tasks["train"]
            assert m("tqueue_partition_task_samples_total", partition=partition, task="train", state="consumed") == t.consumed == 3
            assert m("tqueue_leased_samples", partition=partition, task="train") == t.leased == 2
            assert m("tqueue_partition_bytes", partition=partition) == p.nbytes
            assert m("tqueue_waiting", partition=partition, kind="get_meta", reason="not enough ready") == 1
            assert m("tqueue_version") == st.version == 2
            # the counters over all partitions hold at least this one's
            assert m("tqueue_task_samples_total", task="train", state="consumed") >= 3
            assert m("tqueue_excluded_samples_total", reason="over target") >= 2
            assert m("tqueue_committed_samples_total") >= 8
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

    asyncio.run(main())


def test_counts_are_counters_that_outlive_their_partitions(metered, partition):
    task = f"task-{partition}"  # a task name no other test uses
    with tqueue.Client(metered.address) as c:
        url = c.status().metrics
        assert kinds(url)["tqueue_task_samples_total"][0] == "counter"
        before = scrape(url)
        for step in range(2):  # two steps, each consumed and freed
            name = f"{partition}-{step}"
            c.create_partition(name, tasks=[task])
            c.put(name, {"x": torch.arange(5)})
            c.seal(name)
            meta = c.get_meta(name, ["x"], 3, task=task, lease_timeout=0.2, timeout=10)
            c.fail(meta.select([0]), reason="bad reward")  # one sample excluded
            # the lease expires: its two other samples come back
            again = c.get_meta(name, ["x"], 4, task=task, timeout=10)
            assert len(again.indexes) == 4
            c.ack(again)
            assert name not in [p.name for p in c.status().partitions]  # freed
        after = scrape(url)

    def grew(sample, **labels):
        key = (sample, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert grew("tqueue_task_samples_total", task=task, state="consumed") == 8
    assert grew("tqueue_task_samples_total", task=task, state="expired") == 4
    assert grew("tqueue_task_samples_total", task=task, state="refused") == 0
    assert grew("tqueue_excluded_samples_total", reason="failed: bad reward") == 2
    assert grew("tqueue_committed_samples_total") == 10
    # the per-partition series went with their partitions
    assert not [key for key in after if dict(key[1]).get("partition", "").startswith(partition)]


def _part(tasks: dict[str, dict[str, int]], reasons: dict[str, int], committed: int = 0) -> Any:
    """What Totals.retire reads of a partition."""
    return types.SimpleNamespace(
        uid=0, committed=committed, reasons=reasons,
        tasks={name: types.SimpleNamespace(**{"consumed": 0, "refused": 0, "expired": 0, "lost": 0, **t}) for name, t in tasks.items()},
    )


def _live(tasks: dict[str, dict[str, int]], reasons: dict[str, int], samples: int = 0) -> PartitionStatus:
    return PartitionStatus(
        name="p", uid=1, samples=samples, fields={}, nbytes=0, reasons=reasons,
        tasks={name: TaskStatus(**{"leased": 0, "consumed": 0, **t}) for name, t in tasks.items()},
    )


def test_totals_keep_freed_counts_bounded_and_never_go_down():
    totals = Totals(max_names=2)
    totals.retire(_part({"a": {"consumed": 5}, "b": {"expired": 1}}, {"cleared": 2}, committed=7))
    totals.retire(_part({"c": {"consumed": 3}, "a": {"consumed": 1}}, {"failed: x": 1, "lost": 4}, committed=4))
    committed, tasks, reasons = totals.read([_live({"d": {"consumed": 2}}, {"lost": 1}, samples=3)])
    assert committed == 14
    # a and b keep their series; c and d, first seen past the bound, count together
    assert tasks[("a", "consumed")] == 6 and tasks[("b", "expired")] == 1
    assert tasks[(OTHER, "consumed")] == 5
    assert {name for name, _ in tasks} == {"a", "b", OTHER}
    assert reasons == {"cleared": 2, "failed: x": 1, OTHER: 5}
    # a live count that goes down (a failed move undone) does not take the counter down
    _, _, reasons = totals.read([_live({}, {"cleared": 3})])
    assert reasons["cleared"] == 5
    _, _, reasons = totals.read([_live({}, {"cleared": 1})])
    assert reasons["cleared"] == 5
    # so do a live partition's own, under the same bounded labels
    assert totals.partition_reasons(_live({}, {"cleared": 3, "moved": 2})) == {"cleared": 3, OTHER: 2}
    assert totals.partition_reasons(_live({}, {"cleared": 1})) == {"cleared": 3, OTHER: 2}


def test_metrics_urls_name_the_advertised_host_not_the_wildcard():
    with tqueue.LocalCluster(
        num_storage_units=1, host="0.0.0.0",
        controller={"metrics_port": 0, "advertise": "127.0.0.1"},
        storage={"metrics_port": 0, "advertise": "127.0.0.1"},
    ) as cluster, tqueue.Client(cluster.address) as c:
        st = c.status()
        assert cluster.address.startswith("tcp://127.0.0.1:")
        urls = [st.metrics] + [u.metrics for u in st.units]
        for url in urls:
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
            assert "tqueue_" in scrape_text(url)  # and served there: bound to the wildcard


def documented() -> tuple[dict[str, tuple[str, frozenset[str]]], dict[str, tuple[str, frozenset[str]]]]:
    """The controller's and the units' tables of docs/operations.md: name -> (type, labels)."""
    text = DOCS.read_text()
    section = text[text.index("## Metrics (Prometheus)"):]
    section = section[: section.index("\n## ", 1)]
    tables = []
    for title in ("Controller:", "Each unit:"):
        rows = section[section.index(title):].split("\n\n")[1].splitlines()[2:]
        table = {}
        for row in rows:
            names, kind, labels = (cell.strip() for cell in row.strip("|").split("|")[:3])
            label_set = frozenset(x.strip() for x in re.sub(r"\([^)]*\)", "", labels).split(",") if x.strip())
            for name in re.findall(r"`([a-z_]+)`", names):
                table[name] = (kind, label_set)
        tables.append(table)
    return tables[0], tables[1]


def test_the_docs_list_every_metric_as_scraped(metered, partition):
    controller, unit = documented()

    async def main():
        async with tqueue.AsyncClient(metered.address) as c, busy(c, partition):
            st = await c.status()
            assert kinds(st.metrics) == controller
            for u in st.units:
                assert kinds(u.metrics) == unit

    asyncio.run(main())


def test_metrics_are_off_unless_asked_for(cluster, client):
    st = client.status()
    assert st.metrics == "" and all(u.metrics == "" for u in st.units)
