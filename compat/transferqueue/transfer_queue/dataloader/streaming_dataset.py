"""``StreamingDataset``: an ``IterableDataset`` of ``(TensorDict, BatchMeta)`` micro-batches
read from one partition for one task and data-parallel rank, as TransferQueue's.

The client is made lazily in the process that iterates (a ``DataLoader`` worker makes its
own), from ``config.controller.zmq_info``: the tqueue controller's address that ``init``
recorded. The default fetch waits for its samples at the controller (a parked request, up to
``STREAM_WAIT`` seconds, polling mode or not), then checks again whether it is done: no
sleeping, and no asking again and again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import IterableDataset

from transfer_queue.client import TransferQueueClient
from transfer_queue.metadata import BatchMeta

logger = logging.getLogger(__name__)

STREAM_WAIT = 5.0  # seconds a fetch waits at the controller before the dataset checks again whether it is done


class StreamingDataset(IterableDataset):
    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., tuple[TensorDict | None, BatchMeta]] | None = None,
        process_batch_fn: Callable[..., list[tuple[TensorDict, BatchMeta]]] | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(f"data_fields must be a list with at least one field name, got {data_fields}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = data_fields
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self._tq_client: Any = None
        self.buffer: list[tuple[TensorDict, BatchMeta]] = []
        self.batch_index = 0
        super().__init__()

    def _client(self) -> Any:
        if self._tq_client is None:
            self._tq_client = TransferQueueClient(f"StreamingDataset_{uuid.uuid4().hex[:8]}", self.config.controller.zmq_info)
        return self._tq_client

    def _finished(self) -> bool:
        return (
            self.should_check_consumption_status
            and self.batch_index >= len(self.buffer)
            and self._client().check_consumption_status(self.task_name, self.partition_id)
        )

    def __iter__(self) -> Iterator[tuple[TensorDict, BatchMeta]]:
        client = self._client()
        while not self._finished():
            if self.batch_index < len(self.buffer):
                current = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(*current, micro_batch_size=self.micro_batch_size)
                continue
            data, meta = self.fetch_batch_fn(
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config=self.sampling_config,
                batch_index=self.batch_index,
            )
            if data is not None:
                self.buffer.append((data, meta))

    def reset(self) -> None:
        """Iterate the buffered batches again from the first."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Start on another partition, dropping the buffer."""
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id


def default_fetch_batch_fn(
    tq_client: Any,
    data_fields: list[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[TensorDict | None, BatchMeta]:
    """One batch of ``batch_size`` samples, or ``(None, empty meta)`` when none is ready."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    # the shim's client waits for the samples at the controller (a parked request), up to
    # STREAM_WAIT seconds, instead of being asked again and again
    wait = {"wait": STREAM_WAIT} if isinstance(tq_client, TransferQueueClient) else {}
    meta = tq_client.get_meta(
        data_fields=data_fields,
        batch_size=batch_size,
        partition_id=partition_id,
        task_name=task_name,
        sampling_config=config,
        **wait,
    )
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: TensorDict, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[tuple[TensorDict, BatchMeta]]:
    """Cut a batch into micro-batches of ``micro_batch_size`` rows (the last may be shorter),
    each with its meta; nested fields stay nested, with their layout."""
    if not isinstance(td, TensorDict):
        raise TypeError(f"Expected TensorDict, got {type(td).__name__}")
    if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    if len(td.batch_size) == 0:
        raise ValueError("Input TensorDict must have non-empty batch_size")
    total = td.batch_size[0]
    if micro_batch_size > total:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) exceeds total batch size ({total})")
    count = -(-total // micro_batch_size)
    metas = batch_meta.chunk(count)
    nested = {k: (v.unbind(0), v.layout) for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested}
    dense = TensorDict({k: v for k, v in td.items() if k not in nested}, batch_size=td.batch_size)
    out = []
    for i in range(count):
        lo, hi = i * micro_batch_size, min((i + 1) * micro_batch_size, total)
        piece = dense[lo:hi]
        for key, (rows, layout) in nested.items():
            piece[key] = torch.nested.as_nested_tensor(list(rows[lo:hi]), layout=layout)
        out.append((piece, metas[i]))
    return out


__all__ = ["StreamingDataset", "chunk_batch_fn", "default_fetch_batch_fn"]
