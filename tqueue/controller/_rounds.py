"""Data-parallel rounds: ``dp_size x batch_size`` samples chosen once, split once.

A trainer's ranks each ask for round ``k`` with their ``dp_rank``; the first request that
finds enough samples forms the round: it selects the samples, splits them by token count
(:mod:`._balance`) into equal-sized shares with the same number of micro-batches, and
leases each share. Every later request for ``(task, k, dp_rank)``, from the rank itself
or from its tensor/pipeline/context-parallel peers, gets the identical meta.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InvalidArgumentError
from ..wire import BatchMeta
from . import _balance

KEEP_ROUNDS = 256  # formed rounds remembered per (partition, task), for late peers


@dataclasses.dataclass
class Round:
    number: int
    shares: list[np.ndarray]  # partition indexes of each rank, in the rank's order
    micro: list[list[list[int]]]  # per rank: micro-batches as positions in its share
    num_micro: int
    leases: list[int]
    metas: list[BatchMeta | None]

    @property
    def size(self) -> int:
        return sum(len(s) for s in self.shares)


class RoundBook:
    """The rounds of one task on one partition."""

    def __init__(self, dp_size: int, batch_size: int, max_tokens: int) -> None:
        self.dp_size = dp_size
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.rounds: dict[int, Round] = {}
        self.next = 0

    def check(self, dp_size: int, batch_size: int, max_tokens: int, where: str) -> None:
        if (dp_size, batch_size, max_tokens) != (self.dp_size, self.batch_size, self.max_tokens):
            raise InvalidArgumentError(
                f"{where}: this task's rounds are dp_size={self.dp_size}, batch_size="
                f"{self.batch_size}, max_tokens_per_micro_batch={self.max_tokens}; a request "
                f"asked for {dp_size}, {batch_size}, {max_tokens}"
            )

    def form(
        self,
        indexes: np.ndarray,
        lengths: np.ndarray,
        leases: list[int],
        groups: list[np.ndarray] | None = None,
    ) -> Round:
        """Split this round's samples among the ranks; it becomes round ``next``.

        With ``groups`` (positions into ``indexes``, one array per whole group), every rank
        gets whole groups, the same number of them, balanced by their token sums."""
        if groups is None:
            plan = _balance.plan_round(
                lengths.tolist(), self.dp_size, max_tokens_per_micro_batch=self.max_tokens or None
            )
            ranks, micro = plan.ranks, plan.micro_batches
            num_micro = plan.num_micro_batches
        else:
            sums = [int(lengths[g].sum()) for g in groups]
            ranks = [
                sorted(int(p) for gi in part for p in groups[gi])
                for part in _balance.balanced_partition(sums, self.dp_size, equal_size=True)
            ]
            ranks, micro, num_micro = self._micro(ranks, lengths)
        shares, rank_micro = [], []
        for rank_positions, mbs in zip(ranks, micro):
            where = {p: i for i, p in enumerate(rank_positions)}
            shares.append(indexes[np.asarray(rank_positions, dtype=np.int64)])
            rank_micro.append([[where[p] for p in mb] for mb in mbs])
        rnd = Round(self.next, shares, rank_micro, num_micro, leases, [None] * self.dp_size)
        self.rounds[self.next] = rnd
        self.rounds.pop(self.next - KEEP_ROUNDS, None)
        self.next += 1
        return rnd

    def _micro(self, ranks: list[list[int]], lengths: np.ndarray) -> tuple[list[list[int]], list[list[list[int]]], int]:
        """The same number of micro-batches on every rank (positions into the round)."""
        if not self.max_tokens:
            return ranks, [[r] for r in ranks], 1
        per_rank = [lengths[np.asarray(r, dtype=np.int64)].tolist() for r in ranks]
        count = max(len(_balance.micro_batches(lens, self.max_tokens)) for lens in per_rank)
        count = min(count, min(len(r) for r in ranks))
        micro = []
        for r, lens in zip(ranks, per_rank):
            micro.append([[r[p] for p in mb] for mb in _balance.micro_batches(lens, self.max_tokens, count=count)])
        return ranks, micro, count
