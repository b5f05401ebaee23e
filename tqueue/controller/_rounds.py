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
        names: list[str] | None = None,
    ) -> Round:
        """Split this round's samples among the ranks; it becomes round ``next``.

        With ``groups`` (positions into ``indexes``, one array per whole group; ``names`` their
        ids, for errors), every rank gets whole groups, the same number of them, balanced by
        their token sums. Raises InvalidArgumentError where the groups cannot be dealt so that
        every rank has the same number of micro-batches under the cap."""
        cap = self.max_tokens or None
        if groups is None:
            plan = _balance.plan_round(lengths, self.dp_size, max_tokens_per_micro_batch=cap)
        else:
            if names is None:  # name a group by its samples' partition indexes
                names = [f"with samples {indexes[g].tolist()}" for g in groups]
            plan = _balance.plan_groups(
                lengths, [g.tolist() for g in groups], self.dp_size, max_tokens_per_micro_batch=cap, names=names
            )
        shares, rank_micro = [], []
        for rank_positions, mbs in zip(plan.ranks, plan.micro_batches):
            where = {p: i for i, p in enumerate(rank_positions)}
            shares.append(indexes[np.asarray(rank_positions, dtype=np.int64)])
            rank_micro.append([[where[p] for p in mb] for mb in mbs])
        rnd = Round(self.next, shares, rank_micro, plan.num_micro_batches, leases, [None] * self.dp_size)
        self.rounds[self.next] = rnd
        self.rounds.pop(self.next - KEEP_ROUNDS, None)
        self.next += 1
        return rnd
