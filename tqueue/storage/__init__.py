"""Storage units: processes that hold payload bytes, columnar, as they arrived.

Settings in docs/api.md, "Configuration".

Map: docs/architecture.md#the-storage-unit
"""

from ..config import StorageConfig
from ._server import StorageUnit

__all__ = ["StorageConfig", "StorageUnit"]
