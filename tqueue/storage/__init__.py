"""Storage units: processes that hold payload bytes, columnar, as they arrived.

Described in docs/architecture.md, "The storage unit inside" and "Memory"; settings in docs/api.md, "Configuration".
"""

from ..config import StorageConfig
from ._server import StorageUnit

__all__ = ["StorageConfig", "StorageUnit"]
