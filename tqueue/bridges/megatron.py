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
* ``mode="broadcast"``: the replica's first rank reads, then broadcasts tensors (never
  pickled objects: a header of names, dtypes and shapes as bytes, then each tensor) inside
  the replica's group, on the device. Best with NCCL/HCCL inside a node (GPU to GPU), where
  one read from the storage units beats several.

The device is CUDA if available, else an Ascend NPU (``torch_npu``) if available, else CPU,
unless given; the replica's collective backend follows it (NCCL, HCCL, gloo). Waits for a
step that is not ready are parked requests at the controller (or a blocked collective), never
a polling loop. :meth:`StepReader.done` acks the step once every peer has its data (one ack
per replica); a sealed step's partition frees itself when every task is done with it.
Computed fields go back with :meth:`StepReader.update`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch

from .._extras import optional
from ..client._micro import Form, check_options, shape
from ..errors import InvalidArgumentError
from ..wire import BatchMeta

MODES = ("each", "broadcast")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


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
    """Where this rank sits: its data-parallel rank and size, its replica (the global ranks
    sharing its data-parallel rank) and the replica's first rank, which reads in broadcast
    mode and acks."""

    dp_rank: int
    dp_size: int
    replica: list[int]
    group: Any  # the replica's process group (None when it is this rank alone)

    @property
    def src(self) -> int:
        return self.replica[0]


def layout(dp_rank: int | None = None, dp_size: int | None = None, *, backend: str | None = None) -> Layout:
    """This rank's :class:`Layout`: from ``megatron.core.parallel_state`` when it is
    initialised, else from ``dp_rank``/``dp_size`` (plain ``torch.distributed``). Every rank
    of the job must call it (it forms the replica groups collectively)."""
    import torch.distributed as dist

    if dp_rank is None or dp_size is None:
        ps = _parallel_state()
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
        return Layout(0, 1, [0], None)
    world = dist.get_world_size()
    mine = torch.tensor([dp_rank], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine)  # on the default group's device: CPU under gloo
    ranks_of = [int(t.item()) for t in every]
    if sorted(set(ranks_of)) != list(range(dp_size)):
        raise InvalidArgumentError(f"the ranks' data-parallel ranks {ranks_of} do not cover 0..{dp_size - 1}")
    group = None
    replica: list[int] = []
    for d in range(dp_size):  # every rank creates every group, in the same order
        members = [r for r, x in enumerate(ranks_of) if x == d]
        g = dist.new_group(members, backend=backend) if len(members) > 1 else None
        if d == dp_rank:
            replica, group = members, g
    return Layout(dp_rank, dp_size, replica, group)


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
    ``lease_timeout``: a step not acked (or renewed) in time goes back to the task, for
    another rank to take if this one died (default: never).
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
    ) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode is one of {list(MODES)}, got {mode!r}")
        self.client = client
        self.task = task
        self.mode = mode
        self.device = pick_device(device)
        self.backend = backend_for(self.device)
        self.layout = layout(dp_rank, dp_size, backend=self.backend)
        self.lease_timeout = lease_timeout
        self.steps = 0

    @property
    def is_src(self) -> bool:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == self.layout.src

    def read(
        self,
        partition: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        max_tokens_per_micro_batch: int | None = None,
        policy: str = "first_ready",
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
        the same partitions in the same order.

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
        ask = dict(task=self.task, timeout=timeout, policy=policy, dp_rank=self.layout.dp_rank,
                   dp_size=self.layout.dp_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                   balance_by=balance_by, lease_timeout=self.lease_timeout, micro_batch_size=micro_batch_size,
                   num_microbatches_multiple_of=num_microbatches_multiple_of, min_num_microbatches=min_num_microbatches)
        if self.mode == "each" or self.layout.group is None:
            meta = self.client.get_meta(partition, fields, batch_size, **ask)
            values = dict(self.client.get_data(meta, jagged=jagged))
            values = {k: _to(v, self.device) for k, v in values.items()}
        elif self.is_src:
            meta = self.client.get_meta(partition, fields, batch_size, **ask)
            values = {k: _to(v, self.device) for k, v in dict(self.client.get_data(meta, jagged=jagged)).items()}
            _send(meta, values, self.layout, self.device)
        else:
            meta, values = _receive(self.layout, self.device)
        self.steps += 1
        if form is not None:
            return Step(meta, values, shape(meta, values, form=form, pad_to_multiple_of=pad_to_multiple_of))
        return Step(meta, values, _split(meta, values))

    def done(self, step: Step) -> None:
        """The step is trained on: once every peer of the replica is past its data, the
        replica's first rank acks it."""
        import torch.distributed as dist

        if self.layout.group is not None:
            dist.barrier(group=self.layout.group)
        if self.is_src:
            self.client.ack(step.meta)

    def renew(self, step: Step, lease_timeout: float | None = None) -> None:
        """Keep the step's lease for ``lease_timeout`` (default: the reader's) from now, for a
        step that trains longer than the lease; the replica's first rank renews."""
        if self.is_src:
            self.client.renew(step.meta, lease_timeout=self.lease_timeout if lease_timeout is None else lease_timeout)

    def update(self, step: Step, data: Mapping[str, Any]) -> None:
        """Write computed fields back (values, reference log-probs): one value per sample of
        the share, in its order; written by the replica's first rank."""
        if self.is_src:
            self.client.update(step.meta, data)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [v.to(device) for v in value]
    return value


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


# --- broadcast: tensors only, a header first ------------------------------------------


class _Entry(msgspec.Struct, array_like=True):
    name: str
    kind: str  # "tensor", "tensors" (a list of tensors), "values" (msgpack of plain values)
    dtypes: list[str]
    shapes: list[list[int]]


def _send(meta: BatchMeta, values: dict[str, Any], lay: Layout, device: torch.device) -> None:
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
    header = msgspec.msgpack.encode((meta, entries))
    _bcast_bytes(header, lay, device)
    for t in tensors:
        _bcast(t, lay)


def _receive(lay: Layout, device: torch.device) -> tuple[BatchMeta, dict[str, Any]]:
    meta, entries = msgspec.msgpack.decode(_bcast_bytes(None, lay, device), type=tuple[BatchMeta, list[_Entry]])
    values: dict[str, Any] = {}
    for e in entries:
        if e.kind == "tensor":
            values[e.name] = _bcast(torch.empty(e.shapes[0], dtype=_dtype(e.dtypes[0]), device=device), lay)
        elif e.kind == "tensors":
            values[e.name] = [_bcast(torch.empty(s, dtype=_dtype(d), device=device), lay) for d, s in zip(e.dtypes, e.shapes)]
        else:
            raw = _bcast(torch.empty(e.shapes[0], dtype=torch.uint8, device=device), lay)
            values[e.name] = msgspec.msgpack.decode(raw.cpu().numpy().tobytes())
    return meta, values


def _bcast(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    import torch.distributed as dist

    if t.numel():  # gloo has no bool: the same bytes as uint8
        dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=lay.src, group=lay.group)
    return t


def _bcast_bytes(raw: bytes | None, lay: Layout, device: torch.device) -> bytes:
    size = torch.tensor([len(raw) if raw is not None else 0], dtype=torch.int64, device=device)
    _bcast(size, lay)
    if raw is not None:
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    return bytes(_bcast(buf, lay).cpu().numpy().tobytes())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"unknown dtype {name!r} in a broadcast header")
    return dtype


__all__ = ["MODES", "Layout", "Step", "StepReader", "backend_for", "layout", "pick_device"]
