"""Bridges: inference engines and trainers on either side of tqueue.

Nothing below this package imports it. Each engine is an optional extra, imported lazily by
the bridge that needs it; the conversions of engine outputs into tqueue's standard rollout
fields (:mod:`._fields`) and the HTTP drivers need no engine at all.
"""

from ._driver import Engine, Rollouts, StepReport
from ._fields import FIELDS, FINISHES, Trajectory
from .sglang import SGLangEngine, from_generate
from .vllm import VLLMEngine, VLLMHTTPEngine, from_completion

__all__ = [
    "FIELDS",
    "FINISHES",
    "Engine",
    "Rollouts",
    "SGLangEngine",
    "StepReport",
    "Trajectory",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "from_completion",
    "from_generate",
]
