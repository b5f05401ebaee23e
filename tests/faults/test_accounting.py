"""A unit's accounted bytes (its budget, ``status()`` unit bytes) match what it holds
resident, for small puts and big ones alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tqueue

from ._proc import rss


@pytest.fixture
def fresh() -> Iterator[tuple[tqueue.LocalCluster, tqueue.Client]]:
    """A unit of its own: memory freed by other tests would hide growth."""
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        with tqueue.Client(cluster.address, config=tqueue.ClientConfig(shm=False)) as c:
            yield cluster, c


def unit_bytes(client: tqueue.Client) -> int:
    (unit,) = client.status().units
    return unit.nbytes


@pytest.mark.parametrize(
    "puts, size", [pytest.param(10_000, 64, id="10000x64B", marks=pytest.mark.slow), pytest.param(4, 16 << 20, id="4x16MiB")]
)
def test_accounted_bytes_match_resident_growth(fresh, partition, puts, size):
    cluster, client = fresh
    pid = cluster.pids[1]
    x = torch.full((1, size), 7, dtype=torch.uint8)
    client.put("warm-up", {"x": x})  # the unit's first partition, its first buffers
    rss0, acc0 = rss(pid), unit_bytes(client)
    for _ in range(puts):
        client.put(partition, {"x": x})
    grew, accounted = rss(pid) - rss0, unit_bytes(client) - acc0
    print(f"{puts} puts of {size} B: resident +{grew / puts:.0f} B/put, accounted +{accounted / puts:.0f} B/put")
    # before: a 64-byte put held ~10 KB (a ZeroMQ batch buffer) and was accounted 64 B. The
    # same code grows the unit by 1380-1410 or by 1550 B a small put, steadily one or the
    # other from run to run on one machine (whether the puts land in memory the unit's start
    # freed depends on the allocator's history), against 1337 accounted: within a fifth
    assert abs(grew - accounted) <= 0.2 * grew, (grew, accounted)
    got = client.get_data(client.get_meta(partition, ["x"], puts, task="t", timeout=60))["x"]
    assert got.shape == (puts, size) and bool((got == 7).all())
