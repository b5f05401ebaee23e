"""NIXL, for one-sided reads and writes of a storage unit's registered memory (the ``nixl`` extra).

A unit started with ``StorageConfig.nixl`` registers its arena with a NIXL agent once and tells
the controller its agent's metadata and the arena's address (``UnitInfo.nixl``,
``UnitInfo.nixl_base``). A client with ``ClientConfig.nixl`` loads that metadata into an agent of
its own and moves a fetch's arena ranges (or a put's fields) by one-sided READs (WRITEs) of the
unit's memory: UCX carries them over InfiniBand or RoCE where a host has such a NIC, by CUDA
copies where a buffer is on a GPU, and over TCP or cross-process memory reads (same host)
elsewhere. The unit's CPU takes no part in a transfer beyond its agent's progress thread.

What nixl-cu12 1.5 does that shapes this module (measured on a 2-core host, no GPU):

* its Python API starts each agent's progress thread with a delay of 0, so the thread spins a
  whole core; :func:`load` makes the delay :data:`PROGRESS_DELAY_US` (idle CPU 1-2% of a core,
  same-host reads no slower, 10.5-12 against 5-7 GiB/s with the spinning thread on 2 cores);
* the memory's owner must make progress for a read to end: its agent keeps the progress thread;
* a transfer to a peer that died raises ``nixlRemoteDisconnectError`` (within about 10 ms over
  TCP), and the agent stays usable; its exceptions share no base class but ``Exception``;
* same host, UCX reads by ``process_vm_readv`` and ``transfer()`` copies before it returns (the
  GIL released), so every call here runs on the agent's own thread, never the event loop's;
* an agent's metadata is a snapshot of what it had registered: a unit registers its arena
  before it registers with the controller, and never again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._extras import require
from ..errors import StorageUnitUnavailableError

log = logging.getLogger(__name__)

# UCX's TCP transport moves a one-sided read in segments of 8 KiB unless told otherwise: 256 KiB
# took a 128 MiB read over loopback from 1.0 to 2.4 GB/s (512 KiB: 3.0 raw, but no faster
# through tqueue, and every connection holds buffers of this size)
TCP_SEGMENT = "256k"
PROGRESS_DELAY_US = 1000  # the progress thread's idle wait; 100-10,000 µs read alike
_POLL_S = 0.0002  # between checks of a transfer in flight (a check costs 1-25 µs)
_module: Any = None
_names = itertools.count()

# a test's seam: called (on the agent's thread) once a transfer is posted and still in flight
posted_hook: Callable[[], None] | None = None


def load() -> Any:
    """The nixl module (``nixl_cu12``), imported once, its progress thread made to sleep when
    idle; an ImportError naming the install command where it is missing."""
    global _module
    if _module is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # else it logs each agent on stdout
        for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):  # over TCP: 2.4-2.6 GB/s, not 1.0
            os.environ.setdefault(name, TCP_SEGMENT)
        try:
            mod = require("nixl_cu12", "nixl", by="NIXL payload transfers (StorageConfig.nixl, ClientConfig.nixl)")
        except ImportError as missing:
            try:  # the CUDA 13 build (nixl-cu13) installs the same API as nixl
                mod = importlib.import_module("nixl")
                mod.nixl_agent  # noqa: B018 - not some other module of that name
            except (ImportError, AttributeError):
                raise missing from None
        _quiet_progress(mod)
        _module = mod
    return _module


def _quiet_progress(mod: Any) -> None:
    api = getattr(mod, "_api", None)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or getattr(base, "_tqueue_delay", False):
        return
    prop = base.__dict__.get("pthrDelay")
    if prop is None:
        log.warning("nixl: no pthrDelay on its agent config; its progress thread may spin a core")
        return

    class _Config(base):  # type: ignore[misc, valid-type]
        _tqueue_delay = True

        @property
        def pthrDelay(self) -> int:
            return int(prop.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            prop.__set__(self, max(int(value), PROGRESS_DELAY_US))

    bind.nixlAgentConfig = _Config  # type: ignore[union-attr]


def available() -> bool:
    """Whether the nixl module can be imported here."""
    try:
        load()
    except ImportError:
        return False
    return True


def rdma_devices() -> list[str]:
    """This host's RDMA devices (InfiniBand or RoCE), as the kernel lists them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


class TransferError(Exception):
    """A NIXL transfer failed; ``gone``: because the peer disconnected (it died)."""

    def __init__(self, message: str, *, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


class Agent:
    """One NIXL agent with the UCX backend. Transfers run on a thread of the agent's own (a
    same-host read copies inside ``transfer()``); every call into the binding holds one lock.

    ``register`` host memory for good (a unit's arena); ``connect`` a peer by its metadata;
    ``transfer`` lists of (local address, remote address, length) with a deadline, the local
    buffer registered for the transfer's length.
    """

    def __init__(self, role: str) -> None:
        mod = load()
        self.name = f"tqueue-{role}-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}"
        config = mod.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"])
        self._agent = mod.nixl_agent(self.name, config)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tqueue-nixl")
        self._regs: list[Any] = []
        self._closed = False

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self._agent, method)(*args)

    def register(self, address: int, nbytes: int) -> None:
        """Register host memory [address, address + nbytes) until :meth:`close`."""
        self._regs.append(self._call("register_memory", [(address, nbytes, 0, "")], "DRAM"))

    def metadata(self) -> bytes:
        """What a peer loads to reach this agent's registered memory."""
        return bytes(self._call("get_agent_metadata"))

    def connect(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; the peer's name."""
        name = self._call("add_remote_agent", metadata)
        return name if isinstance(name, bytes) else str(name).encode()

    def forget(self, peer: bytes) -> None:
        """Drop a peer (one that died or closed)."""
        if self._closed:
            return
        try:
            self._call("remove_remote_agent", peer)
        except Exception as exc:  # the binding's errors share no base class
            log.debug("nixl: removing %r: %s", peer, exc)

    async def transfer(
        self, op: str, peer: bytes, pieces: Sequence[tuple[int, int, int]], local: Sequence[tuple[int, int]],
        timeout: float,
    ) -> None:
        """``op`` ("READ": from ``peer``'s memory into this process's; "WRITE": the other way)
        each (local address, remote address, length) of ``pieces``, the local buffers ``local``
        (address, length each) registered meanwhile. :class:`TransferError` if it fails or
        outlasts ``timeout``."""
        if not pieces:
            return
        if self._closed:
            raise TransferError("the client's NIXL agent is closed", gone=False)
        done = asyncio.wrap_future(self._pool.submit(self._transfer, op, peer, pieces, local, timeout))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # a posted transfer cannot be withdrawn: the caller's buffers must outlive it (else
            # the pool hands them out while the engine still writes), and it ends by its deadline
            await asyncio.wait([done])
            raise

    def _transfer(
        self, op: str, peer: bytes, pieces: Sequence[tuple[int, int, int]], local: Sequence[tuple[int, int]],
        timeout: float,
    ) -> None:
        """On the agent's thread: register ``local``, post one transfer of every piece, wait."""
        arr = np.asarray(pieces, dtype=np.uint64).reshape(-1, 3)
        zeros = np.zeros(len(arr), dtype=np.uint64)
        deadline = time.monotonic() + timeout
        reg = handle = None
        try:
            reg = self._call("register_memory", [(a, n, 0, "") for a, n in local], "DRAM")
            mine = self._call("get_xfer_descs", np.stack([arr[:, 0], arr[:, 2], zeros], axis=1), "DRAM")
            theirs = self._call("get_xfer_descs", np.stack([arr[:, 1], arr[:, 2], zeros], axis=1), "DRAM")
            handle = self._call("initialize_xfer", op, mine, theirs, peer, b"")
            state = self._call("transfer", handle)
            if state == "PROC" and posted_hook is not None:
                posted_hook()
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferError(
                        f"a NIXL {op} of {int(arr[:, 2].sum())} bytes did not end within {timeout:.1f} s", gone=False
                    )
                time.sleep(_POLL_S)  # nixl signals the end of a transfer only to a poll, on this thread
                state = self._call("check_xfer_state", handle)
            if state != "DONE":
                raise TransferError(f"a NIXL {op} ended in state {state}", gone=False)
        except TransferError:
            raise
        except Exception as exc:  # the binding's errors share no base class
            gone = "DISCONNECT" in f"{type(exc).__name__} {exc}".upper()
            raise TransferError(f"a NIXL {op} failed: {type(exc).__name__}: {exc}", gone=gone) from exc
        finally:
            for method, arg in (("release_xfer_handle", handle), ("deregister_memory", reg)):
                if arg is not None:
                    try:
                        self._call(method, arg)
                    except Exception as exc:  # the binding's errors share no base class
                        log.debug("nixl: %s: %s", method, exc)

    def close(self) -> None:
        """Wait for transfers in flight, deregister what is registered. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for reg in self._regs:
            try:
                self._call("deregister_memory", reg)
            except Exception as exc:  # the binding's errors share no base class
                log.debug("nixl: deregistering at close: %s", exc)
        self._regs.clear()


def unavailable(unit: str, exc: TransferError) -> StorageUnitUnavailableError:
    """The typed error a failed transfer with a unit becomes."""
    why = "it died or closed" if exc.gone else "the transfer did not complete"
    return StorageUnitUnavailableError(f"{unit}: {exc} ({why})")


def address_of(buf: Any) -> int:
    """The address of a writable buffer's first byte (a numpy array, mmap or bytearray)."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return int(arr.ctypes.data)


__all__ = [
    "PROGRESS_DELAY_US", "TCP_SEGMENT", "Agent", "TransferError", "address_of", "available", "load", "rdma_devices",
    "unavailable",
]
