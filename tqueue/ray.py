"""Launch tqueue on Ray (the ``ray`` extra: ``pip install -e '.[ray]'`` from a checkout).

``tqueue.ray.start(num_storage_units, resources=..., placement_group=...)`` starts the
controller and storage units as Ray actors and returns a :class:`RayCluster` whose
``address`` any client connects to, in Ray or not, and registers it for the Ray job: in any
process of the job, ``tqueue.ray.connect()`` (a client) or ``tqueue.ray.address()`` finds it
without an address passed around, waiting up to a timeout for a worker that starts first, and
raises :class:`~tqueue.DiscoveryError` saying where it looked. Importing this module does not import Ray;
``start`` does, and raises an ``ImportError`` naming the install command where it is missing.
See tqueue/launch/_ray.py.
"""

from .launch._ray import RayCluster, address, connect, start

__all__ = ["RayCluster", "address", "connect", "start"]
