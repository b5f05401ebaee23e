"""Payload routes: a client runs over a route of the test's own (no unit sees the payload),
and the real routes are picked once per unit and carry each put and fetch once."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import tqueue
from tqueue.client._assemble import Part
from tqueue.client._routes import ArenaRoute, BatchBuffers, BulkRoute, InlineRoute, Outgoing, Route, Sent
from tqueue.wire import BatchMeta, Store, Stored, UnitInfo


class MemoryRoute(Route):
    """Keeps each put's encoded fields in memory and serves them back: a unit's part without
    a unit. Serves whole puts, in the order they were written."""

    def __init__(self, info: UnitInfo) -> None:
        super().__init__(info)
        self.puts: dict[tuple[int, ...], dict[str, tuple[Any, list[bytearray]]]] = {}
        self.calls: collections.Counter[str] = collections.Counter()

    async def store(self, put: Outgoing, msg: Store) -> Sent:
        self.calls["store"] += 1
        enc, at = put.wide, 0
        blocks = {}
        for block in enc.blocks:
            frames = [bytearray(memoryview(b)) for b in enc.buffers[at : at + len(block.counts)]]
            at += len(block.counts)
            blocks[block.name] = (block, frames)
        indexes = tuple(msg.indexes) if msg.indexes is not None else tuple(range(msg.start, msg.start + msg.count))
        self.puts[indexes] = blocks
        return Sent(Stored(nbytes=enc.nbytes), wire=0, copied=enc.copied)

    async def fetch(
        self, meta: BatchMeta, positions: np.ndarray, indexes: list[int], fields: list[str], rows: BatchBuffers
    ) -> Part:
        self.calls["fetch"] += 1
        blocks = self.puts[tuple(indexes)]
        return Part(positions=positions, blocks={f: blocks[f] for f in fields}, wire=0)


def test_a_route_of_the_tests_own_carries_put_and_get_data_and_no_unit_sees_the_payload(cluster, partition):
    """The controller grants as always; the payload goes to memory and comes back exact."""
    routes: dict[int, MemoryRoute] = {}

    def memory(info: UnitInfo) -> Route:
        routes[info.unit_id] = MemoryRoute(info)
        return routes[info.unit_id]

    data = {
        "ids": torch.arange(24, dtype=torch.int64).reshape(4, 6),
        "logp": torch.randn(4, 3, dtype=torch.bfloat16),
        "resp": [torch.arange(n, dtype=torch.int32) for n in (1, 5, 0, 3)],
        "meta": [{"k": i} for i in range(4)],
    }

    async def main() -> None:
        async with tqueue.AsyncClient(cluster.address) as client:
            client._conns.choose = memory
            meta = await client.put(partition, data)
            batch = await client.get_data(meta)
            some = await client.get_data(meta, fields=["resp"], jagged="padded")
            assert torch.equal(batch["ids"], data["ids"]) and torch.equal(batch["logp"], data["logp"])
            assert [r.tolist() for r in batch["resp"]] == [r.tolist() for r in data["resp"]]
            assert batch["meta"] == data["meta"]
            assert some["resp"].shape == (4, 5) and some.lengths("resp").tolist() == [1, 5, 0, 3]
            assert not client._conns.unit_peers  # no unit was even connected to
            (route,) = routes.values()
            assert route.calls == {"store": 1, "fetch": 2}
            assert client.stats.puts == 1 and client.stats.gets == 2

    asyncio.run(main())


CONFIGS = {
    "inline": (tqueue.ClientConfig(shm=False, bulk=False), InlineRoute),
    "bulk": (tqueue.ClientConfig(shm=False, bulk_lanes=1, bulk_put_min_bytes=1), BulkRoute),
    "arena": (tqueue.ClientConfig(shm=True, shm_min_bytes=0), ArenaRoute),
}


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_each_unit_gets_its_route_once_and_each_call_passes_through_it_once(cluster, partition, name, monkeypatch):
    config, kind = CONFIGS[name]
    calls: collections.Counter[str] = collections.Counter()
    for method in ("store", "fetch"):
        real = getattr(kind, method)

        def spy(self: Any, *args: Any, _real: Any = real, _name: str = method) -> Any:
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(kind, method, spy)
    data = {"x": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024), "s": [str(i) for i in range(64)]}

    async def main() -> None:
        async with tqueue.AsyncClient(cluster.address, config=config) as client:
            picks: collections.Counter[int] = collections.Counter()
            pick = client._conns.choose

            def counted(info: UnitInfo) -> Route:
                picks[info.unit_id] += 1
                return pick(info)

            client._conns.choose = counted
            metas = [await client.put(partition, data) for _ in range(3)]
            for meta in metas:
                batch = await client.get_data(meta)
                assert torch.equal(batch["x"], data["x"]) and batch["s"] == data["s"]
            units = {u for m in metas for u in m.units}
            assert dict(picks) == {u: 1 for u in units}
            assert all(type(client._conns.routes[u]) is kind for u in units)
            assert calls == {"store": 3, "fetch": 3}

    asyncio.run(main())


def test_a_bulk_route_whose_listener_cannot_be_reached_says_so_once_and_carries_all_inline(cluster, partition, caplog):
    """The route keeps its unit's streams itself; where none can be opened (nothing listens
    at the unit's bulk address) it warns once and every later put and fetch goes inline, exact."""
    config = tqueue.ClientConfig(shm=False, bulk_lanes=1, bulk_put_min_bytes=1)
    data = {"x": torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024), "s": [str(i) for i in range(8)]}

    async def main() -> None:
        async with tqueue.AsyncClient(cluster.address, config=config) as client:
            conns = client._conns
            pick = conns.choose
            conns.choose = lambda info: pick(msgspec.structs.replace(info, bulk="127.0.0.1:1"))  # nothing listens
            with caplog.at_level(logging.WARNING, logger="tqueue.client._routes.bulk"):
                metas = [await client.put(partition, data) for _ in range(3)]
                for meta in metas:
                    batch = await client.get_data(meta)
                    assert torch.equal(batch["x"], data["x"]) and batch["s"] == data["s"]
            units = {u for m in metas for u in m.units}
            for u in units:
                route = conns.routes[u]
                assert isinstance(route, BulkRoute) and route.unreachable and route.idle == []
            warned = [r for r in caplog.records if "goes over ZeroMQ instead" in r.getMessage()]
            assert len(warned) == len(units)

    asyncio.run(main())
