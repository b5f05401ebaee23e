"""Durability on the wire: a checkpoint of the whole data plane, and its restore; and the
checkpoint's folder on disk, as the controller and the units open it.

A client asks the controller (``Checkpoint``, ``Restore``); the controller asks each storage
unit to write or load its payload (``SaveUnit``, ``LoadUnit``). User metadata travels as JSON
text: nothing in a checkpoint is code.

**Where checkpoints go.** A server given a checkpoint root (``checkpoint_root``, required
with authentication on) takes a client's directory as a name under it: relative, no ``..``,
and no symbolic link below the root is followed (each folder is opened with ``O_NOFOLLOW``
from the one above it, files with ``O_NOFOLLOW``, new ones with ``O_EXCL`` under random
temporary names). Without a root, a directory is any path, a relative one taken from the
client's working directory (``base``). The controller hands the units absolute paths (one
directory that the controller and every unit reach under the same name: one host, or a
shared filesystem); a unit with a root refuses one outside it.

**What is trusted.** Nothing read from a checkpoint: the manifest is decoded into typed
structs whose every path and number is bounded (:func:`read_manifest`), each file it names
is opened inside the generation's folder, and (format version 2) each file and the manifest
itself carry a CRC-32C checked at load (a mismatch: ``DataCorruptionError``). A version-1
manifest (written before checksums) loads unverified, with a warning. Errors name the
checkpoint by the name the client gave, and files by their place inside it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
from typing import Annotated, Any, Final

import msgspec

from ..errors import DataCorruptionError, InvalidArgumentError, PermissionDeniedError, TQueueError
from ._crc import crc, extend
from ._messages import Kind, Message, register

log = logging.getLogger(__name__)

FORMAT: Final = "tqueue-checkpoint"
FORMAT_VERSION: Final = 2  # 2: CRC-32C of every file and of the manifest; 1 (read too): none
READS: Final = (1, 2)
MANIFEST: Final = "manifest.json"
MARKER: Final = ".tqueue-generation"  # in each generation folder a checkpoint made (only those are ever deleted)
MARKER_FORMAT: Final = "tqueue-generation"
MAX_MANIFEST_BYTES: Final = 256 << 20
MAX_UNIT_ID: Final = (1 << 15) - 1  # a sample's unit is an int16 (controller/parts/_units.py)
MAX_UID: Final = 1 << 62
MAX_BYTES: Final = 1 << 50
GENERATION: Final = r"^gen-[0-9A-Za-z]{1,40}-[0-9a-f]{1,32}$"
PARTITION_FILE: Final = r"^partitions/p[1-9][0-9]{0,18}\.arrow$"
UNIT_FILE: Final = r"^unit-[0-9]{1,5}/p[1-9][0-9]{0,18}-f[0-9]{1,7}\.arrow$"

_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO planted there does not hang
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Crc = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Uid = Annotated[int, msgspec.Meta(ge=1, le=MAX_UID)]


# --- where a checkpoint is ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Place:
    """A checkpoint's folder: ``path`` (absolute), under ``root`` ("" for none)."""

    path: str
    root: str = ""

    @property
    def name(self) -> str:
        """The checkpoint as errors name it: its name under the root, or its path."""
        return os.path.relpath(self.path, self.root) if self.root else self.path

    def parts(self) -> list[str]:
        rel = os.path.relpath(self.path, self.root)
        return [] if rel == "." else rel.split(os.sep)


def asked(directory: Any, base: str, root: str) -> Place:
    """The folder a client's ``directory`` names: under ``root`` a relative name without
    ``..`` (else ``PermissionDeniedError``); without one, any path (a relative one from the
    client's working directory ``base``)."""
    if not isinstance(directory, str) or not directory or "\0" in directory:
        raise InvalidArgumentError(f"a checkpoint directory is a non-empty path, got {directory!r}")
    if root:
        if os.path.isabs(directory):
            raise PermissionDeniedError(
                f"checkpoint {directory!r}: this cluster keeps checkpoints under its checkpoint root "
                "(checkpoint_root, --checkpoint-root): name one by a relative name under it, not an absolute path"
            )
        if ".." in directory.split("/"):
            raise PermissionDeniedError(
                f"checkpoint {directory!r}: a checkpoint's name under the checkpoint root may not contain '..'"
            )
        path = os.path.normpath(os.path.join(root, directory))
        if path == os.path.normpath(root):
            raise InvalidArgumentError(f"checkpoint {directory!r}: name a folder under the checkpoint root")
        return Place(path, os.path.normpath(root))
    if not os.path.isabs(directory):
        if not os.path.isabs(base):
            raise InvalidArgumentError(f"a checkpoint directory is an absolute path, got {directory!r}")
        directory = os.path.join(base, directory)
    return Place(os.path.normpath(directory))


def confined(path: Any, root: str) -> Place:
    """An absolute ``path`` from the controller or the operator (a relative one is taken
    under ``root``), which must lie under ``root`` where there is one."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgumentError(f"a checkpoint directory is a non-empty path, got {path!r}")
    if not root:
        if not os.path.isabs(path):
            raise InvalidArgumentError(f"a checkpoint directory is an absolute path, got {path!r}")
        return Place(os.path.normpath(path))
    root = os.path.normpath(root)
    full = os.path.normpath(os.path.join(root, path))
    if ".." in path.split("/") or os.path.commonpath([full, root]) != root or full == root:
        raise PermissionDeniedError(f"checkpoint {path!r} is not a folder under the checkpoint root (checkpoint_root)")
    return Place(full, root)


def open_folder(place: Place, *, create: bool = False) -> int:
    """A descriptor of the checkpoint's folder (made, with ``create``). Under a root each
    folder below it is opened from the one above, following no link; without one the path is
    the caller's own and opened as it is."""
    if not place.root:
        try:
            if create:
                os.makedirs(place.path, exist_ok=True)
            return os.open(place.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidArgumentError(f"no checkpoint in {place.path}: the folder is not there") from None
        except NotADirectoryError:
            raise InvalidArgumentError(f"checkpoint {place.path}: not a folder") from None
    try:
        fd = os.open(place.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's: it may be a link
    except OSError as exc:
        raise InvalidArgumentError(f"the checkpoint root cannot be opened: {exc.strerror}") from None
    try:
        for part in place.parts():
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            sub = subfolder(fd, part, place.name)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def subfolder(dir_fd: int, name: str, what: str) -> int:
    """Folder ``name`` in ``dir_fd``, not through a link."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no checkpoint in {what}: {name} is not there") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDeniedError(
                f"checkpoint {what}: {name} is a symbolic link or not a folder (checkpoints follow no links)"
            ) from None
        raise InvalidArgumentError(f"checkpoint {what}: {name} cannot be opened: {exc.strerror}") from None


def read_file(dir_fd: int, name: str, what: str, *, limit: int = MAX_BYTES) -> Any:
    """The bytes of regular file ``name`` in ``dir_fd`` (a read-only map; b"" when empty),
    not through a link; larger than ``limit``: refused unread."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        raise DataCorruptionError(f"checkpoint {what}: {name} is missing: the checkpoint is damaged") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDeniedError(f"checkpoint {what}: {name} is a symbolic link (checkpoints follow no links)") from None
        raise InvalidArgumentError(f"checkpoint {what}: {name} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionDeniedError(f"checkpoint {what}: {name} is not a regular file")
        if st.st_size > limit:
            raise InvalidArgumentError(f"checkpoint {what}: {name} has {st.st_size} bytes, more than {limit} allowed")
        return mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) if st.st_size else b""
    finally:
        os.close(fd)


def file_size(dir_fd: int, name: str, what: str) -> int:
    """The size of regular file ``name`` in ``dir_fd`` (a link or anything else: refused)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise DataCorruptionError(f"checkpoint {what}: {name} is missing: the checkpoint is damaged") from None
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDeniedError(f"checkpoint {what}: {name} is not a regular file (checkpoints follow no links)")
    return st.st_size


class Summed:
    """A file being written (``O_EXCL``, no link followed), with the CRC-32C and count of
    what went in; pyarrow writes to it as to any file."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self._file = os.fdopen(os.open(name, _CREATE, 0o666, dir_fd=dir_fd), "wb")
        self.crc = 0
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = extend(self.crc, view)
        self.size += view.nbytes
        return self._file.write(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._file.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.closed = True
        self._file.close()

    def __enter__(self) -> Summed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def fsync_dir(dir_fd: int) -> None:
    os.fsync(dir_fd)


def verify(data: Any, expected: int | None, what: str, name: str, detail: str = "") -> None:
    """``DataCorruptionError`` unless ``data``'s CRC-32C is ``expected`` (None: a checkpoint
    written before checksums, not verified)."""
    if expected is not None and (got := crc(data)) != expected:
        raise DataCorruptionError(
            f"checkpoint {what}: {name}{detail} fails its CRC-32C ({got:08x}, the manifest says {expected:08x}): "
            "the checkpoint is damaged and is not loaded"
        )


def make_generation(dir_fd: int, generation: str) -> int:
    """Folder ``generation`` in ``dir_fd``, new, with the marker that says a checkpoint made
    it (the only folders a later checkpoint deletes); its descriptor."""
    os.mkdir(generation, dir_fd=dir_fd)
    fd = subfolder(dir_fd, generation, generation)
    try:
        with Summed(fd, MARKER) as f:
            f.write(json.dumps({"format": MARKER_FORMAT, "generation": generation}).encode())
            f.sync()
    except BaseException:
        os.close(fd)
        raise
    return fd


def ours(dir_fd: int, entry: str) -> bool:
    """Whether ``entry`` in ``dir_fd`` is a generation folder a checkpoint made: a real folder
    (no link) holding the marker that names it."""
    if re.match(GENERATION, entry) is None:
        return False
    try:
        st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            return False
        fd = os.open(entry, _DIR, dir_fd=dir_fd)
        try:
            raw = read_file(fd, MARKER, entry, limit=4096)
        finally:
            os.close(fd)
        marker = json.loads(bytes(raw))
    except (TQueueError, OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT and marker.get("generation") == entry


def remove_generation(dir_fd: int, entry: str) -> None:
    """Delete a generation folder a checkpoint made (links inside are removed, never followed)."""
    if ours(dir_fd, entry):
        shutil.rmtree(entry, dir_fd=dir_fd, ignore_errors=True)


def foreign_manifest(dir_fd: int, what: str) -> None:
    """Refuse a folder whose ``manifest.json`` is there and is not a tqueue checkpoint's (or
    is a link): it is never replaced."""
    try:
        st = os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    text = None
    if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_MANIFEST_BYTES:
        try:
            text = json.loads(bytes(read_file(dir_fd, MANIFEST, what, limit=MAX_MANIFEST_BYTES)))
        except (TQueueError, ValueError):
            text = None
    if not isinstance(text, dict) or text.get("format") != FORMAT:
        raise InvalidArgumentError(
            f"checkpoint {what}: the folder holds a {MANIFEST} that is not a tqueue checkpoint's; it is left as it "
            "is: choose another folder"
        )


def commit_manifest(dir_fd: int, manifest: dict[str, Any], what: str) -> None:
    """Write the manifest (with its CRC-32C) under a random temporary name (``O_EXCL``, no
    link followed), fsync it, rename it over the old one: the checkpoint's commit. Then the
    generations a checkpoint made that the new manifest does not name are deleted."""
    manifest = {**manifest, "crc32c": manifest_crc(manifest)}
    foreign_manifest(dir_fd, what)
    tmp = f"{MANIFEST}.{secrets.token_hex(8)}.tmp"
    try:
        with Summed(dir_fd, tmp) as f:
            f.write(json.dumps(manifest, indent=1).encode())
            f.sync()
        foreign_manifest(dir_fd, what)
        os.replace(tmp, MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    fsync_dir(dir_fd)
    for entry in os.listdir(dir_fd):
        if entry.startswith("gen-") and entry != manifest["generation"]:
            remove_generation(dir_fd, entry)


def manifest_crc(manifest: dict[str, Any]) -> int:
    """The CRC-32C of a manifest's content (its ``crc32c`` left out), canonical JSON."""
    rest = {k: v for k, v in manifest.items() if k != "crc32c"}
    return crc(json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())


# --- the manifest ---------------------------------------------------------------------


class PartitionEntry(msgspec.Struct, kw_only=True):
    name: str
    uid: Uid
    path: Annotated[str, msgspec.Meta(pattern=PARTITION_FILE)]
    nbytes: Count
    samples: Count
    crc32c: Crc | None = None


class TrainerEntry(msgspec.Struct, kw_only=True):
    version: Annotated[int, msgspec.Meta(ge=-(1 << 62), le=1 << 62)]
    weights: str
    admission: tuple[int, int] | None
    admitted: Annotated[int, msgspec.Meta(ge=-(1 << 62), le=1 << 62)]


# --- messages -------------------------------------------------------------------------


class Checkpoint(Message):
    """Write the data plane into ``directory`` (under the servers' checkpoint root: a name
    relative to it; without one: a path, a relative one from ``base``); ``metadata``: JSON
    text, kept in the manifest and given back by ``Restore``."""

    KIND = Kind.CHECKPOINT
    directory: str
    metadata: str = "null"
    base: str = ""  # the client's working directory


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
    """Load the checkpoint in ``directory`` (as ``Checkpoint`` names it) into this cluster,
    beside its partitions. ``replace``: a live partition of the same name as one of the
    checkpoint's is replaced by it (else the load is refused)."""

    KIND = Kind.RESTORE
    directory: str
    replace: bool = False
    base: str = ""


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

    path: Annotated[str, msgspec.Meta(pattern=UNIT_FILE)]
    partition_uid: Uid
    partition: str
    field: str
    rows: Count
    nbytes: Count  # of the file
    payload: Count = 0  # bytes of sample values in it
    crc32c: Crc | None = None  # of the whole file (None: a checkpoint written before checksums)


class SaveUnit(Message):
    """Write the payload of ``partitions`` (uids) under ``directory`` (absolute: the
    generation's folder, which the controller made), as this unit holds it when the message
    arrives."""

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
    """Load these payload files (relative to ``directory``, the generation's folder), each
    checked against its CRC-32C first; a load that fails leaves nothing of it here."""

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


class UnitEntry(msgspec.Struct, kw_only=True):
    unit_id: Annotated[int, msgspec.Meta(ge=0, le=MAX_UNIT_ID)]
    name: str
    files: list[UnitFile]


class Manifest(msgspec.Struct, kw_only=True):
    """A checkpoint's ``manifest.json``, as it is checked at load."""

    format: str
    version: int
    generation: Annotated[str, msgspec.Meta(pattern=GENERATION)]
    created: str = ""
    metadata: Any = None
    trainer: TrainerEntry
    partitions: list[PartitionEntry]
    units: list[UnitEntry]
    crc32c: Crc | None = None


register(globals())


def read_manifest(directory: str, root: str = "") -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory`` (absolute, or a name under ``root``),
    checked: see :func:`manifest_of`."""
    place = confined(directory, root)
    fd = open_folder(place)
    try:
        return manifest_of(fd, place.name)
    finally:
        os.close(fd)


def manifest_of(dir_fd: int, what: str) -> dict[str, Any]:
    """The manifest in ``dir_fd``, checked before anything it names is touched: its format
    and version, its CRC-32C (version 2), every path a file of its generation, every number
    bounded, the names and ids it gives unique. As plain values (``Manifest``'s fields)."""
    try:
        os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no checkpoint in {what}: {MANIFEST} is not there") from None
    raw = read_file(dir_fd, MANIFEST, what, limit=MAX_MANIFEST_BYTES)
    try:
        doc = json.loads(bytes(raw))
    except ValueError as exc:
        raise DataCorruptionError(f"checkpoint {what}: {MANIFEST} is not JSON ({exc}): the checkpoint is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InvalidArgumentError(f"checkpoint {what}: {MANIFEST} is not a tqueue checkpoint manifest")
    version = doc.get("version")
    if version not in READS:
        raise InvalidArgumentError(
            f"checkpoint {what}: a checkpoint of format version {version!r}; this version of tqueue reads versions "
            f"{', '.join(map(str, READS))}"
        )
    if version >= 2 and doc.get("crc32c") != manifest_crc(doc):
        raise DataCorruptionError(f"checkpoint {what}: {MANIFEST} fails its CRC-32C: the checkpoint is damaged and is not loaded")
    try:
        manifest = msgspec.convert(doc, Manifest)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"checkpoint {what}: {MANIFEST} is not a valid manifest: {exc}") from None
    _consistent(manifest, what)
    if version < 2:
        log.warning("checkpoint %s was written before checksums (format version 1): its files are not verified", what)
    return msgspec.to_builtins(manifest)


def _consistent(m: Manifest, what: str) -> None:
    def bad(text: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"checkpoint {what}: {MANIFEST} is not a valid manifest: {text}")

    checked = m.version >= 2
    names = {p.name for p in m.partitions}
    by_uid = {p.uid: p.name for p in m.partitions}
    if len(names) != len(m.partitions) or len(by_uid) != len(m.partitions):
        raise bad("two partitions have one name or one uid")
    for p in m.partitions:
        if p.path != f"partitions/p{p.uid}.arrow":
            raise bad(f"partition {p.name!r} (uid {p.uid}) has its file at {p.path!r}")
        if checked and p.crc32c is None:
            raise bad(f"partition {p.name!r} has no CRC-32C")
    if len({u.unit_id for u in m.units}) != len(m.units) or len({u.name for u in m.units}) != len(m.units):
        raise bad("two units have one id or one name")
    for u in m.units:
        paths = set()
        for f in u.files:
            if not f.path.startswith(f"unit-{u.unit_id}/") or f.path in paths:
                raise bad(f"unit {u.unit_id} names file {f.path!r}")
            paths.add(f.path)
            if by_uid.get(f.partition_uid) != f.partition:
                raise bad(f"{f.path} holds partition {f.partition!r} (uid {f.partition_uid}), which the manifest does not list")
            if checked and f.crc32c is None:
                raise bad(f"{f.path} has no CRC-32C")
