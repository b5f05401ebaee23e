"""Launch tqueue on Ray (the ``ray`` extra: ``pip install -e '.[ray]'`` from a checkout).

``tqueue.ray.start(num_storage_units, resources=..., placement_group=...)`` starts the
controller and storage units as Ray actors and returns a :class:`RayCluster` whose
``address`` any client connects to, in Ray or not. Importing this module does not import Ray;
``start`` does, and raises an ``ImportError`` naming the install command where it is missing.
See tqueue/launch/_ray.py.
"""

from .launch._ray import RayCluster, start

__all__ = ["RayCluster", "start"]
