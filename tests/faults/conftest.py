"""One single-unit cluster per module: every put lands on the unit under test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tqueue


@pytest.fixture(scope="module")
def unit_cluster() -> Iterator[tqueue.LocalCluster]:
    with tqueue.LocalCluster(num_storage_units=1) as c:
        yield c


@pytest.fixture(scope="module")
def unit_pid(unit_cluster: tqueue.LocalCluster) -> int:
    return unit_cluster.pids[1]  # the controller starts first


@pytest.fixture
def uclient(unit_cluster: tqueue.LocalCluster) -> Iterator[tqueue.Client]:
    with tqueue.Client(unit_cluster.address) as c:
        yield c


def bulk_address_of(cluster: tqueue.LocalCluster) -> str:
    """The bulk listener of the cluster's first unit, as a client off its host learns it."""
    config = tqueue.ClientConfig(shm=False, host="elsewhere")
    with tqueue.Client(cluster.address, config=config) as c:
        c.connect()
        (info,) = c._inner._conns.units.values()
        assert info.bulk.startswith("127.0.0.1:"), info.bulk
        return str(info.bulk)
