"""Run one of TransferQueue's tutorial scripts with Ray pinned to 127.0.0.1 (no dashboard).

Usage: python run_script.py SCRIPT. The script runs as ``__main__``; only ``ray.init`` is
wrapped, so that nothing the tier starts listens beyond loopback.
"""

from __future__ import annotations

import functools
import runpy
import sys
from typing import Any


def _pin_ray() -> None:
    try:
        import ray
    except ImportError:
        return
    init = ray.init

    @functools.wraps(init)
    def loopback_init(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_node_ip_address", "127.0.0.1")
        kwargs.setdefault("include_dashboard", False)
        return init(*args, **kwargs)

    ray.init = loopback_init


if __name__ == "__main__":
    _pin_ray()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
