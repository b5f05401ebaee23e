"""Bridges: inference engines and trainers on either side of tqueue.

Nothing below this package imports it. Each engine is an optional extra, imported lazily by
the bridge that needs it; the conversions of engine outputs into tqueue's standard rollout
fields (:mod:`._fields`) and the HTTP drivers need no engine at all.

The names load on first use, so that the command line can take the engine demo's flags from
:mod:`.demo` without importing torch.

Described in docs/bridges.md; the names in docs/api.md, "Bridges".

Map: docs/architecture.md#launch-bridges-and-demos
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._driver import Engine, Rollouts, StepReport
    from ._fields import ASSISTANT, FIELDS, FINISHES, TOOL, Trajectory
    from .sglang import SGLangEngine, from_generate
    from .vllm import VLLMEngine, VLLMHTTPEngine, from_completion

__all__ = [
    "ASSISTANT",
    "FIELDS",
    "FINISHES",
    "Engine",
    "Rollouts",
    "SGLangEngine",
    "StepReport",
    "TOOL",
    "Trajectory",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "from_completion",
    "from_generate",
]

_WHERE = {
    "Engine": "._driver", "Rollouts": "._driver", "StepReport": "._driver",
    "ASSISTANT": "._fields", "FIELDS": "._fields", "FINISHES": "._fields", "TOOL": "._fields",
    "Trajectory": "._fields",
    "SGLangEngine": ".sglang", "from_generate": ".sglang",
    "VLLMEngine": ".vllm", "VLLMHTTPEngine": ".vllm", "from_completion": ".vllm",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tqueue.bridges' has no attribute {name!r}")
