"""tqueue: the data plane between rollout engines and training ranks in LLM RL.

Producers ``put`` per-sample fields; consumers ``get_meta`` / ``get_data`` the fields they
need for their task and ``ack`` them. A controller owns metadata, storage units own bytes,
clients talk to both over ZeroMQ.

The client names (which need torch) load on first use, so server processes start
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import ClientConfig, ControllerConfig, StorageConfig
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
from .wire import PROTOCOL_VERSION, BatchMeta, FieldSpec

if TYPE_CHECKING:
    from .client import AsyncClient, Batch, Client, ClientStats, FieldStats, MicroBatch

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "Batch",
    "BatchMeta",
    "Client",
    "ClientConfig",
    "ClientStats",
    "ControllerConfig",
    "ControllerUnavailableError",
    "DataCorruptionError",
    "DataLostError",
    "DiscoveryError",
    "EngineError",
    "FieldSpec",
    "FieldStats",
    "FieldTypeError",
    "ForkedClientError",
    "InvalidArgumentError",
    "LocalCluster",
    "MicroBatch",
    "PROTOCOL_VERSION",
    "PartitionClearedError",
    "PermissionDeniedError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "SchemaError",
    "StorageConfig",
    "StorageFullError",
    "StorageUnitUnavailableError",
    "TQueueError",
    "UnavailableError",
    "UnknownFieldError",
    "WaitTimeoutError",
]

_LAZY = {"AsyncClient", "Batch", "Client", "ClientStats", "FieldStats", "MicroBatch"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(".client", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tqueue' has no attribute {name!r}")
