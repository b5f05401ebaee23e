"""``BaseSampler``: TransferQueue's interface for choosing a batch among the ready samples.

A sampler maps ``(ready_indexes, batch_size, ...)`` to ``(sampled, consumed)``. Under tqueue the
built-in samplers are carried out by the controller's own policies (``transfer_queue.interface``
maps them); the classes here are their reference behaviour, and a user's subclass runs as
written when the shim calls it in the client process (see docs/migrating.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BaseSampler(ABC):
    """Subclasses implement ``sample``. ``_states[partition][task][dp_rank][batch_index]`` holds
    results already handed out, so that the peers of one data-parallel rank get the same batch."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        """Return ``(sampled, consumed)``: the indexes to hand out and those to mark consumed."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None) -> bool:
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        ranks = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in ranks and config.get("batch_index") in ranks[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self._states = state["_states"]
