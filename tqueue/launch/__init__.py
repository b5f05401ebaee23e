"""Ways to start a cluster; the protocol does not depend on any of them.

Described in docs/architecture.md, "Launch"; ``LocalCluster`` and the commands in docs/api.md.
"""

from ._local import LocalCluster

__all__ = ["LocalCluster"]
