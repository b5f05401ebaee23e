"""``TransferQueueClient`` and ``AsyncTransferQueueClient`` over tqueue's ``Client`` and
``AsyncClient``: the same methods (the async client's are ``async_<name>``), one tqueue call
each, with the conversions of ``transfer_queue._convert``.

``get_meta(mode="fetch")`` marks the samples consumed at once, as TransferQueue does: the
shim acks tqueue's lease before it returns. Calls that need tqueue features not built yet
raise ``NotYetSupportedError`` naming the feature; ``data_parser`` is refused by design.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec
from tensordict import TensorDict

import tqueue
from transfer_queue._convert import from_meta, rows, to_fields, to_meta, to_tensordict
from transfer_queue._errors import KEY_INDEX, not_yet, refused
from transfer_queue.metadata import BatchMeta

POLLING_ENV = "TQUEUE_TRANSFER_QUEUE_POLLING"  # "1": an under-supplied get_meta returns an empty meta
STATUS = "tqueue's per-sample production and consumption status (issue 27)"


def _address(controller_info: Any) -> str:
    if isinstance(controller_info, str):
        return controller_info
    address = getattr(controller_info, "address", None) or (
        controller_info.get("address") if isinstance(controller_info, dict) else None
    )
    if not address:
        raise tqueue.InvalidArgumentError(
            f"controller_info must be the tqueue controller's address (tcp://host:port), as "
            f"transfer_queue.init() records it in conf.controller.zmq_info; got {controller_info!r}"
        )
    return str(address)


def _no_parser(data_parser: Callable[[Any], Any] | None) -> None:
    if data_parser is not None:
        raise refused("data_parser (a callable pickled into the storage units)", "apply it to the data before the put")


def _put_target(data: TensorDict, metadata: BatchMeta | None, partition_id: str | None) -> str | None:
    """The partition of a put of new samples, or None for an update of ``metadata``'s samples."""
    if not isinstance(data, TensorDict):
        raise TypeError(f"put takes a TensorDict, got {type(data).__name__}")
    if rows(data) == 0:
        raise ValueError("put of an empty TensorDict")
    if metadata is not None:
        if rows(data) != metadata.size:
            raise ValueError(f"put: data has {rows(data)} rows, metadata {metadata.size} samples")
        return None
    if partition_id is None:
        raise ValueError("put needs partition_id (or metadata)")
    return partition_id


def _updated(metadata: BatchMeta, meta: tqueue.BatchMeta, status: Any, data: TensorDict) -> BatchMeta:
    """``metadata`` with the fields ``data`` wrote to its samples (their specs from ``status``)."""
    specs = _partition(status, meta.partition).fields
    written = to_meta(msgspec.structs.replace(meta, fields=list(data.keys()), schema=specs), list(data.keys()))
    return metadata.union(written)


def _task_and_mode(mode: str, task_name: str | None, sampling_config: dict[str, Any] | None) -> str:
    if mode in ("force_fetch", "insert"):
        need = "reads that do not lease (force_fetch)" if mode == "force_fetch" else "puts that allocate rows (insert)"
        raise not_yet(f"get_meta(mode={mode!r})", f"tqueue's {need} (issue 27)")
    if mode != "fetch":
        raise ValueError(f"mode must be 'fetch', 'force_fetch' or 'insert', got {mode!r}")
    if task_name is None:
        raise ValueError("get_meta(mode='fetch') needs task_name")
    config = dict(sampling_config or {})
    config.pop("task_name", None)
    config.pop("partition_id", None)
    config.pop("batch_index", None)
    config.pop("dp_rank", None)
    if config:
        raise not_yet(f"get_meta(sampling_config={sorted(config)})", "arguments passed to tqueue policies (issue 27)")
    return task_name


def _whole(call: str) -> NotImplementedError:
    return refused(
        f"{call} (a checkpoint of the controller or of the storage alone)",
        "tqueue checkpoints the controller and every unit together, consistently: use transfer_queue.save_checkpoint "
        "and load_checkpoint",
    )


def _polling() -> bool:
    return os.environ.get(POLLING_ENV, "") == "1"


def _one(metas: list[tqueue.BatchMeta]) -> tqueue.BatchMeta:
    if len(metas) != 1:
        raise not_yet("a call on samples of several partitions at once", "calls that span partitions")
    return metas[0]


def _partition(status: Any, partition_id: str) -> Any:
    return next((p for p in status.partitions if p.name == partition_id), None)


def _produced(status: Any, data_fields: list[str], partition_id: str) -> bool:
    p = _partition(status, partition_id)
    return p is not None and p.samples > 0 and set(data_fields) <= set(p.fields) and p.in_flight == 0


def _consumed(status: Any, task_name: str, partition_id: str) -> bool:
    p = _partition(status, partition_id)
    if p is None or p.samples == 0:
        return False
    task = p.tasks.get(task_name)
    return task is not None and task.consumed >= p.ready


class _Refusals:
    """The calls both twins refuse or defer, written once."""

    def initialize_storage_manager(self, manager_type: str = "SimpleStorage", config: Any = None) -> None:
        """Accepted for TransferQueue code: tqueue's client finds the storage units through the
        controller, so there is nothing to set up."""
        if manager_type not in ("SimpleStorage", "AsyncSimpleStorageManager"):
            raise refused(f"storage backend {manager_type!r}", "tqueue has its own storage units; use SimpleStorage")

    def _kv(self, call: str) -> Any:
        raise not_yet(f"TransferQueueClient.{call}", KEY_INDEX)


class AsyncTransferQueueClient(_Refusals):
    def __init__(self, client_id: str, controller_info: Any, zmq_io_threads: int | None = None, zmq_max_sockets: int | None = None):
        self.client_id = client_id
        self._client = tqueue.AsyncClient(_address(controller_info))

    async def async_put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        _no_parser(data_parser)
        partition = _put_target(data, metadata, partition_id)
        if partition is not None:
            return to_meta(await self._client.put(partition, to_fields(data)))
        assert metadata is not None  # _put_target returns None only for an update
        meta = _one(from_meta(metadata))
        await self._client.update(meta, to_fields(data))
        return _updated(metadata, meta, await self._client.status(), data)

    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        task = _task_and_mode(mode, task_name, sampling_config)
        try:
            meta = await self._client.get_meta(partition_id, list(data_fields), batch_size, task=task, timeout=0 if _polling() else None)
        except tqueue.WaitTimeoutError:
            if _polling():
                return BatchMeta.empty()
            raise
        await self._client.ack(meta)
        return to_meta(meta, list(data_fields))

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0:
            return TensorDict({}, batch_size=[0])
        meta = _one(from_meta(metadata))
        batch = await self._client.get_data(meta, meta.fields)
        return to_tensordict(batch, meta.fields, len(meta))

    async def async_clear_partition(self, partition_id: str) -> None:
        await self._client.clear(partition_id)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        for meta in from_meta(metadata):
            await self._client.clear(meta)

    async def async_get_partition_list(self) -> list[str]:
        return [p.name for p in (await self._client.status()).partitions]

    async def async_check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return _produced(await self._client.status(), data_fields, partition_id)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return _consumed(await self._client.status(), task_name, partition_id)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        raise not_yet("set_custom_meta", KEY_INDEX)

    async def async_get_production_status(self, data_fields: list[str], partition_id: str) -> Any:
        raise not_yet("get_production_status", STATUS)

    async def async_get_consumption_status(self, task_name: str, partition_id: str) -> Any:
        raise not_yet("get_consumption_status", STATUS)

    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        raise not_yet("reset_consumption", STATUS)

    async def async_kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        return self._kv("kv_retrieve_meta")

    async def async_kv_retrieve_keys(self, global_indexes: list[int], partition_id: str) -> list[str]:
        return self._kv("kv_retrieve_keys")

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._kv("kv_list")

    async def async_close(self) -> None:
        await self._client.close()


class TransferQueueClient(_Refusals):
    def __init__(self, client_id: str, controller_info: Any, zmq_io_threads: int | None = None, zmq_max_sockets: int | None = None):
        self.client_id = client_id
        self._client = tqueue.Client(_address(controller_info))

    def put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        _no_parser(data_parser)
        partition = _put_target(data, metadata, partition_id)
        if partition is not None:
            return to_meta(self._client.put(partition, to_fields(data)))
        assert metadata is not None  # _put_target returns None only for an update
        meta = _one(from_meta(metadata))
        self._client.update(meta, to_fields(data))
        return _updated(metadata, meta, self._client.status(), data)

    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        task = _task_and_mode(mode, task_name, sampling_config)
        try:
            meta = self._client.get_meta(partition_id, list(data_fields), batch_size, task=task, timeout=0 if _polling() else None)
        except tqueue.WaitTimeoutError:
            if _polling():
                return BatchMeta.empty()
            raise
        self._client.ack(meta)
        return to_meta(meta, list(data_fields))

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0:
            return TensorDict({}, batch_size=[0])
        meta = _one(from_meta(metadata))
        return to_tensordict(self._client.get_data(meta, meta.fields), meta.fields, len(meta))

    def clear_partition(self, partition_id: str) -> None:
        self._client.clear(partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        for meta in from_meta(metadata):
            self._client.clear(meta)

    def get_partition_list(self) -> list[str]:
        return [p.name for p in self._client.status().partitions]

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return _produced(self._client.status(), data_fields, partition_id)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return _consumed(self._client.status(), task_name, partition_id)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        raise not_yet("set_custom_meta", KEY_INDEX)

    def get_production_status(self, data_fields: list[str], partition_id: str) -> Any:
        raise not_yet("get_production_status", STATUS)

    def get_consumption_status(self, task_name: str, partition_id: str) -> Any:
        raise not_yet("get_consumption_status", STATUS)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        raise not_yet("reset_consumption", STATUS)

    def kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        return self._kv("kv_retrieve_meta")

    def kv_retrieve_keys(self, global_indexes: list[int], partition_id: str) -> list[str]:
        return self._kv("kv_retrieve_keys")

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return self._kv("kv_list")

    def save_controller_checkpoint(self, path: str) -> None:
        raise _whole("save_controller_checkpoint")

    def load_controller_checkpoint(self, path: str) -> None:
        raise _whole("load_controller_checkpoint")

    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        raise _whole("save_storage_checkpoint")

    def load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        raise _whole("load_storage_checkpoint")

    def close(self) -> None:
        self._client.close()


__all__ = ["AsyncTransferQueueClient", "TransferQueueClient"]
