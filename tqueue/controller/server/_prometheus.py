"""The controller's Prometheus metrics, read from one ``status()`` snapshot at scrape time
(so a scrape and ``status()`` agree), plus the staleness of served samples and the latency of
requests per message kind.

Gauges say what is now: ``tqueue_partition_samples{partition, state}`` (ready, in flight),
``tqueue_leased_samples{partition, task}``, bytes, budgets, units, parked calls, the version
and the staleness admission. Counters (``..._total``) count what happened:
``tqueue_committed_samples_total``, ``tqueue_task_samples_total{task, state}`` (consumed,
refused, expired, lost) and ``tqueue_excluded_samples_total{reason}`` over every partition the
controller has had, freed ones included (:class:`Totals`), and the same per live partition
(``tqueue_partition_..._total``). docs/operations.md lists every family as scraped, and a test
compares the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ...transport._metrics import Latency, latency_family
from ...wire import PartitionStatus, StatusReply

if TYPE_CHECKING:
    from ..model._partition import Partition

#: task names, and exclusion reasons, that get series of their own in the cumulative
#: counters; those first seen after this many are counted together under ``OTHER``
MAX_NAMES = 1000
OTHER = "(other)"
TASK_STATES = ("consumed", "refused", "expired", "lost")


class Totals:
    """Cumulative sample counts per task name and per exclusion reason, over every partition,
    so that counters outlive the partitions they count (which free themselves once consumed).

    Freed partitions' counts are kept here (:meth:`retire`, when a partition is forgotten);
    a scrape adds the live partitions' (:meth:`read`). Bounded: the first ``max_names`` task
    names and ``max_names`` reasons keep series of their own, later ones count under
    ``"(other)"``; a name, once given a series, keeps it. Reported values never decrease (a
    partition's count of a reason goes down when a failed move is undone; the counter waits
    until it is passed again)."""

    def __init__(self, max_names: int = MAX_NAMES) -> None:
        self.max_names = max_names
        self.committed = 0
        self.tasks: dict[str, list[int]] = {}  # label -> counts of freed partitions, as TASK_STATES
        self.reasons: dict[str, int] = {}  # label -> samples of freed partitions
        self._shown: dict[tuple[str, ...], int] = {}  # what scrapes reported, per series
        self._shown_live: dict[int, dict[str, int]] = {}  # the same per live partition's reason

    def task_label(self, name: str) -> str:
        if name not in self.tasks:
            if len(self.tasks) >= self.max_names:
                name = OTHER
            self.tasks.setdefault(name, [0] * len(TASK_STATES))
        return name

    def reason_label(self, reason: str) -> str:
        if reason not in self.reasons:
            if len(self.reasons) >= self.max_names:
                reason = OTHER
            self.reasons.setdefault(reason, 0)
        return reason

    def retire(self, part: Partition) -> None:
        """Keep the counts of a partition that is being forgotten."""
        self._shown_live.pop(part.uid, None)
        self.committed += part.committed
        for name, task in part.tasks.items():
            counts = self.tasks[self.task_label(name)]
            for i, state in enumerate(TASK_STATES):
                counts[i] += getattr(task, state)
        for reason, count in part.reasons.items():
            self.reasons[self.reason_label(reason)] += count

    def read(self, live: Iterable[PartitionStatus]) -> tuple[int, dict[tuple[str, str], int], dict[str, int]]:
        """Committed samples, per (task, state) and per reason: freed partitions' plus ``live``."""
        committed = self.committed
        tasks = {(name, state): counts[i] for name, counts in self.tasks.items() for i, state in enumerate(TASK_STATES)}
        reasons = dict(self.reasons)
        for p in live:
            committed += p.samples
            for name, task in p.tasks.items():
                label = self.task_label(name)
                for state in TASK_STATES:
                    tasks[(label, state)] = tasks.get((label, state), 0) + getattr(task, state)
            for reason, count in p.reasons.items():
                label = self.reason_label(reason)
                reasons[label] = reasons.get(label, 0) + count
        committed = self._monotonic(("committed",), committed)
        tasks = {key: self._monotonic(("task", *key), value) for key, value in tasks.items()}
        reasons = {key: self._monotonic(("reason", key), value) for key, value in reasons.items()}
        return committed, tasks, reasons

    def partition_reasons(self, p: PartitionStatus) -> dict[str, int]:
        """A live partition's excluded samples per reason, under the same labels as the
        counters over all partitions, and never going down either."""
        counts: dict[str, int] = {}
        for reason, count in p.reasons.items():
            label = self.reason_label(reason)
            counts[label] = counts.get(label, 0) + count
        shown = self._shown_live.setdefault(p.uid, {})
        for label, count in counts.items():
            shown[label] = max(shown.get(label, 0), count)
        return shown

    def _monotonic(self, key: tuple[str, ...], value: int) -> int:
        shown = max(self._shown.get(key, 0), value)
        self._shown[key] = shown
        return shown


_CAUSES = {"samples": "not enough ready", "memory": "memory", "staleness": "staleness"}  # label values


def families(
    st: StatusReply, *, totals: Totals, staleness: list[int], capacity: int, latency: Latency
) -> Iterator[Any]:
    """The metric families of one ``status()`` snapshot ``st`` of the controller, with what the
    snapshot lacks: the freed partitions' ``totals``, the served samples by versions behind
    (``staleness``), the cluster's ``capacity`` and the request ``latency``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield from _partitions(st.partitions, totals)
    committed, tasks, reasons = totals.read(st.partitions)
    yield CounterMetricFamily("tqueue_committed_samples", "Samples committed to partitions, all partitions", value=committed)
    per_task = CounterMetricFamily("tqueue_task_samples", "Samples by task and what became of them, all partitions", labels=["task", "state"])
    for (task, fate), value in sorted(tasks.items()):
        per_task.add_metric([task, fate], value)
    per_reason = CounterMetricFamily("tqueue_excluded_samples", "Samples never served, by reason, all partitions", labels=["reason"])
    for reason, value in sorted(reasons.items()):
        per_reason.add_metric([reason], value)
    yield from (per_task, per_reason)

    unit_bytes = GaugeMetricFamily("tqueue_unit_bytes", "Payload bytes a storage unit holds", labels=["unit"])
    unit_cap = GaugeMetricFamily("tqueue_unit_capacity_bytes", "A storage unit's budget (0: none)", labels=["unit"])
    unit_alive = GaugeMetricFamily("tqueue_unit_alive", "1 while the unit keeps its heartbeats", labels=["unit"])
    for u in st.units:
        unit_bytes.add_metric([str(u.unit_id)], u.nbytes)
        unit_cap.add_metric([str(u.unit_id)], u.capacity)
        unit_alive.add_metric([str(u.unit_id)], int(u.alive))
    yield from (unit_bytes, unit_cap, unit_alive)
    yield GaugeMetricFamily("tqueue_capacity_bytes", "The cluster's budget (0: none)", value=capacity)

    waiting = GaugeMetricFamily("tqueue_waiting", "Parked calls, by what they wait for", labels=["partition", "kind", "reason"])
    counts: dict[tuple[str, str, str], int] = {}
    for w in st.waiting:
        key: tuple[str, str, str] = (w.partition, str(w.kind), _CAUSES[w.cause])
        counts[key] = counts.get(key, 0) + 1
    for key, value in counts.items():
        waiting.add_metric(list(key), value)
    yield waiting
    yield GaugeMetricFamily("tqueue_version", "The trainer's version", value=st.version)
    yield GaugeMetricFamily("tqueue_admitted_samples", "Samples admitted by the staleness bound", value=st.admitted)
    yield GaugeMetricFamily("tqueue_admission_limit_samples", "The staleness bound's limit (-1: none)", value=st.admission_limit)
    yield _staleness(staleness)
    yield latency_family("tqueue_request_seconds", "Controller request latency by message kind (parked time included)", latency)


def _partitions(parts: list[PartitionStatus], totals: Totals) -> Iterator[Any]:
    """Each live partition's families: what it holds now, and its own counters."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    samples = GaugeMetricFamily("tqueue_partition_samples", "Samples of a partition now, by state", labels=["partition", "state"])
    leased = GaugeMetricFamily("tqueue_leased_samples", "Samples of a partition leased to a task now", labels=["partition", "task"])
    nbytes = GaugeMetricFamily("tqueue_partition_bytes", "Payload bytes a partition holds", labels=["partition"])
    sealed = GaugeMetricFamily("tqueue_partition_sealed", "1 once the partition takes no more samples", labels=["partition"])
    committed = CounterMetricFamily("tqueue_partition_committed_samples", "Samples committed to a partition", labels=["partition"])
    tasks = CounterMetricFamily("tqueue_partition_task_samples", "Samples of a partition by task and what became of them",
                                labels=["partition", "task", "state"])
    excluded = CounterMetricFamily("tqueue_partition_excluded_samples", "Samples of a partition never served, by reason",
                                   labels=["partition", "reason"])
    for p in parts:
        samples.add_metric([p.name, "ready"], p.ready)
        samples.add_metric([p.name, "in_flight"], p.in_flight)
        nbytes.add_metric([p.name], p.nbytes)
        sealed.add_metric([p.name], int(p.sealed))
        committed.add_metric([p.name], p.samples)
        for task, t in p.tasks.items():
            leased.add_metric([p.name, task], t.leased)
            for state in TASK_STATES:
                tasks.add_metric([p.name, task, state], getattr(t, state))
        for reason, value in totals.partition_reasons(p).items():
            excluded.add_metric([p.name, reason], value)
    yield from (samples, leased, nbytes, sealed, committed, tasks, excluded)


def _staleness(counts_behind: list[int]) -> Any:
    """Served samples by versions behind the trainer, as a histogram (the last bucket: 16 or more)."""
    from prometheus_client.core import HistogramMetricFamily

    stale = HistogramMetricFamily("tqueue_served_staleness", "Served samples by versions behind the trainer")
    buckets, running = [], 0
    for behind, count in enumerate(counts_behind):
        running += count
        buckets.append((str(behind) if behind < len(counts_behind) - 1 else "+Inf", running))
    stale.add_metric([], buckets, float(sum(i * c for i, c in enumerate(counts_behind))))
    return stale
