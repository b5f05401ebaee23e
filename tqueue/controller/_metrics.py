"""The controller's Prometheus metrics, read from one ``status()`` snapshot at scrape time
(so a scrape and ``status()`` agree), plus the staleness of served samples and the latency of
requests per message kind.

Names: ``tqueue_partition_samples{partition, state}``, ``tqueue_task_samples{partition, task,
state}``, ``tqueue_excluded_samples{partition, reason}`` (aborted, discarded, lost, ...),
``tqueue_partition_bytes``, ``tqueue_unit_bytes{unit}``, ``tqueue_unit_capacity_bytes``,
``tqueue_unit_alive``, ``tqueue_waiting{partition, kind, reason}``, ``tqueue_version``,
``tqueue_admitted_samples`` / ``tqueue_admission_limit_samples``,
``tqueue_served_staleness`` (a histogram of versions behind, per served sample) and
``tqueue_request_seconds{kind}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..transport._metrics import latency_family
from ..wire import StatusRequest

if TYPE_CHECKING:
    from ._server import Controller


def _reason(kind: str, text: str) -> str:
    """A waiter's reason as a label of few values (the text has counts in it)."""
    if kind == "get_meta":
        return "not enough ready"
    text = text.lower()
    if "memory" in text or "capacity" in text or "budget" in text:
        return "memory"
    if "stale" in text or "version" in text or "admission" in text:
        return "staleness"
    return "other"


def families(controller: Controller) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    st = controller._status(b"", StatusRequest(), [])
    samples = GaugeMetricFamily("tqueue_partition_samples", "Samples of a partition by state", labels=["partition", "state"])
    tasks = GaugeMetricFamily("tqueue_task_samples", "Samples of a partition by task and state", labels=["partition", "task", "state"])
    excluded = GaugeMetricFamily("tqueue_excluded_samples", "Samples never served, by reason", labels=["partition", "reason"])
    nbytes = GaugeMetricFamily("tqueue_partition_bytes", "Payload bytes a partition holds", labels=["partition"])
    sealed = GaugeMetricFamily("tqueue_partition_sealed", "1 once the partition takes no more samples", labels=["partition"])
    for p in st.partitions:
        for state, value in (("committed", p.samples), ("ready", p.ready), ("excluded", p.excluded),
                             ("in_flight", p.in_flight), ("lost", p.lost)):
            samples.add_metric([p.name, state], value)
        for task, t in p.tasks.items():
            for state, value in (("leased", t.leased), ("consumed", t.consumed), ("refused", t.refused),
                                 ("expired", t.expired), ("lost", t.lost)):
                tasks.add_metric([p.name, task, state], value)
        for reason, value in p.reasons.items():
            excluded.add_metric([p.name, reason], value)
        nbytes.add_metric([p.name], p.nbytes)
        sealed.add_metric([p.name], int(p.sealed))
    yield from (samples, tasks, excluded, nbytes, sealed)

    unit_bytes = GaugeMetricFamily("tqueue_unit_bytes", "Payload bytes a storage unit holds", labels=["unit"])
    unit_cap = GaugeMetricFamily("tqueue_unit_capacity_bytes", "A storage unit's budget (0: none)", labels=["unit"])
    unit_alive = GaugeMetricFamily("tqueue_unit_alive", "1 while the unit keeps its heartbeats", labels=["unit"])
    for u in st.units:
        unit_bytes.add_metric([str(u.unit_id)], u.nbytes)
        unit_cap.add_metric([str(u.unit_id)], u.capacity)
        unit_alive.add_metric([str(u.unit_id)], int(u.alive))
    yield from (unit_bytes, unit_cap, unit_alive)
    yield GaugeMetricFamily("tqueue_capacity_bytes", "The cluster's budget (0: none)", value=controller.config.capacity_bytes)

    waiting = GaugeMetricFamily("tqueue_waiting", "Parked calls, by what they wait for", labels=["partition", "kind", "reason"])
    counts: dict[tuple[str, str, str], int] = {}
    for w in st.waiting:
        key: tuple[str, str, str] = (w.partition, str(w.kind), _reason(w.kind, w.reason))
        counts[key] = counts.get(key, 0) + 1
    for key, value in counts.items():
        waiting.add_metric(list(key), value)
    yield waiting
    yield GaugeMetricFamily("tqueue_version", "The trainer's version", value=st.version)
    yield GaugeMetricFamily("tqueue_admitted_samples", "Samples admitted by the staleness bound", value=st.admitted)
    yield GaugeMetricFamily("tqueue_admission_limit_samples", "The staleness bound's limit (-1: none)", value=st.admission_limit)

    counts_behind = controller.s.staleness
    stale = HistogramMetricFamily("tqueue_served_staleness", "Served samples by versions behind the trainer")
    buckets, running = [], 0
    for behind, count in enumerate(counts_behind.tolist()):
        running += count
        buckets.append((str(behind) if behind < len(counts_behind) - 1 else "+Inf", running))
    total = float(sum(i * c for i, c in enumerate(counts_behind.tolist())))
    stale.add_metric([], buckets, total)
    yield stale
    yield latency_family("tqueue_request_seconds", "Controller request latency by message kind (parked time included)",
                         controller._server.latency)
