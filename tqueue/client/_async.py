"""The asynchronous client: metadata with the controller, bytes with storage units directly.

:class:`AsyncClient` is a thin front over four objects that own their state: the
:class:`~tqueue.client._connections.Connections` (controller and unit peers, bulk streams,
arenas), the :class:`~tqueue.client._puts.Puts` (the write path), the
:class:`~tqueue.client._gets.Gets` (the read path) and the
:class:`~tqueue.client._lifecycle.Lifecycle` (seals, admission, partial rollouts), which
uses the other three. Each public method says what it does and hands the call on. The calls
with many options take their parameters from one dataclass each (``client/_ask.py``), and
the blocking :class:`~tqueue.client.Client` takes its methods from these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from .._api import deprecated
from .._memory import BufferPool
from .._meta import Meta
from ..config import ClientConfig
from ..errors import InvalidArgumentError
from ..transport._connect import endpoint
from ..wire import Clear, CreatePartition, Ok, StatusReply, StatusRequest
from ..wire._messages import MEMBER_FAILURES
from ._ask import DataAsk, Grouping, MetaAsk, OverSampling, PutAsk, takes, wire_meta
from ._batch import Batch
from ._connections import ClientStats, Connections
from ._gets import Gets, ThreadRoute
from ._key_calls import KeyCalls
from ._lifecycle import Lifecycle
from ._puts import Puts
from ._spaces import MOVED, AsyncCheckpoints, AsyncKeys, AsyncRollouts, AsyncSamples

__all__ = ["AsyncClient", "ClientStats"]

P = ParamSpec("P")
T = TypeVar("T")
N = TypeVar("N")


def _old_copies(copies: int, replicas: int) -> int:
    """``create_partition``'s copies given by their old name ``replicas``."""
    if copies:
        raise InvalidArgumentError(f"create_partition: give copies= or replicas=, not both (copies={copies}, replicas={replicas})")
    return replicas


def _old_grouping(grouping: Grouping | None, size: int | None, on_member_failure: str | None) -> Grouping | None:
    """``create_partition``'s grouping, given flat by its old keywords (a warning)."""
    if size is None and on_member_failure is None:
        return grouping
    used = [name for name, v in (("group_size", size), ("on_member_failure", on_member_failure)) if v is not None]
    deprecated(f"create_partition({'=, '.join(used)}=)", "create_partition(grouping=tqueue.Grouping(size, on_member_failure=...))")
    if grouping is not None:
        raise InvalidArgumentError(f"create_partition: give grouping= or {', '.join(used)}=, not both")
    if not size:  # group_size=0 was the old default: no groups (an on_member_failure alone means nothing)
        return None
    return Grouping(size, "mask_member" if on_member_failure == "mask_member" else "drop_group")


def _old_over_sampling(
    over: OverSampling | None, target: int | None, target_groups: int | None, recycle_to: str | None
) -> OverSampling | None:
    """``create_partition``'s over-sampling, given flat by its old keywords (a warning)."""
    flat = (("target", target), ("target_groups", target_groups), ("recycle_to", recycle_to))
    used = [name for name, v in flat if v is not None]
    if not used:
        return over
    deprecated(f"create_partition({'=, '.join(used)}=)", "create_partition(over_sampling=tqueue.OverSampling(samples=... or groups=..., recycle_to=...))")
    if over is not None:
        raise InvalidArgumentError(f"create_partition: give over_sampling= or {', '.join(used)}=, not both")
    if not target and not target_groups:
        if recycle_to:
            raise InvalidArgumentError("create_partition: recycle_to needs an over-sampling target")
        return None
    return OverSampling(samples=target or 0, groups=target_groups or 0, recycle_to=recycle_to or "")


def _handed_on(
    method: Callable[Concatenate[Lifecycle, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """An :class:`AsyncClient` method that hands the call to the client's :class:`Lifecycle`
    ``method``, with its signature and docstring."""

    @functools.wraps(method)
    async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await method(self._lifecycle, *args, **kwargs)

    return call


def _moved(
    method: Callable[Concatenate[N, P], Coroutine[Any, Any, T]], old: str
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """The deprecated method ``old`` of :class:`AsyncClient`: it warns
    (:class:`~tqueue.TQueueDeprecationWarning`) and hands the call to ``method`` of the
    namespace that holds it now (``MOVED``)."""
    space, name = MOVED[old]

    @functools.wraps(method)
    async def alias(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        deprecated(f"AsyncClient.{old}()", f"client.{space}.{name}()")
        result: T = await getattr(getattr(self, space), name)(*args, **kwargs)
        return result

    alias.__name__ = old
    alias.__qualname__ = f"AsyncClient.{old}"
    alias.__doc__ = f"Deprecated: use ``client.{space}.{name}()``, which this calls.\n\n{method.__doc__ or ''}"
    return alias


class AsyncClient:
    """Talks to a tqueue cluster from inside an asyncio program.

    ``address``: the controller's, ``tcp://host:port`` (or ``host:port``); anything else
    raises :class:`~tqueue.errors.InvalidArgumentError`. Connects lazily on first use: where
    nothing answers at the address the connect fails within seconds
    (:class:`~tqueue.errors.ControllerUnavailableError`), and a refused CurveZMQ handshake
    raises :class:`~tqueue.errors.AuthenticationError`.

    The verbs a user learns first are its methods: ``connect``, ``put``, ``get_meta``,
    ``get_data``, ``ack``, ``seal``, ``clear``, ``status``, ``close``, and ``create_partition``,
    ``update``, ``renew``, ``set_version``. The rest live in namespaces
    (``client/_spaces.py``): ``keys`` (user keys and tags), ``samples`` (reads without a
    lease, allocation, consumption reset, field statistics), ``rollouts`` (partial
    rollouts, failures, admission, seal and version waits, the staleness bound) and
    ``checkpoints`` (save, load). Every call has a timeout: ``request_timeout`` from the
    config bounds how long a server may take to answer; ``get_meta`` additionally waits
    up to its own ``timeout`` for samples to become ready.
    """

    def __init__(self, address: str, *, config: ClientConfig | None = None) -> None:
        self.address = address = endpoint(address)
        self.config = config or ClientConfig.from_env()
        self.stats = ClientStats()
        if self.config.pin_memory and not torch.cuda.is_available():
            raise InvalidArgumentError("ClientConfig.pin_memory needs a CUDA device, and torch sees none")
        if self.config.nixl not in ("auto", "on", "off"):
            raise InvalidArgumentError(f"ClientConfig.nixl is one of 'auto', 'on', 'off'; got {self.config.nixl!r}")
        if self.config.arena_lease_bytes < 0:
            raise InvalidArgumentError(f"ClientConfig.arena_lease_bytes must be >= 0, got {self.config.arena_lease_bytes}")
        pool = BufferPool(self.config.buffer_pool_bytes, pinned=self.config.pin_memory)
        self._conns = Connections(address, self.config)
        self._conns.pool = pool  # a NIXL route stages puts in it
        self.host = self._conns.host
        self._puts = Puts(self._conns, pool, self.stats)
        self._conns.before = self._puts.sent  # a request after a put goes after it, coalesced or not
        self._gets = Gets(self._conns, pool, self.stats)
        self._lifecycle = Lifecycle(self._conns, self._puts, self._gets)
        self._keys = KeyCalls(self._conns)
        self.keys = AsyncKeys(self._keys)
        self.samples = AsyncSamples(self._keys, self._lifecycle)
        self.rollouts = AsyncRollouts(self._lifecycle)
        self.checkpoints = AsyncCheckpoints(self._conns)

    # --- connection -----------------------------------------------------------------

    async def connect(self) -> None:
        """Handshake with the controller (protocol version) and learn the storage units."""
        await self._conns.connect()

    async def close(self) -> None:
        """Close every connection. Idempotent."""
        await self._conns.close()

    async def __aenter__(self) -> AsyncClient:
        try:
            await self.connect()
        except BaseException:
            await self.close()  # the with block never runs, so its exit never would
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- partitions -----------------------------------------------------------------

    async def create_partition(
        self,
        partition: str,
        *,
        fields: Sequence[str] | None = None,
        tasks: Sequence[str] | None = None,
        grouping: Grouping | None = None,
        over_sampling: OverSampling | None = None,
        auto_free: bool = True,
        prefetch: str = "",
        step: int | None = None,
        copies: int = 0,
        dedup: Sequence[str] = (),
        # deprecated: grouping and over_sampling replace them (and replicas, copies)
        group_size: int | None = None,
        on_member_failure: str | None = None,
        target: int | None = None,
        target_groups: int | None = None,
        recycle_to: str | None = None,
        replicas: int | None = None,
    ) -> None:
        """Create ``partition`` now, with options; otherwise its first put creates it.

        ``fields``: the only fields it accepts. ``tasks``: the tasks that must consume every
        sample before it frees itself (default: the tasks that asked for samples).
        ``grouping``: its GRPO groups (:class:`Grouping`: samples per group, what a failed
        member does); a partition with one releases whole groups (by default, and with
        ``policy="groups"``). ``auto_free``: free the partition once every task has consumed
        every sample. ``over_sampling``: seal at a target of samples or whole groups and abort
        the surplus (:class:`OverSampling`).
        ``prefetch``: a consumer short of samples here, once this partition is sealed and
        drained, takes ready samples from that (later) partition; they count as taken there.
        ``step``: the trainer version that reads this partition, for the staleness bound
        (``rollouts.set_staleness``); None takes it from a name ending in ``step-N`` (``step_N``,
        ``stepN``), else the partition has no step.
        ``copies``: 2 stores each put on two units (on different hosts where there are) and
        acknowledges it once both hold it, so that one unit's death loses no acknowledged
        sample: its samples are served from the other copy (0: ``ControllerConfig.copies``).
        ``dedup``: fields shared by content (a GRPO group's image, its prompt): a put sends
        each distinct value once, a unit stores it once for every sample and put that holds
        it (equal by xxh3-64 digest, then byte for byte), and a read sends it once and hands
        each sample a view of it (a dense field: its own rows, copied).
        ``group_size``, ``on_member_failure``, ``target``, ``target_groups``, ``recycle_to`` and
        ``replicas`` are the deprecated spellings (they warn).
        """
        if replicas is not None:
            deprecated("AsyncClient.create_partition(replicas=)", "AsyncClient.create_partition(copies=)")
            copies = _old_copies(copies, replicas)
        if on_member_failure is not None and on_member_failure not in MEMBER_FAILURES:
            raise InvalidArgumentError(f"on_member_failure is one of {list(MEMBER_FAILURES)}, got {on_member_failure!r}")
        grouping = _old_grouping(grouping, group_size, on_member_failure)
        over_sampling = _old_over_sampling(over_sampling, target, target_groups, recycle_to)
        if step is not None and step < 0:
            raise InvalidArgumentError(f"partition {partition!r}: step must be >= 0 or None, got {step}")
        ctl = await self._conns.ctl()
        await ctl.request(
            CreatePartition(
                partition=partition,
                fields=list(fields) if fields is not None else None,
                tasks=list(tasks) if tasks is not None else None,
                group_size=grouping.size if grouping else 0,
                on_member_failure=grouping.on_member_failure if grouping else "drop_group",
                auto_free=auto_free,
                target=over_sampling.samples if over_sampling else 0,
                target_groups=over_sampling.groups if over_sampling else 0,
                recycle_to=over_sampling.recycle_to if over_sampling else "",
                prefetch=prefetch,
                step=-1 if step is None else step,
                copies=copies,
                dedup=list(dedup) if dedup else None,
            ),
            expect=Ok,
        )
        self._puts.shared[partition] = frozenset(dedup)

    async def clear(self, target: str | Meta) -> None:
        """Free a partition (by name), or only the samples of a meta, on every unit.

        Readers waiting on a cleared partition get :class:`PartitionClearedError`; a later
        put to its name starts a new partition (indexes are never reused)."""
        ctl = await self._conns.ctl()
        if not isinstance(target, str):
            target = wire_meta(target, "clear")
            msg = Clear(partition=target.partition, partition_uid=target.partition_uid, indexes=list(target.indexes))
        else:
            msg = Clear(partition=target)
        await ctl.request(msg, expect=Ok)

    async def status(self) -> StatusReply:
        """Partitions, per-task progress, units and waiting callers, and the trainer's
        ``version`` with its ``weights`` pointer, from the controller."""
        ctl = await self._conns.ctl()
        reply, _ = await ctl.request(StatusRequest(), expect=StatusReply)
        return reply

    # --- writes ---------------------------------------------------------------------

    @takes(PutAsk)
    async def put(self, ask: PutAsk) -> Meta:
        """Write new samples to ``partition`` (created on first use) and return their meta.

        ``data`` maps field name to per-sample values (see the module docs of the encoder),
        or is a list of per-sample mappings. ``groups`` gives each sample's group id (the
        prompt uid of a GRPO group), or one id for all; ``version`` the policy version that
        produced them (one, or one per sample). Everything is validated before a byte is
        sent. Returns once the bytes are stored and the controller knows them.

        When the memory budget or the staleness bound has no room, the put waits up to
        ``timeout`` seconds (None: the config's ``put_timeout``; 0: not at all), then
        raises :class:`StorageFullError` (memory) or :class:`WaitTimeoutError` (staleness),
        saying what it asked for and what was used and allowed.

        ``partial``: unfinished rollouts; stored but never served until ``rollouts.complete``.
        A put to a sealed partition (``seal``, or its over-sampling target was reached) stores
        nothing and raises :class:`PartitionSealedError`; with ``if_sealed="discard"`` (the
        over-sampling producer's choice) it returns a meta with ``status="aborted"`` instead.
        Where the partition recycles late samples, they are stored as partial samples there
        (``status="recycled"``) either way. A put that
        crosses the target keeps only the samples that reach it (``status="trimmed"``,
        ``fates`` per sample "ok" or "aborted"); every fate is final when the put returns.
        A put to a partition that sealed and freed itself is treated as sealed for 10 minutes
        after (stragglers), unless :meth:`create_partition` starts it again.
        """
        return await self._puts.put(ask)

    async def update(self, meta: Meta, data: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Add or overwrite fields of the samples of ``meta`` (e.g. a reward worker adding
        ``rewards``). ``data`` has one value per sample of ``meta``, in its order.

        Atomic per sample: all of a sample's fields live on one unit, which installs a write
        whole, so a reader gets every field old or every field new, never a mix."""
        await self._puts.update(wire_meta(meta, "update"), data)

    # --- reads ----------------------------------------------------------------------

    @takes(MetaAsk)
    async def get_meta(self, ask: MetaAsk) -> Meta:
        """Lease ``batch_size`` samples of ``partition`` that have every field in ``fields``
        and that ``task`` has not consumed; wait until enough are ready.

        ``timeout``: seconds to wait (None: the config's ``get_timeout``; ``math.inf``:
        forever). Raises :class:`~tqueue.errors.WaitTimeoutError` saying what was ready.
        ``lease_timeout``: the samples return to the task's pool unless acked (or renewed)
        in time (None: the config's ``lease_timeout``; ``math.inf``: never).
        ``policy``: ``first_ready`` (index order), ``groups`` (whole GRPO groups only), or one
        the controller loaded. None (the default): whole groups where the partition has a
        ``group_size`` (never split across DP ranks), else index order (the controller warns
        once where samples put with groups have no group size to be kept whole by).
        ``dp_rank`` / ``dp_size``: this rank's token-balanced share of a round of
        ``dp_size * batch_size`` samples; every caller asking for the same round and rank
        (tensor/pipeline parallel peers) gets the identical meta. Rounds count per client
        (``round`` overrides). Each share comes cut into micro-batches
        (``meta.micro_batch_indices``), the same number on every rank:
        ``max_tokens_per_micro_batch`` caps their tokens, or ``micro_batch_size`` fixes their
        samples; their count is at least ``min_num_microbatches`` and a multiple of
        ``num_microbatches_multiple_of`` (a virtual pipeline's size). A sample's tokens are
        the sum of the jagged fields ``balance_by`` names (one field, ``"input_ids"``, or the
        parts of one sequence), by default the longest jagged field asked for
        (``prompt_ids`` + ``response_ids`` counting as one sequence).
        ``max_staleness``: refuse (and count) samples older than the trainer's version
        minus this.
        ``pad``: once the partition is sealed and has fewer samples left than asked, return
        them with pad rows (index -1; all-zero tensors, ``batch.is_pad``) instead of waiting,
        so that a batch still divides evenly across ranks and micro-batches.
        ``replica_group`` (with ``dp_size``): rounds are formed and counted for this group
        alone, so that groups of ranks that do not share one ``dp_size`` (TransferQueue's
        ``RankAwareSampler``: each data-parallel replica group reads on its own) take disjoint
        samples of the task, and the ranks of one group the identical meta of each round.
        ``policy_args``: names to MessagePack values that a policy loaded into the controller
        reads as ``candidates.args`` (TransferQueue's ``sampling_config``); the built-in
        policies ignore them. In a round, the policy sees those of the call that opened it.
        """
        return await self._gets.get_meta(ask)

    def thread_route(self) -> ThreadRoute:
        """A route for one blocking caller's thread (after :meth:`connect`): its
        ``get_meta`` is sent and waited for by that thread on a connection of its own, in this
        client's session, about twice as fast as through the event loop. The blocking
        :class:`~tqueue.client.Client` gives each calling thread one; close it when done."""
        return ThreadRoute(self._gets, self._conns.thread_peer())

    async def renew(self, meta: Meta, *, lease_timeout: float | None = None) -> None:
        """Extend the lease of a meta from ``get_meta`` by ``lease_timeout`` from now."""
        await self._gets.renew(wire_meta(meta, "renew"), lease_timeout=lease_timeout)

    @takes(DataAsk)
    async def get_data(self, ask: DataAsk) -> Batch:
        """Fetch the payload of a batch, straight from the storage units, in parallel.

        Either ``get_data(meta, fields=None)`` for a meta from ``get_meta`` (all of its
        fields by default), or the one-call form ``get_data(partition, fields,
        batch_size, task=..., ...)`` that leases (with every option of ``get_meta``) and
        fetches together. ``jagged`` chooses how jagged fields come back: ``list`` of
        per-sample tensors (zero-copy), ``padded`` (with ``pad_value`` on
        ``padding_side``; lengths via ``batch.lengths(field)``), or ``nested`` (a torch
        jagged nested tensor); one mode, or a mapping per field.

        ``device`` (``"cuda"``, ``"cuda:1"``, ``"npu"``; None: host memory): the batch's
        tensors land in that device's memory, copied from page-locked host memory only (a
        registered arena, pinned buffers) in chunks that overlap the host's work; object
        fields and ``batch.lengths`` stay on the host (tqueue/client/_routes/device.py).
        ``"cpu"`` takes the same route into memory of the batch's own.
        """
        options = ask  # a DataAsk is the read's Options
        meta, fields, batch_size, task = ask.meta, ask.fields, ask.batch_size, ask.task
        if not isinstance(meta, str):
            if batch_size is not None or task is not None or ask.dp_size is not None:
                raise InvalidArgumentError("get_data(meta) takes no batch_size, task or dp options: the meta has them")
            return await self._gets.get_data(wire_meta(meta, "get_data"), fields, options)
        if fields is None or batch_size is None or task is None:
            raise InvalidArgumentError("get_data(partition, ...) needs fields, batch_size and task")
        # the one-call form: lease with every option of get_meta, then fetch
        return await self._gets.get_data(ask.lease(meta, fields, batch_size, task), None, options)

    async def ack(self, meta: Meta) -> None:
        """Mark the samples of ``meta`` consumed for its task. Acking twice is harmless."""
        await self._gets.ack(wire_meta(meta, "ack"))

    # --- the trainer's version and the seal: handed to the Lifecycle, which documents them

    seal = _handed_on(Lifecycle.seal)
    set_version = _handed_on(Lifecycle.set_version)

    # --- the old names of what the namespaces hold: deprecated, for one more release

    bind_keys = _moved(AsyncKeys.bind, "bind_keys")
    tag_keys = _moved(AsyncKeys.tag, "tag_keys")
    set_tags = _moved(AsyncKeys.set_tags, "set_tags")
    lookup_keys = _moved(AsyncKeys.lookup, "lookup_keys")
    keys_of = _moved(AsyncKeys.of, "keys_of")
    list_keys = _moved(AsyncKeys.all, "list_keys")
    drop_keys = _moved(AsyncKeys.drop, "drop_keys")
    select = _moved(AsyncSamples.select, "select")
    allocate = _moved(AsyncSamples.allocate, "allocate")
    reset_consumption = _moved(AsyncSamples.reset, "reset_consumption")
    field_stats = _moved(AsyncSamples.stats, "field_stats")
    complete = _moved(AsyncRollouts.complete, "complete")
    postpone = _moved(AsyncRollouts.postpone, "postpone")
    fail = _moved(AsyncRollouts.fail, "fail")
    reserve = _moved(AsyncRollouts.reserve, "reserve")
    sealed = _moved(AsyncRollouts.wait_sealed, "sealed")
    wait_version = _moved(AsyncRollouts.wait_version, "wait_version")
    set_staleness = _moved(AsyncRollouts.set_staleness, "set_staleness")
    save_checkpoint = _moved(AsyncCheckpoints.save, "save_checkpoint")
    load_checkpoint = _moved(AsyncCheckpoints.load, "load_checkpoint")
