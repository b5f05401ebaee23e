"""Moves and drops that a storage unit refuses: a controller in this process, with a fake
unit peer that refuses, so that the failure is certain and nothing races."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tqueue.client._encode import encode
from tqueue.config import ControllerConfig
from tqueue.controller.server._controller import Controller
from tqueue.errors import RemoteError
from tqueue.wire import (
    PROTOCOL_VERSION,
    Clear,
    Commit,
    Dropped,
    Grant,
    Ok,
    Postpone,
    RegisterUnit,
    StatusRequest,
)


class FakeUnit:
    """A storage unit's peer as the controller sees it: refuses every request until told
    to accept; ``asked`` is set at each request."""

    def __init__(self) -> None:
        self.accept = False
        self.requests: list[Any] = []
        self.asked = asyncio.Event()

    async def request(self, msg: Any, *, timeout: float | None, expect: type) -> tuple[Any, list[Any]]:
        self.requests.append(msg)
        self.asked.set()
        if not self.accept:
            raise RemoteError(f"unit refuses {type(msg).__name__}")
        return (Dropped(unit_bytes=0, partition_bytes=0) if expect is Dropped else Ok()), []

    async def close(self) -> None:
        pass


async def controller_with(unit: FakeUnit) -> Controller:
    ctl = Controller(ControllerConfig())
    ctl._register_unit(b"unit", RegisterUnit(protocol=PROTOCOL_VERSION, address="tcp://127.0.0.1:9", host="h"), [])
    await ctl.s.units.peers[0].close()
    ctl.s.units.peers[0] = unit  # type: ignore[assignment]
    return ctl


def put(ctl: Controller, partition: str, count: int) -> int:
    enc = encode({"x": torch.arange(count)}, partition=partition, chunk_bytes=1 << 20)
    granted = ctl.writes.grant(b"p", Grant(partition=partition, count=count, blocks=enc.grant_blocks(), nbytes=enc.nbytes), [])
    assert granted is not None
    ctl.writes.commit(b"unit", Commit(grant_id=granted.grant_id, unit_id=0, fields=["x"], nbytes=enc.nbytes,
                                partition_bytes=enc.nbytes, unit_bytes=enc.nbytes), [])
    return granted.partition_uid


def partitions(ctl: Controller) -> dict[str, Any]:
    return {p.name: p for p in ctl._status(b"p", StatusRequest(), []).partitions}


def test_a_move_the_unit_refuses_is_not_landed_and_the_caller_is_told():
    async def main():
        unit = FakeUnit()
        ctl = await controller_with(unit)
        try:
            uid = put(ctl, "a", 4)
            asked = Postpone(partition="a", partition_uid=uid, indexes=[1, 2], to="b")
            with pytest.raises(RemoteError, match=r"samples \[1, 2\] of partition 'a' to 'b': unit 0 refused samples \[1, 2\]"):
                await ctl.moves.postpone(b"p", asked, [])
            st = partitions(ctl)
            assert (st["a"].ready, st["a"].excluded, st["a"].reasons) == (4, 0, {})  # they stayed
            assert (st["b"].samples, st["b"].ready) == (0, 0)  # nothing landed
        finally:
            await ctl.close()

    asyncio.run(main())


def test_a_drop_the_unit_refuses_is_reported_and_retried():
    async def main():
        unit = FakeUnit()
        ctl = await controller_with(unit)
        try:
            uid = put(ctl, "a", 4)
            await ctl.cleanup.clear(b"p", Clear(partition="a", partition_uid=uid), [])
            [st] = ctl._status(b"p", StatusRequest(), []).units
            assert st.undropped == 1 and ctl.cleanup.drops.armed(0)  # remembered, a retry is due
            unit.accept = True
            await ctl.cleanup.drops.retry(0)  # what the retry timer runs
            [st] = ctl._status(b"p", StatusRequest(), []).units
            assert st.undropped == 0 and not ctl.cleanup.drops.armed(0)
            assert [(type(m).__name__, m.partition_uid, m.indexes) for m in unit.requests] == [("Drop", uid, None)] * 2
        finally:
            await ctl.close()

    asyncio.run(main())
