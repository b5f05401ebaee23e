"""Durability on the wire: a checkpoint of the whole data plane, and its restore.

A client asks the controller (``Checkpoint``, ``Restore``); the controller asks each storage
unit to write or load its payload (``SaveUnit``, ``LoadUnit``). Paths are absolute and name
one directory that the controller and every unit reach under the same name (one host, or a
shared filesystem). User metadata travels as JSON text: nothing in a checkpoint is code.
"""

from __future__ import annotations

import json
import os
from typing import Any, Final

import msgspec

from ..errors import InvalidArgumentError, ProtocolError
from ._messages import Kind, Message, register

FORMAT: Final = "tqueue-checkpoint"
FORMAT_VERSION: Final = 1
MANIFEST: Final = "manifest.json"


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory`` (absolute), checked for its format."""
    if not isinstance(directory, str) or not os.path.isabs(directory):
        raise InvalidArgumentError(f"a checkpoint directory is an absolute path, got {directory!r}")
    path = os.path.join(os.path.normpath(directory), MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no checkpoint in {directory}: {MANIFEST} is not there") from None
    except ValueError as exc:
        raise ProtocolError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ProtocolError(f"{path} is not a tqueue checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ProtocolError(
            f"{path} is a checkpoint of format version {manifest.get('version')}; this version of tqueue reads "
            f"version {FORMAT_VERSION}"
        )
    return manifest


class Checkpoint(Message):
    """Write the data plane into ``directory`` (absolute); ``metadata``: JSON text, kept in
    the manifest and given back by ``Restore``."""

    KIND = Kind.CHECKPOINT
    directory: str
    metadata: str = "null"


class CheckpointReply(Message):
    """What a checkpoint holds and what it cost. ``pause``: the longest time one server's loop
    was held by it (the controller's copy of its metadata, or a unit's snapshot of its
    columns), in seconds: how long puts and gets waited for it at most."""

    KIND = Kind.CHECKPOINT_REPLY
    manifest: str  # path of the manifest written last
    generation: str  # the folder of this checkpoint's files, inside ``directory``
    partitions: int
    samples: int  # committed and not excluded, as of the snapshot
    payload_bytes: int  # of the units' files
    seconds: float
    pause: float
    controller_pause: float = 0.0
    unit_pause: float = 0.0


class Restore(Message):
    """Load the checkpoint in ``directory`` into this cluster, beside its partitions.
    ``replace``: a live partition of the same name as one of the checkpoint's is replaced
    by it (else the load is refused)."""

    KIND = Kind.RESTORE
    directory: str
    replace: bool = False


class Restored(Message):
    KIND = Kind.RESTORED
    metadata: str  # JSON text, as the checkpoint was given it
    partitions: int
    samples: int
    payload_bytes: int
    seconds: float
    units: dict[int, int] = {}  # the checkpoint's unit -> the unit that took its payload


class UnitFile(msgspec.Struct, frozen=True, kw_only=True):
    """One payload file of a unit: one field of one partition, relative to the generation."""

    path: str
    partition_uid: int
    partition: str
    field: str
    rows: int
    nbytes: int  # of the file
    payload: int = 0  # bytes of sample values in it


class SaveUnit(Message):
    """Write the payload of ``partitions`` (uids) under ``directory`` (absolute: the
    generation's folder), as this unit holds it when the message arrives."""

    KIND = Kind.SAVE_UNIT
    directory: str
    partitions: list[int]
    unit: int = 0  # the name of the unit's folder (its unit id)
    # grants the controller had not committed at its copy: a write of one of them that this
    # unit installed is left out (the samples as they were before it)
    exclude: list[int] = []


class UnitSaved(Message):
    KIND = Kind.UNIT_SAVED
    files: list[UnitFile]
    pause: float = 0.0  # seconds the unit's loop was held by the snapshot


class LoadUnit(Message):
    """Load these payload files (relative to ``directory``, the generation's folder)."""

    KIND = Kind.LOAD_UNIT
    directory: str
    files: list[UnitFile]
    # a file's partition uid -> the uid this unit stores its samples under (absent: its own):
    # a checkpoint loaded into a live cluster gets uids no partition there has had
    uids: dict[int, int] = {}


class UnitLoaded(Message):
    KIND = Kind.UNIT_LOADED
    partition_bytes: dict[int, int]  # uid -> payload bytes of that partition here now
    unit_bytes: int  # what the unit holds in all (resident)


register(globals())
