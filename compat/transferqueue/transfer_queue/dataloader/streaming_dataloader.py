"""``StreamingDataLoader``: a ``DataLoader`` over a ``StreamingDataset`` that yields its
``(TensorDict, BatchMeta)`` items as they are (no batching, no collation by default).

With workers, ``multiprocessing_context`` defaults to spawn, as tqueue's own loader does: the
process that makes the loader holds a client, whose threads (its event loop, ZeroMQ's I/O)
would be forked mid-work with the default fork, and a lock one of them held at that moment
stays held in the worker for good. Each spawned worker makes its own client from the
dataset's config, so the dataset and its fetch functions must pickle; pass
``multiprocessing_context="fork"`` to keep the fork.
"""

from __future__ import annotations

from typing import Any

import torch

from transfer_queue.dataloader.streaming_dataset import StreamingDataset


def _identity(item: Any) -> Any:
    return item


class StreamingDataLoader(torch.utils.data.DataLoader):
    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        self.dataset: StreamingDataset = dataset
        if num_workers and multiprocessing_context is None:
            multiprocessing_context = "spawn"
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[Any]:
        return self.dataset.buffer
