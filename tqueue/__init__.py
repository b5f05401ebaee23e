"""tqueue: the data plane between rollout engines and training ranks in LLM RL.

Producers ``put`` per-sample fields; consumers ``get_meta`` / ``get_data`` the fields they
need for their task and ``ack`` them. A controller owns metadata, storage units own bytes,
clients talk to both over ZeroMQ.

The client names (which need torch) load on first use, so server processes start
without importing torch. Each name carries a stability tier, public or developer
(:mod:`tqueue._api`, docs/api.md). The wire's own struct and version
(``tqueue.wire.BatchMeta``, ``tqueue.wire.PROTOCOL_VERSION``) are not part of the API: a user
reads a meta through :class:`Meta`; ``tqueue.BatchMeta`` and ``tqueue.PROTOCOL_VERSION`` still
work for one release, with a :class:`TQueueDeprecationWarning`.

Map: docs/architecture.md#layers
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._api import TQueueDeprecationWarning, deprecated
from ._meta import Meta
from .config import ClientConfig, ControllerConfig, StorageConfig, Timeouts
from .errors import (
    AuthenticationError,
    ControllerUnavailableError,
    DataCorruptionError,
    DataLostError,
    DiscoveryError,
    EngineError,
    FieldTypeError,
    ForkedClientError,
    InvalidArgumentError,
    PartitionClearedError,
    PartitionSealedError,
    PermissionDeniedError,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    SchemaError,
    StorageFullError,
    StorageUnitUnavailableError,
    TQueueError,
    UnavailableError,
    UnknownFieldError,
    WaitTimeoutError,
)
from .launch import LocalCluster
from .wire import FieldSpec

if TYPE_CHECKING:
    from .client import (
        AsyncClient,
        Batch,
        Client,
        ClientStats,
        DataParallel,
        FieldStats,
        Grouping,
        MicroBatch,
        MicroBatches,
        OverSampling,
    )

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "Batch",
    "Client",
    "ClientConfig",
    "ClientStats",
    "ControllerConfig",
    "ControllerUnavailableError",
    "DataCorruptionError",
    "DataLostError",
    "DataParallel",
    "DiscoveryError",
    "EngineError",
    "FieldSpec",
    "FieldStats",
    "FieldTypeError",
    "ForkedClientError",
    "Grouping",
    "InvalidArgumentError",
    "LocalCluster",
    "Meta",
    "MicroBatch",
    "MicroBatches",
    "OverSampling",
    "PartitionClearedError",
    "PartitionSealedError",
    "PermissionDeniedError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "SchemaError",
    "StorageConfig",
    "StorageFullError",
    "StorageUnitUnavailableError",
    "TQueueDeprecationWarning",
    "TQueueError",
    "Timeouts",
    "UnavailableError",
    "UnknownFieldError",
    "WaitTimeoutError",
]

_LAZY = {"AsyncClient", "Batch", "Client", "ClientStats", "DataParallel", "FieldStats", "Grouping", "MicroBatch", "MicroBatches", "OverSampling"}
# names that left the API, still reached here for one release: where they live now
_MOVED = {"BatchMeta": "tqueue.wire.BatchMeta (a user reads tqueue.Meta)", "PROTOCOL_VERSION": "tqueue.wire.PROTOCOL_VERSION"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(".client", __name__), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        deprecated(f"tqueue.{name}", _MOVED[name], stacklevel=3)
        return getattr(importlib.import_module(".wire", __name__), name)  # not cached: each use warns
    raise AttributeError(f"module 'tqueue' has no attribute {name!r}")
