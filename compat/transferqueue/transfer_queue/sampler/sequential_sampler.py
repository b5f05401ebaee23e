"""``SequentialSampler``: the first ``batch_size`` ready samples (tqueue: ``first_ready``)."""

from __future__ import annotations

from typing import Any

from transfer_queue.sampler.base import BaseSampler


class SequentialSampler(BaseSampler):
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        sampled = ready_indexes[:batch_size]
        return sampled, sampled
