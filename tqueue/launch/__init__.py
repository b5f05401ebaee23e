"""Ways to start a cluster; the protocol does not depend on any of them.

``LocalCluster`` and the commands are described in docs/api.md; launching from a shell or on
Ray in docs/operations.md.

Map: docs/architecture.md#launch-bridges-and-demos
"""

from ._local import LocalCluster

__all__ = ["LocalCluster"]
