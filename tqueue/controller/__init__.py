"""The controller process: all metadata, no payload (the floor plan: docs/architecture.md)."""

from ..config import ControllerConfig
from .server._controller import Controller

__all__ = ["Controller", "ControllerConfig"]
