"""Finding a job's cluster on Ray: a named actor that holds its address and config.

A Ray worker inherits the raylet's environment, not its creator's, so an address in an
environment variable does not reach the actors a framework starts. The process that starts a
cluster publishes it instead, in a light actor (:class:`Registry`: an address and a config, no
data) named after the Ray job, so that two jobs on one Ray cluster each find their own. The
actor is owned by the process that published it (it is not detached): it dies with that
process, and so with the cluster that process started. A cluster stopped in a process that
goes on is withdrawn from its registry, which stays for that process's next cluster (Ray
frees an actor's name only some time after it is killed). Clients hold the address once they
have it: killing the actor stops later look-ups, not running clients.

``publish(address, config, name=..., namespace=...)`` registers; ``lookup(...)`` finds the
job's registry (waiting up to ``timeout`` where one is expected later) or raises
:class:`DiscoveryError`, which says where it looked. Ray offers no wait on a named actor's
creation, so ``lookup`` asks again at growing intervals (50 ms up to 1 s) until its deadline.
Only Ray's own calls are made here; importing this module does not import Ray.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from ..errors import DiscoveryError

log = logging.getLogger(__name__)

NAME = "tqueue"
NAMESPACE = "tqueue"
_FIRST_WAIT = 0.05
_OWNED: dict[tuple[str, str, str], list[Any]] = {}  # this process's registries, by (Ray cluster, namespace, name)
_LONGEST_WAIT = 1.0


class Registry:
    """The body of the registry actor: a job's cluster address and config, nothing else."""

    def __init__(self, address: str, config: Any, job_id: str) -> None:
        self.address: str | None = address
        self.config = config
        self.job = job_id

    def set(self, address: str | None, config: Any) -> None:
        """A new cluster of the publishing process, or None: its cluster stopped."""
        self.address, self.config = address, config

    def get_config(self) -> Any:
        return self.config

    def get_address(self) -> str | None:
        return self.address

    def job_id(self) -> str:
        return self.job


def ray_if_running() -> Any:
    """Ray's module where this process is connected to a Ray cluster (a driver that called
    ``ray.init`` or a Ray worker), else None; never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    return ray


def serving_host(ray: Any) -> str:
    """Where a cluster started in this process listens: loopback, unless it runs on a Ray
    cluster of several nodes, whose other nodes reach it at this node's address."""
    if ray is None or sum(1 for n in ray.nodes() if n.get("Alive")) < 2:
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address())


def in_ray_worker(ray: Any) -> bool:
    """Whether this process is a Ray worker (an actor or a task), not a driver."""
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def job_name(ray: Any, name: str) -> str:
    """The registry's name for this Ray job: ``name`` and the job's id."""
    return f"{name}.{ray.get_runtime_context().get_job_id()}"


def publish(ray: Any, address: str, config: Any, *, name: str = NAME, namespace: str = NAMESPACE,
            plain: bool = False) -> Any:
    """Register ``address`` and ``config`` for this Ray job under ``name`` in ``namespace``;
    returns the actor. ``plain``: also take ``name`` itself where no other job holds it (the
    name other programs look up, as TransferQueue's tests do); this job's name is always the
    one that ``lookup`` reads. Raises ``ValueError`` where this job's name is taken (another
    process of the job published first)."""
    job = ray.get_runtime_context().get_job_id()
    key = (ray.get_runtime_context().gcs_address, namespace, job_name(ray, name))  # a new Ray cluster reuses job ids
    owned = _OWNED.get(key)
    if owned is not None:  # this process's registry, withdrawn when its last cluster stopped
        if find(ray, name=name, namespace=namespace) is not None:
            raise ValueError(f"{job_name(ray, name)!r} holds a running cluster of this process")
        ray.get([a.set.remote(address, config) for a in owned], timeout=60)
        return owned
    remote = ray.remote(num_cpus=0)(Registry)
    actors = [remote.options(name=job_name(ray, name), namespace=namespace).remote(address, config, job)]
    ray.get(actors[0].get_address.remote(), timeout=60)
    if plain:
        try:
            alias = remote.options(name=name, namespace=namespace).remote(address, config, job)
            ray.get(alias.get_address.remote(), timeout=60)
            actors.append(alias)
        except ValueError:
            log.info("Ray actor %r in namespace %r belongs to another job; this job's is %r",
                     name, namespace, job_name(ray, name))
    _OWNED[key] = actors
    log.info("cluster %s registered on Ray as %r (namespace %r)", address, job_name(ray, name), namespace)
    return actors


def withdraw(ray: Any, actors: list[Any]) -> None:
    """Say in ``publish``'s registry that its cluster stopped (a look-up then finds none)."""
    try:
        ray.get([a.set.remote(None, None) for a in actors], timeout=60)
    except ray.exceptions.RayActorError:  # killed meanwhile: nobody finds it either
        pass


def find(ray: Any, *, name: str = NAME, namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """This job's registry's ``{"address", "config"}``, or None where there is none now."""
    try:
        actor = ray.get_actor(job_name(ray, name), namespace=namespace)
    except ValueError:
        return None
    try:
        address, config = ray.get([actor.get_address.remote(), actor.get_config.remote()], timeout=60)
    except ray.exceptions.RayActorError:  # killed, or its owner died, before Ray dropped its name
        return None
    if address is None:  # withdrawn: the cluster stopped
        return None
    return {"address": address, "config": config}


def lookup(ray: Any, *, timeout: float, name: str = NAME, namespace: str = NAMESPACE,
           cancel: threading.Event | None = None) -> dict[str, Any]:
    """This job's registry, waited for up to ``timeout`` seconds; :class:`DiscoveryError`
    (saying where it looked) where none appears by then."""
    deadline = time.monotonic() + timeout
    wait = _FIRST_WAIT
    stop = cancel or threading.Event()
    while True:
        found = find(ray, name=name, namespace=namespace)
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0 or stop.wait(min(wait, left)):
            break
        wait = min(wait * 2, _LONGEST_WAIT)
    raise DiscoveryError(
        f"no cluster is registered for Ray job {ray.get_runtime_context().get_job_id()}: looked for the "
        f"Ray actor {job_name(ray, name)!r} in namespace {namespace!r} for {timeout:g} s. Start the cluster "
        "first in a process of this job (the driver or a task-runner actor), or give its address"
    )


__all__ = ["NAME", "NAMESPACE", "DiscoveryError", "Registry", "find", "in_ray_worker", "job_name", "lookup",
           "publish", "ray_if_running", "serving_host", "withdraw"]
