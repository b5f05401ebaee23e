"""Trainers: data-parallel ranks (Megatron, or plain ``torch.distributed``) fetch their share
of each step.

Every rank of the job makes one :class:`StepReader`. Ranks with the same data-parallel rank
form a *replica* (its tensor, pipeline and context-parallel ranks): they must see identical
bytes. Per step, each data-parallel rank gets its token-balanced share of the step's
``dp_size * batch_size`` samples from the controller, as micro-batches with
``global_batch_size``, ``num_microbatches`` and ``micro_batch_indices`` (equal micro-batch
counts on every rank, as pipeline parallelism needs). Two ways to get the bytes to a replica:

* ``mode="each"``: every rank of the replica reads for itself. The controller gives peers
  the identical meta for the same round, so no collective is needed; on one host the bytes
  come through the storage unit's shared-memory arena without a copy per peer. Best on CPU
  and on one host, or where the replica spans hosts with a fast path to the units.
* ``mode="broadcast"``: the first rank of each broadcast group (Megatron's tensor-parallel
  group by default, so each pipeline stage reads for itself; or the replica, or a group
  given) reads, then sends a header over a gloo group (the meta, names, dtypes and shapes as
  MessagePack bytes, or the read's error) and broadcasts each tensor on the device (never
  pickled objects). Best with NCCL/HCCL inside a node (GPU to GPU), where one read from the
  storage units beats several. A read's timeout or error reaches every peer as the same
  typed error; a rank that dies gives its peers :class:`~tqueue.UnavailableError`.

The device is CUDA if available, else an Ascend NPU (``torch_npu``) if available, else CPU,
unless given (``device=``). Tensors travel on the device, in groups of its backend (NCCL,
HCCL, gloo); everything else (the layout, headers, ``done``'s barrier) goes over gloo groups
that tqueue forms, so a job whose default group has no CPU backend (NCCL, HCCL) works. Waits
for a step that is not ready are parked requests at the controller (or a blocked collective),
never a polling loop. :meth:`StepReader.done` acks the step once every peer has its data (one
ack per replica); a sealed step's partition frees itself when every task is done with it.
Computed fields go back with :meth:`StepReader.update`, from one rank per replica.

Simulated, not run, here: CUDA/NCCL and Ascend/HCCL. The tests run the same code on CPU with
gloo, with a default group that has no CPU backend (``cuda:gloo``) standing in for NCCL's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import msgspec
import torch

from .._extras import optional
from ..client._ask import DataParallel, MicroBatches
from ..client._micro import Form, check_options, shape
from ..errors import (
    InvalidArgumentError,
    ProtocolError,
    RemoteError,
    TQueueError,
    UnavailableError,
    WaitTimeoutError,
    from_code,
)
from ..wire import BatchMeta

MODES = ("each", "broadcast")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
GROUP_TIMEOUT = timedelta(minutes=30)  # of the gloo groups tqueue forms (torch's default): a collective waits no longer


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """``device``, or the first of CUDA, Ascend NPU (through ``torch_npu``) and CPU that
    this process can use."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = _npu()
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device``."""
    try:
        return _BACKENDS[device.type]
    except KeyError:
        raise InvalidArgumentError(f"no collective backend known for device type {device.type!r}") from None


def _npu() -> Any:
    """``torch.npu`` once ``torch_npu`` is imported, or None where it is not installed."""
    if optional("torch_npu") is None:
        return None
    return getattr(torch, "npu", None)


@dataclasses.dataclass
class Layout:
    """Where this rank sits.

    ``replica``: the global ranks sharing its data-parallel rank (its tensor, pipeline and
    context-parallel peers); the replica's first rank acks and renews, and ``group`` (gloo;
    None where the rank is alone) is where :meth:`StepReader.done` waits for the replica.
    ``bcast``: the ranks that share one read in broadcast mode (the tensor-parallel group, a
    group given, or the replica), whose first rank reads; ``meta_group`` (gloo) carries their
    headers and ``device_group`` their tensors (None where the rank is alone, or in ``each``
    mode). ``writer``: the rank of the replica whose :meth:`StepReader.update` writes."""

    dp_rank: int
    dp_size: int
    replica: list[int]
    group: Any
    bcast: list[int] = dataclasses.field(default_factory=list)
    meta_group: Any = None
    device_group: Any = None
    writer: int = -1

    @property
    def src(self) -> int:
        """The replica's first rank: it acks and renews."""
        return self.replica[0]

    @property
    def reader(self) -> int:
        """The first rank of this rank's broadcast group: the one that reads in broadcast mode."""
        return self.bcast[0] if self.bcast else self.src


def layout(
    dp_rank: int | None = None,
    dp_size: int | None = None,
    *,
    backend: str | None = None,
    device: torch.device | None = None,
    group: Any = None,
    writer: int | None = None,
    broadcast: bool = True,
) -> Layout:
    """This rank's :class:`Layout`: from ``megatron.core.parallel_state`` when it is
    initialised, else from ``dp_rank``/``dp_size`` (plain ``torch.distributed``).

    ``group``: the process group whose ranks share one read in broadcast mode (default: the
    tensor-parallel group with ``parallel_state``, else the whole replica); it must lie inside
    the replica. ``writer``: the global rank of the replica that writes back (default: the last
    pipeline stage's first tensor- and context-parallel rank with ``parallel_state``, where
    verl collects outputs, else the replica's first rank). ``device``: where tensors go (CPU by
    default); ``backend``: the collective backend of the tensors' groups tqueue forms (default:
    the device's). ``broadcast``: form the broadcast groups.

    Every rank of the job must call it alike. It exchanges every rank's place once: over the
    default group where that has a CPU backend, else on ``device`` where it has that device's
    (NCCL), else over a gloo group of the whole job that tqueue forms once per default group
    (a default group with no CPU backend, such as ``cuda:gloo``). Then every rank forms every
    group, in one order, as Megatron does: a gloo group per replica, and in broadcast mode a
    gloo group per broadcast group for headers, plus one on the device for tensors unless the
    group given (or Megatron's) already is."""
    import torch.distributed as dist

    ps = _parallel_state()
    if dp_rank is None or dp_size is None:
        if ps is None:
            raise InvalidArgumentError(
                "give dp_rank and dp_size, or initialise megatron.core.parallel_state first"
            )
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if not 0 <= dp_rank < dp_size:
        raise InvalidArgumentError(f"dp_rank must be in [0, dp_size), got {dp_rank} of {dp_size}")
    if not dist.is_initialized():
        if dp_size != 1:
            raise InvalidArgumentError("torch.distributed is not initialised: only dp_size=1 works without it")
        return Layout(0, 1, [0], None, [0], writer=0)
    device = torch.device("cpu") if device is None else device
    backend = backend or backend_for(device)
    rank = dist.get_rank()
    given = group if group is not None else (ps.get_tensor_model_parallel_group() if ps is not None else None)
    shared = sorted(dist.get_process_group_ranks(given)) if given is not None else None
    row = [dp_rank, shared[0] if shared else -1, _claim(writer, ps, rank)]
    table = _exchange(torch.tensor(row, dtype=torch.int64), device).tolist()
    dp_of = [r[0] for r in table]
    if sorted(set(dp_of)) != list(range(dp_size)):
        raise InvalidArgumentError(f"the ranks' data-parallel ranks {dp_of} do not cover 0..{dp_size - 1}")
    replicas = [[r for r, x in enumerate(dp_of) if x == d] for d in range(dp_size)]
    bcast_of = _broadcast_groups([r[1] for r in table], dp_of, replicas)
    if shared is not None and bcast_of[rank] != shared:
        raise InvalidArgumentError(
            f"rank {rank}'s broadcast group is ranks {shared}, but ranks {bcast_of[rank]} name rank "
            f"{bcast_of[rank][0]} as its first: give every rank its own group"
        )
    found = Layout(dp_rank, dp_size, replicas[dp_rank], None, bcast_of[rank],
                   writer=_writer(replicas[dp_rank], [table[r][2] for r in replicas[dp_rank]], dp_rank))
    _form_groups(found, replicas, bcast_of, dp_of, backend, given, broadcast)
    return found


def _broadcast_groups(leads: list[int], dp_of: list[int], replicas: list[list[int]]) -> list[list[int]]:
    """Each rank's broadcast group, from each rank's first rank of it (-1: its replica)."""
    leads = [x if x >= 0 else replicas[dp_of[r]][0] for r, x in enumerate(leads)]
    of = [[r for r, y in enumerate(leads) if y == x] for x in leads]
    for members in of:
        if len({dp_of[r] for r in members}) > 1:
            raise InvalidArgumentError(
                f"ranks {members} would share one read, but their data-parallel ranks differ "
                f"({[dp_of[r] for r in members]}): a broadcast group lies inside one replica"
            )
    return of


def _form_groups(found: Layout, replicas: list[list[int]], bcast_of: list[list[int]], dp_of: list[int], backend: str,
                 given: Any, broadcast: bool) -> None:
    """Form every group on every rank, in the same order (``new_group`` is collective), and
    keep this rank's in ``found``: a gloo group per replica; with ``broadcast``, a gloo group
    per broadcast group (the replica's where they are the same ranks) and one on the device
    (``given`` where it is, the gloo one on the CPU)."""
    import torch.distributed as dist

    groups = [dist.new_group(m, backend="gloo", timeout=GROUP_TIMEOUT) if len(m) > 1 else None for m in replicas]
    found.group = groups[found.dp_rank]
    if not broadcast:
        return
    for members in sorted({tuple(m) for m in bcast_of if len(m) > 1}):
        mine = list(members) == found.bcast
        replica = dp_of[members[0]]
        meta = groups[replica] if list(members) == replicas[replica] else dist.new_group(
            list(members), backend="gloo", timeout=GROUP_TIMEOUT)
        if backend == "gloo":
            tensors = meta
        elif given is not None:
            tensors = given if mine else None
        else:
            tensors = dist.new_group(list(members), backend=backend)
        if mine:
            found.meta_group, found.device_group = meta, tensors


def _claim(writer: int | None, ps: Any, rank: int) -> int:
    """Which rank this one holds to be its replica's writer (-1: no view)."""
    if writer is not None:
        return writer
    if ps is not None and ps.is_pipeline_last_stage(ignore_virtual=True) and (
        ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    ):
        return rank
    return -1


def _writer(replica: list[int], claims: list[int], dp_rank: int) -> int:
    named = sorted({c for c in claims if c >= 0})
    if not named:
        return replica[0]
    if len(named) == 1 and named[0] in replica:
        return named[0]
    raise InvalidArgumentError(
        f"the replica of data-parallel rank {dp_rank} (ranks {replica}) names writers {named}: "
        f"exactly one of its own ranks writes back (give every rank the same writer=)"
    )


_WORLD_GLOO: list[Any] = []  # [default group, a gloo group of the whole job], formed once per default group


def _exchange(row: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's ``row``, stacked in rank order (see :func:`layout` for the way)."""
    import torch.distributed as dist

    types = {part.split(":")[0] for part in str(dist.get_backend_config()).split(",")}
    where, on = torch.device("cpu"), None
    if "cpu" not in types:
        if device.type in types:
            where = device
        else:
            if not _WORLD_GLOO or _WORLD_GLOO[0] is not dist.group.WORLD:
                _WORLD_GLOO[:] = [dist.group.WORLD, dist.new_group(backend="gloo")]
            on = _WORLD_GLOO[1]
    every = [torch.zeros_like(row, device=where) for _ in range(dist.get_world_size())]
    dist.all_gather(every, row.to(where), group=on)
    return torch.stack([t.cpu() for t in every])


def _parallel_state() -> Any:
    parallel_state = optional("megatron.core.parallel_state")
    return parallel_state if parallel_state is not None and parallel_state.model_parallel_is_initialized() else None


@dataclasses.dataclass
class Step:
    """One rank's share of a step: ``micro_batches`` (each a mapping of field to value,
    tensors on the device; a :class:`tqueue.MicroBatch` where ``read`` was given a ``form``),
    and the schedule, identical on every rank of the replica."""

    meta: BatchMeta
    fields: dict[str, Any]
    micro_batches: Sequence[Mapping[str, Any]]

    @property
    def global_batch_size(self) -> int:
        return self.meta.global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.meta.num_microbatches

    @property
    def micro_batch_indices(self) -> list[list[int]]:
        return self.meta.micro_batch_indices or [list(range(len(self.meta)))]


class StepReader:
    """One rank's reader of training steps (see the module docs).

    ``client``: a :class:`tqueue.Client` of this process. ``mode``: ``"each"`` or
    ``"broadcast"``. ``device``: where tensors go (default: :func:`pick_device`). ``dp_rank``
    and ``dp_size``: without Megatron's ``parallel_state``. ``task``: the consumer task name.
    ``lease_timeout``: a step not acked (or renewed) in time goes back to the task; the
    rank's replica, restarted, asks for the same round and takes its share back under a new
    lease (default: never). ``group``: the ranks that share one read in broadcast mode
    (default: Megatron's tensor-parallel group, else the replica). ``writer``: the global rank
    of the replica whose :meth:`update` writes (default: Megatron's last pipeline stage's first
    tensor-parallel rank, else the replica's first rank). See :func:`layout`.

    Making one is collective: every rank of the job makes its reader at the same point.
    """

    def __init__(
        self,
        client: Any,
        *,
        task: str = "train",
        mode: str = "each",
        device: str | torch.device | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        lease_timeout: float = math.inf,
        group: Any = None,
        writer: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode is one of {list(MODES)}, got {mode!r}")
        self.client = client
        self.task = task
        self.mode = mode
        self.device = pick_device(device)
        self.backend = backend_for(self.device)
        self.layout = layout(dp_rank, dp_size, backend=self.backend, device=self.device, group=group, writer=writer,
                             broadcast=mode == "broadcast")
        self.lease_timeout = lease_timeout
        self.steps = 0
        self._channel = None if mode == "each" or self.layout.meta_group is None else _Channel(
            self.layout, self.device, self.rank, client.config.request_timeout + 1.0)

    @property
    def rank(self) -> int:
        """This process's global rank (0 without ``torch.distributed``)."""
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_src(self) -> bool:
        """This rank acks and renews for its replica (the replica's first rank)."""
        return self.rank == self.layout.src

    @property
    def is_writer(self) -> bool:
        """This rank's :meth:`update` writes (one rank per replica)."""
        return self.rank == self.layout.writer

    def read(
        self,
        partition: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        max_tokens_per_micro_batch: int | None = None,
        policy: str | None = None,
        balance_by: Sequence[str] | None = None,
        timeout: float = math.inf,
        jagged: str = "padded",
        micro_batch_size: int | None = None,
        num_microbatches_multiple_of: int = 1,
        min_num_microbatches: int = 1,
        form: Form | None = None,
        pad_to_multiple_of: int = 1,
    ) -> Step:
        """This rank's share of the next round of ``partition``: ``batch_size`` samples
        (``dp_size * batch_size`` in the round), waiting for them up to ``timeout``. Rounds
        count per partition (the client counts them), so every rank of a replica must read
        the same partitions in the same order. In broadcast mode the reading rank's timeout
        or error reaches its peers as the same typed error, and a rank that died as
        UnavailableError (see :class:`_Channel`).

        The controller cuts the share into micro-batches as ``get_meta`` documents
        (``max_tokens_per_micro_batch`` or ``micro_batch_size``, ``balance_by``,
        ``min_num_microbatches``, ``num_microbatches_multiple_of``). Without ``form``, each
        micro-batch holds the rows of the share's values (jagged fields as ``jagged`` says:
        padded to the share's longest sample); with ``form="padded"`` or ``"packed"`` it is a
        :class:`tqueue.MicroBatch` padded to its own longest sample or packed with
        ``cu_seqlens``, to a multiple of ``pad_to_multiple_of`` (``Batch.micro_batches``); the
        share's values are then per-sample lists."""
        if form is not None:
            check_options(form, pad_to_multiple_of)
            jagged = "list"
        micro = MicroBatches(max_tokens=max_tokens_per_micro_batch, size=micro_batch_size,
                             multiple_of=num_microbatches_multiple_of, min_count=min_num_microbatches)
        ask = dict(task=self.task, timeout=timeout, policy=policy, balance_by=balance_by, lease_timeout=self.lease_timeout,
                   data_parallel=DataParallel(self.layout.dp_rank, self.layout.dp_size), micro_batches=micro)
        # onto the device by the client's device route: from page-locked memory only, in chunks
        on = None if self.device.type == "cpu" else self.device

        def get_data(meta: BatchMeta) -> dict[str, Any]:
            return dict(self.client.get_data(meta, jagged=jagged, device=on))

        if self._channel is None:
            meta = self.client.get_meta(partition, fields, batch_size, **ask)
            values = get_data(meta)
        elif self.rank == self.layout.reader:
            meta, values = self._channel.lead(
                lambda wait: self.client.get_meta(partition, fields, batch_size, **dict(ask, timeout=wait)), get_data, timeout
            )
        else:
            meta, values = self._channel.follow(timeout)
        self.steps += 1
        if form is not None:
            return Step(meta, values, shape(meta, values, form=form, pad_to_multiple_of=pad_to_multiple_of))
        return Step(meta, values, _split(meta, values))

    def done(self, step: Step) -> None:
        """The step is trained on: once every peer of the replica is past its data (a barrier
        on the replica's gloo group), the replica's first rank acks it. Call it after the
        optimizer step, and after :meth:`update`. Raises UnavailableError where a rank of the
        replica is gone."""
        import torch.distributed as dist

        if self._channel is not None:
            self._channel.check()
        if self.layout.group is not None:
            try:
                dist.barrier(group=self.layout.group)
            except RuntimeError as exc:
                raise UnavailableError(
                    f"rank {self.rank}: its replica {self.layout.replica} lost a rank (dead, or its connection "
                    f"closed) while done() waited for it: {exc}"
                ) from exc
        if self.is_src:
            self.client.ack(step.meta)

    def renew(self, step: Step, lease_timeout: float | None = None) -> None:
        """Keep the step's lease for ``lease_timeout`` (default: the reader's) from now, for a
        step that trains longer than the lease; the replica's first rank renews."""
        if self.is_src:
            self.client.renew(step.meta, lease_timeout=self.lease_timeout if lease_timeout is None else lease_timeout)

    def update(self, step: Step, data: Mapping[str, Any]) -> bool:
        """Write computed fields back (values, reference log-probs): one value per sample of
        the share, in its order. Only the replica's writer writes (:attr:`is_writer`; by
        default the last pipeline stage's first tensor-parallel rank, which holds them); on
        every other rank it does nothing, whatever ``data`` holds, so that the same line runs
        on every rank. Returns True where it wrote."""
        if not self.is_writer:
            return False
        self.client.update(step.meta, data)
        return True


def _split(meta: BatchMeta, values: dict[str, Any]) -> list[dict[str, Any]]:
    micro = meta.micro_batch_indices or [list(range(len(meta)))]
    out = []
    for rows in micro:
        index = torch.tensor(rows, dtype=torch.int64)
        mb: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                mb[name] = value.index_select(0, index.to(value.device))
            else:
                mb[name] = [value[i] for i in rows]
        out.append(mb)
    return out


# --- broadcast: a header first, then tensors only ------------------------------------------

WAITING, READING, DATA, FAILED = range(4)  # what a header says: still waiting; reading; data follows; the read failed
KEEPALIVE = 60.0  # s: a reader waiting longer for its step tells its peers it still waits, this often
MAX_HEADER = 1 << 28  # bytes: a header claiming more is not one of ours


class _Entry(msgspec.Struct, array_like=True):
    name: str
    kind: str  # "tensor", "tensors" (a list of tensors), "values" (msgpack of plain values)
    dtypes: list[str]
    shapes: list[list[int]]


class _Channel:
    """One broadcast group's reads: its first rank reads and sends, the others receive.

    Per read, the first rank sends a header over the group's gloo ``meta_group`` (an int64 pair,
    status and length, then that many bytes): ``WAITING`` every :data:`KEEPALIVE` s while
    the controller holds the step back, ``READING`` once it has the step's meta, then ``DATA``
    (the meta and each field's name, dtype and shape, as MessagePack), followed by each tensor
    over ``device_group``, or ``FAILED`` with the error's code and message, which every peer
    raises as the same class. A peer waits for a header up to the read's ``timeout`` plus the
    client's ``request_timeout`` (what the first rank's own client allows), with no limit of
    its own once the first rank reads (the group's timeout, 30 min, is the bound). A peer that
    dies breaks the group's connections: the others raise
    :class:`~tqueue.UnavailableError` at their next collective, at once. After that, or after
    a peer gave up waiting, the group is out of step: every later call raises again."""

    def __init__(self, lay: Layout, device: torch.device, rank: int, grace: float) -> None:
        self.lay = lay
        self.device = device
        self.rank = rank
        self.grace = grace
        self.failed: TQueueError | None = None

    def check(self) -> None:
        if self.failed is not None:
            raise type(self.failed)(f"this rank's broadcast group failed earlier, so it is out of step: {self.failed}")

    def lead(
        self, get_meta: Callable[[float], BatchMeta], get_data: Callable[[BatchMeta], dict[str, Any]], timeout: float
    ) -> tuple[BatchMeta, dict[str, Any]]:
        """Read (``get_meta(wait)``, then ``get_data(meta)``) and send what was read, or the error."""
        self.check()
        try:
            meta = self._wait_for(get_meta, timeout)
            self._tell(READING)
            values = get_data(meta)
        except Exception as exc:
            if self.failed is None:  # the group still works: the peers raise the same error
                said = [exc.code, str(exc)] if isinstance(exc, TQueueError) else [RemoteError.code, f"{type(exc).__name__}: {exc}"]
                self._tell(FAILED, msgspec.msgpack.encode(said))
            raise
        entries, tensors = _pack(values, self.device)
        self._tell(DATA, msgspec.msgpack.encode((meta, entries)))
        for t in tensors:
            self._tensor(t)
        return meta, values

    def follow(self, timeout: float) -> tuple[BatchMeta, dict[str, Any]]:
        """What the first rank read, or its error raised here."""
        self.check()
        deadline = None if math.isinf(timeout) else time.monotonic() + timeout + self.grace
        while True:
            status, payload = self._hear(deadline)
            if status == READING:
                deadline = None
            elif status == FAILED:
                code, message = msgspec.msgpack.decode(payload, type=tuple[str, str])
                raise from_code(code, message)
            elif status == DATA:
                break
            elif status != WAITING:
                raise self._fail(ProtocolError(f"a broadcast header from rank {self.lay.reader} has status {status}"))
        meta, entries = msgspec.msgpack.decode(payload, type=tuple[BatchMeta, list[_Entry]])
        values: dict[str, Any] = {}
        for e in entries:
            if e.kind == "tensor":
                values[e.name] = self._tensor(torch.empty(e.shapes[0], dtype=_dtype(e.dtypes[0]), device=self.device))
            elif e.kind == "tensors":
                values[e.name] = [
                    self._tensor(torch.empty(s, dtype=_dtype(d), device=self.device)) for d, s in zip(e.dtypes, e.shapes)
                ]
            else:
                raw = self._tensor(torch.empty(e.shapes[0], dtype=torch.uint8, device=self.device))
                values[e.name] = msgspec.msgpack.decode(raw.cpu().numpy().tobytes())
        return meta, values

    def _wait_for(self, get_meta: Callable[[float], BatchMeta], timeout: float) -> BatchMeta:
        """``get_meta``, asked in slices of :data:`KEEPALIVE` s, the peers told after each."""
        start = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - start)
            piece = min(left, KEEPALIVE)
            try:
                return get_meta(max(piece, 0.0))
            except WaitTimeoutError as exc:
                if piece >= left:  # the read's own timeout
                    if piece == timeout:
                        raise
                    raise WaitTimeoutError(f"{exc} (the read waited {timeout} s in all)") from exc
            self._tell(WAITING)

    def _tell(self, status: int, payload: bytes = b"") -> None:
        import torch.distributed as dist

        try:
            dist.broadcast(torch.tensor([status, len(payload)], dtype=torch.int64), src=self.lay.reader, group=self.lay.meta_group)
            if payload:
                dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=self.lay.reader, group=self.lay.meta_group)
        except RuntimeError as exc:
            raise self._lost("sending a header", exc) from exc

    def _hear(self, deadline: float | None) -> tuple[int, bytes]:
        import torch.distributed as dist

        head = torch.zeros(2, dtype=torch.int64)
        try:
            if deadline is not None:  # the receive ends by itself just after the deadline, so that nothing is left behind
                _set_pg_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.0) + 1.0), self.lay.meta_group)
            try:
                work = dist.broadcast(head, src=self.lay.reader, group=self.lay.meta_group, async_op=True)
            finally:
                if deadline is not None:
                    _set_pg_timeout(GROUP_TIMEOUT, self.lay.meta_group)
        except RuntimeError as exc:
            raise self._lost("waiting for a header", exc) from exc
        try:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as exc:
            if deadline is None or work.is_completed():
                raise self._lost("waiting for a header", exc) from exc
            raise self._fail(WaitTimeoutError(
                f"rank {self.rank} waited its read's timeout and the client's request_timeout ({self.grace:.0f} s) "
                f"beyond it for rank {self.lay.reader}, the first of its broadcast group {self.lay.bcast}, which "
                f"sent nothing (hung, or far behind its peers)"
            )) from exc
        status, size = head.tolist()
        if not 0 <= size <= MAX_HEADER:
            raise self._fail(ProtocolError(f"a broadcast header from rank {self.lay.reader} claims {size} bytes"))
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            try:
                dist.broadcast(buf, src=self.lay.reader, group=self.lay.meta_group)
            except RuntimeError as exc:
                raise self._lost("receiving a header", exc) from exc
        return status, buf.numpy().tobytes()

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if t.numel():  # gloo has no bool: the same bytes as uint8
            try:
                dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=self.lay.reader,
                               group=self.lay.device_group)
            except RuntimeError as exc:
                raise self._lost("broadcasting a tensor", exc) from exc
        return t

    def _lost(self, what: str, exc: BaseException) -> TQueueError:
        return self._fail(UnavailableError(
            f"rank {self.rank}: its broadcast group {self.lay.bcast} lost a rank (dead, or its connection "
            f"closed) while {what}: {exc}"
        ))

    def _fail(self, exc: TQueueError) -> TQueueError:
        self.failed = exc
        return exc


def _set_pg_timeout(timeout: timedelta, group: Any) -> None:
    """The timeout of ``group``'s collectives from now on (an op keeps the one it started with).
    torch has no public way to give one collective a timeout of its own."""
    from torch.distributed.distributed_c10d import _set_pg_timeout as set_timeout

    set_timeout(timeout, group)


def _pack(values: dict[str, Any], device: torch.device) -> tuple[list[_Entry], list[torch.Tensor]]:
    """The header entries and the tensors to send, in order; plain values as MessagePack bytes."""
    entries, tensors = [], []
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            entries.append(_Entry(name, "tensor", [_dtype_name(value.dtype)], [list(value.shape)]))
            tensors.append(value.contiguous())
        elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            entries.append(_Entry(name, "tensors", [_dtype_name(v.dtype) for v in value], [list(v.shape) for v in value]))
            tensors.extend(v.contiguous() for v in value)
        else:
            raw = msgspec.msgpack.encode(list(value))
            entries.append(_Entry(name, "values", ["uint8"], [[len(raw)]]))
            tensors.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))
    return entries, tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"unknown dtype {name!r} in a broadcast header")
    return dtype


__all__ = ["MODES", "Layout", "Step", "StepReader", "backend_for", "layout", "pick_device"]
