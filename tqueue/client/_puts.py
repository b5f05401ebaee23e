"""The write path of a client: encode, grant, store over the unit's payload route (inline,
bulk streams or its arena: tqueue/client/_routes/) and updates of stored samples."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from .._memory import BufferPool
from .._tasks import all_or_none
from ..errors import InvalidArgumentError, PartitionSealedError, SchemaError, StorageUnitUnavailableError, UnavailableError
from ..wire import BatchMeta, Grant, Granted, Locate, Located, Store, Stored, UnitInfo
from ..wire._layout import split_lanes
from ..wire._messages import SampleFate
from ._args import _groups, _versions, _wait, listed
from ._ask import PutAsk
from ._connections import ClientStats, Connections
from ._encode import Encoded, encode, join, pack, sample_count, share
from ._integrity import checksum
from ._routes import Outgoing

log = logging.getLogger(__name__)


COALESCE_SAMPLES = 4096  # coalesce_puts: samples in one put made of several
COALESCE_BYTES = 256 << 20  # and bytes
MAX_KNOWN = 4096  # partitions whose fields shared by content a client remembers


@dataclasses.dataclass(slots=True)
class _Waiting:
    """A put waiting for its turn to go with others (coalesce_puts)."""

    enc: Encoded
    groups: list[Any] | None
    versions: list[int] | None
    done: asyncio.Future[BatchMeta]
    put: asyncio.Future[list[BatchMeta]] | None = None  # the put it went out in, with
    batch: list[_Waiting] = dataclasses.field(default_factory=list)  # the callers it went with


def _part(meta: BatchMeta, at: int, n: int) -> BatchMeta:
    """The meta of samples ``at .. at + n`` of a put's meta, with their own fate."""
    if not meta.indexes:  # aborted: nothing was stored, for any of the callers
        return meta
    cut = slice(at, at + n)
    fates = meta.fates[cut] if meta.fates is not None else None
    status = meta.status
    if fates is not None and all(f == "ok" for f in fates):
        status, fates = "ok", None
    elif fates is not None and all(f == "aborted" for f in fates):  # all past the target: as a put of its own
        cut, status, fates = slice(0), "aborted", None
    return msgspec.structs.replace(
        meta,
        indexes=meta.indexes[cut],
        units=meta.units[cut],
        groups=meta.groups[cut] if meta.groups is not None else None,
        versions=meta.versions[cut] if meta.versions is not None else None,
        status=status,
        fates=fates,
    )


class Puts:
    """Writes new samples and fields. Holds what ``reserve`` admitted and puts not yet used."""

    def __init__(self, conns: Connections, pool: BufferPool, stats: ClientStats) -> None:
        self._conns = conns
        self.config = conns.config
        self._pool = pool
        self.stats = stats
        self.reserved = 0  # samples admitted by reserve() and not yet put
        self._waiting: dict[Any, list[_Waiting]] = {}  # coalesce_puts: puts that go next turn, by kind
        self._unsent = 0  # coalesced puts asked for whose grant request has not gone yet
        self._idle: list[asyncio.Future[None]] = []  # callers of sent() waiting for them
        self._tasks: set[asyncio.Task[None]] = set()
        # fields shared by content per partition, as create_partition or a grant told this client
        self.shared: dict[str, frozenset[str]] = {}

    async def put(self, ask: PutAsk) -> BatchMeta:
        """:meth:`AsyncClient.put`."""
        partition = ask.partition
        if ask.if_sealed not in ("raise", "discard"):
            raise InvalidArgumentError(f"put to partition {partition!r}: if_sealed must be 'raise' or 'discard', not {ask.if_sealed!r}")
        enc = encode(ask.data, partition=partition, chunk_bytes=self.config.chunk_bytes, defer_device=True)
        group_ids = _groups(ask.groups, enc.count, partition)
        versions = _versions(ask.version, enc.count, partition)
        wait = _wait(ask.timeout, self.config.put_timeout)
        if self.config.coalesce_puts and not enc.on_device and not enc.cuda_devices:
            meta = await self._coalesced(ask, enc, group_ids, versions, wait)
        else:
            alone = await self._put(partition, enc, group_ids, versions, wait, ask.partial)
            assert not isinstance(alone, int)  # only a put of several callers is answered ``take``
            meta = alone
        if meta.status == "aborted" and ask.if_sealed == "raise":
            raise PartitionSealedError(
                f"put of {enc.count} sample(s) (fields {[b.name for b in enc.blocks]}) to partition {partition!r} "
                "stored nothing: the partition is sealed (seal(), or its over-sampling target was reached) or "
                "sealed and freed itself; an over-sampling producer that expects this passes if_sealed='discard' "
                "and reads status='aborted'"
            )
        return meta

    async def _coalesced(
        self, ask: PutAsk, enc: Encoded, group_ids: list[Any] | None, versions: list[int] | None, wait: float
    ) -> BatchMeta:
        """Queue a put to go with the others of its kind (partition, fields and their specs,
        options) waiting in this turn of the loop; its own samples' meta once stored."""
        key = (
            ask.partition, ask.partial, wait, group_ids is None, versions is None,
            tuple((b.name, b.spec) for b in enc.blocks),
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BatchMeta] = loop.create_future()
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            loop.call_soon(self._send_waiting, key)
        item = _Waiting(enc, group_ids, versions, done)
        waiting.append(item)
        self._unsent += 1
        try:
            return await done
        except asyncio.CancelledError:
            # the last caller to give up waits for the put's withdrawal, as a put alone does
            # (a request on the same connection after this one comes after its Cancel)
            if item.put is not None and all(w.done.cancelled() for w in item.batch):
                await asyncio.wait([item.put])
            raise

    def _send_waiting(self, key: Any) -> None:
        """Send the puts of one kind that waited for this turn: one put of all of them (up to
        COALESCE_SAMPLES samples and COALESCE_BYTES bytes each)."""
        partition, partial, wait = key[0], key[1], key[2]
        queued = self._waiting.pop(key, [])
        waiting = [w for w in queued if not w.done.done()]  # not cancelled meanwhile
        self._went(len(queued) - len(waiting))
        batch: list[_Waiting] = []
        for item in waiting:
            if batch and (
                sum(w.enc.count for w in batch) + item.enc.count > COALESCE_SAMPLES
                or sum(w.enc.nbytes for w in batch) + item.enc.nbytes > COALESCE_BYTES
            ):
                self._start(partition, batch, wait, partial)
                batch = []
            batch.append(item)
        if batch:
            self._start(partition, batch, wait, partial)

    def _went(self, n: int) -> None:
        """``n`` coalesced puts sent their grant request (or never will)."""
        self._unsent -= n
        if not self._unsent:
            for fut in self._idle:
                if not fut.done():
                    fut.set_result(None)
            self._idle.clear()

    async def sent(self) -> None:
        """Once every coalesced put asked for so far has sent its grant request (they go now,
        without waiting for the loop's turn): a request made after a put comes after it on
        the controller's connection, coalesced or not (``Connections.ctl``)."""
        if not self._unsent:
            return
        for key in list(self._waiting):
            self._send_waiting(key)
        if self._unsent:
            fut = asyncio.get_running_loop().create_future()
            self._idle.append(fut)
            await fut

    def _start(self, partition: str, batch: list[_Waiting], wait: float, partial: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._put_together(partition, batch, wait, partial))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put_together(self, partition: str, batch: list[_Waiting], wait: float, partial: bool) -> None:
        went = [False]

        def gone() -> None:  # its grant request is about to go (or never will)
            if not went[0]:
                went[0] = True
                self._went(len(batch))

        put = asyncio.ensure_future(self._put_callers(partition, batch, wait, partial, gone))
        put.add_done_callback(lambda _: gone())

        def withdraw(_: Any) -> None:  # every caller gave up: the put is withdrawn as one alone is
            if all(w.done.cancelled() for w in batch):
                put.cancel()

        for w in batch:
            w.put, w.batch = put, batch
            w.done.add_done_callback(withdraw)
        try:
            metas = await put
        except BaseException as exc:  # every caller gets the put's failure
            for w in batch:
                if not w.done.done():
                    w.done.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        for w, meta in zip(batch, metas):
            if not w.done.done():
                w.done.set_result(meta)

    async def _put_callers(
        self, partition: str, batch: list[_Waiting], wait: float, partial: bool, going: Callable[[], None] | None,
    ) -> list[BatchMeta]:
        """One put of the callers' samples joined; each caller's meta. Where the controller
        answers that the put would cross the partition's target before its last caller
        (``Granted.take``), the callers up to the one that crosses go as one put and the
        others after them as another, so each caller meets the target (kept, trimmed,
        recycled or aborted) as a put of its own would."""
        try:
            if len(batch) == 1:
                enc, group_ids, versions = batch[0].enc, batch[0].groups, batch[0].versions
            else:
                enc = join(partition, [w.enc for w in batch])
                group_ids = None if batch[0].groups is None else [g for w in batch for g in w.groups or ()]
                versions = None if batch[0].versions is None else [v for w in batch for v in w.versions or ()]
        except BaseException:
            if going is not None:
                going()
            raise
        callers = [w.enc.count for w in batch] if len(batch) > 1 else None
        meta = await self._put(partition, enc, group_ids, versions, wait, partial, going, callers)
        if isinstance(meta, int):  # the callers up to the one that crosses, then the others
            cut = [int(n) for n in np.cumsum(callers or ())].index(meta) + 1
            first = await self._put_callers(partition, batch[:cut], wait, partial, None)
            return first + await self._put_callers(partition, batch[cut:], wait, partial, None)
        if len(batch) == 1:
            return [meta]
        ats = np.cumsum([0] + [w.enc.count for w in batch]).tolist()
        return [_part(meta, at, w.enc.count) for w, at in zip(batch, ats)]

    async def _put(
        self, partition: str, enc: Encoded, group_ids: list[Any] | None, versions: list[int] | None,
        wait: float, partial: bool, going: Callable[[], None] | None = None, callers: list[int] | None = None,
    ) -> BatchMeta | int:
        """One put of ``enc``: grant, store (placed again where its unit failed), its meta.
        ``going``: called as its first grant request goes (the controller's connection).
        ``callers``: the samples of each caller of a coalesced put; where the controller
        answers ``Granted.take``, nothing is stored and that is returned."""
        reserved = min(self.reserved, enc.count)
        share(enc, self.shared.get(partition, ()))  # values shared by content go once
        grant = Grant(
            partition=partition, count=enc.count, blocks=enc.grant_blocks(), host=self._conns.host,
            groups=group_ids, nbytes=enc.nbytes, versions=versions, reserved=reserved, partial=partial,
            callers=callers,
        )
        deadline = time.monotonic() + wait  # math.inf: none
        first: Granted | None = None  # a grant replaced after its unit failed was already stored
        left = wait
        while True:
            grant.timeout = left
            ctl = await self._conns.ctl(ordered=False)
            if going is not None:
                going()  # the request goes in the same step: who waited for it is resumed after
                going = None
            reply, _ = await ctl.request(grant, timeout=left + self.config.request_timeout, expect=Granted)
            self.reserved -= reserved
            reserved = 0  # the reservation stays with the write when it is placed again
            if reply.stored and first is not None:
                reply, stored = first, Stored(nbytes=enc.nbytes)
                break
            if reply.take:
                self.reserved += reserved  # the reservation stays with the callers' puts
                return reply.take
            if reply.status == "aborted":
                return BatchMeta(
                    partition=partition, partition_uid=reply.partition_uid, indexes=[], units=[],
                    fields=[b.name for b in enc.blocks], schema={}, status="aborted", sealed=reply.sealed,
                )
            assert reply.unit is not None
            self._learn(reply.partition or partition, reply.dedup, enc)
            try:
                stored = await self._store_copies(reply, reply.partition or partition, enc)
                break
            except StorageUnitUnavailableError as exc:
                if first is not None and time.monotonic() >= deadline:
                    raise  # placed again once at least, whatever the timeout
                # another unit may have room: the controller places the write again and
                # probes this one (a failed store is evidence that it died)
                log.warning("%s; placing the put again", exc)
                grant.replaces, grant.failed_unit, first = reply.grant_id, getattr(exc, "unit_id", reply.unit.unit_id), reply
                left = max(0.0, deadline - time.monotonic())
        assert reply.unit is not None
        fields = [b.name for b in enc.blocks]
        where = reply.partition or partition
        trimmed = 0 <= reply.kept < enc.count
        fates: list[SampleFate] | None = None
        if trimmed:  # the target was reached inside this put: the first ``kept`` samples count
            fates = ["ok" if i < reply.kept else "aborted" for i in range(enc.count)]
        return BatchMeta(
            partition=where,
            partition_uid=reply.partition_uid,
            indexes=list(range(reply.start, reply.start + enc.count)),
            units=[reply.unit.unit_id] * enc.count,
            fields=fields,
            schema=reply.schema,
            groups=group_ids,
            versions=versions,
            status="trimmed" if trimmed else reply.status,
            sealed=reply.sealed or stored.sealed,
            recycled_to=where if reply.status == "recycled" else "",
            fates=fates,
        )

    def _learn(self, partition: str, dedup: list[str], enc: Encoded) -> None:
        """A grant names the partition's fields shared by content: kept for the next puts,
        and applied to this one where it was sent before this client knew."""
        if frozenset(dedup) != self.shared.get(partition, frozenset()):
            if len(self.shared) >= MAX_KNOWN and partition not in self.shared:
                self.shared.clear()  # bounded: a partition forgotten is learned again at its next grant
            self.shared[partition] = frozenset(dedup)
        share(enc, dedup)

    async def _store_copies(self, grant: Granted, partition: str, enc: Encoded) -> Stored:
        """Store a put on its unit, and on the unit of its second copy where the partition
        keeps two copies: acknowledged once both hold it."""
        if not grant.second_units:
            assert grant.unit is not None
            return await self._store(grant.unit, partition, grant, enc, None)
        enc.materialize()  # two routes read it at once: host bytes, not fields left on a device
        units = [grant.unit, *grant.second_units]
        stored = await all_or_none(*(self._store(u, partition, grant, enc, None) for u in units if u is not None))
        return stored[0]

    async def _store(
        self, unit: UnitInfo, partition: str, grant: Granted, enc: Encoded, indexes: list[int] | None,
        append: Sequence[str] = (),
    ) -> Stored:
        """Store one put's bytes on its unit; a unit that went silent is named with the
        partition and the samples the put would have written (and its id is on the error)."""
        try:
            return await self._store_on(unit, partition, grant, enc, indexes, append)
        except StorageUnitUnavailableError as exc:
            samples = indexes if indexes is not None else list(range(grant.start, grant.start + enc.count))
            failed = type(exc)(
                f"partition {partition!r}: samples {listed(samples)} were not stored on storage unit "
                f"{unit.unit_id} at {unit.address}: {exc}"
            )
            failed.unit_id = unit.unit_id  # type: ignore[attr-defined]
            raise failed from exc

    async def _store_on(
        self, unit: UnitInfo, partition: str, grant: Granted, enc: Encoded, indexes: list[int] | None,
        append: Sequence[str] = (),
    ) -> Stored:
        route = self._conns.route_to(unit)
        if not route.device_writes:
            enc.materialize()
        store = Store(
            grant_id=grant.grant_id,
            partition=partition,
            partition_uid=grant.partition_uid,
            start=grant.start,
            count=enc.count,
            blocks=enc.blocks,
            indexes=indexes,
            timeout=self.config.request_timeout,
            append=list(append) or None,
        )
        chunk, take = self.config.chunk_bytes, self._pool.take
        sums = (lambda: checksum(enc)) if self.config.checksums else (lambda: None)
        if not route.local or self.config.arena_checksums:
            sums()
        sent = await route.store(
            Outgoing(
                wide=enc,
                narrow=(lambda defer: pack(enc, chunk, take, defer=defer)) if self.config.pack_ints else None,
                narrow_arena=(
                    (lambda: pack(enc, chunk, take, dense=self.config.arena_pack_dense, one_width=True))
                    if self.config.pack_ints else None
                ),
                split=lambda sizes, lanes: split_lanes(sizes, lanes),
                checksum=sums,
            ),
            store,
        )
        self.stats.puts += 1
        self.stats.put_bytes += enc.nbytes + enc.shared
        self.stats.wire_bytes += sent.wire
        self.stats.copied_bytes += sent.copied
        return sent.stored

    async def update(
        self,
        meta: BatchMeta,
        data: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        complete: bool = False,
        segment: tuple[int, int] | None = None,
        append: Sequence[str] = (),
        splice: Mapping[str, Sequence[int]] | None = None,
    ) -> list[int]:
        """:meth:`AsyncClient.update`; ``complete`` and ``segment`` for
        :meth:`AsyncClient.complete` (``splice``: per field, per sample, the first row this
        update computed, which the controller keeps with the segment). Returns the indexes not written because completing them
        would pass the partition's target (each unit's share is written whole or not at all).
        Samples on no unit yet (allocated rows) are placed first, and those of a partition of
        two copies are written on both units of their copies, where the controller says they
        are now (``Locate``)."""
        copies = [-1] * len(meta)
        if meta.two_copies or any(u < 0 for u, i in zip(meta.units, meta.indexes) if i >= 0):
            meta, copies = await self._locate(meta)
        positions = _by_pair(meta, copies)
        cols, n = sample_count(data, meta.partition)
        if n != len(meta):
            raise SchemaError(
                f"the update of partition {meta.partition!r} has {n} samples, its meta has {len(meta)}"
            )
        writes = []
        for (unit_id, copy), pos in positions.items():
            sub = cols if len(positions) == 1 else _select(cols, pos)
            enc = encode(sub, partition=meta.partition, chunk_bytes=self.config.chunk_bytes)
            writes.append((unit_id, copy, [meta.indexes[i] for i in pos.tolist()], enc, sub))
        ctl = await self._conns.ctl()
        refused: list[int] = []
        rows_of = {f: dict(zip(meta.indexes, (int(r) for r in rows))) for f, rows in (splice or {}).items()}

        async def write(unit_id: int, copy: int, indexes: list[int], enc: Encoded, sub: Any, tries: int = 3) -> None:
            share(enc, self.shared.get(meta.partition, ()))
            reply, _ = await ctl.request(
                Grant(
                    partition=meta.partition,
                    partition_uid=meta.partition_uid,
                    count=enc.count,
                    blocks=enc.grant_blocks(),
                    indexes=indexes,
                    complete=complete,
                    segment=(segment[0], segment[1]) if segment is not None else None,
                    append=list(append) or None,
                    splice={f: [m[i] for i in indexes] for f, m in rows_of.items()} or None,
                ),
                expect=Granted,
            )
            if reply.status == "aborted":  # the target is full: these stay partial, untouched
                refused.extend(indexes)
                return
            if reply.status == "moved":  # their copies split between units since they were located
                if tries <= 1:
                    raise UnavailableError(
                        f"partition {meta.partition!r}: the copies of samples {indexes[:8]} kept moving while "
                        "they were being updated; try again"
                    )
                await self._rewrite(meta, indexes, sub, write, tries - 1)
                return
            self._learn(meta.partition, reply.dedup, enc)
            if reply.unit is not None:  # two copies: their units now, as the controller has them
                targets = [reply.unit.unit_id, *(r.unit_id for r in reply.second_units)]
                for info in (reply.unit, *reply.second_units):
                    self._conns.units[info.unit_id] = info
                    self._conns.connect_unit(info)
                copy = targets[1] if len(targets) > 1 else -1
            else:
                targets = [unit_id] + ([copy] if copy >= 0 else [])
                for u in targets:
                    await self._conns.unit(u)
            if copy >= 0:
                enc.materialize()  # two routes read it at once
            await all_or_none(*(self._store(self._conns.units[u], meta.partition, reply, enc, indexes, append) for u in targets))

        await all_or_none(*(write(*w) for w in writes))
        return sorted(refused)

    async def _rewrite(self, meta: BatchMeta, indexes: list[int], cols: Any, write: Any, tries: int) -> None:
        """Write again, per pair of units as the controller has them now, samples whose copies
        moved between their ``Locate`` and their grant (``cols``: their data, in order)."""
        located, copies = await self._locate(msgspec.structs.replace(meta, indexes=list(indexes), units=[-1] * len(indexes)))
        positions = _by_pair(located, copies)
        calls = []
        for (u, c), pos in positions.items():
            sub = cols if len(positions) == 1 else _select(cols, pos)
            enc = encode(sub, partition=meta.partition, chunk_bytes=self.config.chunk_bytes)
            calls.append(write(u, c, [indexes[i] for i in pos.tolist()], enc, sub, tries))
        await all_or_none(*calls)

    async def _locate(self, meta: BatchMeta) -> tuple[BatchMeta, list[int]]:
        """``meta`` with its samples' units as the controller has them now (placing rows that
        have none), and the unit of each one's second copy (-1: none; pad rows: -1 both)."""
        real = [k for k, i in enumerate(meta.indexes) if i >= 0]
        ctl = await self._conns.ctl()
        where, _ = await ctl.request(
            Locate(partition=meta.partition, partition_uid=meta.partition_uid, indexes=[meta.indexes[k] for k in real],
                   host=self._conns.host),
            expect=Located,
        )
        units, copies = [-1] * len(meta), [-1] * len(meta)
        for k, u, c in zip(real, where.units, where.second_units or [-1] * len(real)):
            units[k], copies[k] = u, c
        return msgspec.structs.replace(meta, units=units), copies


def _by_pair(meta: BatchMeta, copies: list[int]) -> dict[tuple[int, int], np.ndarray]:
    """Batch positions of a meta's samples per (unit, unit of the second copy) (pad rows left out)."""
    out: dict[tuple[int, int], list[int]] = {}
    for k, (u, c) in enumerate(zip(meta.units, copies)):
        if u >= 0:
            out.setdefault((u, c), []).append(k)
    return {pair: np.asarray(pos, dtype=np.int64) for pair, pos in out.items()}


def _select(cols: dict[str, Any], pos: np.ndarray) -> dict[str, Any]:
    """The samples at ``pos`` of each column (a copy for tensors and arrays)."""
    out: dict[str, Any] = {}
    for name, value in cols.items():
        if isinstance(value, torch.Tensor):
            out[name] = value[torch.from_numpy(pos)]
        elif isinstance(value, np.ndarray):
            out[name] = value[pos]
        else:
            out[name] = [value[i] for i in pos.tolist()]
    return out
