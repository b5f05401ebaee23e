"""Servers for tests: started the way an operator starts them (``python -m tqueue ...`` as a
process, :func:`server`), or served in this process on a loop thread (:class:`LoopCluster`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from tqueue.config import ControllerConfig, StorageConfig
from tqueue.controller import Controller
from tqueue.launch._serve import READY
from tqueue.storage import StorageUnit

T = TypeVar("T")


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test moves on: :meth:`time` is the monotonic clock plus an
    offset that :meth:`advance` raises, so what the servers on it schedule (``call_later``,
    ``call_at``, ``asyncio.sleep``, ``wait_for``) and what they measure (``loop.time()``) sees
    the time pass at once: a lease of 30 s expires at ``advance(30)``, not 30 s later. Real
    time still passes too; only ``time.monotonic()`` elsewhere (clients) does not jump."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0.0

    def time(self) -> float:
        return super().time() + self.offset

    def advance(self, seconds: float, timeout: float = 60.0) -> None:
        """Move the loop's time on by ``seconds`` (from another thread than the loop's); return
        once the callbacks due by then have run (the timers due, and the first step of what
        they start: a waiter's wake-up, a task's next turn). What they go on to do takes
        turns of its own: wait for it with a request, an event or a handshake, as ever."""
        if seconds < 0:
            raise ValueError(f"the clock does not go back ({seconds} s)")
        if self._thread_id == threading.get_ident():
            raise RuntimeError("advance() is called from another thread than the loop's (it waits for the loop)")

        async def bump() -> None:
            self.offset += seconds
            # the loop's next turn runs the timers due by the new time; two more let what
            # they woke (a future's callbacks, then the task awaiting it) take a step
            for _ in range(3):
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(bump(), self).result(timeout)


def _ready_address(line: str) -> str:
    assert line.startswith(READY), line
    return json.loads(line[len(READY) :])["address"]


@contextlib.contextmanager
def server(*args: str, ready: Callable[[str], str] = _ready_address) -> Iterator[str]:
    """``tqueue ARGS`` as a process; what ``ready`` reads from its first line (by default the
    address of a server saying it is ready). Leaving the block normally sends SIGTERM and
    requires a clean exit (rc 0); the process is killed by pid if it is still there."""
    proc = subprocess.Popen([sys.executable, "-m", "tqueue", *args], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield ready(proc.stdout.readline().decode())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class LoopCluster:
    """What :class:`tqueue.LocalCluster` starts as child processes, a controller and
    ``num_storage_units`` storage units, served instead by one event loop on a thread of this
    process: for tests that need the servers' behaviour, not their isolation (there are no
    pids to kill or stop). It starts in milliseconds where a child process, which imports
    torch, takes more than a second. ``storage`` and ``controller`` are options of
    :class:`~tqueue.config.StorageConfig` and :class:`~tqueue.config.ControllerConfig`, as
    for LocalCluster; ``unit_hosts`` the host name each unit reports. With ``clock=True`` the
    servers run on a :class:`ClockLoop`, whose time the test moves on with :meth:`advance`
    (leases, grants, liveness windows, tombstones and trims come due at once); keep each
    step shorter than the sessions' window (``heartbeat_interval`` times 3, 3 s by default)
    unless the test means clients to count as gone, as their heartbeats keep real time."""

    def __init__(
        self,
        num_storage_units: int = 2,
        *,
        unit_hosts: Sequence[str] | None = None,
        storage: Mapping[str, Any] | None = None,
        controller: Mapping[str, Any] | None = None,
        clock: bool = False,
    ) -> None:
        self.num_storage_units = num_storage_units
        self.unit_hosts = list(unit_hosts) if unit_hosts is not None else [""] * num_storage_units
        self.storage = dict(storage or {})
        self.controller_config = ControllerConfig(**(controller or {}))
        self.address = ""
        self.unit_addresses: list[str] = []
        self.loop: asyncio.AbstractEventLoop = ClockLoop() if clock else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tests-loop-cluster", daemon=True)
        self._serving: list[asyncio.Task[None]] = []
        self._servers: list[Any] = []

    def start(self) -> LoopCluster:
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self.close()
            raise
        return self

    async def _start(self) -> None:
        ctl = Controller(self.controller_config)
        self._servers.append(ctl)
        self._serving.append(asyncio.ensure_future(ctl.serve()))
        self.address = ctl.address
        for host in self.unit_hosts:
            unit = StorageUnit(StorageConfig(controller=ctl.address, host=host, **self.storage))
            await unit.start()
            self._servers.append(unit)
            self._serving.append(asyncio.ensure_future(unit.serve()))
            self.unit_addresses.append(unit.address)

    @property
    def controller(self) -> Any:
        """The controller object itself (look at it only through :meth:`call`)."""
        return self._servers[0]

    @property
    def units(self) -> list[Any]:
        return self._servers[1:]

    def advance(self, seconds: float) -> None:
        """Move the servers' clock on by ``seconds`` (a cluster started with ``clock=True``);
        see :meth:`ClockLoop.advance`."""
        if not isinstance(self.loop, ClockLoop):
            raise TypeError("advance() needs a cluster started with clock=True")
        self.loop.advance(seconds)

    def client(self, **kwargs: Any) -> Any:
        """A :class:`tqueue.Client` connected to these servers."""
        from tqueue import Client

        return Client(self.address, **kwargs)

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the servers' loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """Run ``fn`` on the servers' loop, between their requests; its result."""

        async def body() -> T:
            return fn()

        return self.run(body(), timeout)

    def close(self) -> None:
        """Stop the servers (units first) and the loop. Idempotent."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.run(self._stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
        self.loop.close()
        # the servers' objects (sockets, arenas, their cycles) go now, with their finalizers,
        # not at a collection in the middle of some later test
        self._servers.clear()
        self._serving.clear()
        gc.collect()

    async def _stop(self) -> None:
        for server in reversed(self._servers):
            await server.close()
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)

    def __enter__(self) -> LoopCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
