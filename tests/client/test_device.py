"""The device route (tqueue/client/_routes/device.py), run on CPU: ``get_data(device="cpu")``
takes the same code as a CUDA or NPU read, so its logic is tested here with real units on
every payload route: exact bytes, only page-locked sources, chunks, the bounce buffers'
turns, a registered arena and a refused registration. The CUDA copies themselves are tested
in tests/client/test_cuda.py, on a host with a GPU."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
import torch

import tqueue
from tqueue.client._routes import device as device_route
from tqueue.client._routes.device import Accelerator, Delivery
from tqueue.errors import InvalidArgumentError

from ..servers import LoopCluster

ROUTES = {
    "inline": tqueue.ClientConfig(shm=False, bulk=False),
    "bulk": tqueue.ClientConfig(shm=False, bulk_lanes=2, bulk_lane_min_bytes=1 << 16, bulk_put_min_bytes=1),
    "arena": tqueue.ClientConfig(shm=True, shm_min_bytes=0, device_lock_bytes=1 << 34),  # registration on
}


def batch_data(n: int = 32, seed: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 151_936, (n, 2048), generator=g),
        "logp": torch.randn(n, 512, generator=g).to(torch.bfloat16),
        "resp": [torch.randint(0, 1000, (int(k),), generator=g, dtype=torch.int32) for k in torch.randint(1, 700, (n,), generator=g)],
        "prompt": [f"p{i}" for i in range(n)],
    }


def acc_of(client: tqueue.Client) -> Accelerator:
    return client._inner._gets._devices.of("cpu")


def same(batch: Any, data: dict[str, Any]) -> None:
    for k in ("ids", "logp"):
        assert batch[k].dtype == data[k].dtype and torch.equal(batch[k], data[k]), k
    assert len(batch["resp"]) == len(data["resp"])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(batch["resp"], data["resp"]))
    assert list(batch["prompt"]) == data["prompt"]


@pytest.mark.parametrize("route", list(ROUTES), ids=list(ROUTES))
def test_a_device_read_is_exact_on_every_route_and_copies_only_from_locked_memory(cluster, partition, route):
    data = batch_data()
    config = ROUTES[route]
    with tqueue.Client(cluster.address, config=config) as c:
        c.put(partition, data)
        host = c.get_data(partition, list(data), 32, task="host", timeout=10)
        moved = c.get_data(partition, list(data), 32, task="dev", device="cpu", timeout=10)
        same(host, data)
        same(moved, data)
        acc = acc_of(c)
        assert acc.copied > 0  # a copy from pageable memory would have raised
        # ids (int64 values under 2**31) cross narrowed to int32 where the wire packed them,
        # and are widened on the device
        least = data["ids"].numel() * 4 + data["logp"].numel() * 2
        assert acc.copied >= least and c.stats.device_bytes >= least
        # the batch owns its memory: none of it is a view of the pool's or the arena's
        for k in ("ids", "logp"):
            assert not acc.locked(moved[k].view(torch.uint8).reshape(-1).numpy()), k


@pytest.mark.parametrize("mode", ["padded", "nested"])
def test_padded_and_nested_fields_land_whole(cluster, partition, mode):
    data = batch_data(16, seed=4)
    with tqueue.Client(cluster.address, config=ROUTES["bulk"]) as c:
        c.put(partition, data)
        host = c.get_data(partition, ["resp"], 16, task="host", jagged=mode, pad_value=-1, timeout=10)
        moved = c.get_data(partition, ["resp"], 16, task="dev", jagged=mode, pad_value=-1, device="cpu", timeout=10)
        if mode == "nested":
            assert moved["resp"].is_nested
            assert torch.equal(moved["resp"].values(), host["resp"].values())
            assert torch.equal(moved["resp"].offsets(), host["resp"].offsets())
        else:
            assert torch.equal(moved["resp"], host["resp"])
            assert torch.equal(moved.lengths("resp"), host.lengths("resp"))


def test_arena_pages_are_registered_block_by_block_as_reads_touch_them(cluster, partition, monkeypatch):
    """The read's arena views are copied from in place, nothing staged; only the blocks they
    lie in are registered (not the arena's whole mapping), each once, for the client's life."""
    registered: list[tuple[int, int]] = []
    real = Accelerator.register_range
    monkeypatch.setattr(
        Accelerator, "register_range", lambda self, arena, at, n: registered.append((at, n)) or real(self, arena, at, n)
    )
    data = batch_data()
    with tqueue.Client(cluster.address, config=ROUTES["arena"]) as c:
        c.put(partition, data)
        acc, copied = acc_of(c), c.stats.copied_bytes
        for task in ("a", "b"):
            batch = c.get_data(partition, ["ids"], 32, task=task, device="cpu", timeout=10)
            assert torch.equal(batch["ids"], data["ids"])
        [arena] = {id(r.arena): r.arena for r in c._inner._conns.routes.values()}.values()
        assert c.stats.copied_bytes == copied  # read in place from the arena: nothing staged
        assert c.stats.device_bytes == 2 * data["ids"].numel() * 8
        assert 1 <= len(registered) == len(set(registered)) <= 2  # the blocks of one read, once
        assert acc.locked_bytes == sum(n for _, n in registered) <= 2 * device_route.LOCK_BLOCK < arena.size
        base = arena.array.ctypes.data
        assert all((at - base) % device_route.LOCK_BLOCK == 0 for at, _ in registered)


def test_a_refused_registration_is_said_once_and_reads_go_through_bounce_buffers(cluster, partition, monkeypatch, caplog):
    monkeypatch.setattr(device_route, "_said", set())
    monkeypatch.setattr(Accelerator, "register_range", lambda self, arena, at, n: "registration refused by this test")
    data = batch_data()
    dense = data["ids"].numel() * 8
    with tqueue.Client(cluster.address, config=ROUTES["arena"]) as c:
        c.put(partition, data)
        copied = c.stats.copied_bytes
        with caplog.at_level(logging.WARNING, logger=device_route.__name__):
            for task in ("a", "b"):
                batch = c.get_data(partition, ["ids"], 32, task=task, device="cpu", timeout=10)
                assert torch.equal(batch["ids"], data["ids"])
        said = [r for r in caplog.records if "registration refused by this test" in r.getMessage()]
        assert len(said) == 1 and "page-locked buffers" in said[0].getMessage()
        assert c.stats.copied_bytes - copied >= 2 * dense  # staged: the arena's pages were not locked
        assert acc_of(c).copied > 0 and acc_of(c).locked_bytes == 0


@pytest.mark.parametrize("budget", [0, 1 << 20], ids=["off", "too-small"])
def test_the_lock_budget_bounds_what_is_registered(cluster, partition, monkeypatch, caplog, budget):
    """``device_lock_bytes=0`` registers nothing; a budget smaller than a block registers
    nothing either and says so once; reads stay exact through the bounce buffers."""
    monkeypatch.setattr(device_route, "_said", set())
    asked: list[Any] = []
    monkeypatch.setattr(Accelerator, "register_range", lambda self, arena, at, n: asked.append(n) or "")
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0, device_lock_bytes=budget)
    x = torch.arange(1 << 16).reshape(1, -1)
    with tqueue.Client(cluster.address, config=config) as c:
        c.put(partition, {"x": x})
        with caplog.at_level(logging.WARNING, logger=device_route.__name__):
            for task in ("a", "b"):
                assert torch.equal(c.get_data(partition, ["x"], 1, task=task, device="cpu", timeout=10)["x"], x)
    assert asked == []
    said = [r for r in caplog.records if "device_lock_bytes" in r.getMessage()]
    assert len(said) == (1 if budget else 0)


class Recorder(Accelerator):
    """The cpu accelerator, recording the order of copies, fences and waits."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), 1 << 20)
        self.log: list[tuple[str, int]] = []
        self._fences = 0

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        self.log.append(("copy", src.nbytes))
        super().copy(dst, src)

    def fence(self) -> Any:
        self._fences += 1
        self.log.append(("fence", self._fences))
        return self._fences

    def wait(self, fence: Any) -> None:
        self.log.append(("wait", fence or 0))


def test_pageable_bytes_go_through_two_bounce_buffers_that_take_turns():
    """Each buffer is refilled only after the copy that last drained it is waited for, so the
    host fills one while the device drains the other; every chunk at most the chunk size."""
    acc = Recorder()
    chunk = 1 << 16
    src = np.random.default_rng(0).integers(0, 255, 5 * chunk + 123, dtype=np.uint8)  # pageable
    dst = acc.empty(src.nbytes)
    d = Delivery(acc, chunk)
    d.write(dst, 0, src)
    d.finish()
    assert np.array_equal(dst.numpy(), src)
    copies = [n for kind, n in acc.log if kind == "copy"]
    assert copies == [chunk] * 5 + [123]
    waits = [n for kind, n in acc.log if kind == "wait"]
    assert waits == [0, 0, 1, 2, 3, 4]  # buffer k's turn waits for the copy two before it
    assert d.bounced == src.nbytes and d.direct == 0


def test_small_samples_are_packed_into_one_copy_and_big_locked_ones_copied_in_place():
    acc = Recorder()
    d = Delivery(acc, 1 << 20)
    small = [np.full(100 + i, i, dtype=np.uint8) for i in range(200)]
    big = acc.locked_alloc(3 << 20)
    big[:] = 7
    total = sum(s.nbytes for s in small)
    dst = acc.empty(total + big.nbytes)
    at = 0
    for s in small:
        d.write(dst, at, s)
        at += s.nbytes
    d.write(dst, at, big)
    d.finish()
    copies = [n for kind, n in acc.log if kind == "copy"]
    assert copies == [total, 1 << 20, 1 << 20, 1 << 20]  # the samples in one, the big one in chunks
    assert d.direct == big.nbytes and d.bounced == total
    assert np.array_equal(dst.numpy()[:total], np.concatenate(small)) and (dst.numpy()[total:] == 7).all()


def test_a_copy_from_pageable_memory_is_refused():
    acc = Accelerator(torch.device("cpu"), 0)
    with pytest.raises(AssertionError, match="pageable"):
        acc.copy(acc.empty(8), np.zeros(8, dtype=np.uint8))


@pytest.mark.parametrize(
    "device, match",
    [("tpu", r"device='tpu'.*cuda, npu or cpu"), ("cuda:0", r"torch sees no CUDA device")],
    ids=["unknown", "no-cuda"],
)
def test_a_device_that_cannot_be_had_is_a_clear_error(cluster, partition, device, match):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with tqueue.Client(cluster.address) as c:
        c.put(partition, {"x": torch.arange(4).reshape(1, 4)})
        with pytest.raises((InvalidArgumentError, RuntimeError), match=match):
            c.get_data(partition, ["x"], 1, task="t", device=device, timeout=10)
        assert torch.equal(c.get_data(partition, ["x"], 1, task="t", timeout=10)["x"], torch.tensor([[0, 1, 2, 3]]))


@pytest.fixture
def empty_pair() -> Any:
    """Two empty units: two equal puts are placed one on each (the least loaded unit)."""
    with LoopCluster(num_storage_units=2) as c:
        yield c


def two_unit_meta(c: tqueue.Client, partition: str) -> tuple[Any, dict[str, Any]]:
    """64 samples over both units of the cluster, read back as one meta."""
    a, b = batch_data(32, seed=7), batch_data(32, seed=8)
    c.put(partition, a)
    c.put(partition, b)
    meta = c.get_meta(partition, ["ids", "logp"], 64, task="meta", timeout=10)
    assert len(set(meta.units)) == 2
    return meta, {k: torch.cat([a[k], b[k]]) for k in ("ids", "logp")}


@pytest.mark.parametrize("route", ["arena", "inline"])
def test_scattered_rows_of_two_units_and_pad_rows_are_assembled_on_the_device(empty_pair, partition, route):
    """Rows of two units interleaved in the batch (a reordered meta) and a pad row: dense
    fields are placed on the device, each frame copied once, from locked memory only."""
    import msgspec

    with tqueue.Client(empty_pair.address, config=ROUTES[route]) as c:
        meta, want = two_unit_meta(c, partition)
        order = np.random.default_rng(1).permutation(64).tolist()
        mixed = msgspec.structs.replace(
            meta, indexes=[meta.indexes[i] for i in order] + [-1], units=[meta.units[i] for i in order] + [-1]
        )
        batch = c.get_data(mixed, device="cpu")
        for k in ("ids", "logp"):
            assert torch.equal(batch[k][:64], want[k][order]), k
            assert not batch[k][64].any(), k  # the pad row
        assert acc_of(c).copied > 0  # a copy from pageable memory would have raised


def test_each_units_part_is_copied_to_the_device_while_the_others_are_still_arriving(empty_pair, partition):
    """The second unit's fetch does not end until the first unit's rows were queued for the
    device: a read that copied only after every part had arrived would never finish."""
    import asyncio

    from tqueue.client._routes import device as dev

    async def main() -> None:
        async with tqueue.AsyncClient(empty_pair.address, config=ROUTES["inline"]) as c:
            a, b = batch_data(16, seed=9), batch_data(16, seed=10)
            await c.put(partition, a)
            await c.put(partition, b)
            meta = await c.get_meta(partition, ["ids"], 32, task="t", timeout=10)
            assert len(set(meta.units)) == 2
            first_queued = asyncio.Event()
            real_add = dev.DenseOnDevice.add

            def add(self: Any, part: Any) -> None:
                real_add(self, part)
                first_queued.set()

            slow_unit = meta.units[-1]
            route = await c._conns.route(slow_unit)
            real_fetch = route.fetch

            async def fetch(*args: Any) -> Any:
                part = await real_fetch(*args)
                await asyncio.wait_for(first_queued.wait(), 10)  # the other unit's rows are on their way
                return part

            route.fetch = fetch  # type: ignore[method-assign]
            dev.DenseOnDevice.add = add  # type: ignore[method-assign]
            try:
                batch = await c.get_data(meta, device="cpu")
            finally:
                dev.DenseOnDevice.add = real_add  # type: ignore[method-assign]
            assert torch.equal(batch["ids"], torch.cat([a["ids"], b["ids"]]))

    asyncio.run(main())


def test_a_unit_failing_mid_read_waits_for_the_copies_already_queued(empty_pair, partition, monkeypatch):
    """One unit's rows are queued for the device, then the other unit fails: the read raises
    the unit's typed error only after every queued copy is done (the page-locked host buffers
    go back to the pool then), and the client reads again afterwards."""
    import asyncio

    from tqueue.client._routes import device as dev
    from tqueue.errors import StorageUnitUnavailableError

    events: list[str] = []
    real_sync = Accelerator.synchronize
    monkeypatch.setattr(Accelerator, "synchronize", lambda self: events.append("synchronized") or real_sync(self))

    async def main() -> None:
        async with tqueue.AsyncClient(empty_pair.address, config=ROUTES["inline"]) as c:
            a, b = batch_data(16, seed=11), batch_data(16, seed=12)
            await c.put(partition, a)
            await c.put(partition, b)
            meta = await c.get_meta(partition, ["ids"], 32, task="t", timeout=10)
            assert len(set(meta.units)) == 2
            first_queued = asyncio.Event()
            real_add = dev.DenseOnDevice.add

            def add(self: Any, part: Any) -> None:
                real_add(self, part)
                events.append("queued")
                first_queued.set()

            failing = await c._conns.route(meta.units[-1])
            real_fetch = failing.fetch

            async def fetch(*args: Any) -> Any:
                await asyncio.wait_for(first_queued.wait(), 10)
                raise StorageUnitUnavailableError("unit failed by this test")

            monkeypatch.setattr(dev.DenseOnDevice, "add", add)
            failing.fetch = fetch  # type: ignore[method-assign]
            with pytest.raises(StorageUnitUnavailableError, match="failed by this test"):
                await c.get_data(meta, device="cpu")
            assert events == ["queued", "synchronized"]
            failing.fetch = real_fetch  # type: ignore[method-assign]
            batch = await c.get_data(meta, device="cpu")
            assert torch.equal(batch["ids"], torch.cat([a["ids"], b["ids"]]))

    asyncio.run(main())


def test_a_punched_arena_is_registered_again_before_it_is_read(partition, monkeypatch):
    """A unit that hands its arena's free pages back to the OS (here on every free:
    ``retain_bytes=0``) moves its arena's epoch on. A page the driver locked before is no
    longer the arena's (the next write there faults in a fresh one), so the client
    unregisters every block of that arena, after its queued copies, and registers them again
    as the next read touches them; that read sees the new bytes, not the orphaned pages."""
    registered: list[int] = []
    unregistered: list[int] = []
    real = Accelerator.register_range
    monkeypatch.setattr(
        Accelerator, "register_range", lambda self, arena, at, n: registered.append(at) or real(self, arena, at, n)
    )
    monkeypatch.setattr(Accelerator, "unregister_range", lambda self, arena, at: unregistered.append(at))
    first, second = batch_data(seed=5), batch_data(seed=6)
    # no lease: a kept range is never punched, and the second put would go into it unasked
    config = dataclasses.replace(ROUTES["arena"], arena_lease_bytes=0)
    with LoopCluster(num_storage_units=1, storage={"retain_bytes": 0}) as cluster:
        with tqueue.Client(cluster.address, config=config) as c:
            c.put(partition, first)
            assert torch.equal(c.get_data(partition, ["ids"], 32, task="t", device="cpu", timeout=10)["ids"], first["ids"])
            before = sorted(registered)
            acc = acc_of(c)
            assert before and acc.locked_bytes > 0 and not unregistered
            c.clear(partition)  # its range is freed and, retaining nothing, punched
            c.put(f"{partition}-2", second)  # the reply to its allocation carries the new epoch
            assert sorted(unregistered) == before and acc.locked_bytes == 0
            got = c.get_data(f"{partition}-2", ["ids"], 32, task="t", device="cpu", timeout=10)["ids"]
            assert torch.equal(got, second["ids"])
            assert sorted(registered[len(before):]) == before  # the same blocks, registered again
            [arena] = {id(r.arena): r.arena for r in c._inner._conns.routes.values()}.values()
            assert arena.epoch >= 1


@pytest.mark.parametrize("budget_blocks", [0, 2, 8], ids=["refused", "budget-2", "room"])
def test_a_device_write_into_an_arena_goes_by_dma_where_blocks_lock_and_through_host_memory_elsewhere(
    monkeypatch, budget_blocks
):
    """The one-copy put of a CUDA field (tqueue/client/_routes/arena.py) calls
    ``DeviceRoutes.to_arena``: each piece of the range that lies in one registration block is
    copied straight into the arena's pages where that block can be registered, and through a
    page-locked buffer and a host copy where it cannot (budget spent, or refused: said once)."""
    from tqueue.client._routes.device import DeviceRoutes
    from tqueue.transport._arena import Arena, ArenaMap

    block = 1 << 20
    monkeypatch.setattr(device_route, "LOCK_BLOCK", block)
    monkeypatch.setattr(device_route, "_said", set())
    if budget_blocks == 0:
        monkeypatch.setattr(Accelerator, "register_range", lambda self, arena, at, n: "refused by this test")
    unit = Arena(16 * block)
    try:
        arena = ArenaMap(unit.path)
        devices = DeviceRoutes(1 << 20, 1 << 20, max(1, budget_blocks) * block)
        src = torch.randint(0, 256, (3 * block + 1000,), dtype=torch.uint8)
        offset = block - 4096  # the pieces: 4096 bytes in block 0, then blocks 1 and 2, 5096 in block 3
        acc, staged = devices.to_arena(arena, offset, src)
        acc.synchronize()
        assert np.array_equal(arena.array[offset : offset + src.numel()], src.numpy())
        assert acc.copied == 0  # nothing went host to device
        expected = {0: src.numel(), 2: src.numel() - 4096 - block, 8: 0}[budget_blocks]
        assert staged == expected and acc.locked_bytes == min(budget_blocks, 4) * block
    finally:
        unit.close()
