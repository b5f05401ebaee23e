"""Keys and tags: each partition's index from user keys to samples, and each sample's tags.

A key names at most one live sample of its partition; a key may exist before its sample (a
put of tags only) and gets one with ``BindKeys``. Tags are a small dict per sample (or per
key without a sample), replaced as a whole when written. Nothing here leases: a lookup returns
a meta of the samples found, as ``Select`` does.

The index is the partition's own (``Partition.keys``, ``_keyindex.py``): it goes with the
partition when that is cleared or frees itself, and into checkpoints with it. A sample cleared
on its own keeps its key until the key is dropped, but is never returned: a lookup finds only
committed, live samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import ControllerConfig
from ..errors import InvalidArgumentError
from ..wire import BatchMeta, BindKeys, DropKeys, KeyListing, KeysFound, ListKeys, LookupKeys, Ok, SetTags, TagKeys, Tags
from ._keyindex import KeyIndex
from ._partition import Partition
from ._samples import COMMITTED, EXCLUDED
from ._state import ControllerState

MetaOf = Callable[[Partition, np.ndarray, list[str], str | None, int, float], BatchMeta]

MAX_KEY_CHARS = 4096


class Keys:
    """The controller's part that owns every partition's ``KeyIndex``."""

    def __init__(self, state: ControllerState, meta_of: MetaOf) -> None:
        self.state = state
        self.config: ControllerConfig = state.config
        self._meta_of = meta_of

    # --- the index of a partition ------------------------------------------------------

    def _of(self, part: Partition) -> KeyIndex:
        """``part``'s index, made on first use."""
        if part.keys is None:
            part.keys = KeyIndex()
        return part.keys

    def _existing(self, name: str) -> tuple[Partition | None, KeyIndex | None]:
        part = self.state.partitions.get(name)
        return (part, part.keys) if part is not None else (None, None)

    def _live(self, part: Partition, indexes: np.ndarray) -> np.ndarray:
        """Which of ``indexes`` are committed samples of ``part`` that were not cleared, failed
        or aborted."""
        masks = part.samples.mask
        ok = (indexes >= 0) & (indexes < min(part.n, len(masks)))
        if not ok.any():
            return ok
        mask = masks[np.where(ok, indexes, 0)]
        return ok & ((mask & COMMITTED) != 0) & ((mask & EXCLUDED) == 0)

    def _check(self, keys: list[str], per: list[Any] | None, what: str) -> None:
        if len(keys) > self.config.max_samples_per_request:
            raise InvalidArgumentError(
                f"{len(keys)} keys in one request, more than max_samples_per_request={self.config.max_samples_per_request}"
            )
        if per is not None and len(per) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys and {len(per)} {what}: one each")
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("the same key twice in one request")
        long = next((k for k in keys if len(k) > MAX_KEY_CHARS), None)
        if long is not None:
            raise InvalidArgumentError(f"a key of {len(long)} characters, more than {MAX_KEY_CHARS}: {long[:40]!r}...")

    # --- handlers ----------------------------------------------------------------------

    def bind(self, ident: bytes, msg: BindKeys, bufs: list[Any]) -> Ok:
        self._check(msg.keys, msg.indexes, "indexes")
        if msg.tags is not None:
            self._check(msg.keys, msg.tags, "tags")
        part = self.state.partitions.get(msg.partition)
        if part is None:
            raise InvalidArgumentError(f"partition {msg.partition!r} does not exist (or was freed): nothing to name")
        keys = self._of(part)
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        dead = np.flatnonzero(~self._live(part, indexes))
        if len(dead):
            raise InvalidArgumentError(
                f"samples {indexes[dead[:8]].tolist()} of partition {msg.partition!r} are not live committed samples"
            )
        for key, i in zip(msg.keys, msg.indexes):
            old = keys.index.get(key, -1)
            if old >= 0 and old != i and self._live(part, np.asarray([old]))[0]:
                raise InvalidArgumentError(f"key {key!r} of partition {msg.partition!r} already names sample {old}")
            other = keys.key_of.get(i)
            if other is not None and other != key:
                raise InvalidArgumentError(f"sample {i} of partition {msg.partition!r} is named {other!r} already")
        for n, (key, i) in enumerate(zip(msg.keys, msg.indexes)):
            old = keys.index.get(key, -1)
            if old >= 0:
                keys.key_of.pop(old, None)
            pending = keys.key_tags.pop(key, None)
            keys.index[key] = i
            keys.key_of[i] = key
            tags = msg.tags[n] if msg.tags is not None else pending
            if tags is not None:
                keys.sample_tags[i] = tags
        return Ok()

    def tag_keys(self, ident: bytes, msg: TagKeys, bufs: list[Any]) -> Ok:
        self._check(msg.keys, msg.tags, "tags")
        part = self.state.partition(msg.partition)
        keys = self._of(part)
        new = sum(1 for k in msg.keys if k not in keys.index)
        if new and len(keys.key_tags) + new > self.config.max_partition_samples:
            raise InvalidArgumentError(
                f"partition {msg.partition!r} would hold more than max_partition_samples="
                f"{self.config.max_partition_samples} keys without samples"
            )
        for key, tags in zip(msg.keys, msg.tags):
            i = keys.index.setdefault(key, -1)
            if i >= 0:
                keys.sample_tags[i] = tags
            else:
                keys.key_tags[key] = tags
        return Ok()

    def set_tags(self, ident: bytes, msg: SetTags, bufs: list[Any]) -> Ok:
        if len(msg.indexes) != len(msg.tags):
            raise InvalidArgumentError(f"{len(msg.indexes)} indexes and {len(msg.tags)} tags: one each")
        if len(msg.indexes) > self.config.max_samples_per_request:
            raise InvalidArgumentError(
                f"{len(msg.indexes)} samples in one request, more than max_samples_per_request="
                f"{self.config.max_samples_per_request}"
            )
        part = self.state.partitions.get(msg.partition)
        if part is None:
            raise InvalidArgumentError(f"partition {msg.partition!r} does not exist (or was freed)")
        indexes = np.asarray(msg.indexes, dtype=np.int64)
        part.samples.check_indexes(indexes, part.name)
        keys = self._of(part)
        for i, tags in zip(msg.indexes, msg.tags):
            keys.sample_tags[i] = tags
        return Ok()

    def lookup(self, ident: bytes, msg: LookupKeys, bufs: list[Any]) -> KeysFound:
        part, keys = self._existing(msg.partition)
        if msg.indexes is not None:
            if len(msg.indexes) > self.config.max_samples_per_request:
                raise InvalidArgumentError(
                    f"{len(msg.indexes)} samples in one request, more than max_samples_per_request="
                    f"{self.config.max_samples_per_request}"
                )
            asked: list[str | None] = [None if keys is None else keys.key_of.get(i) for i in msg.indexes]
            indexes = np.asarray(msg.indexes, dtype=np.int64)
        else:
            if msg.keys is not None:
                self._check(msg.keys, None, "")
            names = list(keys.index) if msg.keys is None and keys is not None else list(msg.keys or [])
            asked = list(names)
            indexes = np.asarray([-1 if keys is None else keys.index.get(k, -1) for k in names], dtype=np.int64)
        if part is None or keys is None:
            return KeysFound(keys=asked, indexes=[-1] * len(asked), tags=[None] * len(asked))
        live = self._live(part, indexes)
        indexes = np.where(live, indexes, -1)
        tags: list[Tags | None] = []
        for key, i in zip(asked, indexes.tolist()):
            if i >= 0:
                tags.append(keys.sample_tags.get(i, {} if key is not None else None))
            else:
                tags.append(keys.tags_of_key(key) if key is not None else None)
        found = indexes[indexes >= 0]
        meta = None
        if len(found):
            fields = msg.fields if msg.fields is not None else self._common_fields(part, found)
            meta = self._meta_of(part, found, list(fields), None, 0, float("inf"))
        return KeysFound(keys=asked, indexes=indexes.tolist(), tags=tags, meta=meta)

    def _common_fields(self, part: Partition, indexes: np.ndarray) -> list[str]:
        have = np.bitwise_and.reduce(part.samples.mask[indexes])
        return [name for name, bit in part.schema.bits.items() if have & bit]

    def list_keys(self, ident: bytes, msg: ListKeys, bufs: list[Any]) -> KeyListing:
        names = [msg.partition] if msg.partition is not None else list(self.state.partitions)
        out: dict[str, dict[str, Tags]] = {}
        for name in names:
            part, keys = self._existing(name)
            if part is None or keys is None or not keys.index:
                continue
            live = self._live(part, np.asarray([max(i, 0) for i in keys.index.values()], dtype=np.int64))
            out[name] = {
                key: (keys.sample_tags.get(i, {}) if i >= 0 else keys.key_tags.get(key, {}))
                for (key, i), ok in zip(keys.index.items(), live.tolist())
                if i < 0 or ok
            }
        return KeyListing(partitions=out)

    def drop(self, ident: bytes, msg: DropKeys, bufs: list[Any]) -> KeysFound:
        self._check(msg.keys, None, "")
        found = self.lookup(ident, LookupKeys(partition=msg.partition, keys=msg.keys, fields=[]), bufs)
        part, keys = self._existing(msg.partition)
        if keys is not None:
            for key in msg.keys:
                i = keys.index.pop(key, -1)
                keys.key_tags.pop(key, None)
                if i >= 0:
                    keys.key_of.pop(i, None)
                    keys.sample_tags.pop(i, None)
        return found

