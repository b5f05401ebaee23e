"""TransferQueue's module-level API: ``init``/``close``, ``get_client``, the metrics endpoint,
the KV calls and checkpoints.

How ``init`` finds the job's cluster, in this order:

1. ``init(conf)`` with ``controller.zmq_info`` set, or ``TQUEUE_ADDRESS`` in the environment:
   attach to that address.
2. Where this process is connected to Ray (a driver after ``ray.init``, or any Ray worker):
   the cluster registered for this Ray job, in the named actor ``TransferQueueController``
   (namespace ``transfer_queue``; ``tqueue/launch/_discovery.py``), whose ``get_config``
   answers as TransferQueue's does. ``init()`` without a conf in a Ray worker waits for it up
   to ``TQUEUE_DISCOVERY_TIMEOUT`` seconds (60), then raises ``tqueue.DiscoveryError`` saying
   where it looked: it never starts a cluster of its own there, whose puts nobody would read.
3. Otherwise start a cluster (a controller and ``backend.SimpleStorage.num_data_storage_units``
   storage units, ``tqueue.LocalCluster``, on loopback, or on the Ray node's address where Ray
   has more than one node), record its
   address in ``conf.controller.zmq_info`` and ``TQUEUE_ADDRESS`` (for the processes this one
   starts), and, on Ray, register it for the job. Two processes of one job that start at once:
   the second to register stops its cluster and attaches to the first's.

Each Ray job registers under its own actor name as well (``TransferQueueController.<job id>``),
which is the one look-ups read, so two jobs on one Ray cluster each find their own; the plain
name goes to the first job that takes it. The actor dies with the process that started the
cluster; clients that attached keep their address and go on if it is killed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

import tqueue
from tqueue import _env
from tqueue.launch import _discovery
from transfer_queue import _kv
from transfer_queue._errors import refused
from transfer_queue._kv import SHIM_PARTITION
from transfer_queue.client import TransferQueueClient, _no_parser
from transfer_queue.metadata import KVBatchMeta
from transfer_queue.sampler import BaseSampler, GRPOGroupNSampler, SequentialSampler, _policy

logger = logging.getLogger(__name__)

ADDRESS_ENV = "TQUEUE_ADDRESS"
RAY_NAME = "TransferQueueController"  # TransferQueue's own actor name and namespace
RAY_NAMESPACE = "transfer_queue"

_lock = threading.Lock()
_state: dict[str, Any] = {"config": None, "cluster": None, "client": None, "registry": []}


def _defaults() -> DictConfig:
    text = resources.files("transfer_queue").joinpath("config.yaml").read_text()
    conf = OmegaConf.create(text)
    assert isinstance(conf, DictConfig)  # a YAML mapping always loads as one
    return conf


POLICY_PREFIX = "tqueue:"
USER_SAMPLER = "transfer_queue_sampler"  # the policy name a user's BaseSampler subclass gets


def _sampler_settings(sampler: Any) -> dict[str, Any]:
    """How the controller carries out ``controller.sampler`` (a built-in sampler's name, class
    or instance: its arguments are read, nothing is pickled), kept in the cluster's settings."""
    name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", type(sampler).__name__)
    if name.startswith(POLICY_PREFIX):  # a tqueue policy loaded into the controller, by name
        policy = name[len(POLICY_PREFIX):]
        if not policy:
            raise ValueError(f"controller.sampler {sampler!r}: name the policy, '{POLICY_PREFIX}NAME'")
        return {"sampler": "policy", "policy": policy}
    if name == SequentialSampler.__name__:
        return {"sampler": "first_ready"}
    if name == GRPOGroupNSampler.__name__:
        n = int(getattr(sampler, "n_samples_per_prompt", 0) or 0) if isinstance(sampler, GRPOGroupNSampler) else 0
        if n <= 0:
            raise ValueError(
                "controller.sampler GRPOGroupNSampler needs its group size: give an instance, "
                "GRPOGroupNSampler(n_samples_per_prompt=n)"
            )
        return {"sampler": "groups", "group_size": n}
    if name == "RankAwareSampler":  # each dp_rank's replica group reads its own rounds (replica_group)
        return {"sampler": "rank_aware"}
    if name == "SeqlenBalancedSampler":  # tqueue's token-balanced rounds of dp_size ranks (whole groups if n > 1)
        dp_size = int(getattr(sampler, "dp_size", 1)) if not isinstance(sampler, (str, type)) else 1
        n = int(getattr(sampler, "n_samples_per_prompt", 1)) if not isinstance(sampler, (str, type)) else 1
        return {"sampler": "seqlen_balanced", "dp_size": dp_size, "group_size": n}
    if isinstance(sampler, BaseSampler) or (isinstance(sampler, type) and issubclass(sampler, BaseSampler)):
        # the user's own sampler: imported by path in the controller init starts (sampler/_policy.py)
        return {"sampler": "policy", "policy": USER_SAMPLER, "spec": _policy.spec(sampler, USER_SAMPLER)}
    raise ValueError(f"controller.sampler: unknown sampler {sampler!r}")


def init(conf: DictConfig | dict[str, Any] | None = None) -> DictConfig:
    """Start a tqueue cluster for this job, or attach to the one already started; idempotent."""
    with _lock:
        if _state["config"] is not None:
            return _state["config"]
        config = _defaults()
        sampler = None
        policies: list[str] = []
        if conf is not None:
            user = OmegaConf.to_container(conf) if isinstance(conf, DictConfig) else dict(conf)
            controller = (user.get("controller") or {}) if isinstance(user, dict) else {}
            sampler = controller.pop("sampler", None)
            # tqueue policies for the cluster this init starts: ["NAME=module:attribute", ...]
            policies = [str(p) for p in controller.pop("policies", None) or []]
            config = OmegaConf.merge(config, user)
        backend = config.backend.storage_backend
        if backend != "SimpleStorage":
            raise refused(f"storage backend {backend!r}", "tqueue stores payload in its own storage units (SimpleStorage)")
        settings = _sampler_settings(sampler if sampler is not None else config.controller.sampler)
        settings["polling_mode"] = bool(config.controller.polling_mode)
        user_sampler = settings.pop("spec", None)
        address = config.controller.zmq_info or os.environ.get(ADDRESS_ENV)
        ray = _discovery.ray_if_running()
        if not address and ray is not None:
            address = _registered(ray, wait=conf is None and _discovery.in_ray_worker(ray))
        if address and user_sampler:
            raise refused(
                f"a sampler of your own ({settings['policy']}) for the cluster at {address}, which is running already",
                "give it to the init() that starts the cluster, or load it into that controller as a tqueue "
                "batch policy (tqueue controller --policy NAME=MODULE:ATTR, docs/migrating.md)",
            )
        if not address:
            address = _start_cluster(config, [*policies, *([user_sampler] if user_sampler else [])], ray)
        elif policies:
            logger.warning(
                "transfer_queue: controller.policies %s are for a cluster init starts; the one at %s is running "
                "already: load them into its controller (tqueue controller --policy NAME=MODULE:ATTR)",
                policies, address,
            )
        config.controller.zmq_info = address
        try:
            client = TransferQueueClient("transfer_queue", address)
            if conf is not None or _state["cluster"] is not None:
                # the job's settings, kept in the cluster for every process that attaches
                client._client.keys.tag(SHIM_PARTITION, ["config"], [settings])
            else:
                config.controller.polling_mode = client.settings().get("polling_mode", False)
        except BaseException:
            _stop_cluster()  # a failed init leaves nothing running
            raise
        _state.update(config=config, client=client)
        return config


def _registered(ray: Any, *, wait: bool) -> str | None:
    """The address of the cluster registered for this Ray job; waited for where ``wait``."""
    if wait:
        found = _discovery.lookup(ray, name=RAY_NAME, namespace=RAY_NAMESPACE, timeout=_env.discovery_timeout())
    else:
        found = _discovery.find(ray, name=RAY_NAME, namespace=RAY_NAMESPACE)
    if found is None:
        return None
    logger.info("transfer_queue: attaching to the Ray job's cluster at %s", found["address"])
    return str(found["address"])


def _start_cluster(config: DictConfig, policies: list[str], ray: Any) -> str:
    """Start this job's cluster (registered on Ray where Ray runs); its address."""
    options: dict[str, Any] = {"policies": policies} if policies else {}
    if config.metrics.enabled:
        options["metrics_port"] = int(config.metrics.port)
    host = _discovery.serving_host(ray)
    cluster = tqueue.LocalCluster(
        num_storage_units=int(config.backend.SimpleStorage.num_data_storage_units),
        controller=options or None, host=host,
    ).start()
    _state["cluster"] = cluster
    if ray is not None:
        # get_config answers as TransferQueue's: the job's config (a DictConfig), address filled in
        record = OmegaConf.merge(config, {"controller": {"zmq_info": cluster.address}})
        try:
            _state["registry"] = _discovery.publish(
                ray, cluster.address, record, name=RAY_NAME, namespace=RAY_NAMESPACE, plain=True
            )
        except ValueError:  # another process of this job registered first: use its cluster
            _stop_cluster()
            found = _registered(ray, wait=False)
            if found is None:
                raise
            return found
        except BaseException:
            _stop_cluster()
            raise
    os.environ[ADDRESS_ENV] = cluster.address
    logger.info("transfer_queue: started a tqueue cluster at %s", cluster.address)
    return cluster.address


def _stop_cluster() -> None:
    cluster = _state["cluster"]
    _state["cluster"] = None
    registry, _state["registry"] = _state.get("registry") or [], []
    ray = _discovery.ray_if_running()
    if registry and ray is not None:
        _discovery.withdraw(ray, registry)
    if cluster is not None:
        if os.environ.get(ADDRESS_ENV) == cluster.address:
            del os.environ[ADDRESS_ENV]
        cluster.close()


def get_client() -> TransferQueueClient:
    """The client of this process (made on first use, after ``init``)."""
    with _lock:
        if _state["config"] is None:
            raise RuntimeError("transfer_queue is not initialized in this process: call transfer_queue.init() first")
        if _state["client"] is None:
            _state["client"] = TransferQueueClient("transfer_queue", _state["config"].controller.zmq_info)
        return _state["client"]


def close() -> None:
    """Close this process's client and, in the process that started it, the cluster."""
    with _lock:
        client = _state["client"]
        _state.update(config=None, client=None)
        if client is not None:
            client.close()
        _stop_cluster()


def get_metrics_endpoint() -> str | None:
    """The controller's Prometheus URL, or None where metrics are off."""
    url = get_client()._client.status().metrics
    return url or None


def _kv_client() -> tqueue.Client:
    return get_client()._client


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Put one key's fields (a dict's tensors get a leading dimension of 1) and/or its tag."""
    _no_parser(data_parser)
    rows = None if fields is None else _kv.one_row(fields)
    return _kv.batch_put(_kv_client(), [key], partition_id, rows, None if tag is None else [tag])


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Put the fields (one row per key) and/or tags of ``keys``: existing keys are written in
    place, new ones become samples; with tags only, the keys exist without samples."""
    _no_parser(data_parser)
    return _kv.batch_put(_kv_client(), keys, partition_id, fields, tags)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> TensorDict:
    """The fields of ``keys`` (all that every key has, or ``select_fields``), without lease."""
    return _kv.batch_get(_kv_client(), keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> TensorDict:
    return _kv.get_by_meta(_kv_client(), meta, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tag}}``, of one partition or of all."""
    return _kv.listing(_kv_client(), partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Forget ``keys`` and free their samples; unknown keys and partitions are ignored."""
    _kv.clear(_kv_client(), keys, partition_id)


async def async_kv_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, *args, **kwargs)


async def async_kv_batch_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, *args, **kwargs)


async def async_kv_batch_get(*args: Any, **kwargs: Any) -> TensorDict:
    return await asyncio.to_thread(kv_batch_get, *args, **kwargs)


async def async_kv_batch_get_by_meta(*args: Any, **kwargs: Any) -> TensorDict:
    return await asyncio.to_thread(kv_batch_get_by_meta, *args, **kwargs)


async def async_kv_list(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, *args, **kwargs)


async def async_kv_clear(*args: Any, **kwargs: Any) -> None:
    return await asyncio.to_thread(kv_clear, *args, **kwargs)


def save_checkpoint(checkpoint_dir: str | Path, *, include_storage: bool = True, metadata: dict[str, Any] | None = None) -> None:
    """tqueue's checkpoint of the whole data plane (``Client.save_checkpoint``: metadata and
    payload, atomic), plus TransferQueue's ``metadata.json`` (``storage_saved``,
    ``user_metadata``) written beside it, also atomically, once tqueue's manifest is in place.

    ``metadata`` must be JSON values (tqueue's ``InvalidArgumentError`` otherwise). tqueue's
    checkpoint always holds the payload: ``include_storage=False`` saves it too, and
    ``metadata.json`` says so (``storage_saved: true``).
    """
    directory = Path(checkpoint_dir).absolute()
    reply = get_client()._client.checkpoints.save(directory, metadata=metadata)
    record = {"storage_saved": True, "user_metadata": metadata, "tqueue_manifest": Path(reply.manifest).name}
    tmp = directory / "metadata.json.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / "metadata.json")


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Load a checkpoint of ``save_checkpoint`` into this cluster, fresh or running, as
    TransferQueue does: a partition of the checkpoint replaces the live one of its name
    (``Client.load_checkpoint(replace=True)``: only once the checkpoint is fully loaded), the
    live partitions it does not hold go on. The job's settings stay this cluster's.
    TransferQueue's own checkpoints (pickle) cannot be read."""
    directory = Path(checkpoint_dir).absolute()
    if not (directory / "manifest.json").exists() and (directory / "controller_state.pkl").exists():
        raise refused(f"{directory} is a TransferQueue checkpoint (pickle)", "tqueue reads only its own checkpoints")
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    for name in ("metadata.json", "manifest.json"):
        if not (directory / name).exists():
            raise FileNotFoundError(f"{directory} holds no {name}: not a checkpoint of transfer_queue.save_checkpoint")
    client = get_client()._client
    # the shim's own partition (the job's settings) is not data: it steps aside for the load
    settings = client.keys.lookup(SHIM_PARTITION, ["config"]).tags[0]
    client.clear(SHIM_PARTITION)
    try:
        client.checkpoints.load(directory, replace=True)
    finally:
        if settings is not None:
            client.keys.tag(SHIM_PARTITION, ["config"], [settings])
