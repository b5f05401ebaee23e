"""Systems the end-to-end benchmark compares, one module each, plus what they share.

Each module imports its peer lazily, so importing it works without the peer installed and
its system's ``unavailable()`` says why it cannot run. What lives here is plain Python and
torch: which samples each producer puts and each consumer takes in a scenario
(:func:`make_plan`), generating a producer's part of the batch (:func:`make_puts`), and
putting a consumer's pieces back into one batch (:func:`assemble`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import torch

from benchmarks.harness import Scenario
from benchmarks.workload import make_batch, select

SEED = 0  # every producer generates with this seed; samples differ by their start index


def missing(*modules: str) -> list[str]:
    """Which of ``modules`` cannot be imported here (checked without importing them)."""
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(m)
    return out


def repo_root() -> str:
    """The directory holding the ``benchmarks`` package (for worker processes' PYTHONPATH)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of put ``put`` of producer ``producer``."""

    producer: int
    put: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Who puts what and who takes what, in one scenario at one size.

    ``puts[p]``: the sample ranges producer ``p`` puts, in order (one put each).
    ``shares[c]``: the contiguous samples consumer ``c`` (a DP rank) ends up holding.
    ``pieces[c]``: where those samples are, in sample order.
    """

    scenario: Scenario
    size: int
    puts: list[list[tuple[int, int]]]
    shares: list[tuple[int, int]]
    pieces: list[list[Piece]]

    def producers_of(self, consumer: int) -> list[int]:
        return sorted({p.producer for p in self.pieces[consumer]})

    def consumers_of(self, producer: int) -> list[int]:
        return sorted({c for c, ps in enumerate(self.pieces) for p in ps if p.producer == producer})


def make_plan(scenario: Scenario, size: int, *, split_per_consumer: bool) -> Plan:
    """Producers' puts and consumers' pieces.

    Streaming scenarios (``scenario.group > 0``): each producer puts its contiguous share as
    groups of ``group`` samples. Otherwise each producer puts its share once, or, with
    ``split_per_consumer`` (systems whose consumers cannot take part of a put: an object
    store, a socket), once per consumer share it overlaps.
    """
    prod_shares = scenario.shares(size, scenario.producers)
    shares = scenario.shares(size, scenario.consumers)
    puts: list[list[tuple[int, int]]] = []
    for a, b in prod_shares:
        if scenario.group:
            puts.append([(g, min(g + scenario.group, b)) for g in range(a, b, scenario.group)])
        elif split_per_consumer:
            puts.append([(max(a, c0), min(b, c1)) for c0, c1 in shares if max(a, c0) < min(b, c1)])
        else:
            puts.append([(a, b)] if b > a else [])
    pieces: list[list[Piece]] = []
    for c0, c1 in shares:
        mine = []
        for p, plist in enumerate(puts):
            for i, (a, b) in enumerate(plist):
                lo, hi = max(a, c0), min(b, c1)
                if lo < hi:
                    mine.append(Piece(p, i, lo - a, hi - a))
        pieces.append(mine)
    return Plan(scenario, size, puts, shares, pieces)


def make_puts(plan: Plan, producer: int) -> list[dict[str, Any]]:
    """Producer ``producer``'s puts, generated the way the scenario says (untimed).

    Streaming: one ``make_batch`` per group. Otherwise one ``make_batch`` for the share and
    the puts are row views of it (``select``): a system that must not send a view's whole
    storage copies it while it is timed.
    """
    mm = plan.scenario.multimodal
    ranges = plan.puts[producer]
    if not ranges:
        return []
    if plan.scenario.group:
        return [make_batch(b - a, multimodal=mm, seed=SEED, start=a) for a, b in ranges]
    a0, b0 = ranges[0][0], ranges[-1][1]
    whole = make_batch(b0 - a0, multimodal=mm, seed=SEED, start=a0)
    if len(ranges) == 1:
        return [whole]
    return [select(whole, a - a0, b - a0) for a, b in ranges]


def assemble(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch from consecutive pieces: tensors concatenated (one copy), lists joined."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for name, first in parts[0].items():
        if isinstance(first, torch.Tensor):
            out[name] = torch.cat([p[name] for p in parts])
        else:
            out[name] = [x for p in parts for x in p[name]]
    return out


def is_view_of_larger(t: torch.Tensor) -> bool:
    """True when pickling ``t`` would carry more storage than its own elements."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def grow_actors(producers: list[Any], consumers: list[Any], want: tuple[int, int], classes: tuple[type, type], timeout: float) -> None:
    """Start Ray actors until there are ``want`` producers and consumers; wait until ready."""
    import ray

    new = []
    for pool, count, cls in ((producers, want[0], classes[0]), (consumers, want[1], classes[1])):
        while len(pool) < count:
            actor = ray.remote(cls).options(num_cpus=0).remote(len(pool))
            pool.append(actor)
            new.append(actor)
    ray.get([a.ready.remote() for a in new], timeout=timeout)
