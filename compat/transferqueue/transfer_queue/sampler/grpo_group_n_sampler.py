"""``GRPOGroupNSampler``: whole groups of ``n_samples_per_prompt`` samples.

TransferQueue knows a group only as ``n`` consecutive global indexes; this class keeps that rule
for code that calls it directly. Under tqueue the controller's ``groups`` policy releases whole
groups by explicit group id instead (the shim gives each put's rows their group ids).
"""

from __future__ import annotations

from typing import Any

from transfer_queue.sampler.base import BaseSampler


class GRPOGroupNSampler(BaseSampler):
    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def _groups(self, ready_indexes: list[int], wanted: int) -> list[int] | None:
        """The first ``wanted`` runs of ``n`` consecutive indexes among the sorted ready ones."""
        n = self.n_samples_per_prompt
        ready = sorted(ready_indexes)
        found: list[int] = []
        i = 0
        while i + n <= len(ready) and len(found) < wanted * n:
            run = ready[i : i + n]
            if run[-1] - run[0] == n - 1 and len(set(run)) == n:
                found.extend(run)
                i += n
            else:
                i += 1
        return found if len(found) == wanted * n else None

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        ranks = self._states.get(partition_id, {}).get(task_name, {})
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if batch_index in ranks.get(dp_rank, {}):
            return ranks[dp_rank][batch_index]
        if batch_size % self.n_samples_per_prompt:
            raise ValueError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({self.n_samples_per_prompt})"
            )
        sampled = self._groups(ready_indexes, batch_size // self.n_samples_per_prompt)
        if sampled is None:
            return [], []
        result = (sampled, list(sampled))
        if dp_rank is not None:
            ranks.setdefault(dp_rank, {}).setdefault(batch_index, result)
            self._states.setdefault(partition_id, {})[task_name] = ranks
        return result
