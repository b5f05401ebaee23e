"""A request's way in: its bounds checked, then its handler run (held while a restarting
controller loads its checkpoint). :class:`Door` wraps every handler the server routes.

Every count, index, length and duration the controller takes from a message is checked here
against :class:`~tqueue.config.ControllerConfig` (or a fixed structural limit), so that no
single message makes it allocate, scan or wait beyond what its configuration allows. A
request past a bound gets :class:`~tqueue.errors.InvalidArgumentError` naming the field, its
value and the limit, and changes nothing. Checks that need the partition (an index below its
size, its size after a put) are made by the handlers, also before they record anything.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from ...config import ControllerConfig
from ...errors import InvalidArgumentError
from ...wire import (
    Ack,
    Admission,
    AllocateRows,
    Clear,
    Corrupt,
    CreatePartition,
    Fail,
    FieldBlock,
    GetMeta,
    Grant,
    Locate,
    Postpone,
    RegisterUnit,
    Renew,
    Reserve,
    Sealed,
    Select,
    VersionWait,
)
from ..model._partition import MAX_FIELDS

MAX_DIMS = 32  # dimensions of one sample of a field (torch allows 25)
MAX_NAME = 4096  # characters of a partition, task or field name


Handler = Callable[[bytes, Any, list[Any]], Any]


class Door:
    """Every request passes here on its way to its handler: a request past its bounds gets
    the InvalidArgumentError as its reply (nothing changed), and one that comes while a
    restarting controller loads its checkpoint (``restored`` set and not yet done) waits
    for it, unless its handler was routed ungated."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.restored: asyncio.Event | None = None

    def wrap(self, handler: Handler, gated: bool = True) -> Handler:
        config = self.config

        def admitted(ident: bytes, msg: Any, bufs: list[Any]) -> Any:
            check(msg, config)
            restored = self.restored
            if not gated or restored is None or restored.is_set():
                return handler(ident, msg, bufs)
            return _after(restored, handler, ident, msg, bufs)

        return admitted


async def _after(restored: asyncio.Event, handler: Handler, ident: bytes, msg: Any, bufs: list[Any]) -> Any:
    await restored.wait()
    result = handler(ident, msg, bufs)
    if inspect.isawaitable(result):
        result = await result
    return result


def check(msg: Any, config: ControllerConfig) -> None:
    """Raise InvalidArgumentError if ``msg`` asks for more than the controller allows."""
    checker = _CHECKS.get(type(msg))
    if checker is not None:
        checker(msg, config)


MAX_POLICY_ARGS = 64  # names in a GetMeta's policy_args (the values are bounded by the message size)


def count(field: str, value: int, limit: int, low: int = 0) -> None:
    if value < low:
        least = ">= 0" if low == 0 else f"at least {low}"
        raise InvalidArgumentError(f"{field} must be {least}, got {value}")
    if value > limit:
        raise InvalidArgumentError(f"{field}={value} is out of bounds: at most {limit}")


def length(field: str, values: Sequence[Any] | None, limit: int) -> None:
    if values is not None and len(values) > limit:
        raise InvalidArgumentError(f"{field} lists {len(values)} entries; at most {limit} are allowed")


def indexes(field: str, values: Sequence[int] | None, config: ControllerConfig) -> None:
    """At most a request's worth of sample indexes, each one a partition could have."""
    if not values:
        return
    length(field, values, config.max_samples_per_request)
    low, high = min(values), max(values)
    if low < 0 or high >= config.max_partition_samples:
        bad = low if low < 0 else high
        raise InvalidArgumentError(
            f"{field} holds sample {bad}; samples are 0 to {config.max_partition_samples - 1} "
            f"(max_partition_samples={config.max_partition_samples})"
        )


def seconds(field: str, value: float) -> None:
    """A number of seconds >= 0 (math.inf: no deadline)."""
    if math.isnan(value) or value < 0:
        raise InvalidArgumentError(f"{field} must be >= 0 seconds (math.inf: none), got {value}")


def name(field: str, value: str) -> None:
    if len(value) > MAX_NAME:
        raise InvalidArgumentError(f"{field} is {len(value)} characters long; at most {MAX_NAME} are allowed")


def names(field: str, values: Sequence[str] | None, limit: int) -> None:
    length(field, values, limit)
    for value in values or ():
        name(field, value)


def _blocks(blocks: Sequence[FieldBlock], config: ControllerConfig) -> None:
    length("blocks", blocks, MAX_FIELDS)
    most = config.max_samples_per_request
    for block in blocks:
        name("blocks.name", block.name)
        spec = block.spec
        count(f"field {block.name!r}: spec.ndim", spec.ndim, MAX_DIMS)
        length(f"field {block.name!r}: spec.shape", spec.shape, MAX_DIMS)
        length(f"field {block.name!r}: counts", block.counts, most)
        length(f"field {block.name!r}: shapes", block.shapes, most * MAX_DIMS)


def _grant(msg: Grant, config: ControllerConfig) -> None:
    most = config.max_samples_per_request
    name("partition", msg.partition)
    count("count", msg.count, most, low=1)
    count("nbytes", msg.nbytes, 1 << 62)
    count("reserved", msg.reserved, most)
    seconds("timeout", msg.timeout)
    for field in ("groups", "versions", "indexes"):
        values = getattr(msg, field)
        if values is not None and len(values) != msg.count:
            raise InvalidArgumentError(
                f"partition {msg.partition!r}: {field} lists {len(values)} entries for count={msg.count}"
            )
    if msg.callers is not None and (sum(msg.callers) != msg.count or min(msg.callers, default=0) < 1):
        raise InvalidArgumentError(
            f"partition {msg.partition!r}: callers must be positive counts that sum to count={msg.count} "
            f"(got {len(msg.callers)} summing to {sum(msg.callers)})"
        )
    indexes("indexes", msg.indexes, config)
    _blocks(msg.blocks, config)
    names("append", msg.append, MAX_FIELDS)
    if msg.append and msg.indexes is None:
        raise InvalidArgumentError(f"partition {msg.partition!r}: only an update (of indexes) appends to samples")


def _get_meta(msg: GetMeta, config: ControllerConfig) -> None:
    most = config.max_samples_per_request
    name("partition", msg.partition)
    name("task", msg.task)
    name("replica_group", msg.replica_group)
    if msg.replica_group and not msg.dp_size:
        raise InvalidArgumentError("replica_group needs dp_size (the group's own: 1 where each of its ranks reads the same)")
    count("batch_size", msg.batch_size, most, low=1)
    if msg.policy_args is not None:
        names("policy_args", list(msg.policy_args), MAX_POLICY_ARGS)
    count("dp_size", msg.dp_size, most)
    if msg.dp_size and msg.dp_size * msg.batch_size > most:
        raise InvalidArgumentError(
            f"dp_size * batch_size = {msg.dp_size} * {msg.batch_size} is out of bounds: "
            f"at most max_samples_per_request={most} samples a round"
        )
    count("max_tokens_per_micro_batch", msg.max_tokens_per_micro_batch, 1 << 62)
    count("micro_batch_size", msg.micro_batch_size, most)
    count("num_microbatches_multiple_of", msg.num_microbatches_multiple_of, most, low=1)
    count("min_num_microbatches", msg.min_num_microbatches, most, low=1)
    names("fields", msg.fields, MAX_FIELDS)
    names("balance_by", msg.balance_by, MAX_FIELDS)
    seconds("timeout", msg.timeout)
    seconds("lease_timeout", msg.lease_timeout)


def _ack(msg: Ack, config: ControllerConfig) -> None:
    indexes("indexes", msg.indexes, config)


def _fail(msg: Fail, config: ControllerConfig) -> None:
    name("partition", msg.partition)
    indexes("indexes", msg.indexes, config)
    count("count", msg.count, config.max_samples_per_request)


def _clear(msg: Clear, config: ControllerConfig) -> None:
    indexes("indexes", msg.indexes, config)


def _postpone(msg: Postpone, config: ControllerConfig) -> None:
    name("to", msg.to)
    indexes("indexes", msg.indexes, config)


def _renew(msg: Renew, config: ControllerConfig) -> None:
    seconds("timeout", msg.timeout)


def _reserve(msg: Reserve, config: ControllerConfig) -> None:
    count("count", msg.count, config.max_samples_per_request, low=1)
    seconds("timeout", msg.timeout)


def _sealed(msg: Sealed, config: ControllerConfig) -> None:
    seconds("timeout", msg.timeout)


def _version_wait(msg: VersionWait, config: ControllerConfig) -> None:
    seconds("timeout", msg.timeout)


def _select(msg: Select, config: ControllerConfig) -> None:
    names("fields", msg.fields, MAX_FIELDS)


def _admission(msg: Admission, config: ControllerConfig) -> None:
    count("batch_size", msg.batch_size, config.max_samples_per_request)
    count("max_staleness", msg.max_staleness, 1 << 32, low=-1)


def _create(msg: CreatePartition, config: ControllerConfig) -> None:
    name("partition", msg.partition)
    name("recycle_to", msg.recycle_to)
    name("prefetch", msg.prefetch)
    names("fields", msg.fields, MAX_FIELDS)
    names("tasks", msg.tasks, config.max_tasks_per_partition)
    names("dedup", msg.dedup, MAX_FIELDS)
    count("group_size", msg.group_size, config.max_samples_per_request)
    count("target", msg.target, config.max_partition_samples)
    count("target_groups", msg.target_groups, config.max_partition_samples)


def _allocate_rows(msg: AllocateRows, config: ControllerConfig) -> None:
    name("partition", msg.partition)
    count("count", msg.count, config.max_samples_per_request, low=1)


def _locate(msg: Locate, config: ControllerConfig) -> None:
    indexes("indexes", msg.indexes, config)
    seconds("timeout", msg.timeout)


def _corrupt(msg: Corrupt, config: ControllerConfig) -> None:
    indexes("indexes", msg.indexes, config)
    if msg.field:
        name("field", msg.field)


def _register(msg: RegisterUnit, config: ControllerConfig) -> None:
    count("capacity", msg.capacity, 1 << 62)


_CHECKS: dict[type, Callable[[Any, ControllerConfig], None]] = {
    Grant: _grant,
    GetMeta: _get_meta,
    Ack: _ack,
    Fail: _fail,
    Clear: _clear,
    Postpone: _postpone,
    Renew: _renew,
    Reserve: _reserve,
    Sealed: _sealed,
    VersionWait: _version_wait,
    Select: _select,
    Admission: _admission,
    CreatePartition: _create,
    RegisterUnit: _register,
    AllocateRows: _allocate_rows,
    Locate: _locate,
    Corrupt: _corrupt,
}
