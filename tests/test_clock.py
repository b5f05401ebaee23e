"""The tests' controllable clock (tests/servers.py): a LoopCluster started with ``clock=True``
serves on a loop whose time the test moves on; what is scheduled on it comes due at
``advance``, not before, and the servers' own timers (a lease's expiry) follow it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tqueue.errors import WaitTimeoutError

from .servers import ClockLoop, LoopCluster


@pytest.fixture
def loop():
    loop = ClockLoop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_timer_fires_on_advance_not_before(loop):
    fired = threading.Event()
    loop.call_soon_threadsafe(lambda: loop.call_later(3600, fired.set))
    loop.advance(0)  # the timer is scheduled by now
    assert not fired.wait(0.2)  # an hour of loop time is not 0.2 s of real time
    loop.advance(3599)
    assert not fired.is_set()  # a second short of it
    loop.advance(1)
    assert fired.is_set()  # due, and run before advance returned


def test_a_sleep_and_a_wait_for_deadline_come_due_on_advance(loop):
    async def sleeper() -> float:
        started = loop.time()
        await asyncio.sleep(600)
        return loop.time() - started

    async def waiter() -> str:
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 600)
        except asyncio.TimeoutError:
            return "timed out"
        return "set"

    slept = asyncio.run_coroutine_threadsafe(sleeper(), loop)
    waited = asyncio.run_coroutine_threadsafe(waiter(), loop)
    loop.advance(0)
    assert not slept.done() and not waited.done()
    before = loop.time()
    loop.advance(600)
    assert loop.time() - before >= 600
    assert slept.result(10) >= 600 and waited.result(10) == "timed out"


def test_the_clock_does_not_go_back_and_is_advanced_from_another_thread(loop):
    with pytest.raises(ValueError, match="does not go back"):
        loop.advance(-1)

    async def inside() -> None:
        loop.advance(1)

    with pytest.raises(RuntimeError, match="another thread"):
        asyncio.run_coroutine_threadsafe(inside(), loop).result(10)


def test_a_lease_expires_when_the_servers_clock_passes_it_and_not_before(partition):
    """The controller's own timers follow the clock: a lease of 30 s is held after 29 s of
    it and served again at 30 (the sessions' window is long, so no client counts as gone)."""
    with LoopCluster(1, clock=True, controller={"heartbeat_interval": 60}) as c, c.client() as client:
        client.put(partition, {"x": torch.arange(2)})
        first = client.get_meta(partition, ["x"], 2, task="t", timeout=10, lease_timeout=30)
        c.advance(29)
        with pytest.raises(WaitTimeoutError, match="0 ready for this task"):
            client.get_meta(partition, ["x"], 2, task="t", timeout=0)
        c.advance(1)
        again = client.get_meta(partition, ["x"], 2, task="t", timeout=10)  # a wait, answered at the expiry
        assert again.indexes == first.indexes and again.lease != first.lease
        st = {p.name: p for p in client.status().partitions}[partition].tasks["t"]
        assert (st.expired, st.leased) == (2, 2)
    plain = LoopCluster(1)
    try:
        with pytest.raises(TypeError, match="clock=True"):
            plain.advance(1)
    finally:
        plain.close()
