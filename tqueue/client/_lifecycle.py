"""Client calls for flow control and the rollout lifecycle: seals and failures, the
staleness bound, partial rollouts, postponing, metrics. :class:`~tqueue.client.AsyncClient`
holds one :class:`Lifecycle` beside its puts and gets."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from .._meta import Meta as UserMeta
from ..errors import InvalidArgumentError, SchemaError
from ..wire import (
    Admission,
    Fail,
    GroupId,
    MetaReply,
    Ok,
    Postpone,
    Reserve,
    Seal,
    Sealed,
    Select,
    SetVersion,
    VersionReply,
    VersionWait,
)
from ._args import _rows, _wait
from ._ask import wire_meta
from ._encode import sample_count

if TYPE_CHECKING:
    from ._ask import Completion
    from ._connections import Connections
    from ._gets import Gets
    from ._puts import Puts


@dataclasses.dataclass(frozen=True)
class FieldStats:
    """Statistics of a scalar field over a partition's live samples."""

    count: int
    mean: float
    std: float
    min: float
    max: float


class Lifecycle:
    """Seals, failures, admission and the rollout lifecycle of one client: controller
    requests on its connections, and for ``complete`` and ``field_stats`` its reads and
    writes. :class:`~tqueue.client.AsyncClient` hands these calls on as they are, so each
    method's signature and docstring here are the client's."""

    def __init__(self, conns: Connections, puts: Puts, gets: Gets) -> None:
        self._conns = conns
        self.config = conns.config
        self._puts = puts
        self._gets = gets

    async def seal(self, partition: str) -> None:
        """Say that no more samples will be put to ``partition``; once every task has
        consumed every sample, it frees itself (unless created with ``auto_free=False``)."""
        ctl = await self._conns.ctl()
        await ctl.request(Seal(partition=partition), expect=Ok)

    async def fail(
        self,
        target: str | UserMeta,
        *,
        reason: str,
        group: GroupId = None,
        count: int = 1,
    ) -> None:
        """Report failed rollouts: the samples of a meta, or ``count`` members of ``group``
        that will never be put. The partition's ``on_member_failure`` decides whether the
        group is aborted or released without them; either way they are never served."""
        ctl = await self._conns.ctl()
        if not isinstance(target, str):
            failed = wire_meta(target, "rollouts.fail")
            msg = Fail(partition=failed.partition, partition_uid=failed.partition_uid, indexes=list(failed.indexes), reason=reason)
        else:
            if group is None:
                raise InvalidArgumentError("fail(partition, ...) needs the group whose members failed")
            msg = Fail(partition=target, group=group, count=count, reason=reason)
        await ctl.request(msg, expect=Ok)

    async def set_version(self, version: int, *, weights: str = "") -> None:
        """The trainer's current policy weight version (admission and staleness use it), and
        ``weights``: where those weights are published, an opaque pointer (a path, a URL) for
        engines that pull them, kept with that version. A version not above the current one
        changes nothing, its pointer included: publish the pointer with the version it
        belongs to. :meth:`wait_version` and ``status()`` (``version``, ``weights``) tell
        both."""
        ctl = await self._conns.ctl()
        await ctl.request(SetVersion(version=version, weights=weights), expect=Ok)

    async def wait_version(self, after: int = -1, *, timeout: float | None = None) -> VersionReply:
        """Wait until the trainer's version is past ``after`` (at once if it is) and return
        it with its weights' pointer (``.version``, ``.weights``), e.g. for an engine to pull
        new weights without polling. The wait is parked at the controller, up to ``timeout``
        seconds (None: the config's ``get_timeout``; ``math.inf``: no limit), then raises
        :class:`~tqueue.errors.WaitTimeoutError`; cancelled, it is withdrawn there."""
        wait = _wait(timeout, self.config.get_timeout)
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(
            VersionWait(after=after, timeout=wait),
            timeout=wait + self.config.request_timeout,  # math.inf: no limit
            expect=VersionReply,
        )
        return reply

    async def set_staleness(self, max_staleness: int | None, batch_size: int = 0) -> None:
        """Bound how far producers run ahead of the trainer, AReaL-style; None lifts the bound.

        A partition of step ``s`` (``create_partition(step=s)``, or a name ending in
        ``step-s``) is read by the trainer at version ``s``: puts to it are admitted while
        ``s <= version + max_staleness`` and wait for ``set_version`` beyond that; samples of
        other steps never hold them back. Partitions without a step share a running total of
        ``(version + max_staleness + 1) * batch_size`` samples produced or in flight, which
        ``reserve`` draws on too. A put to a partition that a consumer is parked on is admitted
        at once: the bound never holds back what the trainer is waiting for."""
        ctl = await self._conns.ctl()
        await ctl.request(Admission(max_staleness=-1 if max_staleness is None else max_staleness, batch_size=batch_size), expect=Ok)

    async def reserve(self, count: int, *, timeout: float | None = None) -> None:
        """Admit ``count`` samples before generating them (waits like a put, up to
        ``timeout``); the next puts of this client draw on the reservation."""
        wait = _wait(timeout, self.config.put_timeout)
        ctl = await self._conns.ctl()
        await ctl.request(
            Reserve(count=count, timeout=wait),
            timeout=wait + self.config.request_timeout,  # math.inf: no limit
            expect=Ok,
        )
        self._puts.reserved += count

    async def complete(self, call: Completion) -> list[int]:
        """:meth:`AsyncClient.complete`."""
        meta, data, append, lengths = wire_meta(call.meta, "rollouts.complete"), call.data, call.append, call.lengths
        cols, n = sample_count(data, meta.partition)
        if n != len(meta):
            raise SchemaError(f"complete() got {n} samples for a meta of {len(meta)} (partition {meta.partition!r})")
        splice = dict(call.splice or {})
        for name in [*append, *splice]:
            if name not in cols:
                raise SchemaError(f"complete(): field {name!r} is to be appended or spliced but has no new values")
        # appended fields: only the new rows are sent, and the unit adds them after the stored
        # ones (nothing stored is read back or copied); spliced ones are read and written whole
        offsets = {name: [int(at)] * n if isinstance(at, int) else [int(k) for k in at] for name, at in splice.items()}
        for name, rows in offsets.items():
            if len(rows) != n or min(rows, default=0) < 0:
                raise InvalidArgumentError(
                    f"complete(): field {name!r} of partition {meta.partition!r} is spliced at one row >= 0 per "
                    f"sample ({n}), got {rows}"
                )
        # a field spliced at row 0 everywhere is written whole: nothing stored is read
        kept = [name for name, rows in offsets.items() if any(rows)]
        old = await self._gets.get_data(meta, kept) if kept else {}
        new = dict(cols)
        for name, rows in offsets.items():
            out = []
            stored = _rows(old[name]) if name in old else [x[:0] for x in _rows(cols[name])]
            for i, (o, x, k) in enumerate(zip(stored, _rows(cols[name]), rows)):
                if len(o) < k or len(x) < k:
                    raise SchemaError(
                        f"field {name!r} of sample {meta.indexes[i]} (partition {meta.partition!r}): "
                        f"splicing at row {k} needs that many rows, stored {len(o)}, new {len(x)}"
                    )
                row = torch.cat([o[:k], x[k:]])
                if lengths is not None and len(row) != lengths[i]:
                    raise SchemaError(
                        f"field {name!r} of sample {meta.indexes[i]} (partition {meta.partition!r}) "
                        f"would have {len(row)} rows after the splice; its sequence has {lengths[i]} tokens"
                    )
                out.append(row)
            new[name] = out
        return await self._puts.update(meta, new, complete=call.finished, segment=(call.version, call.first_token),
                                       append=list(append), splice=offsets)

    async def postpone(self, given: UserMeta, to: str, *, whole_groups: bool = False) -> UserMeta:
        """Move these samples (with ``whole_groups``, every member of their groups) to a later
        partition, data kept and partial ones still partial; returns their meta there."""
        meta = wire_meta(given, "rollouts.postpone")
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(
            Postpone(
                partition=meta.partition,
                partition_uid=meta.partition_uid,
                indexes=[i for i in meta.indexes if i >= 0],
                to=to,
                whole_groups=whole_groups,
            ),
            expect=MetaReply,
        )
        return reply.meta

    async def sealed(self, partition: str, *, timeout: float | None = None) -> None:
        """Wait until ``partition`` is sealed (its over-sampling target reached, or
        ``seal``): producers of the surplus learn it here without polling."""
        wait = _wait(timeout, self.config.get_timeout)
        ctl = await self._conns.ctl()
        await ctl.request(
            Sealed(partition=partition, timeout=wait),
            timeout=wait + self.config.request_timeout,  # math.inf: no limit
            expect=Ok,
        )

    async def field_stats(self, partition: str, field: str) -> FieldStats:
        """count, mean, std, min and max of a scalar field over the partition's live samples:
        aborted, failed, postponed and partial samples and pad rows are left out."""
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(Select(partition=partition, fields=[field]), expect=MetaReply)
        meta = reply.meta
        if not len(meta):
            return FieldStats(count=0, mean=math.nan, std=math.nan, min=math.nan, max=math.nan)
        values = (await self._gets.get_data(meta, [field]))[field]
        if isinstance(values, list):
            values = torch.tensor([float(v) for v in values], dtype=torch.float64)
        values = torch.as_tensor(values).to(torch.float64)
        if values.dim() > 1 and values[0].numel() == 1:
            values = values.reshape(-1)
        if values.dim() != 1:
            raise InvalidArgumentError(f"field {field!r} of partition {partition!r} is not one number per sample")
        return FieldStats(
            count=len(values),
            mean=float(values.mean()),
            std=float(values.std(unbiased=False)),
            min=float(values.min()),
            max=float(values.max()),
        )
