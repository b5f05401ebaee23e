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
