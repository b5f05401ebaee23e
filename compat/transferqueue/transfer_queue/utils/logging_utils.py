"""``get_logger(name, default_level="WARNING")``, as TransferQueue's recipes call it."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s - %(levelname)s - %(name)s - %(message)s"


def get_logger(name: str | None, default_level: str = "WARNING") -> logging.Logger:
    """The logger ``name``, at the level ``TQ_LOGGING_LEVEL`` names (else ``default_level``),
    writing to stderr where nothing else handles it: the caller's own logger, set up as
    TransferQueue sets up the loggers it hands out (a Ray actor has no logging set up)."""
    logger = logging.getLogger(name)
    logger.setLevel(os.environ.get("TQ_LOGGING_LEVEL", default_level))
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    return logger
