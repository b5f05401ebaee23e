"""Checks of call arguments, and their wording in errors, shared by the client's modules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..wire import BatchMeta, GroupId


def _wait(timeout: float | None, default: float, name: str = "timeout") -> float:
    wait = default if timeout is None else timeout
    if not isinstance(wait, (int, float)) or math.isnan(wait) or wait < 0:
        raise InvalidArgumentError(f"{name} must be >= 0 seconds (or math.inf), got {timeout!r}")
    return float(wait)


def _versions(version: int | Sequence[int] | None, count: int, partition: str) -> list[int] | None:
    if version is None:
        return None
    if isinstance(version, int):
        return [version] * count
    out = [int(v) for v in version]
    if len(out) != count:
        raise InvalidArgumentError(f"put to partition {partition!r}: {len(out)} versions for {count} samples")
    return out


def _groups(groups: Sequence[GroupId] | GroupId, count: int, partition: str) -> list[GroupId] | None:
    if groups is None:
        return None
    if isinstance(groups, (str, int)):
        return [groups] * count
    out = list(groups)
    if len(out) != count:
        raise InvalidArgumentError(
            f"put to partition {partition!r}: {len(out)} group ids for {count} samples"
        )
    for i, g in enumerate(out):
        if g is not None and type(g) not in (str, int):
            raise InvalidArgumentError(
                f"group id of sample {i} in the put to partition {partition!r} is a "
                f"{type(g).__name__}; group ids are str or int"
            )
    return out


def _rows(value: Any) -> list[Any]:
    """Per-sample values of a field (a list, or a tensor split along its first dimension)."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return list(value)


def _by_unit(meta: BatchMeta) -> dict[int, np.ndarray]:
    """Batch positions of a meta's samples per unit (pad rows, unit -1, left out)."""
    units = np.asarray(meta.units, dtype=np.int64)
    if len(units) != len(meta.indexes):
        raise InvalidArgumentError("meta has a different number of units and indexes")
    return {int(u): np.flatnonzero(units == u) for u in np.unique(units) if u >= 0}  # -1: pad rows


def listed(indexes: list[int], most: int = 32) -> str:
    """Sample indexes for an error message: all of them, or the first ``most`` and how many more."""
    if len(indexes) <= most:
        return str(indexes)
    return f"{indexes[:most]} and {len(indexes) - most} more"
