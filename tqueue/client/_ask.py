"""The arguments of the client calls that carry many options, written once.

Each of ``put``, ``get_meta``, ``get_data`` and ``complete`` takes its arguments as one frozen
dataclass: :class:`PutAsk`, :class:`MetaAsk`, :class:`DataAsk`, :class:`Completion`. The dataclass is the
call's only parameter list: :func:`takes` gives the client's method the signature of the
dataclass (for help(), IDEs and mypy alike), builds the dataclass from the call's arguments
and hands it to the method's body. The blocking :class:`~tqueue.client.Client` takes its
methods from :class:`~tqueue.client.AsyncClient`'s, signatures included, so no parameter
list is written twice.

The options of a lease (``timeout`` ... ``pad``) belong to both ``get_meta`` and the one-call
form of ``get_data``: they are :class:`LeaseOptions`, a base of both. How a read presents
jagged fields is :class:`Options`, a base of :class:`DataAsk`.

Options that travel together are small objects: :class:`DataParallel` (this rank's share of
a round) and :class:`MicroBatches` (how a share is cut). The flat keywords they replace
(``dp_rank``, ``dp_size``, ``round``, ``replica_group``, ``max_tokens_per_micro_batch``,
``micro_batch_size``, ``num_microbatches_multiple_of``, ``min_num_microbatches``) still work
for one release, with a :class:`~tqueue.TQueueDeprecationWarning` (:func:`warn_flat`);
inside, the objects are spread into those fields, which the read path reads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

from .._api import deprecated
from .._meta import Meta
from ..errors import InvalidArgumentError
from ..wire import BatchMeta

if TYPE_CHECKING:
    import torch

    from ..wire import GroupId

P = ParamSpec("P")
A = TypeVar("A")
R = TypeVar("R")
S = TypeVar("S")
JaggedAs = Literal["list", "padded", "nested"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Task:
    task: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class _AnyTask:
    task: str | None = None


@dataclasses.dataclass(frozen=True)
class PutAsk:
    """The arguments of one ``put`` call, as :meth:`AsyncClient.put` documents them."""

    partition: str
    data: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    _: dataclasses.KW_ONLY
    groups: Sequence[GroupId] | GroupId = None
    version: int | Sequence[int] | None = None
    timeout: float | None = None
    partial: bool = False
    if_sealed: Literal["raise", "discard"] = "raise"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """How a read presents its fields: ``jagged`` is one mode or a per-field mapping;
    ``device`` where tensors land (None: host memory). The options of
    :meth:`AsyncClient.get_data`, and of every reader built on it."""

    jagged: JaggedAs | Mapping[str, JaggedAs] = "list"
    pad_value: float | int | bool = 0
    padding_side: Literal["right", "left"] = "right"
    device: str | torch.device | None = None
    dtype: Mapping[str, torch.dtype] | None = None
    """Integer fields read in a narrower integer dtype (``{"routed_experts": torch.uint8}``):
    stored packed at that width, they are not widened on the way; any value that does not
    fit raises :class:`~tqueue.errors.InvalidArgumentError` naming it."""

    def mode(self, field: str) -> JaggedAs:
        mode = self.jagged if isinstance(self.jagged, str) else self.jagged.get(field, "list")
        if mode not in ("list", "padded", "nested"):
            raise InvalidArgumentError(f"jagged mode for field {field!r} is {mode!r}; use list, padded or nested")
        return mode

    def check(self) -> None:
        if self.padding_side not in ("right", "left"):
            raise InvalidArgumentError(f"padding_side is 'right' or 'left', got {self.padding_side!r}")


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """This reader's place among data-parallel ranks: ``rank`` of ``size``. A read takes
    this rank's token-balanced share of a round of ``size * batch_size`` samples; every
    caller asking for the same round and rank (its tensor and pipeline parallel peers) gets
    the identical meta. Rounds count per client; ``round`` names one instead.
    ``replica_group``: rounds are formed and counted for this group of ranks alone (groups
    that do not share one ``size`` then take disjoint samples of the task)."""

    rank: int
    size: int
    round: int | None = None
    replica_group: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and isinstance(self.size, int) and 0 <= self.rank < self.size):
            raise InvalidArgumentError(f"DataParallel needs 0 <= rank < size, got rank {self.rank!r} of size {self.size!r}")


@dataclasses.dataclass(frozen=True)
class Grouping:
    """A partition's GRPO groups: ``size`` samples each (the ``n`` of a prompt's rollouts),
    released whole; ``on_member_failure`` says what a member reported failed does to its
    group: ``"drop_group"`` aborts the group, ``"mask_member"`` releases it without the member."""

    size: int
    on_member_failure: Literal["drop_group", "mask_member"] = "drop_group"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise InvalidArgumentError(f"Grouping needs a size >= 1, got {self.size!r}")
        if self.on_member_failure not in ("drop_group", "mask_member"):
            raise InvalidArgumentError(
                f"Grouping's on_member_failure is 'drop_group' or 'mask_member', got {self.on_member_failure!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverSampling:
    """Over-sampling: once ``samples`` samples (or ``groups`` whole groups) are complete, the
    partition seals itself and aborts the surplus; later puts are refused
    (``PartitionSealedError``, or ``status="aborted"`` with ``if_sealed="discard"``) or, with
    ``recycle_to``, stored in that partition as partial samples."""

    samples: int = 0
    groups: int = 0
    recycle_to: str = ""

    def __post_init__(self) -> None:
        if self.samples < 0 or self.groups < 0 or bool(self.samples) == bool(self.groups):
            raise InvalidArgumentError(
                f"OverSampling needs one target: samples or groups (> 0), got samples={self.samples}, groups={self.groups}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatches:
    """How a read's share is cut into micro-batches (``meta.micro_batch_indices``), the same
    number on every data-parallel rank: ``max_tokens`` caps each one's tokens, or ``size``
    fixes its samples; their count is at least ``min_count`` and a multiple of
    ``multiple_of`` (a virtual pipeline's size)."""

    max_tokens: int | None = None
    size: int | None = None
    multiple_of: int = 1
    min_count: int = 1


# the flat keywords of a lease that DataParallel and MicroBatches replace, with their defaults
_DP_FLAT = {"dp_rank": None, "dp_size": None, "round": None, "replica_group": None}
_MICRO_FLAT = {"max_tokens_per_micro_batch": None, "micro_batch_size": None,
               "num_microbatches_multiple_of": 1, "min_num_microbatches": 1}
_QUIET = threading.local()  # .flat: this thread's calls were warned about already (the Client's loop)


def quiet_flat() -> None:
    """Warn no more about flat keywords in this thread: the blocking client's loop thread,
    whose calls the client warned about in the caller's thread."""
    _QUIET.flat = True


def warn_flat(call: str, kwargs: Mapping[str, Any]) -> None:
    """Warn, at the caller of the caller of this, if a lease is asked for with the flat
    keywords that :class:`DataParallel` and :class:`MicroBatches` replace."""
    if getattr(_QUIET, "flat", False):
        return
    used = [k for k in (*_DP_FLAT, *_MICRO_FLAT) if k in kwargs]
    if not used:
        return
    new = []
    if any(k in _DP_FLAT for k in used):
        new.append("data_parallel=tqueue.DataParallel(rank, size, round=..., replica_group=...)")
    if any(k in _MICRO_FLAT for k in used):
        new.append("micro_batches=tqueue.MicroBatches(max_tokens=..., size=..., multiple_of=..., min_count=...)")
    deprecated(f"{call}({'=, '.join(used)}=)", " and ".join(new), stacklevel=4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseOptions:
    """How a lease is asked for, as :meth:`AsyncClient.get_meta` documents it."""

    timeout: float | None = None
    lease_timeout: float | None = None
    policy: str | None = None
    data_parallel: DataParallel | None = None
    micro_batches: MicroBatches | None = None
    balance_by: Sequence[str] | None = None
    max_staleness: int | None = None
    pad: bool = False
    policy_args: Mapping[str, Any] | None = None
    # deprecated: data_parallel and micro_batches replace them (and are spread into them)
    dp_rank: int | None = None
    dp_size: int | None = None
    round: int | None = None
    replica_group: str | None = None
    max_tokens_per_micro_batch: int | None = None
    micro_batch_size: int | None = None
    num_microbatches_multiple_of: int = 1
    min_num_microbatches: int = 1

    def __post_init__(self) -> None:
        dp, micro = self.data_parallel, self.micro_batches
        if dp is not None:
            if not isinstance(dp, DataParallel):
                raise InvalidArgumentError(f"data_parallel is a tqueue.DataParallel, got {type(dp).__name__}")
            self._spread(_DP_FLAT, "data_parallel", (dp.rank, dp.size, dp.round, dp.replica_group))
        if micro is not None:
            if not isinstance(micro, MicroBatches):
                raise InvalidArgumentError(f"micro_batches is a tqueue.MicroBatches, got {type(micro).__name__}")
            self._spread(_MICRO_FLAT, "micro_batches", (micro.max_tokens, micro.size, micro.multiple_of, micro.min_count))

    def _spread(self, flat: Mapping[str, Any], name: str, values: Sequence[Any]) -> None:
        given = [k for k, default in flat.items() if getattr(self, k) != default]
        if given:
            raise InvalidArgumentError(f"give {name} or {', '.join(given)}, not both")
        for key, value in zip(flat, values):
            object.__setattr__(self, key, value)  # frozen: set once, while it is made


# bases in this order put ``task`` first among the keyword-only parameters
@dataclasses.dataclass(frozen=True)
class MetaAsk(LeaseOptions, _Task):
    """The arguments of one ``get_meta`` call, as :meth:`AsyncClient.get_meta` documents them."""

    partition: str
    fields: Sequence[str]
    batch_size: int


# bases in this order keep ``task`` first and the presentation options last
@dataclasses.dataclass(frozen=True)
class DataAsk(Options, LeaseOptions, _AnyTask):
    """The arguments of one ``get_data`` call, as :meth:`AsyncClient.get_data` documents them:
    a meta, or a partition to lease from with every option of ``get_meta``, and how to present
    jagged fields (it is the read's :class:`Options`)."""

    meta: Meta | str
    fields: Sequence[str] | None = None
    batch_size: int | None = None

    def lease(self, partition: str, fields: Sequence[str], batch_size: int, task: str) -> MetaAsk:
        """The ``get_meta`` of the one-call form: a lease with these options."""
        # the objects are spread into the flat fields already: those carry them
        skip = ("data_parallel", "micro_batches")
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(LeaseOptions) if f.name not in skip}
        return MetaAsk(partition, fields, batch_size, task=task, **options)


@dataclasses.dataclass(frozen=True)
class Completion:
    """The arguments of one ``complete`` call, as :meth:`AsyncClient.complete` documents them."""

    meta: Meta
    data: Mapping[str, Any]
    _: dataclasses.KW_ONLY
    version: int
    first_token: int
    append: Sequence[str] = ()
    splice: Mapping[str, int | Sequence[int]] | None = None
    lengths: Sequence[int] | None = None
    finished: bool = True


def ask(kind: Callable[P, A], call: str, *args: P.args, **kwargs: P.kwargs) -> A:
    """``kind(*args, **kwargs)``, where a wrong argument is named as one of ``call``'s: the
    one place an ask is built from a call's arguments."""
    try:
        return kind(*args, **kwargs)
    except TypeError as exc:  # a missing or unknown argument: the dataclass's wording, our name
        raise TypeError(f"{call}(): {str(exc).split('(): ', 1)[-1]}") from None


def wire_meta(meta: Meta, call: str) -> BatchMeta:
    """The meta a user passes back, as the struct it is: one that ``put``, ``get_meta`` or a
    key call returned (a :class:`Meta` built any other way carries nothing to find the
    samples by)."""
    if not isinstance(meta, BatchMeta):
        raise InvalidArgumentError(f"{call}: {type(meta).__name__} is not a meta that put or get_meta returned")
    return meta


def takes(
    kind: Callable[P, A],
) -> Callable[[Callable[[S, A], Coroutine[Any, Any, R]]], Callable[Concatenate[S, P], Coroutine[Any, Any, R]]]:
    """Make ``async def method(self, ask: A)`` a method called with ``A``'s parameters.

    The method keeps its name and docstring, and shows ``A``'s signature (``self`` first)."""

    def decorate(body: Callable[[S, A], Coroutine[Any, Any, R]]) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
        name = body.__name__

        leases = isinstance(kind, type) and issubclass(kind, LeaseOptions)

        @functools.wraps(body)
        async def method(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
            if leases:
                warn_flat(name, kwargs)
            return await body(self, ask(kind, name, *args, **kwargs))

        parameters = list(inspect.signature(body).parameters.values())[:1]  # self
        parameters += inspect.signature(kind).parameters.values()
        returns = inspect.signature(body).return_annotation
        method.__signature__ = inspect.Signature(parameters, return_annotation=returns)  # type: ignore[attr-defined]
        del method.__wrapped__  # the signature is the dataclass's, not the body's
        return method

    return decorate
