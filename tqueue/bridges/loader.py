"""A streaming loader: a torch ``IterableDataset`` of batches from one partition or a
sequence of partitions (steps), for ``torch.utils.data.DataLoader``.

Two sides. The *leasing* side runs where the dataset is iterated: in each DataLoader worker,
or in the trainer's process when there are none. It opens its own client there (nothing
crosses a fork; a client made before the fork raises
:class:`~tqueue.errors.ForkedClientError` if used in a worker), leases batches with
``get_meta(pad=True)``, fetches them and never acks. The *trainer's* side runs in the
trainer's process, on what the DataLoader hands over, and owns the acks:

* a batch carries its lease (``StepBatch.meta``) to the trainer's process;
* it is acked there, when the trainer asks for the next batch (``ack="next"``) or when the
  trainer says so (``stream.ack(batch)``; ``ack="manual"``), never by a worker, so a batch
  prefetched by a worker is not acked before the trainer had it;
* the trainer's side renews a batch's lease as it hands it over: a batch whose lease lapsed
  while it waited in a worker's queue is dropped there (its samples were served again);
* ``end_of_step`` is set on the last batch the trainer gets from a partition.

So every sample reaches the trainer once. When the trainer dies, what it had not acked (the
batch it held, those its workers had leased) returns at its lease's expiry to the next
trainer. When a worker dies, the batches it had handed over stay with the trainer's side
(which acks them), and the one it held undelivered returns at its lease's expiry.

A partition ends for the loader when it is sealed and nothing is left or leased (the
controller answers an empty batch); then the loader goes on to the next partition.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from ..client._ask import wire_meta
from ..config import ClientConfig
from ..errors import InvalidArgumentError
from ..wire import BatchMeta

if TYPE_CHECKING:
    from ..client import Client

log = logging.getLogger(__name__)

AckMode = Literal["next", "manual"]
ACK_MODES = ("next", "manual")


@dataclasses.dataclass(eq=False)
class StepBatch:
    """One batch as the trainer gets it: ``data`` (what ``transform`` made of the batch, or a
    dict of its fields plus ``"_meta"``), ``meta`` (its samples, without pad rows, and its
    lease) and ``end_of_step`` (True on the last batch the trainer gets from the partition).
    ``batch[key]`` is ``batch.data[key]``."""

    data: Any
    meta: BatchMeta
    end_of_step: bool = False

    def __getitem__(self, key: Any) -> Any:
        return self.data[key]


class StepStream(torch.utils.data.IterableDataset[StepBatch]):
    """Batches of ``batch_size`` samples of ``fields`` from ``partitions`` in order, for
    ``task``, as :class:`StepBatch` objects. The last batch of a partition may be short (the
    controller pads it; pad rows are dropped before anything sees the batch).
    ``transform(batch)``, if given, turns each :class:`~tqueue.Batch` (pad rows gone) into
    the batch's ``data``, in the worker. ``partitions`` may be a callable returning the
    names, evaluated in the iterating process.

    ``ack="next"``: a batch is acked when the trainer asks for the next one (or the stream
    ends); a trainer that stops early (``break``, an exception) leaves its last batch
    unacked, and it returns at its lease's expiry. ``ack="manual"``: only
    :meth:`ack` acks. ``lease_timeout`` must cover a batch's wait in the workers' queues
    and, from the moment it is handed over, the trainer's time with it."""

    def __init__(
        self,
        address: str,
        partitions: Sequence[str] | Callable[[], Iterable[str]],
        fields: Sequence[str],
        batch_size: int,
        *,
        task: str = "train",
        config: ClientConfig | None = None,
        jagged: Any = "list",
        lease_timeout: float = 60.0,
        timeout: float = math.inf,
        transform: Callable[[Any], Any] | None = None,
        ack: AckMode = "next",
    ) -> None:
        super().__init__()
        if ack not in ACK_MODES:
            raise InvalidArgumentError(f"ack must be one of {ACK_MODES}, got {ack!r}")
        self.address = address
        self.partitions = partitions
        self.fields = list(fields)
        self.batch_size = batch_size
        self.task = task
        self.config = config
        self.jagged = jagged
        self.lease_timeout = lease_timeout
        self.timeout = timeout
        self.transform = transform
        self.ack_mode: AckMode = ack
        self._trainer: _Trainer | None = None  # the trainer's side, in the process that made it

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_trainer"] = None  # a worker gets the settings, not the trainer's client
        return state

    def __iter__(self) -> Iterator[StepBatch]:
        if torch.utils.data.get_worker_info() is not None:
            return self._worker()
        trainer = self._side()  # no workers: this process leases and trains
        return trainer.deliver(self._leases(trainer.client), fresh=True)

    def ack(self, batch: StepBatch | BatchMeta) -> None:
        """Ack a batch the trainer is done with (from the trainer's process). Acking twice
        is harmless; an ack after the lease expired counts nothing (its samples were
        served again)."""
        self._side().ack(batch.meta if isinstance(batch, StepBatch) else batch)

    def close(self) -> None:
        """Close the trainer's side's client (batches it holds return at their leases'
        expiry). The stream can be iterated again afterwards."""
        if self._trainer is not None:
            self._trainer.client.close()
            self._trainer = None

    def _side(self) -> _Trainer:
        if self._trainer is None or self._trainer.pid != os.getpid():
            self._trainer = _Trainer(self)
        return self._trainer

    def _worker(self) -> Iterator[StepBatch]:
        from ..client import Client

        with Client(self.address, config=self.config) as client:
            yield from self._leases(client)

    def _leases(self, client: Client) -> Iterator[StepBatch]:
        """Leased batches, in partition order; none is acked here."""
        names = self.partitions() if callable(self.partitions) else self.partitions
        for partition in names:
            while True:
                meta = client.get_meta(
                    partition, self.fields, self.batch_size, task=self.task, timeout=self.timeout,
                    lease_timeout=self.lease_timeout, pad=True,
                )
                if not meta.indexes:
                    break  # sealed, nothing left and nothing leased: the partition is done
                if meta.pads:
                    meta = meta.select([i for i, x in enumerate(meta.indexes) if x >= 0])
                batch = client.get_data(meta, jagged=self.jagged)
                yield StepBatch(self._out(batch), wire_meta(meta, "StepLoader"))

    def _out(self, batch: Any) -> Any:
        if self.transform is not None:
            return self.transform(batch)
        out: dict[str, Any] = {name: batch[name] for name in self.fields}
        out["_meta"] = batch.meta
        return out


class _Trainer:
    """The trainer's side of a stream, in the trainer's process: its client, the batches
    handed over and not acked yet (by lease), and the partitions whose last batch was."""

    def __init__(self, stream: StepStream) -> None:
        from ..client import Client

        self.client = Client(stream.address, config=stream.config)
        self.pid = os.getpid()
        self.mode = stream.ack_mode
        self.lease_timeout = stream.lease_timeout
        self.held: dict[int, BatchMeta] = {}
        self.ended: set[int] = set()  # uids of partitions whose last batch is held

    def deliver(self, source: Iterator[StepBatch], *, fresh: bool) -> Iterator[StepBatch]:
        """Hand ``source``'s batches to the trainer, acking each as the mode says.
        ``fresh``: leased in this process just now (no queue to wait in)."""
        previous: StepBatch | None = None
        while True:
            if previous is not None and self.mode == "next":
                self.ack(previous.meta)  # the trainer asks for more: it is done with the last
            previous = None
            if self.mode == "manual":
                self._check_held()
            try:
                item = next(source)
            except StopIteration:
                return
            if self._take(item, fresh):
                previous = item
                yield item

    def ack(self, meta: BatchMeta) -> None:
        self.client.ack(meta)
        self.held.pop(meta.lease, None)
        uid = meta.partition_uid
        if uid in self.ended and not any(m.partition_uid == uid for m in self.held.values()):
            self.ended.discard(uid)

    def _take(self, item: StepBatch, fresh: bool) -> bool:
        """Hold a batch for the trainer; False if its lease lapsed on the way."""
        meta = item.meta
        if not fresh and not math.isinf(self.lease_timeout):
            try:  # a fresh term from now; a lapsed lease is no longer held
                self.client.renew(meta, lease_timeout=self.lease_timeout)
            except InvalidArgumentError as exc:
                log.warning(
                    "a batch of %d samples of partition %r is dropped: its lease lapsed before the trainer "
                    "asked for it, and its samples are served again (a lease_timeout of %s s is shorter "
                    "than the wait in the workers' queues): %s",
                    len(meta.indexes), meta.partition, self.lease_timeout, exc,
                )
                return False
        self.held[meta.lease] = meta
        item.end_of_step = bool(meta.sealed) and self._last(meta)
        if item.end_of_step:
            self.ended.add(meta.partition_uid)
        return True

    def _last(self, meta: BatchMeta) -> bool:
        """Whether nothing of ``meta``'s partition can come after it: the partition is
        sealed with no put in flight, and every sample that is not acked, refused or
        excluded is held here (asked of the controller's status)."""
        st = self.client.status()
        part = next((p for p in st.partitions if p.uid == meta.partition_uid), None)
        if part is None:
            return True  # cleared under the stream: nothing more comes
        task = part.tasks.get(cast(str, meta.task))
        if task is None:
            return False
        held = sum(len(m.indexes) for m in self.held.values() if m.partition_uid == meta.partition_uid)
        unleased = part.ready - task.consumed - task.refused - task.leased
        return part.sealed and not part.in_flight and unleased <= 0 and task.leased <= held

    def _check_held(self) -> None:
        stuck = [m for m in self.held.values() if m.partition_uid in self.ended]
        if stuck:
            raise InvalidArgumentError(
                f"{len(stuck)} batches of partition {stuck[0].partition!r} are not acked, and its last batch "
                f"was handed over: the loader goes on to the next partition once they are acked "
                f"(stream.ack(batch)); asking for more first would wait for their leases to lapse"
            )


class _StepLoader(torch.utils.data.DataLoader[StepBatch]):
    """A DataLoader whose iterator, with workers, passes their batches through the stream's
    trainer side (acks, lapsed leases, ``end_of_step``)."""

    def __iter__(self) -> Iterator[StepBatch]:  # type: ignore[override]
        source = super().__iter__()
        if self.num_workers == 0:
            return cast(Iterator[StepBatch], source)  # the stream's own iterator runs here
        return cast(StepStream, self.dataset)._side().deliver(cast(Iterator[StepBatch], source), fresh=False)


def loader(dataset: StepStream, *, num_workers: int = 0, **options: Any) -> torch.utils.data.DataLoader[StepBatch]:
    """A ``DataLoader`` over ``dataset`` that yields its :class:`StepBatch` objects as they
    are (``batch_size=None``), acked in the trainer's process. With workers,
    ``multiprocessing_context`` defaults to spawn (each makes its own client) and
    ``in_order`` to False: a worker waiting for a partition's end waits for the acks of
    batches another worker leased, which must not queue behind it."""
    if num_workers:
        options.setdefault("multiprocessing_context", "spawn")
        options.setdefault("in_order", False)
    return _StepLoader(dataset, batch_size=None, num_workers=num_workers, **options)
