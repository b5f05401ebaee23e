"""``SeqlenBalancedSampler``: whole groups, split among ``dp_size`` ranks so that each rank gets
about the same number of tokens (a per-sample ``total_lengths`` in ``custom_meta``), by the
Karmarkar-Karp largest-differencing method. Under tqueue, ``get_meta(data_parallel=DataParallel(rank,
size), balance_by=)`` balances at the controller by the samples' own lengths."""

from __future__ import annotations

import heapq
import logging
from typing import Any

from transfer_queue.sampler.grpo_group_n_sampler import GRPOGroupNSampler

logger = logging.getLogger(__name__)


class BalanceError(ValueError, AssertionError):
    """Items that cannot be split as asked. Also an ``AssertionError``, which TransferQueue's
    own helpers raise here (its tests expect it)."""


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split the indexes of ``seqlen_list`` into ``k_partitions`` sets of near-equal sums (with
    ``equal_size``, also of equal counts). Largest differencing: each partial solution is ``k``
    sets; the two partial solutions of largest spread are merged, the heaviest set of one with
    the lightest of the other, until one remains."""
    k = k_partitions
    if equal_size and len(seqlen_list) % k:
        raise BalanceError(f"{len(seqlen_list)} items cannot be split into {k} sets of equal size")
    order = sorted((value, index) for index, value in enumerate(seqlen_list))
    if equal_size:
        seeds = [order[i : i + k] for i in range(0, len(order), k)]
    else:
        seeds = [[item] for item in order]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tick, seed in enumerate(seeds):
        sets = [(value, [index]) for value, index in seed] + [(0, []) for _ in range(k - len(seed))]
        sets.sort(key=lambda s: (s[0], len(s[1])), reverse=True)
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), tick, sets))
    tick = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda s: (s[0], len(s[1])), reverse=True)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    return [indexes for _, indexes in heap[0][2]] if heap else [[] for _ in range(k)]


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """``karmarkar_karp``'s sets, each sorted; every set non-empty (at least ``k`` items)."""
    if len(seqlen_list) < k_partitions:
        raise BalanceError(f"number of items: {len(seqlen_list)} < k_partitions: {k_partitions}")
    partitions = [sorted(p) for p in karmarkar_karp(seqlen_list, k_partitions, equal_size)]
    if any(not p for p in partitions) or sorted(i for p in partitions for i in p) != list(range(len(seqlen_list))):
        raise BalanceError(f"cannot balance {len(seqlen_list)} items into {k_partitions} non-empty sets")
    return partitions


class SeqlenBalancedSampler(GRPOGroupNSampler):
    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size
        self._balanced_cache: dict[tuple[Any, ...], list[list[int]]] = {}

    def _split(self, sampled: list[int], partition: Any) -> list[list[int]]:
        if partition is None:
            logger.warning("SeqlenBalancedSampler: no partition given, splitting equally without balancing.")
            size = len(sampled) // self.dp_size
            return [sampled[r * size : (r + 1) * size if r < self.dp_size - 1 else None] for r in range(self.dp_size)]
        meta = partition.get_custom_meta(sampled)
        lengths = [meta.get(index, {}).get("total_lengths", 1) for index in sampled]
        n = self.n_samples_per_prompt
        if len(lengths) >= n and len(lengths) % n == 0:
            groups = [sum(lengths[g * n : (g + 1) * n]) for g in range(len(lengths) // n)]
            parts = get_seqlen_balanced_partitions(groups, self.dp_size, equal_size=True)
            return [[sampled[g * n + s] for g in part for s in range(n)] for part in parts]
        parts = get_seqlen_balanced_partitions(lengths, self.dp_size, equal_size=False)
        return [[sampled[i] for i in part] for part in parts]

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        dp_rank, batch_index = kwargs.get("dp_rank", 0), kwargs.get("batch_index", 0)
        key = (partition_id, task_name, batch_index)
        if key not in self._balanced_cache:
            sampled, _ = super().sample(ready_indexes, batch_size * self.dp_size, task_name=task_name, partition_id=partition_id)
            if not sampled:
                return [], []
            self._balanced_cache[key] = parts = self._split(sampled, kwargs.get("partition"))
            ranks = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
            for rank in range(self.dp_size):
                share = parts[rank] if rank < len(parts) else []
                ranks.setdefault(rank, {})[batch_index] = (share, list(share))
        parts = self._balanced_cache[key]
        share = parts[dp_rank] if dp_rank < len(parts) else []
        return share, list(share)

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for key in [key for key in self._balanced_cache if key[0] == partition_id]:
            del self._balanced_cache[key]

    def save_checkpoint(self) -> dict[str, Any]:
        return {**super().save_checkpoint(), "_balanced_cache": self._balanced_cache}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        super().load_checkpoint(state)
        self._balanced_cache = state["_balanced_cache"]
