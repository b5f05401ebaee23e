"""Keys, tags and reads without a lease, as a client asks for them: a partition's index from
user keys to samples, each sample's tags (``tqueue/controller/parts/_user_keys.py`` keeps them), and the
meta of every live sample (``select``). The calls neither lease nor consume: their metas can
be read by anyone, any number of times."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._meta import Meta as UserMeta
from ..errors import InvalidArgumentError, PartitionClearedError
from ..wire import (
    AllocateRows,
    BindKeys,
    Clear,
    DropKeys,
    KeyListing,
    KeysFound,
    ListKeys,
    LookupKeys,
    MetaReply,
    Ok,
    ResetConsumption,
    Select,
    SetTags,
    TagKeys,
)
from ._connections import Connections


def _tags(tags: Sequence[dict[str, Any]] | None, count: int, what: str) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    out = list(tags)
    if len(out) != count or not all(isinstance(t, dict) for t in out):
        raise InvalidArgumentError(f"tags: one dict per {what} ({count}), got {len(out)} values")
    return out


def _keys(keys: Sequence[str]) -> list[str]:
    out = list(keys)
    bad = next((k for k in out if not isinstance(k, str)), None)
    if bad is not None:
        raise InvalidArgumentError(f"keys are str, got {type(bad).__name__}: {bad!r}")
    return out


class KeyCalls:
    """The key and tag calls of one client; :class:`~tqueue.client.AsyncClient` hands them on
    as they are, so each method's signature and docstring here are the client's."""

    def __init__(self, conns: Connections) -> None:
        self._conns = conns

    async def bind_keys(self, meta: UserMeta, keys: Sequence[str], *, tags: Sequence[dict[str, Any]] | None = None) -> None:
        """Name the samples of ``meta`` (a put's) by ``keys``, one each in meta order, and with
        ``tags`` replace their tags. A key names one sample of its partition: a key that names
        another live sample is refused (:class:`InvalidArgumentError`); a key made by
        :meth:`tag_keys` gets this sample and keeps its tags unless ``tags`` are given."""
        names = _keys(keys)
        if len(names) != len(meta.indexes):
            raise InvalidArgumentError(f"bind_keys: {len(names)} keys for {len(meta.indexes)} samples: one each")
        msg = BindKeys(partition=meta.partition, keys=names, indexes=list(meta.indexes), tags=_tags(tags, len(names), "key"))
        await (await self._conns.ctl()).request(msg, expect=Ok)

    async def tag_keys(self, partition: str, keys: Sequence[str], tags: Sequence[dict[str, Any]]) -> None:
        """Replace the tags of ``keys`` of ``partition`` (one dict of MessagePack values each).
        A key not known yet is made without a sample (and the partition, if there is none):
        it is listed with its tags, and a later :meth:`bind_keys` gives it a sample."""
        names = _keys(keys)
        msg = TagKeys(partition=partition, keys=names, tags=_tags(tags, len(names), "key") or [])
        await (await self._conns.ctl()).request(msg, expect=Ok)

    async def set_tags(self, meta: UserMeta, tags: Sequence[dict[str, Any]]) -> None:
        """Replace the tags of the samples of ``meta``, one dict each in meta order."""
        msg = SetTags(partition=meta.partition, indexes=list(meta.indexes), tags=_tags(tags, len(meta.indexes), "sample") or [])
        await (await self._conns.ctl()).request(msg, expect=Ok)

    async def lookup_keys(
        self, partition: str, keys: Sequence[str] | None = None, *, fields: Sequence[str] | None = None
    ) -> KeysFound:
        """Where ``keys`` of ``partition`` are (None: every key), with their tags: ``indexes``
        (-1 where a key is unknown or has no live sample), ``tags`` (None: unknown key) and
        ``meta``, the samples found, in the order asked, for ``fields`` (None: every field
        they all have) or None when none was found. ``get_data(found.meta)`` reads them; no
        lease is taken and nothing is consumed."""
        msg = LookupKeys(
            partition=partition,
            keys=None if keys is None else _keys(keys),
            fields=None if fields is None else list(fields),
        )
        reply, _ = await (await self._conns.ctl()).request(msg, expect=KeysFound)
        return reply

    async def keys_of(self, partition: str, indexes: Sequence[int], *, fields: Sequence[str] | None = None) -> KeysFound:
        """The keys and tags of samples ``indexes`` of ``partition`` (a key None where a sample
        has none), with the meta of the live ones as :meth:`lookup_keys` gives it."""
        msg = LookupKeys(partition=partition, indexes=[int(i) for i in indexes], fields=None if fields is None else list(fields))
        reply, _ = await (await self._conns.ctl()).request(msg, expect=KeysFound)
        return reply

    async def list_keys(self, partition: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """Every key with its tags, per partition: of ``partition``, or of every partition."""
        reply, _ = await (await self._conns.ctl()).request(ListKeys(partition=partition), expect=KeyListing)
        return reply.partitions

    async def drop_keys(self, partition: str, keys: Sequence[str]) -> None:
        """Forget ``keys`` of ``partition`` and free the samples they named, on every unit.
        Unknown keys, and a partition that does not exist, are ignored."""
        ctl = await self._conns.ctl()
        found, _ = await ctl.request(DropKeys(partition=partition, keys=_keys(keys)), expect=KeysFound)
        if found.meta is not None:
            meta = found.meta
            await ctl.request(Clear(partition=meta.partition, partition_uid=meta.partition_uid, indexes=list(meta.indexes)), expect=Ok)

    async def select(
        self, partition: str, fields: Sequence[str], *, limit: int | None = None, consumed_by: str | None = None
    ) -> UserMeta | None:
        """The meta of the live samples of ``partition`` that have every field of ``fields``
        (committed; not partial, failed, aborted or cleared), in index order, at most
        ``limit`` of them: no lease is taken and nothing is consumed, whatever any task did
        with them. ``consumed_by``: only those that task consumed. None where the partition
        does not exist."""
        if limit is not None and limit < 0:
            raise InvalidArgumentError(f"limit must be >= 0, got {limit}")
        msg = Select(partition=partition, fields=list(fields), consumed_by=consumed_by, limit=-1 if limit is None else limit)
        try:
            reply, _ = await (await self._conns.ctl()).request(msg, expect=MetaReply)
        except PartitionClearedError:
            return None
        return reply.meta

    async def allocate(self, partition: str, count: int) -> UserMeta:
        """``count`` new samples of ``partition`` (made if need be) with no fields yet, to be
        written later with :meth:`~tqueue.AsyncClient.update` (TransferQueue's
        ``get_meta(mode="insert")``). Readers see a sample once it holds every field they ask
        for; each sample is placed on a unit by its first write, and every later write of it
        goes there. A partition with a target or groups takes none (``InvalidArgumentError``)."""
        if count < 1:
            raise InvalidArgumentError(f"allocate needs count >= 1, got {count}")
        reply, _ = await (await self._conns.ctl()).request(AllocateRows(partition=partition, count=count), expect=MetaReply)
        return reply.meta

    async def reset_consumption(self, partition: str, task: str | None = None) -> None:
        """Make every sample of ``partition`` that ``task`` (None: every task) consumed
        available to it again, to be read once more; samples it holds under a lease stay
        leased. A partition that does not exist is left alone."""
        await (await self._conns.ctl()).request(ResetConsumption(partition=partition, task=task), expect=Ok)
