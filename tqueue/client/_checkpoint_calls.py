"""Checkpoint and restore, as a client asks for them (the work is the controller's and the
units': see ``tqueue/controller/parts/_checkpoints.py``)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..errors import InvalidArgumentError
from ..wire import Checkpoint, CheckpointReply, Restore, Restored
from ._connections import Connections


def _directory(directory: str | os.PathLike[str]) -> str:
    """The directory as given: servers with a checkpoint root take it as a name under the
    root; others take a relative one from this client's working directory (``base``), never
    from their own."""
    try:
        path = os.fspath(directory)
    except TypeError:
        raise InvalidArgumentError(f"a checkpoint directory is a path, got {type(directory).__name__}") from None
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"a checkpoint directory is a non-empty path, got {directory!r}")
    return path


async def save(conns: Connections, directory: str | os.PathLike[str], metadata: Any) -> CheckpointReply:
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"checkpoint metadata must be JSON (dicts, lists, str, int, float, bool, None): {exc}"
        ) from None
    ctl = await conns.ctl()
    reply, _ = await ctl.request(
        Checkpoint(directory=_directory(directory), metadata=text, base=os.getcwd()), expect=CheckpointReply, timeout=math.inf
    )
    return reply


async def load(conns: Connections, directory: str | os.PathLike[str], *, replace: bool = False) -> Any:
    if not isinstance(replace, bool):
        raise InvalidArgumentError(f"replace is True or False, got {replace!r}")
    ctl = await conns.ctl()
    restore = Restore(directory=_directory(directory), replace=replace, base=os.getcwd())
    reply, _ = await ctl.request(restore, expect=Restored, timeout=math.inf)
    return json.loads(reply.metadata)
