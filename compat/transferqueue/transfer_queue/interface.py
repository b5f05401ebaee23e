"""TransferQueue's module-level API: ``init``/``close``, ``get_client``, the metrics endpoint,
the KV calls and checkpoints.

``init(conf)`` in the first process starts a tqueue cluster on this host (a controller and
``backend.SimpleStorage.num_data_storage_units`` storage units, ``tqueue.LocalCluster``), records
its address in ``conf.controller.zmq_info`` and in the environment variable ``TQUEUE_ADDRESS``,
which the processes it starts afterwards inherit: ``init()`` there attaches to that cluster
(Ray's named-actor discovery is not used). ``init(conf)`` with ``controller.zmq_info`` set
attaches to that address.
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
from transfer_queue._errors import KEY_INDEX, not_yet, refused
from transfer_queue.client import POLLING_ENV, TransferQueueClient
from transfer_queue.metadata import KVBatchMeta
from transfer_queue.sampler import BaseSampler, SequentialSampler

logger = logging.getLogger(__name__)

ADDRESS_ENV = "TQUEUE_ADDRESS"

_lock = threading.Lock()
_state: dict[str, Any] = {"config": None, "cluster": None, "client": None}


def _defaults() -> DictConfig:
    text = resources.files("transfer_queue").joinpath("config.yaml").read_text()
    conf = OmegaConf.create(text)
    assert isinstance(conf, DictConfig)  # a YAML mapping always loads as one
    return conf


def _sampler_policy(sampler: Any) -> str:
    """The tqueue policy that carries out ``controller.sampler``."""
    name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", type(sampler).__name__)
    if name == SequentialSampler.__name__:
        return "first_ready"
    if name in ("GRPOGroupNSampler", "RankAwareSampler", "SeqlenBalancedSampler"):
        raise not_yet(f"init(controller.sampler={name})", "the mapping of this sampler onto tqueue's policies (issue 27)")
    if isinstance(sampler, BaseSampler) or (isinstance(sampler, type) and issubclass(sampler, BaseSampler)):
        raise refused(
            f"a sampler object ({name}) pickled into the controller",
            "write it as a tqueue batch policy and load it by name (ControllerConfig.policies, docs/migrating.md)",
        )
    raise ValueError(f"controller.sampler: unknown sampler {sampler!r}")


def init(conf: DictConfig | dict[str, Any] | None = None) -> DictConfig:
    """Start a tqueue cluster for this job, or attach to the one already started; idempotent."""
    with _lock:
        if _state["config"] is not None:
            return _state["config"]
        config = _defaults()
        sampler = None
        if conf is not None:
            user = OmegaConf.to_container(conf) if isinstance(conf, DictConfig) else dict(conf)
            sampler = (user.get("controller") or {}).pop("sampler", None) if isinstance(user, dict) else None
            config = OmegaConf.merge(config, user)
        backend = config.backend.storage_backend
        if backend != "SimpleStorage":
            raise refused(f"storage backend {backend!r}", "tqueue stores payload in its own storage units (SimpleStorage)")
        _sampler_policy(sampler if sampler is not None else config.controller.sampler)
        address = config.controller.zmq_info or os.environ.get(ADDRESS_ENV)
        if not address:
            cluster = tqueue.LocalCluster(
                num_storage_units=int(config.backend.SimpleStorage.num_data_storage_units),
                controller={"metrics_port": int(config.metrics.port)} if config.metrics.enabled else None,
            ).start()
            _state["cluster"] = cluster
            address = cluster.address
            os.environ[ADDRESS_ENV] = address
            if config.controller.polling_mode:
                os.environ[POLLING_ENV] = "1"
            logger.info("transfer_queue: started a tqueue cluster at %s", address)
        config.controller.zmq_info = address
        if config.controller.polling_mode:
            os.environ[POLLING_ENV] = "1"
        _state["config"] = config
        return config


def get_client() -> TransferQueueClient:
    """The client of this process (made on first use, after ``init``)."""
    with _lock:
        if _state["config"] is None:
            raise RuntimeError("transfer_queue.init() has not been called in this process")
        if _state["client"] is None:
            _state["client"] = TransferQueueClient("transfer_queue", _state["config"].controller.zmq_info)
        return _state["client"]


def close() -> None:
    """Close this process's client and, in the process that started it, the cluster."""
    with _lock:
        client, cluster = _state["client"], _state["cluster"]
        _state.update(config=None, cluster=None, client=None)
        if client is not None:
            client.close()
        if cluster is not None:
            if os.environ.get(ADDRESS_ENV) == cluster.address:
                del os.environ[ADDRESS_ENV]
            os.environ.pop(POLLING_ENV, None)
            cluster.close()


def get_metrics_endpoint() -> str | None:
    """The controller's Prometheus URL, or None where metrics are off."""
    url = get_client()._client.status().metrics
    return url or None


def kv_put(key: str, partition_id: str, fields: TensorDict | dict[str, Any] | None = None, tag: dict[str, Any] | None = None, data_parser: Any = None) -> KVBatchMeta:
    raise not_yet("kv_put", KEY_INDEX)


def kv_batch_put(keys: list[str], partition_id: str, fields: TensorDict | None = None, tags: list[dict[str, Any]] | None = None, data_parser: Any = None) -> KVBatchMeta:
    raise not_yet("kv_batch_put", KEY_INDEX)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> TensorDict:
    raise not_yet("kv_batch_get", KEY_INDEX)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> TensorDict:
    raise not_yet("kv_batch_get_by_meta", KEY_INDEX)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    raise not_yet("kv_list", KEY_INDEX)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    raise not_yet("kv_clear", KEY_INDEX)


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
    reply = get_client()._client.save_checkpoint(directory, metadata=metadata)
    record = {"storage_saved": True, "user_metadata": metadata, "tqueue_manifest": Path(reply.manifest).name}
    tmp = directory / "metadata.json.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / "metadata.json")


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Load a checkpoint of ``save_checkpoint`` into this cluster, which must have no partitions
    yet (``Client.load_checkpoint``). TransferQueue's own checkpoints (pickle) cannot be read."""
    directory = Path(checkpoint_dir).absolute()
    if not (directory / "manifest.json").exists() and (directory / "controller_state.pkl").exists():
        raise refused(f"{directory} is a TransferQueue checkpoint (pickle)", "tqueue reads only its own checkpoints")
    get_client()._client.load_checkpoint(directory)
