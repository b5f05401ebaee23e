"""A unit's commits of one loop turn go to the controller as one message, and each store
still learns its own outcome: recorded, refused with its own typed error, or failed because
the controller did not answer. A real controller on a loop thread, a real ZeroMQ connection."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq

from tqueue.config import ControllerConfig
from tqueue.errors import ControllerUnavailableError, InvalidArgumentError
from tqueue.storage._commit_queue import CommitQueue
from tqueue.transport import _zmq

from ..conftest import RawPeer
from ..faults.test_controller_bounds import LoopThread, put, register


@pytest.fixture
def cluster():
    lt = LoopThread(ControllerConfig())
    peer = RawPeer(lt.ctl.address)
    register(peer)  # unit 0, as the controller sees it
    yield lt, peer
    peer.close()
    lt.close()


def kinds(lt: LoopThread) -> dict[str, int]:
    """Requests the controller answered, by message kind."""
    return lt.call(lambda: {k: sum(c) for k, (c, _) in lt.ctl._server.latency.kinds.items()})


async def _queue(address: str) -> tuple[CommitQueue, _zmq.Peer]:
    ctl = _zmq.Peer(address, name="controller", unavailable=ControllerUnavailableError)
    return CommitQueue(lambda: ctl, lambda: (0, 64)), ctl


def test_the_commits_of_one_turn_go_as_one_message_and_each_store_learns_its_own_outcome(cluster):
    lt, peer = cluster
    put(peer, "p", 2)
    put(peer, "p", 3)
    first, last = sorted(lt.ctl.s.grants)

    async def run() -> tuple[list[Any], int, int]:
        queue, ctl = await _queue(lt.ctl.address)
        try:
            outcomes = await asyncio.gather(
                queue.commit(first, ["x"], 16, 16, 10.0),
                queue.commit(424242, ["x"], 8, 16, 10.0),  # no such grant
                queue.commit(last, ["x"], 24, 40, 10.0),
                return_exceptions=True,
            )
            return outcomes, queue.sent, queue.commits
        finally:
            queue.close()
            await ctl.close()

    before = kinds(lt)
    outcomes, sent, commits = lt.run(run())
    assert (sent, commits) == (1, 3)
    assert outcomes[0] is False and outcomes[2] is False  # recorded; the partition has no target, so never sealed
    assert isinstance(outcomes[1], InvalidArgumentError)
    assert "grant 424242 is unknown or already committed" in str(outcomes[1])
    after = kinds(lt)
    assert after.get("Commits", 0) - before.get("Commits", 0) == 1 and after.get("Commit", 0) == before.get("Commit", 0)
    assert lt.call(lambda: (len(lt.ctl.s.grants), lt.ctl.s.partitions["p"].committed)) == (0, 5)


def test_a_lone_commit_goes_as_a_commit_and_a_later_turn_as_another_message(cluster):
    lt, peer = cluster
    put(peer, "p", 1)
    put(peer, "p", 1)
    first, second = sorted(lt.ctl.s.grants)

    async def run() -> tuple[bool, bool, int]:
        queue, ctl = await _queue(lt.ctl.address)
        try:
            a = await queue.commit(first, ["x"], 8, 8, 10.0)
            b = await queue.commit(second, ["x"], 8, 16, 10.0)
            return a, b, queue.sent
        finally:
            queue.close()
            await ctl.close()

    before = kinds(lt)
    assert lt.run(run()) == (False, False, 2)
    after = kinds(lt)
    assert after["Commit"] - before.get("Commit", 0) == 2 and after.get("Commits", 0) == before.get("Commits", 0)


def test_a_controller_that_does_not_answer_fails_every_store_of_the_turn_each_with_its_own_error():
    """A ROUTER that never reads stands for a controller that stopped: each store waits at
    most its limit, and each gets a ControllerUnavailableError of its own."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> list[Any]:
        queue, ctl = await _queue(f"tcp://127.0.0.1:{port}")
        try:
            return await asyncio.gather(
                *(queue.commit(g, ["x"], 8, 8, 0.3) for g in (1, 2, 3)), return_exceptions=True
            )
        finally:
            queue.close()
            await ctl.close()

    try:
        outcomes = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        silent.close()
    assert all(isinstance(o, ControllerUnavailableError) for o in outcomes), outcomes
    assert len({id(o) for o in outcomes}) == 3  # one instance each: tracebacks are not shared
    assert len({id(o.__cause__) for o in outcomes}) == 1


def test_a_store_cancelled_while_its_commit_is_out_leaves_the_others_answered(cluster):
    lt, peer = cluster
    put(peer, "p", 1)
    put(peer, "p", 1)
    first, second = sorted(lt.ctl.s.grants)

    async def run() -> tuple[bool, bool]:
        queue, ctl = await _queue(lt.ctl.address)
        try:
            gone = asyncio.ensure_future(queue.commit(first, ["x"], 8, 8, 10.0))
            kept = asyncio.ensure_future(queue.commit(second, ["x"], 8, 16, 10.0))
            for _ in range(100):  # turns of the loop until the message carrying both has left
                if queue.sent:
                    break
                await asyncio.sleep(0)
            assert (queue.sent, queue.commits) == (1, 2)
            gone.cancel()
            return await kept, gone.cancelled()
        finally:
            queue.close()
            await ctl.close()

    assert lt.run(run()) == (False, True)
    # the message had left: the controller recorded both (the cancelled store's unit rolls its
    # bytes back, as for any store whose caller went away after its commit was sent)
    assert lt.call(lambda: (len(lt.ctl.s.grants), lt.ctl.s.partitions["p"].committed)) == (0, 2)
