"""The device route: a read delivered into accelerator memory, ``get_data(..., device=...)``.

Whichever route brought a unit's bytes to this host, the last leg is host to device, and its
speed depends on the host memory it starts from. From page-locked memory (pinned, or host
memory registered with the driver) a copy runs by DMA at the copy engines' speed and does not
block the host; from pageable memory the driver stages it through a bounce buffer of its own,
synchronously, at a fraction of that (ANCHORS.md; benchmarks/cuda.py measures both). So a
device read never hands the driver pageable memory:

* the batch's host buffers (the dense rows a bulk stream receives in place, what assembly
  copies) come from a page-locked pool of the accelerator's (:meth:`Accelerator.pool`);
* where ``ClientConfig.device_lock_bytes`` allows (off by default), the pages of a unit's
  arena on this host are registered with the driver (``cudaHostRegister``) in blocks of
  :data:`LOCK_BLOCK` (64 MiB) as reads (and CUDA puts, :meth:`DeviceRoutes.to_arena`) first
  touch them, so its views are copied from in place. A registered block stays locked until the
  unit punches the arena's free pages (its epoch moves on: the locked pages are orphans then)
  and is registered again when touched; the total is bounded by the budget and the process's
  memlock limit, never by the arena's whole size (``StorageConfig.shm_bytes``). Past the
  budget, or where the driver refuses (a memlock limit, an accelerator without host
  registration), that is said once in the log and those views go through the bounce buffers
  below. Off by default because the driver then refuses a copy from a host tensor spanning two
  registrations: ``.to("cuda")`` of a same-host batch's view (docs/performance.md);
* any other bytes (ZeroMQ frames, views of an unregistered arena, small jagged samples) are
  packed back to back into two page-locked bounce buffers of ``ClientConfig.device_chunk_bytes``
  that take turns: the host fills one while the copy engine drains the other.

Dense tensor fields are assembled on the device (:class:`DenseOnDevice`): as each unit's part
arrives, while the others are still on their way, each of its frames is copied once into its
rows of the field's device tensor (from a registered arena's pages, or the pinned rows a bulk
stream filled in place); integers the wire packed cross narrow and are widened on the device;
scattered rows are scattered there. Big locked ranges go in chunks of ``device_chunk_bytes``,
queued without waiting. The other fields are assembled on the host as for any read and then
moved (:func:`deliver`): a jagged field becomes one device buffer with per-sample views (or a
padded / nested tensor, moved whole); object fields, numpy fields and per-sample lengths stay
on the host. The read returns once every copy is done, so the batch may be used on any stream.

``cuda`` and ``npu`` (Ascend, through ``torch_npu``) are accelerators. ``cpu`` takes the same
route into memory of the batch's own (no views of the unit's arena or of the client's pool):
the tests run every branch of this module that way, with registration allowed or refused.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..._extras import require
from ..._memory import BufferPool
from ..._threads import copy_bytes
from ...errors import InvalidArgumentError, ProtocolError
from ...transport._arena import ArenaMap
from ...wire import BatchMeta, FieldSpec
from ...wire._layout import int_dtype, itemsize
from ...wire._messages import PackedType
from ...wire._pack import PACKED
from .._assemble import Part, dense_frames, pad_rows
from .._batch import Batch
from .._encode import TORCH_DTYPES
from .arena import ArenaRoute
from .base import Route

log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()  # (device type, what) already logged: each once per process
SMALL = 64 * 1024  # locked ranges below this are packed into a bounce buffer with their neighbours
LOCK_BLOCK = 64 << 20  # an arena's pages are registered with the driver in blocks of this size


def _say_once(kind: str, what: str, message: str) -> None:
    if (kind, what) not in _said:
        _said.add((kind, what))
        log.warning("%s", message)


class Accelerator:
    """What a device read needs of one device: memory there, page-locked host memory, copies
    queued without waiting, fences, and registration of host ranges with the driver.

    The base class is the ``cpu`` device, where nothing is queued: copies happen at once, a
    fence is always passed, and "page-locked" is what this object handed out or registered.
    Subclasses override the device's own calls."""

    def __init__(self, device: torch.device, pool_bytes: int, lock_budget: int = 0) -> None:
        self.device = device
        self._ranges: dict[int, int] = {}  # start address -> end: host memory known to be locked
        self._pool = _LockedPool(self, pool_bytes)
        self.copied = 0  # bytes copied host to device (a copy from pageable memory raises instead)
        self.lock_budget = lock_budget  # most bytes of arenas this accelerator registers
        self.locked_bytes = 0  # of arenas, registered so far
        self._arenas: list[tuple[int, int, ArenaMap]] = []  # (start, end, map) that may be registered
        self._blocks: dict[int, int] = {}  # start -> bytes: the arena blocks registered now
        self.registrations = 0  # blocks registered over the accelerator's life (again after a punch too)
        self._refused = False  # the driver refused once: no more tries

    # --- host memory --------------------------------------------------------------------

    def pool(self) -> BufferPool:
        """Page-locked host buffers for the batch (pooled, as the client's)."""
        return self._pool

    def locked_alloc(self, nbytes: int) -> np.ndarray:
        """A fresh page-locked host buffer (the pool's allocator)."""
        buf = np.empty(nbytes, dtype=np.uint8)
        self._track(buf)
        return buf

    def _track(self, buf: np.ndarray) -> None:
        start = buf.ctypes.data
        self._ranges[start] = start + buf.nbytes
        weakref.finalize(buf, self._ranges.pop, start, None)

    def add_arena(self, arena: ArenaMap) -> None:
        """An arena whose pages :meth:`locked` registers, block by block, as reads touch them.

        When the unit hands the arena's free pages back to the OS (its epoch moves on), the
        pages this registered may no longer be the arena's: a later write to that offset
        faults in a fresh page while the driver keeps the locked one. So every block of the
        arena is unregistered then (after the copies queued so far), and registered again as
        reads and writes touch it."""
        start = arena.array.ctypes.data
        if all(a is not arena for _, _, a in self._arenas):
            self._arenas.append((start, start + arena.size, arena))
            me, end = weakref.ref(self), start + arena.size

            def forget() -> None:
                acc = me()
                if acc is not None:
                    acc._forget(start, end, arena)

            arena.on_epoch(forget)

    def _forget(self, lo: int, hi: int, arena: ArenaMap) -> None:
        stale = [at for at in self._blocks if lo <= at < hi]
        if not stale:
            return
        self.synchronize()  # no queued copy may still read or write a block being unregistered
        for at in stale:
            self.unregister_range(arena, at)
            self._ranges.pop(at, None)
            self.locked_bytes -= self._blocks.pop(at)

    def register_range(self, arena: ArenaMap, start: int, nbytes: int) -> str:
        """Register ``nbytes`` of host memory at address ``start`` (inside ``arena``'s mapping)
        with the driver: "" once done, else why not."""
        return ""

    def unregister_range(self, arena: ArenaMap, start: int) -> None:
        """Undo :meth:`register_range` of the range at ``start``."""

    def locked(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in host memory the device copies from by DMA; a buffer in an
        arena's pages is made so, its blocks registered, while the budget lasts."""
        start = buf.ctypes.data
        end = start + buf.nbytes
        if any(lo <= start and end <= hi for lo, hi in self._ranges.items()):
            return True
        return self._register_blocks(start, end)

    def _register_blocks(self, start: int, end: int) -> bool:
        if self._refused:
            return False
        for lo, hi, arena in self._arenas:
            if not (lo <= start and end <= hi):
                continue
            first, last = (start - lo) // LOCK_BLOCK, (end - 1 - lo) // LOCK_BLOCK
            for block in range(first, last + 1):
                at = lo + block * LOCK_BLOCK
                if at in self._ranges:
                    continue
                n = min(LOCK_BLOCK, hi - at)
                if self.locked_bytes + n > self.lock_budget:
                    _say_once(self.device.type, "budget", f"registering {n} more bytes of arena pages would pass "
                              f"ClientConfig.device_lock_bytes ({self.lock_budget}): further copies between arena "
                              f"pages and {self.device.type} go through page-locked buffers")
                    return False
                why = self.register_range(arena, at, n)
                if why:
                    self._refused = True
                    _say_once(self.device.type, "refused", f"{why}: copies between storage units' arenas and "
                              f"{self.device.type} go through page-locked buffers")
                    return False
                self._ranges[at] = at + n
                self._blocks[at] = n
                self.locked_bytes += n
                self.registrations += 1
            return True
        return False

    # --- the device ---------------------------------------------------------------------

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Queue ``dst[:] = src`` (host to device) without waiting; ``src`` must be locked and
        must stay untouched until a later fence is passed."""
        if not self.locked(src):
            raise AssertionError("a device copy from pageable memory")  # a bug of this module
        self.copied += src.nbytes
        self._queue(dst, src)

    def _queue(self, dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(src))

    def to_host(self, dst: np.ndarray, src: torch.Tensor) -> None:
        """Queue ``dst[:] = src`` (``src``: bytes on the device) without waiting; ``dst`` must
        be locked and untouched until a later fence is passed."""
        if not self.locked(dst):
            raise AssertionError("a device copy into pageable memory")  # a bug of the caller
        torch.from_numpy(dst).copy_(src, non_blocking=self.device.type != "cpu")

    def fence(self) -> Any:
        """A mark after every copy queued so far."""
        return None

    def wait(self, fence: Any) -> None:
        """Block until the copies before ``fence`` are done."""

    def synchronize(self) -> None:
        """Block until every queued copy is done."""


class CudaAccelerator(Accelerator):
    def __init__(self, device: torch.device, pool_bytes: int, lock_budget: int = 0) -> None:
        super().__init__(device, pool_bytes, lock_budget)
        self._undo: dict[int, Any] = {}  # start -> the finalizer that unregisters it

    def locked_alloc(self, nbytes: int) -> np.ndarray:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def register_range(self, arena: ArenaMap, start: int, nbytes: int) -> str:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(start, nbytes, 0)
        if int(rc) != 0:
            return f"cudaHostRegister of {nbytes} bytes refused (CUDA error {int(rc)})"
        self._undo[start] = weakref.finalize(arena, cudart.cudaHostUnregister, start)  # unlocked when the map goes
        return ""

    def unregister_range(self, arena: ArenaMap, start: int) -> None:
        undo = self._undo.pop(start, None)
        if undo is not None:
            undo()

    def locked(self, buf: np.ndarray) -> bool:
        return super().locked(buf) or torch.from_numpy(buf).is_pinned()

    def _queue(self, dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(src), non_blocking=True)

    def fence(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, fence: Any) -> None:
        if fence is not None:
            fence.synchronize()

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class NpuAccelerator(CudaAccelerator):
    """An Ascend NPU through ``torch_npu``, which offers pinned memory but no registration of
    host memory it did not allocate: arena views go through the bounce buffers."""

    def register_range(self, arena: ArenaMap, start: int, nbytes: int) -> str:
        return "torch_npu cannot register host memory it did not allocate"

    def fence(self) -> Any:
        event = torch.npu.Event()  # type: ignore[attr-defined]
        event.record(torch.npu.current_stream(self.device))  # type: ignore[attr-defined]
        return event

    def synchronize(self) -> None:
        torch.npu.current_stream(self.device).synchronize()  # type: ignore[attr-defined]

    def locked(self, buf: np.ndarray) -> bool:
        return Accelerator.locked(self, buf) or torch.from_numpy(buf).is_pinned()


class _LockedPool(BufferPool):
    """The client's buffer pool over an accelerator's page-locked memory."""

    def __init__(self, acc: Accelerator, max_idle_bytes: int) -> None:
        super().__init__(max_idle_bytes)
        self._acc = acc

    def _alloc(self, nbytes: int) -> np.ndarray:
        return self._acc.locked_alloc(nbytes)


_KINDS: dict[str, type[Accelerator]] = {"cpu": Accelerator, "cuda": CudaAccelerator, "npu": NpuAccelerator}


def accelerator(device: str | torch.device, pool_bytes: int, lock_budget: int = 0) -> Accelerator:
    """The :class:`Accelerator` for ``device`` (``cuda``, ``cuda:1``, ``npu``, ``cpu``)."""
    if str(device).split(":")[0] == "npu":  # a device type torch knows once torch_npu is imported
        require("torch_npu", "npu", by="get_data(device='npu')")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    kind = _KINDS.get(dev.type) if dev is not None else None
    if kind is None:
        raise InvalidArgumentError(f"get_data(device={str(device)!r}): a device is cuda, npu or cpu")
    assert dev is not None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"get_data(device={str(device)!r}): torch sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return kind(dev, pool_bytes, lock_budget)


class DeviceRoutes:
    """A client's device reads: one accelerator per device, made on first use, told of the
    arenas its reads go through (whose pages it registers as reads touch them)."""

    def __init__(self, pool_bytes: int, chunk_bytes: int, lock_budget: int) -> None:
        self._pool_bytes = pool_bytes
        self.chunk_bytes = chunk_bytes
        self._lock_budget = lock_budget
        self._by_device: dict[str, Accelerator] = {}

    def of(self, device: str | torch.device) -> Accelerator:
        """The accelerator of ``device``: one per device, whatever it is called (``cuda`` is
        ``cuda:0`` where that is the current device). Registrations are the driver's, per
        process: two accelerators of one device would register the same pages twice, and the
        second be refused."""
        key = str(device)
        acc = self._by_device.get(key)
        if acc is None:
            made = accelerator(device, self._pool_bytes, self._lock_budget)
            acc = self._by_device.setdefault(str(made.device), made)
            self._by_device[key] = acc
        return acc

    def to_arena(self, arena: ArenaMap, offset: int, src: torch.Tensor) -> tuple[Accelerator, int]:
        """Queue the copy of ``src`` (a contiguous tensor on a device) into ``arena`` from
        ``offset``: by DMA straight into the arena's pages, registered block by block while the
        budget lasts and the driver allows; elsewhere through a page-locked buffer and a host
        copy. Returns the accelerator whose copies to wait for before the arena's bytes may be
        read, and the bytes that went the long way."""
        acc = self.of(src.device)
        if self._lock_budget > 0:
            acc.add_arena(arena)
        flat = src.reshape(-1).view(torch.uint8)
        n, staged, at = flat.numel(), 0, 0
        while at < n:  # one piece per registration block: each is locked, or not, as a whole
            end = min(n, ((offset + at) // LOCK_BLOCK + 1) * LOCK_BLOCK - offset)
            view = arena.array[offset + at : offset + end]
            if acc.locked(view):
                acc.to_host(view, flat[at:end])
            else:
                bounce = acc.locked_alloc(end - at)
                acc.to_host(bounce, flat[at:end])
                acc.synchronize()
                copy_bytes(view, bounce)
                staged += end - at
            at = end
        return acc, staged

    def prepare(self, acc: Accelerator, routes: Sequence[Route]) -> None:
        """Tell ``acc`` of the arena of each arena route of a read."""
        if self._lock_budget <= 0:
            return
        for route in routes:
            if isinstance(route, ArenaRoute):
                acc.add_arena(route.arena)


@dataclasses.dataclass
class _Staged:
    """A bounce buffer being filled: the device range its bytes go to."""

    dst: torch.Tensor | None = None
    at: int = 0  # device offset of the buffer's first byte
    fill: int = 0


class Delivery:
    """The copies of one read to the device: big locked ranges straight, everything else
    packed into two bounce buffers that take turns."""

    def __init__(self, acc: Accelerator, chunk_bytes: int) -> None:
        self.acc = acc
        self.chunk = max(4096, chunk_bytes)
        self._bounce: list[np.ndarray] = []
        self._fences: list[Any] = [None, None]
        self._turn = 0
        self._staged = _Staged()
        self.direct = self.bounced = 0  # bytes copied from locked memory in place / through the bounce buffers

    def write(self, dst: torch.Tensor, at: int, src: np.ndarray) -> None:
        """Queue ``dst[at : at + len(src)] = src``."""
        n = src.nbytes
        if n >= SMALL and self.acc.locked(src):
            self._flush()  # what is staged goes first, while the host goes on
            for off in range(0, n, self.chunk):
                self.acc.copy(dst[at + off : at + min(n, off + self.chunk)], src[off : off + self.chunk])
            self.direct += n
            return
        st = self._staged
        if st.dst is not dst or st.at + st.fill != at:
            self._flush()
        off = 0
        while off < n:
            buf = self._buffer()
            if st.dst is None:
                st.dst, st.at, st.fill = dst, at + off, 0
            k = min(n - off, self.chunk - st.fill)
            copy_bytes(buf[st.fill : st.fill + k], src[off : off + k])
            st.fill += k
            off += k
            if st.fill == self.chunk:
                self._flush()
        self.bounced += n

    def _buffer(self) -> np.ndarray:
        if len(self._bounce) < 2:
            self._bounce = [self.acc.locked_alloc(self.chunk) for _ in range(2)]
        if self._staged.dst is None:  # a buffer's turn starts: its last copy must be done
            self.acc.wait(self._fences[self._turn])
        return self._bounce[self._turn]

    def _flush(self) -> None:
        st = self._staged
        if st.dst is None:
            return
        if st.fill:
            self.acc.copy(st.dst[st.at : st.at + st.fill], self._bounce[self._turn][: st.fill])
            self._fences[self._turn] = self.acc.fence()
            self._turn ^= 1
        st.dst, st.at, st.fill = None, 0, 0

    def flush(self) -> None:
        """Queue what is staged, so that device work queued next sees those bytes."""
        self._flush()

    def finish(self) -> None:
        """Queue what is staged and wait for every copy (the host memory may then go)."""
        self._flush()
        self.acc.synchronize()


class DenseOnDevice:
    """The dense tensor fields of one device read, assembled on the device as each unit's
    part arrives (while the other units' parts are still on their way): each frame is
    copied once, host to device, into its rows of the field's device tensor (a registered
    arena's pages or the pinned rows a bulk stream filled, in place); a frame of packed
    integers crosses narrow and is widened on the device; a frame of scattered rows is
    scattered there. A field some unit sent in another layout is left to host assembly."""

    def __init__(self, meta: BatchMeta, fields: Sequence[str], delivery: Delivery) -> None:
        self.d = delivery
        self.size = len(meta.indexes)
        self.meta = meta
        self.out: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        for f in fields:
            spec = meta.schema[f]
            if spec.kind == "tensor" and spec.layout == "dense" and spec.dtype in TORCH_DTYPES:
                self.rows[f] = int(np.prod(spec.shape, dtype=np.int64)) * itemsize(spec)
                self.out[f] = delivery.acc.empty(self.size * self.rows[f])
        self.fallback: set[str] = set()

    def add(self, part: Part) -> None:
        """Queue the copies of one unit's part."""
        for f in list(self.out):
            block, frames = part.blocks.get(f, (None, []))
            spec = self.meta.schema[f]
            if (
                block is None or f in self.fallback or block.spec.layout != "dense"
                or block.spec.dtype != spec.dtype or tuple(block.spec.shape) != tuple(spec.shape)
            ):
                self.fallback.add(f)
                continue
            self._frames(f, spec, block, frames, part.positions)

    def _frames(self, f: str, spec: FieldSpec, block: Any, frames: list[Any], positions: np.ndarray) -> None:
        row, out, d = self.rows[f], self.out[f], self.d
        bufs: list[np.ndarray] = []
        packs: list[PackedType] = []
        counts: list[tuple[int, int]] = []
        dense_frames(f, block, frames, 0, bufs, packs, counts)  # checks them against their header, as assembly does
        if sum(c for _, c in counts) != len(positions):
            raise ProtocolError(f"field {f!r}: the unit sent {sum(c for _, c in counts)} samples, {len(positions)} were asked")
        for buf, narrow, (at, c) in zip(bufs, packs, counts):
            pos = positions[at : at + c]
            if not c:
                continue
            if not narrow and pos[-1] - pos[0] == c - 1:  # rows in order: straight into place
                d.write(out, int(pos[0]) * row, buf)
                continue
            tmp = d.acc.empty(buf.nbytes)
            d.write(tmp, 0, buf)
            d.flush()  # the device work below reads tmp
            if narrow:
                wide = int_dtype(spec)
                assert wide is not None
                narrow_t = torch.from_numpy(np.empty(0, PACKED[narrow])).dtype
                wide_t = torch.from_numpy(np.empty(0, wide)).dtype
                tmp = tmp.view(narrow_t).to(wide_t).view(torch.uint8)
            if pos[-1] - pos[0] == c - 1:
                out[int(pos[0]) * row : (int(pos[-1]) + 1) * row].copy_(tmp)
            else:
                index = torch.from_numpy(pos).to(out.device)
                out.view(self.size, row).index_copy_(0, index, tmp.view(c, row))

    def finish(self) -> dict[str, torch.Tensor]:
        """The fields assembled here (pad rows zero); the caller waits for the copies."""
        pads = pad_rows(self.meta)
        done = {}
        for f, out in self.out.items():
            if f in self.fallback:
                continue
            spec = self.meta.schema[f]
            if len(pads):
                out.view(self.size, self.rows[f])[torch.from_numpy(pads).to(out.device)] = 0
            done[f] = out.view(TORCH_DTYPES[spec.dtype]).reshape(self.size, *spec.shape)
        return done


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a flat uint8 array (no copy; contiguous tensors only)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _dense(d: Delivery, t: torch.Tensor) -> torch.Tensor:
    src = _bytes(t)
    out = d.acc.empty(src.nbytes)
    d.write(out, 0, src)
    return out.view(t.dtype).reshape(t.shape)


def _samples(d: Delivery, samples: Sequence[Any]) -> list[torch.Tensor]:
    """Per-sample tensors in one device buffer, back to back; views of it come back."""
    srcs = [_bytes(s) for s in samples]
    out = d.acc.empty(sum(s.nbytes for s in srcs))
    views, at = [], 0
    for s, src in zip(samples, srcs):
        d.write(out, at, src)
        views.append(out[at : at + src.nbytes].view(s.dtype).reshape(s.shape))
        at += src.nbytes
    return views


def _value(d: Delivery, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            offsets = value.offsets()  # type: ignore[attr-defined]
            return torch.nested.nested_tensor_from_jagged(_dense(d, value.values()), _dense(d, offsets))
        return _dense(d, value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return _samples(d, value)
    return value  # object fields stay on the host


def deliver(
    batch: Batch, d: Delivery, fields: Sequence[str], on_device: Mapping[str, torch.Tensor]
) -> Batch:
    """``batch`` with its tensors in ``d``'s device memory, every copy done, its fields in the
    order of ``fields``: those in ``on_device`` assembled there already, the others moved."""
    moved = {name: _value(d, value) for name, value in batch.items()}
    d.finish()
    return batch.replaced({f: on_device[f] if f in on_device else moved[f] for f in fields})

