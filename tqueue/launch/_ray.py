"""Launch on Ray: the controller and storage units as Ray actors (``tqueue.ray``).

Each actor supervises one server process started the way an operator starts it (``python -m
tqueue controller|storage-unit ... --watch-stdin``): the server stops when its actor dies (its
stdin closes), and Ray places the actor, so the server runs on the node Ray chose. Units go
round-robin over the alive nodes that have every resource of ``resources`` (a filter, e.g.
``{"tqueue": 1}`` for nodes given a custom resource), or into the bundles of a placement group.
The controller's address comes back; clients connect to it from any process, in Ray or not.
``start`` also registers the cluster for its Ray job (a light named actor, ``_discovery.py``):
any process of the job finds it with ``address()`` or ``connect()``, with no address passed
around; another job on the same Ray cluster finds its own. Only this module and
``_discovery.py`` call Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _env
from .._extras import require
from . import _discovery
from ._local import controller_flags, unit_flags
from ._serve import READY


def _ray() -> Any:
    return require("ray", "ray", by="tqueue.ray")


class ServerActor:
    """The body of one actor: one tqueue server process, started in ``__init__``."""

    def __init__(self, args: Sequence[str], bind_host: str) -> None:
        import ray

        host = bind_host or ray.util.get_node_ip_address()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tqueue", *args, "--bind", f"tcp://{host}:0", "--watch-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith(READY):
            raise RuntimeError(f"tqueue {args[0]} did not start on node {ray.get_runtime_context().get_node_id()}: {line!r}")
        self.proc.stdout.close()
        self.facts = {**json.loads(line[len(READY):]), "node": ray.get_runtime_context().get_node_id(), "pid": self.proc.pid}

    def info(self) -> dict[str, Any]:
        return self.facts

    def stop(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the server sees EOF and stops cleanly
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclasses.dataclass
class RayCluster:
    """A tqueue cluster of Ray actors: ``address`` for clients; ``controller`` and ``units``
    are the actors' facts (node id, address, pid). ``stop()`` stops the servers and their
    actors."""

    address: str
    controller: dict[str, Any]
    units: list[dict[str, Any]]
    actors: list[Any]
    registry: list[Any] = dataclasses.field(default_factory=list)

    def stop(self) -> None:
        ray = _ray()
        _discovery.withdraw(ray, self.registry)  # no later look-up finds a cluster that is stopping
        self.registry.clear()
        for actor in reversed(self.actors):  # units first
            try:
                ray.get(actor.stop.remote(), timeout=60)
            finally:
                ray.kill(actor)
        self.actors.clear()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start(
    num_storage_units: int = 2,
    *,
    resources: Mapping[str, float] | None = None,
    placement_group: Any = None,
    controller_resources: Mapping[str, float] | None = None,
    controller: Mapping[str, Any] | None = None,
    storage: Mapping[str, Any] | None = None,
    bind_host: str = "",
    name: str = "tqueue",
    register: bool = True,
) -> RayCluster:
    """Start a controller and ``num_storage_units`` units as Ray actors (``ray.init()`` first).

    ``resources``: the units go round-robin over alive nodes that have these resources (each
    unit asks for none of them: they only filter), or, with ``placement_group``, one per
    bundle in order. ``controller_resources``: what the controller's actor asks for (e.g. a
    custom resource of the head node). ``controller`` / ``storage``: config options as for
    :class:`~tqueue.LocalCluster`. ``bind_host``: the servers' host (default: the node's
    address as Ray knows it). ``register``: publish the cluster for this Ray job under
    ``name`` (``address(name=...)`` and ``connect(name=...)`` find it); a second ``start`` of
    the same name in one job raises ``ValueError`` before it starts anything.
    """
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if num_storage_units < 1:
        raise ValueError(f"num_storage_units must be at least 1, got {num_storage_units}")
    if register and _discovery.find(ray, name=name) is not None:
        raise ValueError(f"a tqueue cluster named {name!r} is registered for this Ray job already: "
                         "stop it, or give this one another name")
    remote = ray.remote(num_cpus=0)(ServerActor)
    actors: list[Any] = []
    registry: list[Any] = []
    try:
        ctl_opts: dict[str, Any] = {"name": f"{name}-controller"}
        if controller_resources:
            ctl_opts["resources"] = dict(controller_resources)
        ctl = remote.options(**ctl_opts).remote(["controller", *controller_flags(controller)], bind_host)
        actors.append(ctl)
        ctl_facts = ray.get(ctl.info.remote(), timeout=120)
        address = ctl_facts["address"]
        strategies: list[Any]
        if placement_group is not None:
            bundles = placement_group.bundle_count
            strategies = [PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i % bundles)
                          for i in range(num_storage_units)]
        else:
            nodes = [n for n in ray.nodes() if n.get("Alive") and all(
                n.get("Resources", {}).get(k, 0) >= v for k, v in (resources or {}).items())]
            if not nodes:
                raise ValueError(f"no alive Ray node has the resources {dict(resources or {})}")
            nodes.sort(key=lambda n: n["NodeID"])
            strategies = [NodeAffinitySchedulingStrategy(nodes[i % len(nodes)]["NodeID"], soft=False)
                          for i in range(num_storage_units)]
        units = []
        for i, strategy in enumerate(strategies):
            args = ["storage-unit", "--controller", address, "--name", f"{name}-unit-{i}", *unit_flags(storage)]
            actor = remote.options(name=f"{name}-unit-{i}", scheduling_strategy=strategy).remote(args, bind_host)
            actors.append(actor)
            units.append(actor)
        unit_facts = ray.get([u.info.remote() for u in units], timeout=120)
        if register:
            registry = _discovery.publish(ray, address, {"address": address, "units": len(units)}, name=name)
    except BaseException:
        if registry:
            _discovery.withdraw(ray, registry)
        for actor in reversed(actors):
            ray.kill(actor)
        raise
    return RayCluster(address=address, controller=ctl_facts, units=unit_facts, actors=actors, registry=registry)


def address(*, name: str = "tqueue", timeout: float | None = None) -> str:
    """The address of the cluster this Ray job registered under ``name`` (``start``), waited
    for up to ``timeout`` seconds (default ``TQUEUE_DISCOVERY_TIMEOUT``, 60: a worker may
    start before the cluster does); raises
    :class:`~tqueue.DiscoveryError`, saying where it looked, where none is registered by then
    or where this process is not connected to Ray."""
    ray = _ray()
    if not ray.is_initialized():
        raise _discovery.DiscoveryError("tqueue.ray.address() looks in the Ray job of this process, which is "
                                        "not connected to Ray: call ray.init() first, or pass the address")
    wait = _env.discovery_timeout() if timeout is None else timeout
    return str(_discovery.lookup(ray, name=name, timeout=wait)["address"])


def connect(*, name: str = "tqueue", timeout: float | None = None, config: Any = None) -> Any:
    """A :class:`~tqueue.Client` of the cluster this Ray job registered (``address``)."""
    from ..client import Client

    return Client(address(name=name, timeout=timeout), config=config)


__all__ = ["RayCluster", "ServerActor", "address", "connect", "start"]
