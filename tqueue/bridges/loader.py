"""A streaming loader: a torch ``IterableDataset`` of batches from one partition or a
sequence of partitions (steps), for ``torch.utils.data.DataLoader``.

Each iterator (the main process, or each DataLoader worker) opens its own client when it
starts, so nothing crosses a fork; a client made before the fork raises
:class:`~tqueue.errors.ForkedClientError` if used in a worker. Every batch is leased from the
controller, so workers never get the same sample: with ``num_workers > 0`` the batches are
distinct across workers. A batch is acked when the next one is asked for (or the iterator
ends), that is once the consumer is done with it; a worker that dies holding a lease loses
nothing: the lease expires after ``lease_timeout`` and its samples go to the next asker. A
partition ends for the loader when it is sealed and nothing is left or leased (the
controller answers an empty batch); then the loader goes on to the next partition.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..config import ClientConfig


class StepStream(torch.utils.data.IterableDataset):
    """Batches of ``batch_size`` samples of ``fields`` from ``partitions`` in order, for
    ``task``. The last batch of a partition may be short (``pad=True`` is the controller's
    way of ending it: pad rows are dropped). ``transform(batch)``, if given, turns each
    :class:`~tqueue.Batch` into what the loader yields (default: a dict of its fields plus
    ``"_meta"``). ``partitions`` may be a callable returning the names, evaluated in the
    iterating process."""

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
    ) -> None:
        super().__init__()
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

    def __iter__(self) -> Iterator[Any]:
        from ..client import Client

        names = self.partitions() if callable(self.partitions) else self.partitions
        # a batch not acked (the consumer stopped early) returns to the task at its lease's expiry
        with Client(self.address, config=self.config) as client:
            held = None
            for partition in names:
                while True:
                    if held is not None:  # the consumer asked for more: it is done with the last
                        client.ack(held)
                        held = None
                    meta = client.get_meta(
                        partition, self.fields, self.batch_size, task=self.task, timeout=self.timeout,
                        lease_timeout=self.lease_timeout, pad=True,
                    )
                    if not meta.indexes:
                        break  # sealed, nothing left and nothing leased: the partition is done
                    real = [i for i, x in enumerate(meta.indexes) if x >= 0]
                    batch = client.get_data(meta, jagged=self.jagged)
                    held = meta
                    yield self._out(batch, real)
            if held is not None:
                client.ack(held)

    def _out(self, batch: Any, real: list[int]) -> Any:
        if self.transform is not None:
            return self.transform(batch)
        out: dict[str, Any] = {}
        keep = len(real) != len(batch.meta.indexes)
        index = torch.tensor(real, dtype=torch.int64)
        for name in self.fields:
            value = batch[name]
            if keep:
                value = value.index_select(0, index) if isinstance(value, torch.Tensor) else [value[i] for i in real]
            out[name] = value
        out["_meta"] = batch.meta
        return out


def loader(dataset: StepStream, *, num_workers: int = 0, **options: Any) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over ``dataset`` that yields its batches as they are (the
    dataset batches already): ``batch_size=None``; ``multiprocessing_context`` defaults to
    spawn where workers are used (each makes its own client)."""
    if num_workers and "multiprocessing_context" not in options:
        options["multiprocessing_context"] = "spawn"
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers, **options)
