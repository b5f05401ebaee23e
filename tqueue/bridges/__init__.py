"""Bridges: inference engines and trainers on either side of tqueue.

Nothing below this package imports it. Each engine is an optional extra, imported lazily by
the bridge that needs it; the conversions of engine outputs into tqueue's standard rollout
fields (:mod:`._fields`) need no engine at all.
"""

from ._fields import FIELDS, FINISHES, Trajectory
from .sglang import from_generate
from .vllm import from_completion

__all__ = ["FIELDS", "FINISHES", "Trajectory", "from_completion", "from_generate"]
