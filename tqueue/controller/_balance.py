"""Token balance for one round: split samples among data-parallel ranks, then into micro-batches.

The controller forms a round of ``dp_size * batch_size`` samples and hands each rank the same
number of samples with nearly the same number of tokens, then cuts every rank's share into the
same number of micro-batches, each under a token cap where the samples allow it.

Everything here is Python over integers (numpy only to read array inputs): the controller
process never imports torch. Every function is deterministic: it looks only at the length values
and breaks ties by position, so every caller that plans the same round gets the identical plan.

The inner routines (Karmarkar-Karp, first-fit decreasing, the refining trades, two sorts) have C
twins in the optional extension ``tqueue._native_balance`` (native/balance.c), built at install
time where a compiler is found. They return exactly what the Python ones return, so the plan does
not depend on which ran. ``IMPLEMENTATION`` says which is in use: "native" where the extension is
built, unless ``TQUEUE_NATIVE=0`` or ``use_native(False)`` chose Python. At 4096 samples the C
path plans a round in a few ms where Python takes tens (native/README.md has the numbers); the
controller's event loop waits for the whole plan, and so does every other request to it.

The balancing is the Karmarkar-Karp largest differencing method generalised to k-way partitions:
a heap holds partial solutions, each a k-tuple of (sum, items); the two with the largest spread
(largest sum minus smallest sum) are merged by pairing the largest sum of one with the smallest
sum of the other, until one solution remains. A local pass then trades samples between the
heaviest part and light ones while that lowers the heaviest (swaps only where sizes must stay
equal); it never makes the largest sum worse.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence
from typing import Union

import numpy as np

from .. import _env

try:  # the C versions of the inner routines (native/balance.c), where they were built
    from .. import _native_balance
except ImportError:  # no compiler at install time, or the build failed: pure Python
    _native_balance = None

__all__ = ["RoundPlan", "balanced_partition", "micro_batches", "plan_round"]

# A subset's items are a tree of joins (None for no item, an int position for one, a pair for a
# join) flattened once at the end, so merging costs O(1) per subset however large it grows.
_Tree = Union[None, int, tuple]


# ---------------------------------------------------------------------------------------------
# implementation: C twins where built, else Python

_native = None  # the extension module while the native path is in use
IMPLEMENTATION = "python"  # "native" or "python": which versions of the inner routines run


def use_native(flag: bool) -> str:
    """Run the C versions of the inner routines (``flag`` true) or the Python ones; returns the
    previous ``IMPLEMENTATION``. Raises RuntimeError for ``use_native(True)`` where the
    extension was not built. Both give identical plans: this only changes the speed."""
    global _native, IMPLEMENTATION
    previous = IMPLEMENTATION
    if flag and _native_balance is None:
        raise RuntimeError(
            "tqueue._native_balance is not built (no C compiler when tqueue was installed, or "
            "its build failed): only the Python planner is available"
        )
    _native = _native_balance if flag else None
    IMPLEMENTATION = "native" if flag else "python"
    return previous


use_native(_native_balance is not None and bool(_env.number("TQUEUE_NATIVE", 1)))


def _kk(vals: list[int], order: list[int], parts: int, equal_size: bool) -> list[list[int]]:
    """``_kk_python``'s result, from C where in use. The C version refuses (OverflowError)
    lengths or totals beyond int64, which Python ints hold: those take the Python path."""
    if _native is not None:
        try:
            return _native.kk(vals, order, parts, equal_size)
        except OverflowError:
            pass
    return _kk_python(vals, order, parts, equal_size)


def _first_fit_decreasing(
    vals: list[int], positions: Sequence[int], cap: int
) -> tuple[list[int], list[list[int]]]:
    """``_first_fit_decreasing_python``'s result, from C where in use (as ``_kk``)."""
    if _native is not None:
        try:
            return _native.first_fit_decreasing(vals, positions, cap)
        except OverflowError:
            pass
    return _first_fit_decreasing_python(vals, positions, cap)


def _refine(
    bins: list[list[int]], vals: list[int], until: int = 0, moves: bool = True
) -> list[list[int]]:
    """``_refine_python``'s result, from C where in use (as ``_kk``)."""
    if _native is not None:
        try:
            return _native.refine(bins, vals, until, moves)
        except OverflowError:
            pass
    return _refine_python(bins, vals, until, moves)


def _descending(vals: list[int], positions: Sequence[int]) -> list[int]:
    """The positions, longest first; stable, so equal lengths keep their order (as _kk needs)."""
    if _native is not None:
        try:
            return _native.descending(vals, positions)
        except OverflowError:
            pass
    return sorted(positions, key=vals.__getitem__, reverse=True)


def _canonical(groups: list[list[int]]) -> list[list[int]]:
    """``_canonical_python``'s result, from C where in use (as ``_kk``)."""
    if _native is not None:
        try:
            return _native.canonical(groups)
        except OverflowError:
            pass
    return _canonical_python(groups)


# ---------------------------------------------------------------------------------------------
# public API


def balanced_partition(
    lengths: Sequence[int] | np.ndarray, parts: int, *, equal_size: bool = True
) -> list[list[int]]:
    """Divide positions ``0 .. len(lengths)-1`` into ``parts`` lists with balanced length sums.

    Guarantees:

    * the result has exactly ``parts`` lists; together they are a permutation of
      ``range(len(lengths))`` (every position exactly once);
    * each list is sorted ascending, and the lists are ordered by their first (smallest)
      position; with ``equal_size=False`` and fewer samples than parts, the empty lists come last;
    * with ``equal_size=True`` (the default) every list has exactly ``len(lengths) // parts``
      positions; ``len(lengths)`` must be divisible by ``parts``;
    * with ``equal_size=False`` and ``len(lengths) >= parts``, no list is empty;
    * deterministic: the split depends only on the sequence of length values, ties between equal
      lengths broken by position. Reordering the input only renames positions: the per-part
      multisets of lengths, hence the per-part sums, stay the same.

    The sums are balanced with the k-way Karmarkar-Karp largest differencing method. Items are
    taken in descending length order. With ``equal_size`` each initial partial solution is a
    group of ``parts`` consecutive items of that order, one item per subset, so every merge keeps
    the subsets' cardinalities equal; without it each item seeds a solution of one item and
    ``parts - 1`` empty subsets. With ``equal_size`` a pass of swaps follows (the heaviest part
    trades a sample with a light part while that lowers it; sizes unchanged): groups of
    consecutive sorted items give KK little to cancel a heavy part with, and on heavy-tailed
    lengths it can leave a part or two ~1% heavy at 8+ parts, which the swaps remove.

    Raises ValueError if ``parts < 1``, if a length is not a non-negative integer (naming the
    first bad position), or if ``equal_size`` and ``len(lengths) % parts != 0``.
    """
    return _partition(_as_lengths(lengths), _positive_int(parts, "parts"), equal_size)


def _partition(vals: list[int], parts: int, equal_size: bool) -> list[list[int]]:
    n = len(vals)
    if equal_size and n % parts:
        raise ValueError(
            f"equal_size=True needs len(lengths) divisible by parts: {n} samples cannot be "
            f"split into {parts} equal parts ({n} % {parts} = {n % parts})"
        )
    order = _descending(vals, range(n))
    groups = _kk(vals, order, parts, equal_size)
    if equal_size:
        groups = _refine(groups, vals, moves=False)
    return _canonical(groups)


def micro_batches(
    lengths: Sequence[int] | np.ndarray, max_tokens: int, *, count: int | None = None
) -> list[list[int]]:
    """Split one rank's samples into micro-batches of at most ``max_tokens`` tokens.

    Positions are 0-based into ``lengths``. Guarantees:

    * together the micro-batches are a permutation of ``range(len(lengths))``; none is empty;
    * a sample longer than ``max_tokens`` is alone in its micro-batch; every other micro-batch
      sums to at most ``max_tokens``;
    * each micro-batch is sorted ascending; micro-batches are ordered by their first position;
    * without ``count``: as many micro-batches as first-fit decreasing needs (call it the
      minimum; one per oversize sample plus FFD's bins for the rest, at most 11/9 of the optimum
      plus one), with the tokens then balanced among them;
    * with ``count``: exactly ``count`` micro-batches, balanced by token sum; ``count`` must lie
      between that minimum and ``len(lengths)``;
    * deterministic, as ``balanced_partition``. An empty ``lengths`` gives ``[]``.

    Balancing: oversize samples each take a micro-batch; the rest are split by Karmarkar-Karp
    (``equal_size=False``) into the remaining number; where that breaks the cap (KK balances
    sums but does not know the cap) the heaviest micro-batches trade samples with light ones
    until they fit. If that fails, FFD's bins are used instead: split, heaviest first, up to that
    number and balanced by the same trades (moves and swaps between heavy and light
    micro-batches), which never raise the largest sum, so the cap holds.

    Raises ValueError if ``max_tokens < 1``, if a length is not a non-negative integer, or if
    ``count`` is outside ``[minimum, len(lengths)]``.
    """
    vals = _as_lengths(lengths)
    max_tokens = _positive_int(max_tokens, "max_tokens")
    oversize, ffd = _first_fit_decreasing(vals, range(len(vals)), max_tokens)
    minimum = len(oversize) + len(ffd)
    if count is None:
        count = minimum
    else:
        count = _count_in_range(count, minimum, len(vals), max_tokens)
    return _canonical(_pack(vals, max_tokens, count, oversize, ffd))


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """How one round is divided: which samples each rank gets and how it cuts them.

    All positions are global, i.e. 0-based into the round's ``lengths``.

    Attributes:
        ranks: positions per rank, each sorted ascending; every position appears exactly once
            and every rank has ``len(lengths) // dp_size`` of them.
        micro_batches: per rank, its micro-batches (non-empty lists of positions, each sorted
            ascending, ordered by first position); together a rank's micro-batches are exactly
            ``ranks[r]``.
        num_micro_batches: the number of micro-batches, identical for every rank.
        token_sums: tokens per rank.
    """

    ranks: list[list[int]]
    micro_batches: list[list[list[int]]]
    num_micro_batches: int
    token_sums: list[int]


def plan_round(
    lengths: Sequence[int] | np.ndarray,
    dp_size: int,
    *,
    max_tokens_per_micro_batch: int | None = None,
) -> RoundPlan:
    """Plan one round: balanced ranks of equal size, each cut into the same number of micro-batches.

    Ranks come from ``balanced_partition(lengths, dp_size, equal_size=True)``: rank ``r`` gets the
    ``r``-th list, i.e. the lists are ordered by their smallest position.

    Without ``max_tokens_per_micro_batch`` each rank has a single micro-batch holding all its
    samples. With it, each rank needs some minimum number of micro-batches (see
    ``micro_batches``); ``num_micro_batches`` is the largest of those, and every rank is split
    into exactly that many with ``micro_batches(..., count=num_micro_batches)``, so every
    micro-batch respects the cap unless it is a single oversize sample.

    Deterministic: the same ``lengths`` and arguments always give an equal plan.

    Raises ValueError if ``dp_size < 1``, if ``lengths`` is empty or not divisible by
    ``dp_size``, if a length is not a non-negative integer, if the cap is below 1, or if a rank
    has fewer samples than the number of micro-batches (cannot happen with equal-size ranks,
    since a rank never needs more micro-batches than it has samples; checked all the same).
    """
    vals = _as_lengths(lengths)
    dp_size = _positive_int(dp_size, "dp_size")
    if not vals:
        raise ValueError("plan_round needs at least one sample; lengths is empty")
    ranks = _partition(vals, dp_size, equal_size=True)
    token_sums = _sums(ranks, vals)
    if max_tokens_per_micro_batch is None:
        return RoundPlan(ranks, [[list(rank)] for rank in ranks], 1, token_sums)

    cap = _positive_int(max_tokens_per_micro_batch, "max_tokens_per_micro_batch")
    packed = [_first_fit_decreasing(vals, rank, cap) for rank in ranks]
    needs = [len(oversize) + len(ffd) for oversize, ffd in packed]
    count = max(needs)
    for r, rank in enumerate(ranks):
        if len(rank) < count:
            worst = needs.index(count)
            raise ValueError(
                f"rank {r} has {len(rank)} samples but every rank must be cut into {count} "
                f"micro-batches (rank {worst} needs {count} of at most {cap} tokens); "
                f"raise max_tokens_per_micro_batch or the batch size"
            )
    plans = [_canonical(_pack(vals, cap, count, *packed[r])) for r in range(len(ranks))]
    return RoundPlan(ranks, plans, count, token_sums)


# ---------------------------------------------------------------------------------------------
# argument checks


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> list[int]:
    """The lengths as a list of Python ints, or ValueError naming the first bad position."""
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be one-dimensional, got an array of shape {lengths.shape}")
        if lengths.dtype.kind not in "iu":
            if len(lengths):
                raise ValueError(
                    f"lengths[0] is {lengths[0]!r}: lengths must be non-negative integers, "
                    f"got an array of dtype {lengths.dtype}"
                )
            return []
        if lengths.dtype.kind == "i":
            bad = np.flatnonzero(lengths < 0)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"lengths[{i}] is {int(lengths[i])}: lengths must be non-negative integers"
                )
        return lengths.tolist()  # Python ints
    if isinstance(lengths, (str, bytes)):
        raise ValueError(
            f"lengths must be a sequence of non-negative integers, got {type(lengths).__name__}"
        )
    if isinstance(lengths, (list, tuple)) and all(type(x) is int for x in lengths):
        if not lengths or min(lengths) >= 0:  # the common case, without the loop below
            return list(lengths)
    out = []
    for i, x in enumerate(lengths):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"lengths[{i}] is {x!r}: lengths must be non-negative integers")
        out.append(int(x))
    return out


def _positive_int(value: int, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _count_in_range(count: int, minimum: int, n: int, cap: int) -> int:
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
        raise ValueError(f"count must be an integer, got {count!r}")
    if not minimum <= count <= n:
        raise ValueError(
            f"count={count} is outside [{minimum}, {n}]: first-fit decreasing packs these {n} "
            f"samples into no fewer than {minimum} micro-batches of at most {cap} tokens, and "
            f"each micro-batch needs at least one sample"
        )
    return int(count)


# ---------------------------------------------------------------------------------------------
# Karmarkar-Karp


def _join(a: _Tree, b: _Tree) -> _Tree:
    if a is None:
        return b
    if b is None:
        return a
    return (a, b)


def _flatten(tree: _Tree) -> list[int]:
    out: list[int] = []
    stack = [tree]
    while stack:
        t = stack.pop()
        if t is None:
            continue
        if isinstance(t, tuple):
            stack.extend(t)
        else:
            out.append(t)
    return out


def _kk_python(
    vals: list[int], order: list[int], parts: int, equal_size: bool
) -> list[list[int]]:
    """k-way largest differencing over the positions ``order`` (descending by length).

    With ``equal_size`` ``len(order)`` must be a multiple of ``parts``. Returns ``parts`` lists
    of positions (unsorted, in an order that depends only on the values).

    A partial solution is a list of its non-empty subsets ``(sum, count, uid, items)`` sorted
    ascending; the ``parts - len(list)`` empty subsets are implicit and rank below every
    non-empty one (even one of zero-length items), so merges fill empty subsets first and no
    subset stays empty while items remain. ``uid`` breaks ties between equal (sum, count): a
    position for one item, a creation counter for a merge, so the items are never compared and
    the outcome depends only on the values and the order of equal ones. Seeding a solution with
    one item costs O(1), not O(parts), and merging a full solution with one of m non-empty
    subsets touches m of its subsets plus a C-level copy."""
    k = parts
    if k == 1:
        return [list(order)]
    heap: list[tuple[int, int, list[tuple[int, int, int, _Tree]]]] = []
    if equal_size:
        for g in range(0, len(order), k):
            sol = sorted((vals[p], 1, p, p) for p in order[g : g + k])
            heap.append((sol[0][0] - sol[-1][0], len(heap), sol))
    else:
        for p in order:
            heap.append((-vals[p], len(heap), [(vals[p], 1, p, p)]))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)  # key: (-spread, creation order); solutions are never compared
    seq = len(heap)
    uid = len(vals)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        # Pair each subset of a with the subset of b of opposite rank (a's largest with b's
        # smallest), implicit empties included: only a's and b's m smallest non-empty subsets
        # meet a non-empty partner, a[i] with b[m-1-i]; the rest meet empties.
        m = len(a) + len(b) - k
        if m <= 0:
            merged = a + b
            merged.sort()
        else:
            merged = a[m:] + b[m:]
            for i in range(m):
                sa, ca, _, ta = a[i]
                sb, cb, _, tb = b[m - 1 - i]
                merged.append((sa + sb, ca + cb, uid, _join(ta, tb)))
                uid += 1
            merged.sort()  # runs: a[m:], b[m:], the new subsets
        low = merged[0][0] if len(merged) == k else 0
        heapq.heappush(heap, (low - merged[-1][0], seq, merged))
        seq += 1
    final = heap[0][2]
    return [_flatten(s[3]) for s in final] + [[] for _ in range(k - len(final))]


def _canonical_python(groups: list[list[int]]) -> list[list[int]]:
    """Each group sorted ascending; groups ordered by first position, empty groups last."""
    out = [sorted(g) for g in groups]
    out.sort(key=lambda g: (0, g[0]) if g else (1, 0))
    return out


# ---------------------------------------------------------------------------------------------
# micro-batches


def _first_fit_decreasing_python(
    vals: list[int], positions: Sequence[int], cap: int
) -> tuple[list[int], list[list[int]]]:
    """Oversize positions (each needs a micro-batch of its own) and FFD bins for the rest.

    First fit over a row of bins that starts empty: a max-tree over the bins' free room finds
    the leftmost bin with room for an item in O(log n)."""
    oversize = [p for p in positions if vals[p] > cap]
    rest = sorted((p for p in positions if vals[p] <= cap), key=vals.__getitem__, reverse=True)
    size = 1
    while size < len(rest):
        size *= 2
    room = [cap] * (2 * size)  # room[size + b]: free tokens of bin b; inner nodes: max below
    bins: list[list[int]] = []
    for p in rest:
        x = vals[p]
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= x else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([p])
        else:
            bins[b].append(p)
        room[node] -= x
        while node > 1:  # refresh the maxima above, up to the first that does not change
            node //= 2
            left, right = room[2 * node], room[2 * node + 1]
            best = left if left >= right else right
            if room[node] == best:
                break
            room[node] = best
    return oversize, bins


def _pack(
    vals: list[int], cap: int, count: int, oversize: list[int], ffd: list[list[int]]
) -> list[list[int]]:
    """Exactly ``count`` non-empty bins; needs ``len(oversize) + len(ffd) <= count <= items``."""
    k = count - len(oversize)
    normal = [p for b in ffd for p in b]
    bins: list[list[int]] = []
    if k:
        order = _descending(vals, normal)
        # KK balances the sums but does not know the cap: repair it where it breaks the cap,
        # and where that fails, balance FFD's bins, which respect it.
        bins = _refine(_kk(vals, order, k, equal_size=False), vals, until=cap)
        if max(_sums(bins, vals)) > cap:
            bins = _refine(_split(ffd, k, vals), vals)
    return bins + [[p] for p in oversize]


def _sums(bins: list[list[int]], vals: list[int]) -> list[int]:
    return [sum(map(vals.__getitem__, b)) for b in bins]


def _split(ffd: list[list[int]], k: int, vals: list[int]) -> list[list[int]]:
    """FFD's bins split into ``k``: the heaviest bin with two or more items halves by KK."""
    bins = [list(b) for b in ffd]
    sums = _sums(bins, vals)
    while len(bins) < k:
        i = max((j for j in range(len(bins)) if len(bins[j]) > 1), key=sums.__getitem__)
        order = _descending(vals, bins[i])
        left, right = _kk(vals, order, 2, equal_size=False)
        bins[i] = left
        sums[i] = sum(map(vals.__getitem__, left))
        bins.append(right)
        sums.append(sum(map(vals.__getitem__, right)))
    return bins


_PARTNERS = 4  # lightest bins a heavy bin tries to trade with


def _refine_python(
    bins: list[list[int]], vals: list[int], until: int = 0, moves: bool = True
) -> list[list[int]]:
    """Lower heavy bins by moving a sample to, or swapping one with, a light bin (swaps only,
    keeping every bin's size, if not ``moves``).

    The heaviest bin that has not been found stuck trades with the lightest bin that allows an
    improvement (among the few lightest); a bin no trade can lower is marked stuck and the next
    heaviest goes on. Stops when the heaviest open bin holds at most ``until`` tokens (with
    ``until`` > 0, also as soon as a bin above ``until`` is stuck: the caller then gives up on
    these bins), when every bin is stuck, or at a step limit.

    Every trade leaves both bins below the heavier one's old sum, so the largest sum never grows
    (a cap that held still holds) and the sorted sums fall lexicographically. Moves never empty
    a bin."""
    k = len(bins)
    if k < 2:
        return bins
    bins = [list(b) for b in bins]
    sums = _sums(bins, vals)
    stuck = [False] * k
    for _ in range(4 * k + 16):
        order = sorted(range(k), key=sums.__getitem__)  # stable: ties by bin index
        hi = next((i for i in reversed(order) if not stuck[i]), None)
        if hi is None or sums[hi] <= until:
            break
        step = None
        for lo in order[:_PARTNERS]:
            diff = sums[hi] - sums[lo]
            if diff <= 1:
                break
            step = _best_exchange(bins[hi], bins[lo], vals, diff, moves)
            if step is not None:
                break
        if step is None:
            if until:
                break
            stuck[hi] = True
            continue
        out, into = step
        if out is not None:
            bins[hi].remove(out)
            bins[lo].append(out)
        if into is not None:
            bins[lo].remove(into)
            bins[hi].append(into)
        delta = (vals[out] if out is not None else 0) - (vals[into] if into is not None else 0)
        sums[hi] -= delta
        sums[lo] += delta
    return bins


def _best_exchange(
    heavy: list[int], light: list[int], vals: list[int], diff: int, moves: bool = True
) -> tuple[int | None, int | None] | None:
    """The move (x, None) or swap (x, y) from ``heavy`` to ``light`` that shifts d tokens,
    0 < d < diff, with d nearest diff / 2; None if there is none. Moves only if ``moves``."""
    best = diff  # score max(d, diff - d); must beat diff
    step = None
    hv = sorted((vals[p], p) for p in heavy)
    if moves and len(heavy) > 1:
        i = bisect.bisect_left(hv, (diff // 2, -1))
        for x, p in hv[max(0, i - 1) : i + 2]:
            if 0 < x < diff and max(x, diff - x) < best:
                best, step = max(x, diff - x), (p, None)
    lv = sorted((vals[p], p) for p in light)
    lvals = [v for v, _ in lv]
    last = None
    for x, p in hv:
        if x == last:
            continue
        last = x
        j = bisect.bisect_left(lvals, x - diff // 2)
        for y, q in lv[max(0, j - 1) : j + 1]:
            d = x - y
            if 0 < d < diff and max(d, diff - d) < best:
                best, step = max(d, diff - d), (p, q)
    return step
