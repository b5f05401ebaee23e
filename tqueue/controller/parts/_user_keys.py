"""Keys and tags: each partition's index from user keys to samples, and each sample's tags.

A key names at most one live sample of its partition; a key may exist before its sample (a
put of tags only) and gets one with ``BindKeys``. Tags are a small dict per sample (or per
key without a sample), replaced as a whole when written. Nothing here leases: a lookup returns
a meta of the samples found, as ``Select`` does.

Every tag write and key is bounded (``ControllerConfig.max_tag_bytes``, per sample or key; per
partition and in total ``max_tag_bytes_per_partition``, ``max_tag_bytes_total``,
``max_keys_per_partition`` and ``max_keys_total``): a request past one is refused whole with
``InvalidArgumentError`` naming the partition and the bound, and changes nothing. Tags count as
their MessagePack bytes; ``status().keys`` shows the use and the bounds.

The index is the partition's own (``Partition.keys``, ``_keyindex.py``): it goes with the
partition when that is cleared or frees itself, and into checkpoints with it. A sample cleared
on its own keeps its key until the key is dropped, but is never returned: a lookup finds only
committed, live samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ...config import ControllerConfig
from ...errors import InvalidArgumentError
from ...wire import (
    BatchMeta,
    BindKeys,
    DropKeys,
    KeyListing,
    KeysFound,
    ListKeys,
    LookupKeys,
    Ok,
    SetTags,
    TagKeys,
    Tags,
)
from ...wire._status import KeyStatus, KeyUse
from ..model._keyindex import KeyIndex
from ..model._partition import Partition
from ..model._samples import COMMITTED, EXCLUDED
from ..model._state import ControllerState

MetaOf = Callable[[Partition, np.ndarray, list[str], str | None, int, float], BatchMeta]

MAX_KEY_CHARS = 4096
_SIZER = msgspec.msgpack.Encoder()

# a tag write, before it is made: (sample index, key) of each place it writes (one of the two
# is None: a key without a sample), and the tags it writes there (None: the place is emptied)
Writes = list[tuple[int | None, str | None, Tags | None]]


def tag_bytes(tags: Tags | None) -> int:
    """What ``tags`` count against the bounds: their MessagePack bytes (0: none)."""
    return len(_SIZER.encode(tags)) if tags is not None else 0


class Keys:
    """The controller's part that owns every partition's ``KeyIndex``."""

    def __init__(self, state: ControllerState, meta_of: MetaOf) -> None:
        self.state = state
        self.config: ControllerConfig = state.config
        self._meta_of = meta_of
        # per partition name: (uid, id of its KeyIndex, its tags' bytes) as last counted; a
        # partition freed, made again or restored under the name is counted again from its index
        self._tag_bytes: dict[str, tuple[int, int, int]] = {}

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

    # --- bounds -------------------------------------------------------------------------

    def _bytes_of(self, part: Partition) -> int:
        """The bytes of ``part``'s tags (counted from its index once, then kept up to date)."""
        keys = part.keys
        if keys is None:
            return 0
        seen = self._tag_bytes.get(part.name)
        if seen is not None and seen[:2] == (part.uid, id(keys)):
            return seen[2]
        total = sum(map(tag_bytes, keys.sample_tags.values())) + sum(map(tag_bytes, keys.key_tags.values()))
        self._tag_bytes[part.name] = (part.uid, id(keys), total)
        return total

    def _totals(self) -> tuple[int, int]:
        """Keys and tag bytes of all partitions (and the counts of freed ones forgotten)."""
        keys = tags = 0
        keyed = 0
        for part in self.state.partitions.values():
            if part.keys is not None:
                keyed += 1
                keys += len(part.keys.index)
                tags += self._bytes_of(part)
        if len(self._tag_bytes) > keyed:
            live = self.state.partitions
            self._tag_bytes = {
                name: seen for name, seen in self._tag_bytes.items() if name in live and live[name].uid == seen[0]
            }
        return keys, tags

    def _admit(self, part: Partition, new_keys: int, writes: Writes) -> int:
        """Refuse a request that would pass a bound on tags or keys (before anything changes);
        else the partition's tag bytes once it is made."""
        cfg = self.config
        keys = self._of(part)
        delta = 0
        for i, key, tags in writes:
            size = tag_bytes(tags)
            if size > cfg.max_tag_bytes:
                where = f"key {key!r}" if key is not None else f"sample {i}"
                raise InvalidArgumentError(
                    f"the tags of {where} of partition {part.name!r} are {size} bytes as MessagePack, more than "
                    f"max_tag_bytes={cfg.max_tag_bytes}"
                )
            old = keys.sample_tags.get(i) if i is not None else keys.key_tags.get(key or "")
            delta += size - tag_bytes(old)
        mine = self._bytes_of(part) + delta
        if new_keys <= 0 and delta <= 0:
            return mine  # a write that takes nothing more is never refused
        held = len(keys.index) + new_keys
        if new_keys > 0 and held > cfg.max_keys_per_partition:
            raise InvalidArgumentError(
                f"partition {part.name!r} would hold {held} keys, more than max_keys_per_partition="
                f"{cfg.max_keys_per_partition} (drop_keys, or clear the partition)"
            )
        if delta > 0 and mine > cfg.max_tag_bytes_per_partition:
            raise InvalidArgumentError(
                f"partition {part.name!r} would hold {mine} bytes of tags, more than max_tag_bytes_per_partition="
                f"{cfg.max_tag_bytes_per_partition}"
            )
        all_keys, all_tags = self._totals()
        if new_keys > 0 and all_keys + new_keys > cfg.max_keys_total:
            raise InvalidArgumentError(
                f"partition {part.name!r}: {new_keys} new keys would make {all_keys + new_keys} in all partitions, "
                f"more than max_keys_total={cfg.max_keys_total}"
            )
        if delta > 0 and all_tags + delta > cfg.max_tag_bytes_total:
            raise InvalidArgumentError(
                f"partition {part.name!r}: {delta} more bytes of tags would make {all_tags + delta} in all "
                f"partitions, more than max_tag_bytes_total={cfg.max_tag_bytes_total}"
            )
        return mine

    def _counted(self, part: Partition, total: int) -> None:
        if part.keys is not None:
            self._tag_bytes[part.name] = (part.uid, id(part.keys), total)

    def status(self) -> KeyStatus:
        """The keys and tags held, per partition and in all, with their bounds."""
        cfg = self.config
        keys, tags = self._totals()
        return KeyStatus(
            keys=keys, tag_bytes=tags, max_keys_total=cfg.max_keys_total, max_tag_bytes_total=cfg.max_tag_bytes_total,
            max_keys_per_partition=cfg.max_keys_per_partition,
            max_tag_bytes_per_partition=cfg.max_tag_bytes_per_partition, max_tag_bytes=cfg.max_tag_bytes,
            partitions={
                name: KeyUse(keys=len(p.keys.index), tag_bytes=self._bytes_of(p))
                for name, p in self.state.partitions.items() if p.keys is not None
            },
        )

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
        writes: Writes = []
        for n, (key, i) in enumerate(zip(msg.keys, msg.indexes)):
            pending = keys.key_tags.get(key)
            if msg.tags is not None or pending is not None:  # the key's own tags go to its sample
                writes += [(i, None, msg.tags[n] if msg.tags is not None else pending)]
                writes += [(None, key, None)] if pending is not None else []
        counted = self._admit(part, sum(1 for k in msg.keys if k not in keys.index), writes)
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
        self._counted(part, counted)
        return Ok()

    def tag_keys(self, ident: bytes, msg: TagKeys, bufs: list[Any]) -> Ok:
        self._check(msg.keys, msg.tags, "tags")
        part = self.state.partitions.get_or_create(msg.partition)
        keys = self._of(part)
        new = sum(1 for k in msg.keys if k not in keys.index)
        if new and len(keys.key_tags) + new > self.config.max_partition_samples:
            raise InvalidArgumentError(
                f"partition {msg.partition!r} would hold more than max_partition_samples="
                f"{self.config.max_partition_samples} keys without samples"
            )
        writes: Writes = []
        for key, tags in zip(msg.keys, msg.tags):
            i = keys.index.get(key, -1)
            writes.append((i, None, tags) if i >= 0 else (None, key, tags))
        counted = self._admit(part, new, writes)
        for key, tags in zip(msg.keys, msg.tags):
            i = keys.index.setdefault(key, -1)
            if i >= 0:
                keys.sample_tags[i] = tags
            else:
                keys.key_tags[key] = tags
        self._counted(part, counted)
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
        last = dict(zip(msg.indexes, msg.tags))  # a sample named twice keeps its last tags
        counted = self._admit(part, 0, [(i, None, tags) for i, tags in last.items()])
        keys.sample_tags.update(last)
        self._counted(part, counted)
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
        if part is not None and keys is not None:
            counted = self._bytes_of(part)
            for key in msg.keys:
                i = keys.index.pop(key, -1)
                counted -= tag_bytes(keys.key_tags.pop(key, None))
                if i >= 0:
                    keys.key_of.pop(i, None)
                    counted -= tag_bytes(keys.sample_tags.pop(i, None))
            self._counted(part, counted)
        return found

