"""TransferQueue's KV API over tqueue's keys and tags (``Client.bind_keys``, ``tag_keys``,
``lookup_keys``, ``list_keys``, ``drop_keys``; docs/api.md, "Keys and tags").

A key is a sample of its partition; its tag is the sample's tags (TransferQueue's
``custom_meta``). A put of keys already there writes their fields in place (``Client.update``)
and one of new keys puts new samples and names them; a put of tags only makes the keys without
samples. Reads take no lease and consume nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

import tqueue
from transfer_queue._convert import rows, to_fields, to_tensordict, tolerant_put
from transfer_queue.metadata import KVBatchMeta

SHIM_PARTITION = "__transfer_queue__"  # the shim's own settings, shared by every process


def _names(keys: list[str] | str) -> list[str]:
    names = [keys] if isinstance(keys, str) else list(keys)
    if len(set(names)) != len(names):
        raise ValueError("Got duplicated keys.")
    return names


def _take(data: dict[str, Any], picked: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in data.items():
        out[name] = value[torch.as_tensor(picked)] if isinstance(value, torch.Tensor) else [value[r] for r in picked]
    return out


def one_row(fields: TensorDict | dict[str, Any]) -> TensorDict:
    """``kv_put``'s fields as a batch of one: a dict's tensors get a leading dimension of 1."""
    if isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, dict):
        raise TypeError(f"kv_put fields are a TensorDict or a dict, got {type(fields).__name__}")
    values = {
        name: value.unsqueeze(0) if isinstance(value, torch.Tensor) else NonTensorStack(value, batch_size=[1])
        for name, value in fields.items()
    }
    return TensorDict(values, batch_size=[1])


def batch_put(
    client: tqueue.Client,
    keys: list[str],
    partition: str,
    fields: TensorDict | None,
    tags: list[dict[str, Any]] | None,
    *,
    again: bool = True,
) -> KVBatchMeta:
    names = _names(keys)
    if tags is not None and len(tags) != len(names):
        raise ValueError(f"keys and tags must have same length, but got {len(names)} and {len(tags)}")
    if fields is None:
        if tags is None:
            raise ValueError("kv_batch_put needs fields, tags or both")
        client.keys.tag(partition, names, tags)
        return _meta(client, names, partition)
    if rows(fields) != len(names):
        raise ValueError(f"kv_batch_put: {len(names)} keys for {rows(fields)} rows of fields")
    data = to_fields(fields)
    found = client.keys.lookup(partition, names, fields=[])
    old = [r for r, i in enumerate(found.indexes) if i >= 0]
    new = [r for r, i in enumerate(found.indexes) if i < 0]
    if old and found.meta is not None:
        existing = found.meta
        tolerant_put(client, partition, _take(data, old), lambda d: client.update(existing, d))
        if tags is not None:
            client.keys.set_tags(found.meta, [tags[r] for r in old])
    if new:
        meta = tolerant_put(client, partition, _take(data, new), lambda d: client.put(partition, d))
        try:
            client.keys.bind(meta, [names[r] for r in new], tags=None if tags is None else [tags[r] for r in new])
        except tqueue.InvalidArgumentError:
            # another process named some of these keys meanwhile: drop these samples and write
            # into the samples the keys name now (once; a second refusal is the caller's)
            client.clear(meta)
            if not again:
                raise
            return batch_put(client, keys, partition, fields, tags, again=False)
    return _meta(client, names, partition)


def _meta(client: tqueue.Client, names: list[str], partition: str) -> KVBatchMeta:
    found = client.keys.lookup(partition, names)
    fields = None if found.meta is None else sorted(found.meta.fields)
    return KVBatchMeta(keys=names, tags=[t or {} for t in found.tags], partition_id=partition, fields=fields)


def batch_get(client: tqueue.Client, keys: list[str] | str, partition: str, select_fields: list[str] | str | None) -> TensorDict:
    names = _names(keys)
    found = client.keys.lookup(partition, names)
    if not names or found.meta is None or any(i < 0 for i in found.indexes):
        raise ValueError(f"keys or partition were not found! partition={partition!r}, keys={names[:8]}")
    have = list(found.meta.fields)
    wanted = have if select_fields is None else [select_fields] if isinstance(select_fields, str) else list(select_fields)
    missing = [f for f in wanted if f not in have]
    if missing:
        raise ValueError(f"Some fields are not ready for every key: {missing} (partition {partition!r}); ready: {sorted(have)}")
    batch = client.get_data(found.meta, wanted)
    return to_tensordict(batch, wanted, len(names))


def get_by_meta(client: tqueue.Client, meta: KVBatchMeta, select_fields: list[str] | str | None) -> TensorDict:
    if meta.partition_id is None:
        raise ValueError("kv_batch_get_by_meta: the KVBatchMeta has no partition_id")
    fields = meta.fields
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        missing = [f for f in wanted if fields is not None and f not in fields]
        if missing:
            raise ValueError(f"select_fields {missing} not found in the KVBatchMeta's fields {fields}")
        fields = wanted
    return batch_get(client, meta.keys, meta.partition_id, fields)


def listing(client: tqueue.Client, partition: str | None) -> dict[str, dict[str, Any]]:
    if partition == SHIM_PARTITION:
        return {}
    return {p: keys for p, keys in client.keys.all(partition).items() if p != SHIM_PARTITION}


def clear(client: tqueue.Client, keys: list[str] | str, partition: str) -> None:
    client.keys.drop(partition, _names(keys))
