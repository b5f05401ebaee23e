"""Storage units: processes that hold payload bytes, columnar, as they arrived."""

from ..config import StorageConfig
from ._server import StorageUnit

__all__ = ["StorageConfig", "StorageUnit"]
