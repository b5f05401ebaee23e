"""``TransferQueueClient`` and ``AsyncTransferQueueClient`` over tqueue's ``Client``.

The blocking client carries out each call with tqueue's; its async twin runs the same call in
a worker thread (``async_<name>``), so both behave alike by construction. ``get_meta`` in
``fetch`` mode marks the samples consumed at once, as TransferQueue does: the shim acks tqueue's
lease before it returns. Per-sample ``custom_meta`` is tqueue's sample tags. A ``BatchMeta`` may
span partitions (one tqueue call per partition, rows kept in its order); ``data_parser`` is
refused by design.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

import tqueue
from transfer_queue import _kv
from transfer_queue._convert import (
    from_meta,
    merge,
    plain,
    rows,
    split,
    take_rows,
    to_fields,
    to_meta,
    to_tensordict,
    tolerant_put,
)
from transfer_queue._errors import refused
from transfer_queue.metadata import BatchMeta


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


def _check_mode(mode: str, task_name: str | None) -> None:
    if mode not in ("fetch", "force_fetch", "insert"):
        raise ValueError(f"mode must be 'fetch', 'force_fetch' or 'insert', got {mode!r}")
    if mode == "fetch" and task_name is None:
        raise ValueError("get_meta(mode='fetch') needs task_name")


def _in_order(metas: list[BatchMeta], rows: list[list[int]]) -> BatchMeta:
    """One ``BatchMeta`` of per-partition metas, each sample at its row in ``rows``."""
    if len(metas) == 1:
        return metas[0]
    joined = BatchMeta.concat(metas, validate=False)
    at = {r: i for i, r in enumerate(r for picked in rows for r in picked)}
    joined.reorder([at[r] for r in range(len(at))])
    return joined


def _partition(status: Any, partition_id: str) -> Any:
    return next((p for p in status.partitions if p.name == partition_id), None)


def _whole(call: str) -> NotImplementedError:
    return refused(
        f"{call} (a checkpoint of the controller or of the storage alone)",
        "tqueue checkpoints the controller and every unit together, consistently: use transfer_queue.save_checkpoint "
        "and load_checkpoint",
    )


class TransferQueueClient:
    def __init__(self, client_id: str, controller_info: Any, zmq_io_threads: int | None = None, zmq_max_sockets: int | None = None):
        self.client_id = client_id
        self._client = tqueue.Client(_address(controller_info))
        self._settings: dict[str, Any] | None = None
        self._grouped: set[str] = set()  # partitions this client made with their group size

    def initialize_storage_manager(self, manager_type: str = "SimpleStorage", config: Any = None) -> None:
        """Accepted for TransferQueue code: tqueue's client finds the storage units through the
        controller, so there is nothing to set up."""
        if manager_type not in ("SimpleStorage", "AsyncSimpleStorageManager"):
            raise refused(f"storage backend {manager_type!r}", "tqueue has its own storage units; use SimpleStorage")

    def settings(self) -> dict[str, Any]:
        """The job's settings as ``init`` recorded them in the cluster: ``polling_mode``, and
        ``sampler`` (``first_ready`` or ``groups`` with ``group_size``)."""
        if self._settings is None:
            self._settings = dict(self._client.keys.lookup(_kv.SHIM_PARTITION, ["config"]).tags[0] or {})
        return self._settings

    def _put_new(self, partition: str, data: TensorDict) -> tqueue.wire.BatchMeta:
        """A put of new samples; under GRPOGroupNSampler(n) each n consecutive rows of the put
        are one group, named so (tqueue's ``groups`` policy releases whole groups by id)."""
        fields = to_fields(data)
        settings = self.settings()
        grouped = settings.get("sampler") == "groups" or (
            settings.get("sampler") == "seqlen_balanced" and int(settings.get("group_size", 1)) > 1
        )
        if not grouped:
            return tolerant_put(self._client, partition, fields, lambda d: self._client.put(partition, d))
        n = int(settings["group_size"])
        if rows(data) % n:
            raise ValueError(f"put of {rows(data)} rows under GRPOGroupNSampler(n_samples_per_prompt={n}): whole groups only")
        if partition not in self._grouped:
            try:
                self._client.create_partition(partition, grouping=tqueue.Grouping(n))
            except tqueue.InvalidArgumentError:
                pass  # made already, by another put of this job
            self._grouped.add(partition)
        tag = uuid.uuid4().hex
        groups = [f"{tag}-{r // n}" for r in range(rows(data))]
        return tolerant_put(self._client, partition, fields, lambda d: self._client.put(partition, d, groups=groups))

    def _with_tags(self, meta: tqueue.wire.BatchMeta, fields: list[str] | None = None) -> BatchMeta:
        out = to_meta(meta, fields)
        if len(meta):
            out.custom_meta = [dict(t or {}) for t in self._client.keys.of(meta.partition, meta.indexes, fields=[]).tags]
        return out

    # --- writing and reading ----------------------------------------------------------

    def put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        _no_parser(data_parser)
        if not isinstance(data, TensorDict):
            raise TypeError(f"put takes a TensorDict, got {type(data).__name__}")
        if rows(data) == 0:
            raise ValueError("put of an empty TensorDict")
        if metadata is None:
            if partition_id is None:
                raise ValueError("put needs partition_id (or metadata)")
            return to_meta(self._put_new(partition_id, data))
        if rows(data) != metadata.size:
            raise ValueError(f"put: data has {rows(data)} rows, metadata {metadata.size} samples")
        fields = to_fields(data)
        names = [str(k) for k in data.keys()]
        parts = split(metadata)
        for meta, picked in parts:  # one update per partition, of the rows it holds
            values = fields if len(parts) == 1 else take_rows(fields, picked)
            tolerant_put(self._client, meta.partition, values, lambda d, m=meta: self._client.update(m, d))
        status = self._client.status()
        written = [
            to_meta(msgspec.structs.replace(meta, fields=names, schema=_partition(status, meta.partition).fields), names)
            for meta, _ in parts
        ]
        return metadata.union(_in_order(written, [picked for _, picked in parts]))

    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
        *,
        wait: float | None = None,
    ) -> BatchMeta:
        """TransferQueue's ``get_meta``. ``wait`` (the shim's own): in fetch mode, wait up to
        that many seconds at the controller for the samples, then return an empty meta, in
        polling mode or not (the streaming dataset waits so rather than asking again and
        again)."""
        _check_mode(mode, task_name)
        data_fields = list(dict.fromkeys(data_fields))  # a field named twice is read once, as TransferQueue does
        if mode == "insert":
            return self._insert(list(data_fields), batch_size, partition_id)
        settings = self.settings()
        polling = bool(settings.get("polling_mode", False))
        if mode == "force_fetch":
            return self._force_fetch(list(data_fields), batch_size, partition_id, polling)
        assert task_name is not None  # _check_mode refuses fetch without a task
        group = (sampling_config or {}).get("dp_rank")
        sampler = settings.get("sampler")
        rounds: dict[str, Any] = {}
        if sampler == "rank_aware" and group is not None:
            # the ranks of one dp_rank read the same samples, round after round (tqueue's rounds
            # of a replica group, counted by this client), other dp_ranks others
            rounds = {"data_parallel": tqueue.DataParallel(0, 1, replica_group=str(group))}
        elif sampler == "seqlen_balanced":  # one token-balanced round over dp_size ranks per batch
            rounds = {"data_parallel": tqueue.DataParallel(int(group or 0), int(settings["dp_size"]))}
        grouped = sampler == "groups" or (sampler == "seqlen_balanced" and int(settings.get("group_size", 1)) > 1)
        policy = "groups" if grouped else "first_ready"
        extra: dict[str, Any] = {}
        if sampler == "policy":  # a tqueue policy loaded into the controller gets sampling_config
            policy = str(settings["policy"])
            extra["policy_args"] = {str(k): plain(v) for k, v in (sampling_config or {}).items()}
        try:
            meta = self._client.get_meta(
                partition_id,
                list(data_fields),
                batch_size,
                task=task_name,
                timeout=wait if wait is not None else 0 if polling else None,
                policy=policy,
                **rounds,
                **extra,
            )
        except (tqueue.WaitTimeoutError, tqueue.UnknownFieldError, tqueue.PartitionClearedError):
            if polling or wait is not None:
                return BatchMeta.empty()
            raise
        self._client.ack(meta)
        return self._with_tags(meta, list(data_fields))

    def _insert(self, fields: list[str], batch_size: int, partition_id: str) -> BatchMeta:
        """``batch_size`` rows of ``partition_id`` with no data yet (tqueue's ``allocate``), for
        ``put(data, metadata=...)`` to fill, all at once or field by field."""
        if not fields:
            raise RuntimeError("Must provide data_fields for inserting new data")
        out = to_meta(self._client.samples.allocate(partition_id, batch_size), [])
        out.field_schema = {n: {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False} for n in fields}
        out.production_status = np.zeros(batch_size, dtype=np.int8)
        return out

    def _force_fetch(self, fields: list[str], batch_size: int, partition_id: str, polling: bool) -> BatchMeta:
        """The first ``batch_size`` live samples, whoever consumed them and whether or not they
        hold ``fields`` yet (``production_status`` says which do, as in TransferQueue), without
        a lease (tqueue's ``select``). Too few: an empty meta in polling mode, else
        ``WaitTimeoutError`` at once (a force_fetch that waits is not supported)."""
        meta = self._client.samples.select(partition_id, [], limit=batch_size)
        if meta is not None and len(meta) == batch_size:
            ready = self._client.samples.select(partition_id, fields)
            produced = set(ready.indexes) if ready is not None else set()
            out = self._with_tags(msgspec.structs.replace(meta, fields=fields), fields)
            out.production_status = np.array([i in produced for i in meta.indexes], dtype=np.int8)
            return out
        if polling:
            return BatchMeta.empty()
        have = 0 if meta is None else len(meta)
        raise tqueue.WaitTimeoutError(
            f"get_meta(mode='force_fetch'): partition {partition_id!r} has {have} samples with fields {fields}, "
            f"{batch_size} were asked for (over tqueue a force_fetch does not wait)"
        )

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0:
            return TensorDict({}, batch_size=[0])
        parts = split(metadata)
        if len(parts) == 1:
            meta = parts[0][0]
            return to_tensordict(self._client.get_data(meta, meta.fields), meta.fields, len(meta))
        # samples of several partitions: each partition's read, its rows put back in place
        names = list(metadata.field_names)
        got = [(to_tensordict(self._client.get_data(m, m.fields), m.fields, len(m)), picked) for m, picked in parts]
        return merge(got, names, metadata.size)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Keep each sample's ``custom_meta`` in the cluster (tqueue's sample tags)."""
        for meta in from_meta(metadata):
            where = {i: r for r, i in enumerate(metadata.global_indexes)}
            self._client.keys.set_tags(meta, [metadata.custom_meta[where[i]] for i in meta.indexes])

    # --- partitions and status --------------------------------------------------------

    def clear_partition(self, partition_id: str) -> None:
        self._client.clear(partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        for meta in from_meta(metadata):
            self._client.clear(meta)

    def get_partition_list(self) -> list[str]:
        return [p.name for p in self._client.status().partitions if p.name != _kv.SHIM_PARTITION]

    def _produced(self, data_fields: list[str], partition_id: str) -> tuple[list[int], list[int]] | None:
        """The live samples of the partition, and those of them that have every field."""
        every = self._client.samples.select(partition_id, [])
        if every is None:
            return None
        have = self._client.samples.select(partition_id, list(data_fields))
        return list(every.indexes), [] if have is None else list(have.indexes)

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        """Whether every live sample of the partition has every field (False: no samples)."""
        found = self._produced(data_fields, partition_id)
        return found is not None and len(found[0]) > 0 and len(found[1]) == len(found[0])

    def get_production_status(self, data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
        """``(global indexes, status)``: per live sample, 1 where it has every field, else 0;
        ``(None, None)`` for a partition that does not exist."""
        found = self._produced(data_fields, partition_id)
        if found is None:
            return None, None
        have = set(found[1])
        return torch.tensor(found[0], dtype=torch.long), torch.tensor([int(i in have) for i in found[0]], dtype=torch.int8)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        p = _partition(self._client.status(), partition_id)
        if p is None or p.samples == 0:
            return False
        task = p.tasks.get(task_name)
        return task is not None and task.consumed >= p.ready

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[Any, Any]:
        """``(global indexes, status)``: per live sample, 1 where ``task_name`` consumed it, else
        0; ``(None, None)`` for a partition that does not exist."""
        every = self._client.samples.select(partition_id, [])
        if every is None:
            return None, None
        done = self._client.samples.select(partition_id, [], consumed_by=task_name)
        consumed = set() if done is None else set(done.indexes)
        status = [int(i in consumed) for i in every.indexes]
        return torch.tensor(list(every.indexes), dtype=torch.long), torch.tensor(status, dtype=torch.int8)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let ``task_name`` (None: every task) read again what it consumed."""
        self._client.samples.reset(partition_id, task_name)
        return True

    # --- keys -------------------------------------------------------------------------

    def kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        """The ``BatchMeta`` of ``keys`` (in order), for ``get_data`` and ``put(metadata=)``;
        ``create``: keys not found get new rows with no data yet (tqueue's ``allocate``)."""
        found = self._client.keys.lookup(partition_id, list(keys))
        missing = [k for k, i in zip(found.keys, found.indexes) if i < 0]
        if missing and create:
            self._client.keys.bind(self._client.samples.allocate(partition_id, len(missing)), missing)
            found = self._client.keys.lookup(partition_id, list(keys))
            missing = [k for k, i in zip(found.keys, found.indexes) if i < 0]
        if missing or found.meta is None:
            raise ValueError(f"keys {missing[:8]} were not found in partition {partition_id!r}")
        return self._with_tags(found.meta)

    def kv_retrieve_keys(self, global_indexes: list[int], partition_id: str) -> list[str]:
        found = self._client.keys.of(partition_id, list(global_indexes), fields=[])
        missing = [i for i, k in zip(global_indexes, found.keys) if k is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} of partition {partition_id!r} have no key")
        return [k for k in found.keys if k is not None]

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return _kv.listing(self._client, partition_id)

    # --- checkpoints and the end ------------------------------------------------------

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


_ASYNC = [
    "put", "get_meta", "get_data", "set_custom_meta", "clear_partition", "clear_samples", "get_partition_list",
    "check_production_status", "check_consumption_status", "get_production_status", "get_consumption_status",
    "reset_consumption", "kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "save_controller_checkpoint",
    "load_controller_checkpoint", "save_storage_checkpoint", "load_storage_checkpoint", "close",
]


def _in_thread(name: str) -> Callable[..., Any]:
    method = getattr(TransferQueueClient, name)

    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(method, getattr(self, "_sync", self), *args, **kwargs)

    call.__name__ = call.__qualname__ = f"async_{name}"
    return call


class AsyncTransferQueueClient:
    """``async_<name>`` for each method of :class:`TransferQueueClient`, run in a worker thread
    on a blocking client of its own."""

    def __init__(self, client_id: str, controller_info: Any, zmq_io_threads: int | None = None, zmq_max_sockets: int | None = None):
        self.client_id = client_id
        self._sync = TransferQueueClient(client_id, controller_info)

    def initialize_storage_manager(self, manager_type: str = "SimpleStorage", config: Any = None) -> None:
        self._sync.initialize_storage_manager(manager_type, config)


for _name in _ASYNC:
    setattr(AsyncTransferQueueClient, f"async_{_name}", _in_thread(_name))
    setattr(TransferQueueClient, f"async_{_name}", getattr(AsyncTransferQueueClient, f"async_{_name}"))


__all__ = ["AsyncTransferQueueClient", "TransferQueueClient"]
