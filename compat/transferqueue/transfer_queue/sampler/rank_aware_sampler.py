"""``RankAwareSampler``: every caller with the same ``(partition, task, dp_rank, batch_index)``
gets the same batch (the tensor/pipeline-parallel peers of one data-parallel rank). tqueue's
``get_meta(data_parallel=DataParallel(rank, size, round=))`` gives the same guarantee at the controller."""

from __future__ import annotations

from typing import Any

from transfer_queue.sampler.base import BaseSampler


class RankAwareSampler(BaseSampler):
    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int,
        batch_index: int,
        task_name: str,
        partition_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        batches = self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        if batch_index not in batches:
            sampled = ready_indexes[:batch_size]
            if len(sampled) < batch_size:
                return [], []
            batches[batch_index] = sampled
        return batches[batch_index], batches[batch_index]
