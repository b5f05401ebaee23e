"""Ray's object store: producers ``ray.put``, consumers ``ray.get`` the refs the driver hands them.

Producers and consumers are Ray actors (one process each, kept across runs). A producer
generates its part of the batch (untimed), then ``ray.put``s each of its puts and returns
the ObjectRefs inside a dict, so Ray passes them on as refs instead of resolving them. The
driver submits each consumer's ``get`` with the producers' returns as arguments, so a
consumer starts as soon as its producers are done; it ``ray.get``s its pieces and, where
it has several (8to4), concatenates them into one batch.

Two variants of one class: ``RaySystem()`` sends torch tensors as users pass them (torch's
own pickling: the bytes go in-band), ``RaySystem(zero_copy=True)`` sets
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` for the driver and every worker, so tensors go
out-of-band into the store and ``ray.get`` returns tensors mapped onto it.

Objects are freed after every run (the driver drops the refs, consumers drop what they
hold, producers keep nothing), so the store's pages are reused: the first run after
``start()`` pays for fresh store pages, later runs measure a warm store.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from benchmarks import workload
from benchmarks.harness import Result, Scenario, now, settle
from benchmarks.systems import Plan, assemble, grow_actors, is_view_of_larger, make_plan, make_puts, missing, repo_root

ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"
TIMEOUT_S = 600.0


def _plan(scenario: dict[str, Any], size: int) -> Plan:
    return make_plan(Scenario(**scenario), size, split_per_consumer=True)


def ray_unavailable() -> str | None:
    if missing("ray"):
        return "ray is not installed (bash benchmarks/install_peers.sh)"
    return None


# Ray turns a node address of 127.0.0.1 into the host's interface address unless "clusters"
# are off (``ray_constants.ENABLE_RAY_CLUSTER``, read from this variable when ray is imported):
# off, every Ray server of this private single-node instance advertises 127.0.0.1.
_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_saved: list[tuple[str, str | None, Any]] = []


def ray_init(*, env_vars: dict[str, str], object_store_bytes: int, setup_hook: str | None = None,
             verbose: bool = False) -> None:
    """Start a private local Ray on 127.0.0.1 whose workers can import ``benchmarks``.

    Each ``env_vars`` entry is also set in this process (the driver) until :func:`ray_shutdown`.
    """
    import ray
    import ray._private.ray_constants as rc

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process: stop the other Ray-based system first")
    _saved.append(("ENABLE_RAY_CLUSTER", os.environ.get(_CLUSTER_ENV), rc.ENABLE_RAY_CLUSTER))
    os.environ[_CLUSTER_ENV] = "0"
    rc.ENABLE_RAY_CLUSTER = False
    for k, v in env_vars.items():
        _saved.append((k, os.environ.get(k), None))
        os.environ[k] = v
    path = os.pathsep.join(p for p in (repo_root(), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONPATH": path, **env_vars}}
    if setup_hook:
        runtime_env["worker_process_setup_hook"] = setup_hook
    try:
        ray.init(
            num_cpus=max(16, os.cpu_count() or 1),  # logical: every actor fits, whatever the core count
            object_store_memory=object_store_bytes,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env=runtime_env,
            log_to_driver=verbose,
            namespace="benchmarks",
        )
    except BaseException:
        ray_shutdown()
        raise


def ray_shutdown() -> None:
    """Stop the Ray that :func:`ray_init` started (its processes with it) and restore the env."""
    import ray
    import ray._private.ray_constants as rc

    ray.shutdown()
    while _saved:
        key, env, const = _saved.pop()
        name = _CLUSTER_ENV if key == "ENABLE_RAY_CLUSTER" else key
        if env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = env
        if key == "ENABLE_RAY_CLUSTER":
            rc.ENABLE_RAY_CLUSTER = const


class _Producer:
    """Ray actor: generates its puts (untimed), then ``ray.put``s them (timed)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[dict[str, Any]] = []
        self.spent: list[dict[str, Any]] = []
        self.clone_views = False

    def ready(self) -> bool:
        return True

    def prepare(self, scenario: dict[str, Any], size: int, clone_views: bool) -> int:
        self.spent = []  # the last run's batch, freed here, untimed (harness.py)
        self.parts = make_puts(_plan(scenario, size), self.index)
        self.clone_views = clone_views
        return sum(workload.nbytes(p) for p in self.parts)

    def put(self) -> dict[str, Any]:
        import ray
        import torch

        t0 = now()
        refs = []
        for part in self.parts:
            if self.clone_views:  # torch pickles a view's whole storage: send only the rows
                part = {k: v.clone() if isinstance(v, torch.Tensor) and is_view_of_larger(v) else v
                        for k, v in part.items()}
            refs.append(ray.put(part))
            del part
        t1 = now()
        self.spent, self.parts = self.parts, []
        return {"t0": t0, "t1": t1, "refs": refs}


class _Consumer:
    """Ray actor: ``ray.get``s its pieces and holds them as one batch (timed), then verifies."""

    def __init__(self, index: int) -> None:
        self.index = index

    def ready(self) -> bool:
        return True

    def get(self, scenario: dict[str, Any], size: int, *sent: dict[str, Any]) -> dict[str, Any]:
        import ray

        plan = _plan(scenario, size)
        by_producer = dict(zip(plan.producers_of(self.index), sent))
        pieces = plan.pieces[self.index]
        t0 = now()
        objs = ray.get([by_producer[pc.producer]["refs"][pc.put] for pc in pieces], timeout=TIMEOUT_S)
        parts = [o if pc.lo == 0 and pc.hi == len(o["meta"]) else workload.select(o, pc.lo, pc.hi)
                 for o, pc in zip(objs, pieces)]
        batch = assemble(parts)
        t1 = now()
        q0, q1 = plan.shares[self.index]
        workload.verify(batch, q0, q1, multimodal=plan.scenario.multimodal)
        del batch, parts, objs, by_producer, sent
        settle()  # mapped (zero-copy) tensors pin their objects until they are gone
        return {"t0": t0, "t1": t1}


class RaySystem:
    """Ray 2.60 object store; ``zero_copy`` turns on Ray's zero-copy torch tensor serialization."""

    transport = "shm"

    def __init__(self, zero_copy: bool = False, object_store_gb: float = 8.0, verbose: bool = False) -> None:
        self.zero_copy = zero_copy
        self.name = "ray-zerocopy" if zero_copy else "ray"
        self.object_store_bytes = int(object_store_gb * 1e9)
        self.verbose = verbose
        if zero_copy:
            self.copies = ("put: 1 (tensor bytes out-of-band into the store; row slices of a batch are "
                           "contiguous, no clone); get: 0 (tensors mapped onto the store), +1 where a "
                           "consumer concatenates several puts (8to4); prompt/meta pickled in-band")
        else:
            self.copies = ("put: several (torch pickles each tensor in-band: torch.save to bytes, into the "
                           "pickle, into the store) +1 on DP splits (1to4: slices are cloned first, else each "
                           "would carry its whole storage); get: 2 (bytes out of the store, torch.load into new "
                           "tensors), +1 where a consumer concatenates several puts (8to4)")
        self._producers: list[Any] = []
        self._consumers: list[Any] = []
        self._saved_const: Any = None
        self._started = False

    def unavailable(self) -> str | None:
        return ray_unavailable()

    def start(self) -> None:
        env: dict[str, str] = {}
        if self.zero_copy:
            # Workers read the variable when they import ray; this process may already have.
            import ray._private.ray_constants as rc

            env[ZERO_COPY_ENV] = "1"
            self._saved_const = rc.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS
            rc.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = True
        ray_init(env_vars=env, object_store_bytes=self.object_store_bytes, verbose=self.verbose)
        self._started = True

    def _grow(self, producers: int, consumers: int) -> None:
        grow_actors(self._producers, self._consumers, (producers, consumers), (_Producer, _Consumer), TIMEOUT_S)

    def run(self, scenario: Scenario, size: int) -> Result:
        import ray

        plan = make_plan(scenario, size, split_per_consumer=True)
        self._grow(scenario.producers, scenario.consumers)
        scn = dataclasses.asdict(scenario)
        prods, cons = self._producers[: scenario.producers], self._consumers[: scenario.consumers]
        nbytes = sum(ray.get([p.prepare.remote(scn, size, not self.zero_copy) for p in prods], timeout=TIMEOUT_S))
        sent = [p.put.remote() for p in prods]
        got = [c.get.remote(scn, size, *[sent[p] for p in plan.producers_of(i)]) for i, c in enumerate(cons)]
        gets = ray.get(got, timeout=TIMEOUT_S)
        puts = [{"t0": s["t0"], "t1": s["t1"]} for s in ray.get(sent, timeout=TIMEOUT_S)]
        del sent, got  # the last refs to this run's objects: the store frees them
        return Result(
            system=self.name, scenario=scenario.name, size=size, transport=self.transport, nbytes=nbytes,
            put_s=max(p["t1"] - p["t0"] for p in puts),
            get_meta_s=None,
            get_s=max(g["t1"] - g["t0"] for g in gets),
            e2e_s=max(g["t1"] for g in gets) - min(p["t0"] for p in puts),
        )

    def stop(self) -> None:
        if self._started:
            import ray

            try:
                for a in self._producers + self._consumers:
                    ray.kill(a)
            finally:
                self._producers, self._consumers = [], []
                ray_shutdown()
                self._started = False
        if self._saved_const is not None:
            import ray._private.ray_constants as rc

            rc.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = self._saved_const
            self._saved_const = None
