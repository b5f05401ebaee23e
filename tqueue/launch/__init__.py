"""Ways to start a cluster; the protocol does not depend on any of them."""

from ._local import LocalCluster

__all__ = ["LocalCluster"]
