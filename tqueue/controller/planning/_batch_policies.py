"""Batch policies: which ready samples a ``get_meta`` gets.

A policy is any object with a ``name`` and a ``select(candidates, count)`` method that returns
the partition indexes to lease (a numpy int64 array of ``count`` of them, or fewer only if the
policy means it), or None to keep the request waiting. It runs inside the controller's one
loop: it must not block and should cost about as much as the batch it picks. It sees the
partition through :class:`Candidates`; it must only return samples that ``candidates.ready()``
lists (the controller checks, and refuses anything else).

Built in: ``first_ready`` (index order) and ``groups`` (whole GRPO groups, in completion
order; every group feature of a read is here: the last short batch of a padded read, and the dealing of whole groups to data-parallel ranks). Others load at controller start from ``ControllerConfig.policies``
(``"name=module:attribute"``, the attribute a class or factory taking no arguments), e.g.::

    class NewestFirst:
        name = "newest_first"

        def select(self, candidates, count):
            ready = candidates.ready()
            if len(ready) < count:
                return None
            newest = np.argsort(-candidates.versions(ready), kind="stable")[:count]
            return np.sort(ready[newest])

    tqueue controller --policy newest_first=my_rl.policies:NewestFirst

Data-parallel rounds apply a policy to pick the round's ``dp_size * batch_size`` samples. A
built-in policy may also say how a drained partition's last short batch is picked (``last``),
how a round's samples are dealt to ranks (``deal``; else token balance, ``_balance.plan_round``),
whether a drained partition may prefetch for it (``prefetches``) and what ``status`` adds
(``note``).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ...errors import InvalidArgumentError
from ..model._partition import FIRST_READY, WHOLE_GROUPS, Partition
from ..model._samples import TaskState
from . import _balance
from ._balance import Deal, MicroRule, RoundPlan

_BRUTE_FORCE = 2000  # assignments of groups to ranks tried exhaustively when the greedy fails


@dataclasses.dataclass
class Candidates:
    """A partition as a policy sees it, for one task and set of fields."""

    partition: Partition
    task: TaskState
    mask: np.uint64
    min_version: int | None
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The reader's ``policy_args`` (MessagePack values; empty if none). In a data-parallel
    round, those of the call that opened the round."""

    @property
    def name(self) -> str:
        return self.partition.name

    def ready(self) -> np.ndarray:
        """Every sample the task may take now (has the fields, not leased, consumed,
        excluded or partial, not too stale), in index order."""
        return self.task.all_ready(self.mask, self.min_version)

    def first(self, count: int) -> np.ndarray | None:
        """The first ``count`` ready samples in index order (cheap: scans from the task's
        low-water mark), or None if there are fewer."""
        return self.task.find_ready(self.mask, count, self.min_version)

    def groups(self, count: int) -> np.ndarray | None:
        """Live members of the first ``count`` complete, ready groups, or None."""
        return self.task.find_groups(self.mask, count, self.min_version)

    def versions(self, indexes: np.ndarray) -> np.ndarray:
        """Oldest policy version of each sample (-1 where unknown)."""
        return self.partition.samples.version[indexes]

    def lengths(self, indexes: np.ndarray, fields: list[str]) -> np.ndarray:
        """Tokens per sample: dim 0 summed over the jagged ``fields``."""
        return self.partition.schema.balance_lengths(indexes, fields)

    def group_ids(self, indexes: np.ndarray) -> list[Any] | None:
        return self.partition.samples.groups_of(indexes)


class Policy(Protocol):
    name: str

    def select(self, candidates: Candidates, count: int) -> np.ndarray | None: ...


class FirstReady:
    """The first ready samples, in index order (arrival order for one producer). The
    controller's reads take this path without calling it (``Reads.select``)."""

    name = FIRST_READY

    def select(self, candidates: Candidates, count: int) -> np.ndarray | None:
        return candidates.first(count)


class WholeGroups:
    """Only whole groups (``count`` samples = ``count / group_size`` groups), in the order
    they completed; a group's members by explicit id, never by index adjacency. In a round,
    every rank gets whole groups (:func:`plan_groups`)."""

    name = WHOLE_GROUPS
    prefetches = False

    def select(self, candidates: Candidates, count: int) -> np.ndarray | None:
        return candidates.groups(self._whole(candidates.partition, count))

    def last(self, candidates: Candidates, count: int) -> np.ndarray:
        """The most whole groups (fewer than the batch's) a drained partition still has ready:
        the last, short batch of a padded read."""
        for groups in range(self._whole(candidates.partition, count) - 1, 0, -1):
            found = candidates.groups(groups)
            if found is not None:
                return found
        return np.zeros(0, dtype=np.int64)

    def deal(self, partition: Partition, indexes: np.ndarray) -> Deal:
        """Whole groups per rank for a round of ``indexes``."""
        ordinals = partition.samples.group[indexes]
        positions = [np.flatnonzero(ordinals == g) for g in dict.fromkeys(ordinals.tolist())]
        return deal_whole(positions, [f"with samples {indexes[g].tolist()}" for g in positions])

    def note(self, partition: Partition) -> str:
        return f"; {len(partition.groups.order)} groups complete"

    @staticmethod
    def _whole(part: Partition, count: int) -> int:
        size = part.options.group_size
        if not size:
            raise InvalidArgumentError(
                f"policy 'groups' needs a group_size on partition {part.name!r} (create_partition)"
            )
        if count % size:
            raise InvalidArgumentError(
                f"batch of {count} samples is not a whole number of groups of {size} "
                f"(partition {part.name!r})"
            )
        return count // size


BUILT_IN: dict[str, Policy] = {p.name: p for p in (FirstReady(), WholeGroups())}


def load(specs: tuple[str, ...] | list[str]) -> dict[str, Policy]:
    """The built-in policies plus those named ``"name=module:attribute"``."""
    policies = dict(BUILT_IN)
    for spec in specs:
        name, sep, target = spec.partition("=")
        module, colon, attr = target.partition(":")
        if not sep or not colon or not name or not module or not attr:
            raise ValueError(f"a policy is given as name=module:attribute, got {spec!r}")
        factory = getattr(importlib.import_module(module), attr)
        is_factory = isinstance(factory, type) or (callable(factory) and not hasattr(factory, "select"))
        policy = factory() if is_factory else factory
        if not callable(getattr(policy, "select", None)):
            raise ValueError(f"policy {spec!r} has no select(candidates, count) method")
        policies[name] = policy
    return policies


def check(chosen: np.ndarray, candidates: Candidates, policy: str) -> np.ndarray:
    """A policy's choice, checked: ready samples only, each once."""
    chosen = np.asarray(chosen, dtype=np.int64)
    if len(np.unique(chosen)) != len(chosen) or not np.isin(chosen, candidates.ready()).all():
        raise InvalidArgumentError(
            f"policy {policy!r} chose samples of partition {candidates.name!r} that are not ready for this task"
        )
    return chosen


# ---------------------------------------------------------------------------------------------
# whole groups dealt to data-parallel ranks


def deal_whole(positions: Sequence[np.ndarray], names: Sequence[str] | None = None) -> Deal:
    """A round's dealing of whole groups (``positions`` into the round, one array per group;
    ``names`` for errors) to ranks, by :func:`plan_groups`."""
    groups = [g.tolist() for g in positions]
    return lambda lengths, dp_size, rule: plan_groups(lengths, groups, dp_size, names=names, rule=rule)


def plan_groups(
    lengths: Sequence[int] | np.ndarray,
    groups: Sequence[Sequence[int]],
    dp_size: int,
    *,
    max_tokens_per_micro_batch: int | None = None,
    names: Sequence[str] | None = None,
    rule: MicroRule | None = None,
) -> RoundPlan:
    """Whole groups per rank, the same number of groups each, balanced by token sums, every rank
    cut into the same number of micro-batches (as ``rule`` says; default:
    ``MicroRule(max_tokens_per_micro_batch)``).

    ``groups`` lists positions into ``lengths``, one list per group; groups may differ in size
    (a member masked out). A rank with fewer samples than another rank needs micro-batches
    cannot follow it (nor, with a fixed micro-batch size, one of another size): the
    token-balanced assignment is then traded (or, for few groups, searched exhaustively) for
    one where every rank can be cut into the same count.

    Raises InvalidArgumentError if no assignment found has such a count, naming the groups
    (``names`` or their positions) and the rule; ValueError for malformed arguments.
    """
    vals = _balance._as_lengths(lengths)
    dp_size = _balance._positive_int(dp_size, "dp_size")
    rule = _balance._rule(rule, max_tokens_per_micro_batch)
    members = [sorted(int(p) for p in g) for g in groups]
    if not members or len(members) % dp_size:
        raise ValueError(f"{len(members)} groups cannot be split into {dp_size} equal parts")
    sums = [sum(vals[p] for p in g) for g in members]
    assignment = _balance._partition(sums, dp_size, equal_size=True)
    sizes = {sum(len(members[g]) for g in part) for part in assignment}
    # Ranks of equal size have a common count (none needs more than its samples) unless the
    # rule raises it or fixes the size: only then is the assignment checked.
    plain = rule.micro_batch_size is None and rule.minimum == rule.multiple_of == 1
    if not (plain and (len(sizes) == 1 or rule.max_tokens is None)) and _slack(vals, members, assignment, rule) < 0:
        found = _feasible(vals, members, assignment, rule, sums) if len(sizes) > 1 else None
        if found is None:
            raise InvalidArgumentError(_no_plan(vals, members, dp_size, rule, names))
        assignment = found
    return _balance._with_micro(vals, [[p for gi in part for p in members[gi]] for part in assignment], rule)




def _slack(vals: list[int], members: list[list[int]], assignment: list[list[int]], rule: MicroRule) -> int:
    """Fewest samples of a rank minus the micro-batches the rule cuts every rank into (with a
    fixed size: minus the most samples of a rank): >= 0 where a common count exists."""
    shapes = [_shape(vals, members, part, rule) for part in assignment]
    return _score(shapes, rule)[0]


def _score(shapes: list[tuple[int, int]], rule: MicroRule) -> tuple[int, int]:
    """The slack, then fewer bottleneck ranks (fewest samples, or the neediest) first."""
    low, high = min(n for n, _ in shapes), max(need for _, need in shapes)
    size = rule.micro_batch_size
    if size is not None:  # equal shares that the size divides, whose count the rule allows
        slack = low - high if high % size == 0 and rule.count(high // size) * size == high else -high
    else:
        slack = low - rule.count(high)
    return slack, -sum((n == low) + (need == high) for n, need in shapes)


def _shape(vals: list[int], members: list[list[int]], part: list[int], rule: MicroRule) -> tuple[int, int]:
    """(samples, micro-batches needed) of a rank holding the groups ``part``; with a fixed
    micro-batch size, (samples, samples)."""
    rank = [p for gi in part for p in members[gi]]
    if rule.micro_batch_size is not None:
        return len(rank), len(rank)
    if rule.max_tokens is None:
        return len(rank), 1
    return len(rank), _balance._needs(vals, rank, rule.max_tokens)[0]


def _feasible(
    vals: list[int], members: list[list[int]], start: list[list[int]], rule: MicroRule, sums: list[int]
) -> list[list[int]] | None:
    """An assignment of groups to ranks (same number each) with a common micro-batch count.

    Where there are few assignments, every one is tried and the most balanced that works wins.
    Else, from the token-balanced start, swaps of two groups between a bottleneck rank (fewest
    samples, or most micro-batches needed) and another rank are taken while they raise the slack
    (or keep it and free a bottleneck rank), until it is >= 0. None if none is found."""
    parts, size = len(start), len(start[0])
    if _assignments(len(members), parts) <= _BRUTE_FORCE:
        found = [
            a for a in _every_assignment(list(range(len(members))), parts, size)
            if _slack(vals, members, a, rule) >= 0
        ]
        return min(found, key=lambda a: max(sum(sums[g] for g in part) for part in a), default=None)
    current = [list(p) for p in start]
    shapes = [_shape(vals, members, part, rule) for part in current]

    def score(shapes: list[tuple[int, int]]) -> tuple[int, int]:
        return _score(shapes, rule)

    best_score = score(shapes)
    for _ in range(2 * len(members)):
        low, high = min(n for n, _ in shapes), max(need for _, need in shapes)
        tight = [r for r, (n, need) in enumerate(shapes) if n == low or need == high]
        best = None
        for a in tight:
            for b in range(parts):
                if b == a:
                    continue
                for i, j in itertools.product(range(size), range(size)):
                    pa, pb = list(current[a]), list(current[b])
                    pa[i], pb[j] = current[b][j], current[a][i]
                    trial = list(shapes)
                    trial[a], trial[b] = _shape(vals, members, pa, rule), _shape(vals, members, pb, rule)
                    if score(trial) > best_score:
                        best_score, best = score(trial), (a, b, pa, pb, trial)
        if best is None:
            return None
        a, b, current[a], current[b], shapes = best
        if best_score[0] >= 0:
            return current
    return None


def _assignments(groups: int, parts: int) -> int:
    """Ways to deal ``groups`` into ``parts`` unordered parts of equal size."""
    size = groups // parts
    return math.factorial(groups) // (math.factorial(size) ** parts * math.factorial(parts))


def _every_assignment(items: list[int], parts: int, size: int) -> Iterator[list[list[int]]]:
    """Each division of ``items`` into ``parts`` unordered lists of ``size``, once."""
    if parts == 1:
        yield [items]
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        chosen = [first, *others]
        left = [x for x in rest if x not in others]
        for tail in _every_assignment(left, parts - 1, size):
            yield [chosen, *tail]


def _no_plan(
    vals: list[int], members: list[list[int]], dp_size: int, rule: MicroRule, names: Sequence[str] | None
) -> str:
    label = list(names) if names is not None else [f"at positions {g}" for g in members]
    fixed = rule.micro_batch_size is not None
    described = ", ".join(
        f"group {label[i]} ({len(g)} samples{'' if fixed else f', {_shape(vals, [g], [0], rule)[1]} micro-batches'})"
        for i, g in enumerate(members)
    )
    if fixed:
        why = (f"gives every rank the same number of samples, a multiple of micro_batch_size="
               f"{rule.micro_batch_size} whose count the rule allows")
        fix = "change micro_batch_size, or let the groups be whole (no masked members)"
    else:
        why = ("gives every rank at least as many samples as the micro-batches the round is cut into "
               "(every rank must have the same count, none empty)")
        fix = "raise max_tokens_per_micro_batch or lower min_num_microbatches / num_microbatches_multiple_of"
    return (
        f"cannot plan a round of {len(members)} whole groups over {dp_size} ranks with "
        f"{rule.describe()}: no assignment found {why}; groups: {described}; {fix}"
    )
