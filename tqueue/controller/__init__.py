"""The controller process: all metadata, no payload."""

from ..config import ControllerConfig
from ._server import Controller

__all__ = ["Controller", "ControllerConfig"]
