"""TransferQueue 0.1.11 (PyPI ``transferqueue``, module ``transfer_queue``) with SimpleStorage.

``start()`` brings up a private local Ray on 127.0.0.1 and ``transfer_queue.init()``: its
controller and 2 SimpleStorage units, each a Ray actor serving ZeroMQ. Producers and
consumers are Ray actors too (kept across runs); each connects to the running TransferQueue
with ``transfer_queue.init()``, as its docs say a second process does.

Puts and gets go through TransferQueue's key-value interface, the one that lets a consumer
name the samples it takes (a DP rank's contiguous share): a producer turns each put into a
``TensorDict`` (tensors as they are, prompt strings and meta dicts as ``NonTensorStack``,
images as a strided nested tensor) and calls ``kv_batch_put`` with one key per sample
(``s<index>``); a consumer calls ``kv_retrieve_meta`` for its keys (``get_meta_s``) and then
``get_data`` (``get_s``), and turns what comes back into plain tensors and lists. The
driver submits each consumer's get with its producers' returns as arguments, so it starts
as soon as they are done, and clears the run's partition afterwards.

TransferQueue's servers bind the address Ray reports for the node, which is the host's
interface address even when Ray runs on 127.0.0.1, and its port picker binds all
interfaces; :func:`pin_loopback`, run in every Ray worker as its setup hook and in the
driver, points both at 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from benchmarks import workload
from benchmarks.harness import Result, Scenario, now, settle
from benchmarks.systems import Plan, grow_actors, make_plan, make_puts, missing

TIMEOUT_S = 600.0
LOOPBACK = "127.0.0.1"
SETUP_HOOK = "benchmarks.systems.tq_sys.pin_loopback"


def pin_loopback() -> None:
    """Make TransferQueue bind and advertise 127.0.0.1 only, in this process."""
    import importlib
    import socket
    import sys

    def node_ip() -> str:
        return LOOPBACK

    def free_port(ip: str = LOOPBACK) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    zu = importlib.import_module("transfer_queue.utils.zmq_utils")
    originals = {"get_node_ip_address": zu.get_node_ip_address, "get_free_port": zu.get_free_port}
    replacements = {"get_node_ip_address": node_ip, "get_free_port": free_port}
    # The servers import the names into their own modules: patch every copy.
    for mod in ("transfer_queue.controller", "transfer_queue.storage.simple_storage"):
        importlib.import_module(mod)
    for name, module in list(sys.modules.items()):
        if name.startswith("transfer_queue") and module is not None:
            for attr, original in originals.items():
                if getattr(module, attr, None) is original:
                    setattr(module, attr, replacements[attr])


def _plan(scenario: dict[str, Any], size: int) -> Plan:
    return make_plan(Scenario(**scenario), size, split_per_consumer=False)


def _keys(a: int, b: int) -> list[str]:
    return [f"s{i}" for i in range(a, b)]


def _to_tensordict(part: dict[str, Any]) -> Any:
    import torch
    from tensordict import NonTensorStack, TensorDict

    n = len(part["meta"])
    td = TensorDict({k: v for k, v in part.items() if isinstance(v, torch.Tensor)}, batch_size=[n])
    for k in workload.OBJECT_FIELDS:
        td[k] = NonTensorStack.from_list(list(part[k]))
    if workload.IMAGE_FIELD in part:
        with warnings.catch_warnings():  # strided nested tensors are a "prototype" API
            warnings.simplefilter("ignore")
            td[workload.IMAGE_FIELD] = torch.nested.as_nested_tensor(list(part[workload.IMAGE_FIELD]),
                                                                     layout=torch.strided)
    return td


def _from_tensordict(td: Any, n: int) -> dict[str, Any]:
    """What a consumer works with: dense tensors, lists of strings/dicts, a list of images."""
    import torch
    from tensordict import NonTensorStack

    out: dict[str, Any] = {}
    for k in td.keys():
        v = td.get(k)
        if isinstance(v, NonTensorStack):
            out[k] = v.tolist()
        elif isinstance(v, torch.Tensor) and v.is_nested:
            if v.layout == torch.jagged:  # TransferQueue returns per-sample rows as jagged
                offsets = v.offsets()
                lengths = offsets.diff()
                if bool((lengths == lengths[0]).all()):  # equal rows: the values are the batch
                    out[k] = v.values().view(n, int(lengths[0]), *v.values().shape[1:])
                    continue
            out[k] = list(v.unbind())
        else:
            out[k] = v
    return out


class _Producer:
    """Ray actor: generates its puts (untimed), then ``kv_batch_put``s them (timed)."""

    def __init__(self, index: int) -> None:
        import transfer_queue as tq

        tq.init()  # finds the running controller and makes this process's client
        self.index = index
        self.parts: list[dict[str, Any]] = []
        self.spent: list[dict[str, Any]] = []

    def ready(self) -> bool:
        return True

    def prepare(self, scenario: dict[str, Any], size: int, partition: str) -> int:
        self.spent = []  # the last run's batch, freed here, untimed (harness.py)
        plan = _plan(scenario, size)
        self.parts = make_puts(plan, self.index)
        self.ranges = plan.puts[self.index]
        self.partition = partition
        return sum(workload.nbytes(p) for p in self.parts)

    def put(self) -> dict[str, float]:
        import transfer_queue as tq

        t0 = now()
        for (a, b), part in zip(self.ranges, self.parts):
            tq.kv_batch_put(keys=_keys(a, b), partition_id=self.partition, fields=_to_tensordict(part))
        t1 = now()
        self.spent, self.parts = self.parts, []
        return {"t0": t0, "t1": t1}


class _Consumer:
    """Ray actor: metadata for its keys, then the data (both timed), then verifies."""

    def __init__(self, index: int) -> None:
        import transfer_queue as tq

        tq.init()
        self.index = index
        self.client = tq.get_client()

    def ready(self) -> bool:
        return True

    def get(self, scenario: dict[str, Any], size: int, partition: str, *producers_done: Any) -> dict[str, float]:
        plan = _plan(scenario, size)
        q0, q1 = plan.shares[self.index]
        keys = _keys(q0, q1)
        t0 = now()
        meta = self.client.kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        t1 = now()
        if meta.size != len(keys) or not meta.is_ready:
            raise RuntimeError(f"consumer {self.index}: samples {q0}..{q1 - 1} are not all in partition {partition}")
        batch = _from_tensordict(self.client.get_data(meta), q1 - q0)
        t2 = now()
        workload.verify(batch, q0, q1, multimodal=plan.scenario.multimodal)
        del batch, meta
        settle()
        return {"t0": t0, "t1": t1, "t2": t2}


class TransferQueueSystem:
    """TransferQueue 0.1.11 on a private local Ray, SimpleStorage backend."""

    name = "transferqueue"
    transport = "tcp"
    copies = ("put: 0 to wrap tensors in a TensorDict (images: 1, into a strided nested tensor); "
              "routing by sample index over 2 storage units makes each unit's rows a strided view "
              "that TransferQueue's msgpack encoder copies contiguous (1); ZeroMQ tcp to the unit, "
              "which keeps the frames; get: ZeroMQ tcp from the units, per-sample rows packed into "
              "one jagged tensor per field (1); prompt/meta as NonTensorStack")

    def __init__(self, storage_units: int = 2, object_store_gb: float = 2.0, verbose: bool = False) -> None:
        self.storage_units = storage_units
        self.object_store_bytes = int(object_store_gb * 1e9)  # Ray's store is unused here
        self.verbose = verbose
        self._producers: list[Any] = []
        self._consumers: list[Any] = []
        self._client: Any = None
        self._started = False
        self._run = 0

    def unavailable(self) -> str | None:
        absent = missing("ray", "transfer_queue", "tensordict", "omegaconf")
        if absent:
            return f"{', '.join(absent)} not installed (bash benchmarks/install_peers.sh)"
        return None

    def start(self) -> None:
        from benchmarks.systems.ray_sys import ray_init

        # Quiet (its put and get warn that 8 threads exceed 2 cores); set here before
        # transfer_queue is first imported, in the workers by their environment.
        env = {"TQ_LOGGING_LEVEL": os.environ.get("TQ_LOGGING_LEVEL", "ERROR")}
        ray_init(env_vars=env, object_store_bytes=self.object_store_bytes, setup_hook=SETUP_HOOK,
                 verbose=self.verbose)
        self._started = True
        pin_loopback()
        import transfer_queue as tq
        from omegaconf import OmegaConf

        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": self.storage_units}}}))
        self._client = tq.get_client()

    def _grow(self, producers: int, consumers: int) -> None:
        grow_actors(self._producers, self._consumers, (producers, consumers), (_Producer, _Consumer), TIMEOUT_S)

    def run(self, scenario: Scenario, size: int) -> Result:
        import ray

        plan = make_plan(scenario, size, split_per_consumer=False)
        self._grow(scenario.producers, scenario.consumers)
        self._run += 1
        partition = f"bench-{self._run}"
        scn = dataclasses.asdict(scenario)
        prods, cons = self._producers[: scenario.producers], self._consumers[: scenario.consumers]
        try:
            nbytes = sum(ray.get([p.prepare.remote(scn, size, partition) for p in prods], timeout=TIMEOUT_S))
            sent = [p.put.remote() for p in prods]
            got = [c.get.remote(scn, size, partition, *[sent[p] for p in plan.producers_of(i)])
                   for i, c in enumerate(cons)]
            gets = ray.get(got, timeout=TIMEOUT_S)
            puts = ray.get(sent, timeout=TIMEOUT_S)
        finally:
            self._client.clear_partition(partition)
        return Result(
            system=self.name, scenario=scenario.name, size=size, transport=self.transport, nbytes=nbytes,
            put_s=max(p["t1"] - p["t0"] for p in puts),
            get_meta_s=max(g["t1"] - g["t0"] for g in gets),
            get_s=max(g["t2"] - g["t1"] for g in gets),
            e2e_s=max(g["t2"] for g in gets) - min(p["t0"] for p in puts),
        )

    def stop(self) -> None:
        if not self._started:
            return
        import ray

        from benchmarks.systems.ray_sys import ray_shutdown

        try:
            import transfer_queue as tq

            for a in self._producers + self._consumers:
                ray.kill(a)
            self._producers, self._consumers = [], []
            if self._client is not None:
                tq.close()
                self._client = None
        finally:
            ray_shutdown()
            self._started = False
