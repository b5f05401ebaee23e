"""Batch policies: which ready samples a ``get_meta`` gets.

A policy is any object with a ``name`` and a ``select(candidates, count)`` method that returns
the partition indexes to lease (a numpy int64 array of ``count`` of them, or fewer only if the
policy means it), or None to keep the request waiting. It runs inside the controller's one
loop: it must not block and should cost about as much as the batch it picks. It sees the
partition through :class:`Candidates`; it must only return samples that ``candidates.ready()``
lists (the controller checks, and refuses anything else).

Built in: ``first_ready`` (index order) and ``groups`` (whole GRPO groups, in completion
order). Others load at controller start from ``ControllerConfig.policies``
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

Data-parallel rounds apply a policy to pick the round's ``dp_size * batch_size`` samples.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ...errors import InvalidArgumentError
from ..model._partition import Partition
from ..model._samples import TaskState


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


FIRST_READY = "first_ready"


class FirstReady:
    """The first ready samples, in index order (arrival order for one producer). The
    controller's reads take this path without calling it (``Reads.select``)."""

    name = FIRST_READY

    def select(self, candidates: Candidates, count: int) -> np.ndarray | None:
        return candidates.first(count)


class WholeGroups:
    """Only whole groups (``count`` samples = ``count / group_size`` groups), in the order
    they completed; a group's members by explicit id, never by index adjacency."""

    name = "groups"

    def select(self, candidates: Candidates, count: int) -> np.ndarray | None:
        part = candidates.partition
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
        return candidates.groups(count // size)


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

