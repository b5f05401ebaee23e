"""Data-parallel rounds: ``dp_size x batch_size`` samples chosen once, split once.

A trainer's ranks each ask for round ``k`` with their ``dp_rank``; the first request that
finds enough samples forms the round: it selects the samples, splits them by token count
(:mod:`._balance`) into equal-sized shares with the same number of micro-batches, and
leases each share. Every later request for ``(task, k, dp_rank)``, from the rank itself
or from its tensor/pipeline/context-parallel peers, gets the identical meta.

A sample's tokens, for the balance and the cap, are counted as verl's
``rearrange_micro_batches`` counts them (the attention mask's sum): its sequence, once.
:func:`token_counts` says how that is read from the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from ...errors import InvalidArgumentError
from ...wire import BatchMeta, GetMeta
from . import _balance
from ._balance import Deal

KEEP_ROUNDS = 256  # formed rounds remembered per (partition, task), for late peers
# the standard rollout fields (tqueue.bridges._fields): one sequence, stored in two parts
SEQUENCE = ("prompt_ids", "response_ids")


def token_counts(
    lengths: Mapping[str, np.ndarray], indexes: np.ndarray, fields: Sequence[str], balance_by: Sequence[str] | None
) -> np.ndarray:
    """Tokens per sample of ``indexes`` (pad rows, index -1, weigh nothing); ``lengths``: the
    partition's size of dimension 0 per jagged field.

    With ``balance_by``, the sum of those fields' lengths: name the one field that holds the
    sequence (``["input_ids"]``), or the fields that together make it
    (``["prompt_ids", "response_ids"]``). Without it, the longest of the jagged ``fields``
    asked for, where ``prompt_ids`` and ``response_ids``, when both are asked for, count as
    one sequence (their sum): fields aligned with the sequence or the response (log-probs,
    masks, routed experts) are not counted again. Where no jagged field has a length, every
    sample counts 1."""
    real = indexes >= 0
    safe = np.where(real, indexes, 0)

    def of(names: Sequence[str]) -> np.ndarray:
        """The sum of these fields' lengths (a field without lengths adds nothing)."""
        out = np.zeros(len(indexes), dtype=np.int64)
        for name in names:
            arr = lengths.get(name)
            if arr is not None:
                out += np.where(real, arr[safe], 0)
        return out

    if balance_by is not None:
        total = of(balance_by)
    else:
        jagged = [name for name in dict.fromkeys(fields) if name in lengths]
        whole = all(name in jagged for name in SEQUENCE)
        counted = [[name] for name in jagged if not (whole and name in SEQUENCE)]
        if whole:
            counted.append(list(SEQUENCE))
        total = np.zeros(len(indexes), dtype=np.int64)
        for names in counted:
            np.maximum(total, of(names), out=total)
    if not total.any():
        total = real.astype(np.int64)
    return total


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
    """The rounds of one task on one partition. ``max_tokens`` 0 and ``micro_batch_size`` 0:
    none (as on the wire)."""

    def __init__(
        self, dp_size: int, batch_size: int, max_tokens: int, micro_batch_size: int = 0,
        multiple_of: int = 1, minimum: int = 1,
    ) -> None:
        self.dp_size = dp_size
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.micro_batch_size = micro_batch_size
        self.multiple_of = multiple_of
        self.minimum = minimum
        self.rule = _balance.MicroRule(
            max_tokens=max_tokens or None, micro_batch_size=micro_batch_size or None,
            multiple_of=multiple_of, minimum=minimum,
        )
        self._refuse_impossible()
        self.rounds: dict[int, Round] = {}
        self.next = 0

    @classmethod
    def of(cls, msg: GetMeta) -> RoundBook:
        """The book for the rounds ``msg`` asks for; InvalidArgumentError where no round of
        that shape can be cut as asked."""
        return cls(
            msg.dp_size, msg.batch_size, msg.max_tokens_per_micro_batch, msg.micro_batch_size,
            msg.num_microbatches_multiple_of, msg.min_num_microbatches,
        )

    def _shape(self) -> tuple[int, ...]:
        return (self.dp_size, self.batch_size, self.max_tokens, self.micro_batch_size, self.multiple_of, self.minimum)

    def check(self, msg: GetMeta, where: str) -> None:
        other = (
            msg.dp_size, msg.batch_size, msg.max_tokens_per_micro_batch, msg.micro_batch_size,
            msg.num_microbatches_multiple_of, msg.min_num_microbatches,
        )
        if other != self._shape():
            raise InvalidArgumentError(
                f"{where}: this task's rounds are dp_size={self.dp_size}, batch_size="
                f"{self.batch_size}, max_tokens_per_micro_batch={self.max_tokens}, micro_batch_size="
                f"{self.micro_batch_size}, num_microbatches_multiple_of={self.multiple_of}, "
                f"min_num_microbatches={self.minimum}; a request asked for {', '.join(map(str, other))}"
            )

    def _refuse_impossible(self) -> None:
        """What no round of ``batch_size`` samples per rank can satisfy, refused up front."""
        size, least = self.micro_batch_size, self.rule.count(1)
        if size and (self.batch_size % size or self.rule.count(self.batch_size // size) != self.batch_size // size):
            raise InvalidArgumentError(
                f"micro_batch_size={size} cuts batch_size={self.batch_size} into "
                f"{self.batch_size / size:g} micro-batches per rank; it must divide batch_size into a "
                f"whole number that is at least min_num_microbatches={self.minimum} and a multiple of "
                f"num_microbatches_multiple_of={self.multiple_of}"
            )
        if least > self.batch_size:
            raise InvalidArgumentError(
                f"min_num_microbatches={self.minimum} with num_microbatches_multiple_of={self.multiple_of} "
                f"asks for at least {least} micro-batches per rank, more than its batch_size={self.batch_size} "
                f"samples (every micro-batch holds one)"
            )

    def form(self, indexes: np.ndarray, lengths: np.ndarray, leases: list[int], deal: Deal | None = None) -> Round:
        """Split this round's samples among the ranks; it becomes round ``next``.

        ``deal`` (a policy's: whole groups per rank) plans it; by default token balance
        (``_balance.plan_round``). Raises InvalidArgumentError where the plan cannot give every
        rank the same number of micro-batches under the cap."""
        if deal is None:
            plan = _balance.plan_round(lengths, self.dp_size, rule=self.rule)
        else:
            plan = deal(lengths, self.dp_size, self.rule)
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
