"""The read path of a client: leases from the controller (get_meta, renew, ack) and
payload fetched from the storage units in parallel and assembled into a :class:`Batch`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import numpy as np

from .._memory import BufferPool
from .._tasks import all_or_none
from ..errors import (
    DataCorruptionError,
    DataLostError,
    InvalidArgumentError,
    PartitionClearedError,
    StorageUnitUnavailableError,
    UnknownFieldError,
    did_you_mean,
)
from ..transport import _zmq
from ..wire import Ack, BatchMeta, Corrupt, GetMeta, Locate, Located, MetaReply, Ok, Renew
from ._args import _by_unit, _wait, listed
from ._ask import MetaAsk, Options, ask  # MetaAsk: defined there; still importable from here
from ._assemble import Part, assemble, expanded, narrowed
from ._batch import Batch
from ._connections import ClientStats, Connections
from ._integrity import verify, verify_rows
from ._routes import BatchBuffers, Route
from ._routes.device import Accelerator, Delivery, DenseOnDevice, deliver

log = logging.getLogger(__name__)

# seconds a read waits, after its unit closed the connection, for ZeroMQ to learn whether the
# unit is gone (a reconnect refused: its samples are lost) or back (restarted, or a network blip)
RECONNECT_VERDICT: Final = 2.0


class ThreadRoute:
    """``get_meta`` sent and waited for by one calling thread on a connection of its own to the
    controller, in its client's session, not through the client's event loop: the blocking
    client's route for it, about twice as fast. Same arguments, rounds and errors as
    :meth:`AsyncClient.get_meta`; an exception in the waiting thread (Ctrl-C) withdraws the
    request at the controller. Made by :meth:`AsyncClient.thread_route`."""

    def __init__(self, gets: Gets, peer: _zmq.BlockingPeer) -> None:
        self._gets = gets
        self._peer = peer

    @property
    def closed(self) -> bool:
        return self._peer.closed

    def get_meta(self, *args: Any, **kwargs: Any) -> BatchMeta:
        msg, limit = self._gets.request(ask(MetaAsk, "get_meta", *args, **kwargs))
        return self._gets.got_meta(msg, self._peer.request(msg, expect=MetaReply, timeout=limit))

    def close(self) -> None:
        self._peer.close()


class Gets:
    """Reads: leases, fetches and acks. Remembers the data-parallel rounds it has seen."""

    def __init__(self, conns: Connections, pool: BufferPool, stats: ClientStats) -> None:
        self._conns = conns
        self.config = conns.config
        self._pool = pool
        self.stats = stats
        self._round_of: dict[tuple[Any, ...], tuple[int, int]] = {}  # DP rounds seen
        self._devices = conns.devices

    async def get_meta(self, ask: MetaAsk) -> BatchMeta:
        """:meth:`AsyncClient.get_meta`."""
        msg, limit = self.request(ask)
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(msg, expect=MetaReply, timeout=limit)
        return self.got_meta(msg, reply)

    def request(self, ask: MetaAsk) -> tuple[GetMeta, float]:
        """The ``GetMeta`` of a ``get_meta`` call and how long to wait for its answer (shared
        with the blocking client, which sends it from the caller's thread); ``math.inf``:
        no limit."""
        wait = _wait(ask.timeout, self.config.get_timeout)
        lease = _wait(ask.lease_timeout, self.config.lease_timeout, "lease_timeout")
        fields = [ask.fields] if isinstance(ask.fields, str) else list(ask.fields)
        group = ask.replica_group or ""
        seen_uid, next_round = self._round_of.get((ask.partition, ask.task, ask.dp_rank, ask.dp_size, group), (0, 0))
        round = ask.round
        if ask.dp_size is not None:
            if ask.dp_rank is None:
                raise InvalidArgumentError("dp_size needs dp_rank")
            if round is None:
                round = next_round
        msg = GetMeta(
            partition=ask.partition,
            fields=fields,
            batch_size=ask.batch_size,
            task=ask.task,
            timeout=wait,
            lease_timeout=lease,
            policy=ask.policy or "",
            dp_rank=-1 if ask.dp_rank is None else ask.dp_rank,
            dp_size=ask.dp_size or 0,
            round=-1 if round is None else round,
            round_uid=seen_uid,
            max_tokens_per_micro_batch=ask.max_tokens_per_micro_batch or 0,
            balance_by=[ask.balance_by] if isinstance(ask.balance_by, str)
            else list(ask.balance_by) if ask.balance_by is not None else None,
            micro_batch_size=ask.micro_batch_size or 0,
            num_microbatches_multiple_of=ask.num_microbatches_multiple_of,
            min_num_microbatches=ask.min_num_microbatches,
            max_staleness=ask.max_staleness,
            pad=ask.pad,
            replica_group=group,
            policy_args=_policy_args(ask.policy_args),
        )
        return msg, wait + self.config.request_timeout  # math.inf: no limit

    def got_meta(self, msg: GetMeta, reply: MetaReply) -> BatchMeta:
        meta = reply.meta
        if msg.dp_size:
            key = (msg.partition, msg.task, msg.dp_rank, msg.dp_size, msg.replica_group)
            self._round_of[key] = (meta.partition_uid, meta.round + 1)
        return meta

    async def renew(self, meta: BatchMeta, *, lease_timeout: float | None = None) -> None:
        """:meth:`AsyncClient.renew`."""
        if meta.task is None or not meta.lease:
            raise InvalidArgumentError("renew takes a meta from get_meta (this one holds no lease)")
        lease = _wait(lease_timeout, self.config.lease_timeout, "lease_timeout")
        ctl = await self._conns.ctl()
        await ctl.request(
            Renew(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                task=meta.task,
                lease=meta.lease,
                timeout=lease,
            ),
            expect=Ok,
        )

    async def get_data(
        self, meta: BatchMeta | MetaAsk, fields: Sequence[str] | None = None, options: Options | None = None
    ) -> Batch:
        """:meth:`AsyncClient.get_data`: of ``meta``, or of what ``get_meta(ask)`` leases."""
        options = options or Options()
        options.check()
        acc = None if options.device is None else self._devices.of(options.device)  # before a lease
        if isinstance(meta, MetaAsk):
            meta = await self.get_meta(meta)
        want = list(meta.fields if fields is None else ([fields] if isinstance(fields, str) else fields))
        for f in want:
            if f not in meta.schema:
                raise UnknownFieldError(
                    f"field {f!r} is not in the schema of this meta of partition "
                    f"{meta.partition!r}{did_you_mean(f, meta.schema)}; known: {sorted(meta.schema)}"
                )
        return await self._fetch(meta, want, options, acc)

    async def _fetch(self, meta: BatchMeta, fields: list[str], options: Options, acc: Accelerator | None) -> Batch:
        """Fetch from every unit in parallel (one request each, or one per lane), each over
        the route its connections picked for it, then assemble.

        (Splitting the request per field, to copy one field while the next arrives, was
        slower on two cores: the copy competes with ZeroMQ's receive for the CPU.)"""
        positions = _by_unit(meta)
        pool = self._pool if acc is None else acc.pool()  # page-locked for a device
        if not positions:  # nothing to fetch: an empty batch, or pad rows only
            return self._delivered(assemble(meta, fields, [], options, pool)[0], acc)
        routes = {u: await self._conns.route(u) for u in positions}
        delivery = dense = None
        if acc is not None:  # the device route: dense fields assembled there as parts arrive
            self._devices.prepare(acc, list(routes.values()))
            delivery = Delivery(acc, self._devices.chunk_bytes)
            dense = DenseOnDevice(meta, fields, delivery)
        rows = BatchBuffers(meta, pool)
        indexes = np.asarray(meta.indexes, dtype=np.int64)
        jobs = [(routes[u], lane) for u, p in positions.items() for lane in routes[u].lanes(meta, fields, p)]
        try:
            fetched = await all_or_none(
                *(self._fetch_part(route, meta, p, indexes[p].tolist(), fields, rows, dense) for route, p in jobs)
            )
            parts = [part for some in fetched for part in some]
        except BaseException:
            if delivery is not None:  # a unit failed, or Ctrl-C: no copy may still read the host buffers
                delivery.finish()
            raise
        on_device = dense.finish() if dense is not None else {}
        on_host = [f for f in fields if f not in on_device]
        batch, tally = assemble(meta, on_host, parts, options, pool, rows.buffers)
        if any(part.unchecked for part in parts):
            try:
                verify_rows(meta, parts, batch)
            except DataCorruptionError as exc:  # read again: the bad samples from their other copy
                where = await self._report(exc, meta)
                units = dict(zip(exc.samples, where.units))  # type: ignore[attr-defined]
                placed = msgspec.structs.replace(meta, units=[units.get(i, u) for i, u in zip(meta.indexes, meta.units)])
                log.warning("%s; reading them from their other copy", exc)
                return await self._fetch(placed, fields, options, acc)
        self.stats.gets += 1
        self.stats.get_bytes += tally.logical
        self.stats.wire_bytes += tally.wire
        self.stats.copied_bytes += tally.copied
        if delivery is None:
            return narrowed(batch, options)
        moved = deliver(batch, delivery, fields, on_device)
        self.stats.copied_bytes += delivery.bounced
        self.stats.device_bytes += delivery.direct + delivery.bounced
        return narrowed(moved, options)

    def _delivered(self, batch: Batch, acc: Accelerator | None) -> Batch:
        """An empty batch on its device (the device route), or as it is."""
        if acc is None:
            return batch
        return deliver(batch, Delivery(acc, self._devices.chunk_bytes), list(batch), {})

    async def _fetch_part(
        self, route: Route, meta: BatchMeta, pos: np.ndarray, idx: list[int], fields: list[str], rows: BatchBuffers,
        dense: DenseOnDevice | None = None,
    ) -> list[Part]:
        """The samples at batch positions ``pos`` (partition indexes ``idx``) from one unit;
        its dense fields' copies to the device queued at once, for a device read. Where the
        unit is gone and the partition keeps copies, from the units of the copies."""
        try:
            part = await route.fetch(meta, pos, idx, fields, rows)
            if self.config.checksums and (not route.local or self.config.arena_checksums):
                verify(meta, route.info.unit_id, part, assembled=dense is None)
            part = expanded(part)  # values shared by content: one per sample, as views
            if dense is not None:
                dense.add(part)
            return [part]
        except DataCorruptionError as exc:
            return await self._corrupt(exc, route, meta, pos, idx, fields, rows, dense)
        except StorageUnitUnavailableError as exc:
            unit_id = route.info.unit_id
            where = await self._locate(meta, idx, unit_id)
            units = _live_copies(where, unit_id)
            if units is not None:
                return await self._fetch_copies(meta, pos, np.asarray(idx, dtype=np.int64), units, fields, rows, dense)
            samples = f"partition {meta.partition!r}: samples {listed(idx)} on storage unit {unit_id} at {route.info.address}"
            # lost only on proof: the controller declared the unit dead (its samples are
            # excluded for good), or the unit's address refuses connections (its process
            # is gone, and its memory with it). A unit silent or slow may be back.
            peer = self._conns.unit_peers.get(unit_id)
            if (where is not None and any(where.gone)) or (peer is not None and await peer.settled(RECONNECT_VERDICT)
                                                           and peer.refusing):
                raise DataLostError(f"{samples} cannot be read: {exc}") from exc
            raise StorageUnitUnavailableError(
                f"{samples} cannot be read now: {exc}. They are not lost unless the controller declares the unit "
                "dead (it has been silent for the liveness window); read them again later"
            ) from exc

    async def _corrupt(
        self, exc: DataCorruptionError, route: Route, meta: BatchMeta, pos: np.ndarray, idx: list[int],
        fields: list[str], rows: BatchBuffers, dense: DenseOnDevice | None,
    ) -> list[Part]:
        """Samples read from ``route``'s unit failed their checksum: reported, so that the
        controller drops that copy; read again, the bad ones from their other copy where
        the partition keeps one. Else (no good copy left) the error, once they are lost."""
        unit_id = route.info.unit_id
        bad: list[int] = exc.samples  # type: ignore[attr-defined]
        where = await self._report(exc, meta)
        units = np.full(len(idx), unit_id, dtype=np.int64)
        at = {i: k for k, i in enumerate(idx)}
        for i, u in zip(bad, where.units):
            units[at[i]] = u
        log.warning("%s; reading them from their other copy", exc)
        return await self._fetch_copies(meta, pos, np.asarray(idx, dtype=np.int64), units, fields, rows, dense)

    async def _report(self, exc: DataCorruptionError, meta: BatchMeta) -> Located:
        """Tell the controller which copies failed their checksum; where the samples are now.
        Raises ``exc`` where some have no good copy left (they are lost now, counted)."""
        bad: list[int] = exc.samples  # type: ignore[attr-defined]
        unit_id: int = exc.unit_id  # type: ignore[attr-defined]
        self.stats.corrupt += len(bad)
        ctl = await self._conns.ctl()
        where, _ = await ctl.request(
            Corrupt(partition=meta.partition, partition_uid=meta.partition_uid, unit_id=unit_id, indexes=bad,
                    field=exc.field),  # type: ignore[attr-defined]
            expect=Located,
        )
        if not where.two_copies or any(where.gone) or unit_id in where.units:
            raise exc
        return where

    async def _locate(self, meta: BatchMeta, idx: list[int], failed: int) -> Located | None:
        """Where samples read from unit ``failed`` live, as the controller knows: for a
        partition of two copies, once it has declared the unit dead and promoted the copies (a
        ``Locate`` parked there, within the request timeout). None where the partition is
        gone."""
        ctl = await self._conns.ctl()
        wait = self.config.request_timeout
        try:
            where, _ = await ctl.request(
                Locate(partition=meta.partition, partition_uid=meta.partition_uid, indexes=idx, moved_from=failed,
                       timeout=wait),
                expect=Located, timeout=2 * wait,
            )
        except (PartitionClearedError, InvalidArgumentError):
            return None
        return where

    async def _fetch_copies(
        self, meta: BatchMeta, pos: np.ndarray, idx: np.ndarray, units: np.ndarray, fields: list[str], rows: BatchBuffers,
        dense: DenseOnDevice | None,
    ) -> list[Part]:
        """The samples at ``pos`` from the units their copies are on now."""
        jobs = []
        for unit_id in np.unique(units).tolist():
            sel = units == unit_id
            route = await self._conns.route(unit_id)
            jobs.append(self._fetch_part(route, meta, pos[sel], idx[sel].tolist(), fields, rows, dense))
        return [part for some in await all_or_none(*jobs) for part in some]

    async def ack(self, meta: BatchMeta) -> None:
        """:meth:`AsyncClient.ack`."""
        if meta.task is None:
            raise InvalidArgumentError("ack takes a meta from get_meta (this one has no task)")
        ctl = await self._conns.ctl()
        await ctl.request(
            Ack(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                task=meta.task,
                indexes=[i for i in meta.indexes if i >= 0],  # pad rows are nobody's
                lease=meta.lease,
            ),
            expect=Ok,
        )



def _live_copies(where: Located | None, failed: int) -> np.ndarray | None:
    """The units to read the samples from instead of unit ``failed``: those of their copies,
    promoted. None where the partition keeps one copy, a sample has no live copy left, or
    the unit has not been declared dead (the samples are still placed on it)."""
    if where is None or not where.two_copies or any(where.gone):
        return None
    units = np.asarray(where.units, dtype=np.int64)
    return None if (units == failed).any() else units


def _policy_args(args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``policy_args`` as they travel: a mapping of names to MessagePack values."""
    if args is None:
        return None
    if not isinstance(args, Mapping):
        raise InvalidArgumentError(f"policy_args is a mapping of names to values, got {type(args).__name__}")
    out = dict(args)
    for name, value in out.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"policy_args: names are strings, got {name!r}")
        try:
            msgspec.msgpack.encode(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgumentError(
                f"policy_args[{name!r}] is a {type(value).__name__}, not a MessagePack value: {exc}"
            ) from None
    return out
