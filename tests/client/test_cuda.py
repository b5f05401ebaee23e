"""CUDA tensors put by a rollout worker on a GPU host: copied to host memory once, then the
same paths as CPU tensors. Needs a CUDA device; skipped elsewhere (CI has none)."""

from __future__ import annotations

import pytest
import torch

import tqueue

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cluster():
    with tqueue.LocalCluster(num_storage_units=1) as c:
        yield c


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_cuda_fields_come_back_exact_and_the_device_copy_is_counted(cluster, partition, shm):
    g = torch.Generator(device="cuda").manual_seed(7)
    data = {
        "ids": torch.randint(0, 151_936, (64, 1024), device="cuda", generator=g),
        "mask": torch.ones(64, 1024, dtype=torch.int64, device="cuda"),
        "logp": torch.randn(64, 512, device="cuda", generator=g).to(torch.bfloat16),
        "cols": torch.arange(64 * 300, device="cuda").reshape(300, 64).t(),  # not contiguous
        "jagged": [torch.arange(n, device="cuda") * 3 for n in (0, 5, 4000)] + [torch.zeros(1, device="cuda", dtype=torch.int64)] * 61,
    }
    host = {k: ([t.cpu() for t in v] if isinstance(v, list) else v.cpu()) for k, v in data.items()}
    config = tqueue.ClientConfig(shm=shm, shm_min_bytes=0, request_timeout=30)
    with tqueue.Client(cluster.address, config=config) as c:
        c.put(partition, data)
        dense = sum(host[k].numel() * host[k].element_size() for k in ("ids", "mask", "logp", "cols"))
        assert c.stats.copied_bytes >= dense  # each device tensor crossed to the host once
        batch = c.get_data(partition, list(data), 64, task="t", timeout=30)
        for k in ("ids", "mask", "logp", "cols"):
            assert batch[k].device.type == "cpu" and batch[k].dtype == host[k].dtype, k
            assert torch.equal(batch[k], host[k]), k
        assert all(torch.equal(a, b) for a, b in zip(batch["jagged"], host["jagged"]))
        assert torch.equal(batch["ids"].cuda(non_blocking=True), data["ids"])


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_big_cuda_fields_are_read_only_after_their_copy_to_the_host_ends(cluster, partition, shm):
    """The copies to pinned host memory are queued without waiting; the put must wait for
    them before it reads a byte. A copy of 256 MB takes milliseconds, long enough that
    reading early returns stale or zero bytes."""
    g = torch.Generator(device="cuda").manual_seed(11)
    big = torch.randint(-(1 << 40), 1 << 40, (64, 1 << 19), device="cuda", generator=g)
    also = torch.randn(64, 1 << 18, device="cuda", generator=g)
    config = tqueue.ClientConfig(shm=shm, shm_min_bytes=0, request_timeout=60)
    with tqueue.Client(cluster.address, config=config) as c:
        for round_ in range(2):  # the second put reuses pinned blocks that hold the first's bytes
            part = f"{partition}-{round_}"
            c.put(part, {"big": big, "also": also})
            batch = c.get_data(part, ["big", "also"], 64, task="t", timeout=60)
            assert torch.equal(batch["big"], big.cpu()) and torch.equal(batch["also"], also.cpu())
            big.add_(1)
            also.mul_(2)


def test_pin_memory_assembles_socket_batches_in_pinned_memory(cluster, partition):
    data = {
        "ids": torch.randint(0, 151_936, (256, 4096)),
        "logp": torch.randn(256, 1024),
        "jagged": [torch.arange(n) for n in range(1, 257)],
        "prompt": [f"p{i}" for i in range(256)],
    }
    config = tqueue.ClientConfig(shm=False, pin_memory=True, request_timeout=30)
    with tqueue.Client(cluster.address, config=config) as c:
        c.put(partition, data)
        for task in ("a", "b"):  # the second get reuses pooled pinned buffers
            batch = c.get_data(partition, list(data), 256, task=task, timeout=30)
            for k in ("ids", "logp"):
                assert batch[k].is_pinned(), k
                assert torch.equal(batch[k], data[k]), k
                assert torch.equal(batch[k].to("cuda", non_blocking=True).cpu(), data[k]), k
            assert all(torch.equal(a, b) for a, b in zip(batch["jagged"], data["jagged"]))
            assert list(batch["prompt"]) == data["prompt"]


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_get_data_onto_the_gpu_is_exact_and_copies_only_from_page_locked_memory(cluster, partition, shm):
    """The device route on a real GPU: a CUDA put read back with ``device="cuda"`` lands on the
    device, bit-exact, every copy from pinned or registered host memory (the arena, on shm,
    registration turned on)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    data = {
        "x": torch.randn(64, 1 << 16, device="cuda", generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 151_936, (64, 1024), device="cuda", generator=g),
        "resp": [torch.arange(n, device="cuda") for n in range(1, 65)],
        "tag": [f"s{i}" for i in range(64)],
    }
    config = tqueue.ClientConfig(shm=shm, shm_min_bytes=0, request_timeout=60, device_lock_bytes=1 << 34)
    with tqueue.Client(cluster.address, config=config) as c:
        c.put(partition, data)
        copied = c.stats.copied_bytes
        batch = c.get_data(partition, list(data), 64, task="t", device="cuda", timeout=60)
        for k in ("x", "ids"):
            assert batch[k].is_cuda and torch.equal(batch[k], data[k]), k
        assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(batch["resp"], data["resp"]))
        assert list(batch["tag"]) == data["tag"]
        acc = c._inner._gets._devices.of("cuda")
        assert acc.copied > 0  # a copy from pageable memory would have raised
        if shm:  # the arena was registered: its pages were copied from in place, nothing staged
            dense = sum(data[k].numel() * data[k].element_size() for k in ("x", "ids"))
            assert c.stats.copied_bytes - copied < dense


def test_a_cuda_put_to_a_same_host_unit_crosses_once_into_the_arena_pages(cluster, partition):
    """A dense CUDA field put to a unit on this host is copied by DMA straight into the unit's
    arena (its pages registered with the driver): one crossing, no pinned staging and no host
    copy after it; a jagged CUDA field still goes through pinned memory."""
    g = torch.Generator(device="cuda").manual_seed(13)
    data = {
        "x": torch.randn(64, 1 << 16, device="cuda", generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 151_936, (64, 4096), device="cuda", generator=g)[:, ::2],  # not contiguous
        "resp": [torch.arange(n, device="cuda") for n in range(1, 65)],
    }
    dense = sum(data[k].numel() * data[k].element_size() for k in ("x", "ids"))
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0, request_timeout=60, device_lock_bytes=1 << 34)
    with tqueue.Client(cluster.address, config=config) as c:
        copied = c.stats.copied_bytes
        c.put(partition, data)
        assert dense <= c.stats.copied_bytes - copied < 2 * dense  # dense: the crossing alone
        devices = c._inner._conns.devices
        assert devices.of("cuda") is devices.of(f"cuda:{torch.cuda.current_device()}")  # one per device
        assert devices.of("cuda").registrations > 0
        batch = c.get_data(partition, list(data), 64, task="t", device="cuda", timeout=60)
        for k in ("x", "ids"):
            assert batch[k].is_cuda and torch.equal(batch[k], data[k]), k
        assert all(torch.equal(a, b) for a, b in zip(batch["resp"], data["resp"]))


def test_after_a_unit_punches_its_arena_writes_and_reads_use_its_pages_not_locked_orphans(partition):
    """A unit retaining nothing punches its arena's free pages on every free. Pages the driver
    locked (registered) before are orphaned by the punch: the next write to that offset lands
    in a fresh page. The client registers the arena again under the unit's new epoch, so each
    put's DMA lands in the unit's pages (a read through the host sees it) and each device read
    copies from them (not from the locked orphans)."""
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0, request_timeout=60, device_lock_bytes=1 << 34)
    with tqueue.LocalCluster(num_storage_units=1, storage={"retain_bytes": 0}) as cluster:
        with tqueue.Client(cluster.address, config=config) as c:
            for round_ in range(3):
                part = f"{partition}-{round_}"
                x = torch.full((64, 1 << 16), round_ + 1, dtype=torch.int32, device="cuda")
                c.put(part, {"x": x})
                host = c.get_data(part, ["x"], 64, task="h", timeout=60)["x"]
                assert torch.equal(host, x.cpu()), f"round {round_}: the unit holds {host.flatten()[:4].tolist()}"
                got = c.get_data(part, ["x"], 64, task="t", device="cuda", timeout=60)["x"]
                assert torch.equal(got, x), f"round {round_}: read {got.flatten()[:4].tolist()}"
                c.clear(part)


def test_cuda_leaves_of_nested_values_come_back_on_the_host_exact(cluster, partition):
    """A nested value's CUDA leaf is copied to the host at put (waited for there: its bytes
    go into the value's MessagePack at once), and comes back a host tensor."""
    g = torch.Generator(device="cuda").manual_seed(5)
    pixels = torch.randn(3, 1 << 16, device="cuda", generator=g).to(torch.bfloat16)[:, ::2]  # not contiguous
    values = [{"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 3]], device="cuda")}, None]
    with tqueue.Client(cluster.address, config=tqueue.ClientConfig(request_timeout=30)) as c:
        c.put(partition, {"mm": values})
        got = c.get_data(partition, ["mm"], 2, task="t", timeout=30)["mm"]
    assert got[1] is None
    assert got[0]["pixel_values"].device.type == "cpu" and got[0]["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(got[0]["pixel_values"], pixels.cpu())
    assert got[0]["image_grid_thw"].tolist() == [[1, 2, 3]]
