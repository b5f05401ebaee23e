"""Resets of consumption: a task reads again what it consumed (``ResetConsumption``).

Samples a task consumed become available to it again, counted out of its ``consumed``; samples
it holds under a lease stay leased (their ack still counts), refused ones stay refused. Parked
reads of the partition are woken after the reply, as after a commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...wire import Ok, ResetConsumption
from ..model._samples import AVAILABLE, CONSUMED
from ..model._state import ControllerState


class Resets:
    def __init__(self, state: ControllerState, wake_soon: Callable[[str], None]) -> None:
        self.state = state
        self._wake_soon = wake_soon

    def reset(self, ident: bytes, msg: ResetConsumption, bufs: list[Any]) -> Ok:
        part = self.state.partitions.get(msg.partition)
        if part is None:
            return Ok()  # nothing is consumed in a partition that is not there
        names = list(part.tasks) if msg.task is None else [msg.task]
        again = 0
        for name in names:
            task = part.tasks.get(name)
            if task is None:
                continue
            done = np.flatnonzero(task.state[: part.n] == CONSUMED)
            if not len(done):
                continue
            task.state[done] = AVAILABLE
            task.consumed -= len(done)
            task.lo = min(task.lo, int(done[0]))
            task.group_lo = 0  # cheap to rescan: complete groups only
            again += len(done)
        if again:
            self._wake_soon(part.name)
        return Ok()
