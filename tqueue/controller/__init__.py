"""The controller process: all metadata, no payload. Its sub-packages (model, planning,
parts, server) and what lives where:
docs/architecture.md, "Controller floor plan", "The controller inside"."""

from ..config import ControllerConfig
from .server._controller import Controller

__all__ = ["Controller", "ControllerConfig"]
