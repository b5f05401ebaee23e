"""conftest.py for TransferQueue's own tests when the tier runs them against the shim (copied
next to them at test time; never imported by tqueue's own suite).

* A tqueue cluster is started before anything else and its address exported as
  ``TQUEUE_ADDRESS``, so that ``tq.init()`` attaches to it everywhere, Ray workers included.
* ``ray.init`` is pinned to 127.0.0.1, without a dashboard.
* TransferQueue's tests look into its controller through the Ray actor
  ``TransferQueueController`` (namespace ``transfer_queue``): after ``ray.init`` an actor of
  that name answers ``list_partitions``, ``clear_partition``, ``get_partition_snapshot`` and
  ``get_config`` from tqueue's status and keys. It is the tests' window, not the shim's: the
  shim needs no Ray.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import numpy as np

import tqueue

_cluster: tqueue.LocalCluster | None = None


class ControllerWindow:
    """What TransferQueue's tests read from its controller, answered from tqueue."""

    def __init__(self, address: str) -> None:
        self._client = tqueue.Client(address)

    def list_partitions(self) -> list[str]:
        return [p.name for p in self._client.status().partitions if p.name != "__transfer_queue__"]

    def clear_partition(self, partition_id: str) -> None:
        self._client.clear(partition_id)

    def get_config(self) -> dict[str, Any]:
        return {"controller": {"zmq_info": self._client.address}}

    def get_partition_snapshot(self, partition_id: str) -> Any:
        status = next((p for p in self._client.status().partitions if p.name == partition_id), None)
        if status is None:
            return None
        columns = {name: col for col, name in enumerate(status.fields)}
        keys = self._client.list_keys(partition_id).get(partition_id, {})
        mapping: dict[str, int] = {}
        present: dict[int, list[str]] = {}
        for key in keys:
            found = self._client.lookup_keys(partition_id, [key])
            if found.indexes[0] >= 0 and found.meta is not None:
                mapping[key] = found.indexes[0]
                present[found.indexes[0]] = list(found.meta.fields)
        size = max(present, default=-1) + 1
        production = np.zeros((size, max(len(columns), 1)), dtype=np.int8)
        for index, fields in present.items():
            for name in fields:
                production[index, columns[name]] = 1
        return types.SimpleNamespace(
            keys_mapping=mapping,
            global_indexes=sorted(present),
            custom_meta={mapping[k]: tags for k, tags in keys.items() if k in mapping},
            field_name_mapping=columns,
            production_status=production,
        )


def pytest_configure(config: Any) -> None:
    global _cluster
    _cluster = tqueue.LocalCluster(num_storage_units=2).start()
    os.environ["TQUEUE_ADDRESS"] = _cluster.address
    try:
        import ray
    except ImportError:
        return
    import sys

    from ray import cloudpickle

    # Ray's workers cannot import this conftest: its window class travels by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init = ray.init

    @functools.wraps(init)
    def loopback_init(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_node_ip_address", "127.0.0.1")
        kwargs.setdefault("include_dashboard", False)
        context = init(*args, **kwargs)
        window = ray.remote(ControllerWindow).options(
            name="TransferQueueController", namespace="transfer_queue", get_if_exists=True
        )
        loopback_init.window = window.remote(_cluster.address)  # type: ignore[attr-defined]
        return context

    ray.init = loopback_init


def pytest_unconfigure(config: Any) -> None:
    if _cluster is not None:
        _cluster.close()
