"""The controller process: all metadata, no payload. Its sub-packages (model, planning,
parts, server), what each part owns and the modules a request enters are on the map.

Map: docs/architecture.md#controller-floor-plan
"""

from ..config import ControllerConfig
from .server._controller import Controller

__all__ = ["Controller", "ControllerConfig"]
