"""Checkpoint and restore of the whole data plane, as the controller leads them.

**A checkpoint** (``Checkpoint``) goes in three steps:

1. It waits until no move between partitions is half done (samples taken out of one
   partition, not landed in the other yet), then, in one step of the controller's loop,
   copies every partition's metadata (``_snapshot.capture``) and sends ``SaveUnit`` to every
   live unit. A unit gets it on the same connection as the drops and moves, after those sent
   before and before those sent after: so each unit's snapshot holds every sample this copy
   calls committed (puts that commit meanwhile are in neither, or only on the unit, where the
   restore ignores them). That step, and each unit's snapshot of its columns, are the only
   times a checkpoint holds a loop: for time in proportion to samples and pieces, never bytes.
2. The partitions' files (``partitions/p<uid>.arrow``) are written by a thread, the units'
   (``unit-<id>/...``) by theirs, all into a new folder ``gen-<time>-<random>`` inside the
   directory, each file fsynced, then the folders.
   The generation's folder is made first, with a marker (``.tqueue-generation``); the
   directory is confined to the checkpoint root and opened following no link
   (``wire/_durable.py``).
3. Once all are written, ``manifest.json`` (with the CRC-32C of every file, and its own) is
   written under a random temporary name (``O_EXCL``), fsynced and renamed over the old one
   (then the directory is fsynced): the rename is the commit. A ``manifest.json`` that is not
   a checkpoint's is never replaced. Older generations that carry the marker are deleted
   after it, nothing else. A checkpoint that stops anywhere before the rename
   leaves the previous manifest, and the generation it names, as they were.

**A restore** (``Restore``) reads the manifest and refuses, before anything is loaded, a
checkpoint partition whose name a live partition has (unless ``replace``) or one partition
past ``max_partitions``. Each checkpoint partition gets a uid this controller never gave out
(its own in a fresh or restarted controller, else a new one: the units store its payload
under it, ``LoadUnit.uids``), so nothing of it meets a live partition's samples, leases,
grants or pending drops. Every path and number of the manifest and the partition files is checked,
and each file's CRC-32C, in a thread, and the partitions are rebuilt there, before any unit
loads a byte. It gives each old unit's files to a live unit (to the unit of the
same name, the rest the largest first, to the unit given least so far: any number of units
takes any checkpoint), waits for every unit to load them (a failure drops what was loaded,
and the live partitions are as they were), then, in one step of the loop, forgets the live
partitions it replaces (their waiters told, as by a clear) and rebuilds the checkpoint's under
their names, their samples on their new units, leases given back. Only then is the replaced
partitions' payload dropped on every unit. The trainer's version, weights pointer and
staleness bound come from the checkpoint when the cluster had no partitions; a live
cluster's stay as they are. Its reply carries the user metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import numpy as np

from ..._tasks import all_or_none
from ...errors import DataCorruptionError, InvalidArgumentError, TQueueError, UnavailableError
from ...wire import (
    Checkpoint,
    CheckpointReply,
    Drop,
    Dropped,
    LoadUnit,
    Restore,
    Restored,
    SaveUnit,
    UnitFile,
    UnitLoaded,
    UnitSaved,
    _durable,
)
from ...wire._durable import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest  # noqa: F401 (the server reads it from here)
from ..model._partition import Partition
from ..model._samples import COMMITTED, EXCLUDED
from ..model._state import ControllerState
from ._snapshot import Image, capture, read_image, rebuild, write_image

log = logging.getLogger(__name__)

MOVES_WAIT: Final = 30.0  # seconds a checkpoint waits for moves under way to land


class Checkpoints:
    """Handlers of ``Checkpoint`` and ``Restore`` over ``state``; ``wake`` serves readers
    parked on a partition that a restore brought back; ``forget`` and ``free`` clear a live
    partition that a restore replaces (``Cleanup.forget``, ``Cleanup.drop_everywhere``)."""

    def __init__(
        self, state: ControllerState, *, wake: Callable[[str], None], copy_again: Callable[[], None] = lambda: None,
        forget: Callable[[Partition, str], object], free: Callable[[Partition], Awaitable[None]],
        landed: Callable[[float], Awaitable[None]],
    ) -> None:
        self._copy_again = copy_again  # a restored partition of two copies holds one: copy them again
        self.state = state
        self._wake = wake
        self._forget = forget
        self._free = free
        self._landed = landed  # (within seconds): no move between partitions is under way (Moves.landed)
        self._busy = ""  # "a checkpoint" or "a restore" while one runs
        self.root = state.config.checkpoint_root
        if state.config.auth_dir and not self.root:
            raise InvalidArgumentError(
                "controller: with authentication on (auth_dir) a checkpoint root is required: set checkpoint_root "
                "(--checkpoint-root) to the folder clients' checkpoints may be written to and loaded from"
            )

    async def save(self, ident: bytes, msg: Checkpoint, bufs: list[Any]) -> CheckpointReply:
        place = _durable.asked(msg.directory, msg.base, self.root)
        try:
            metadata = json.loads(msg.metadata)
        except ValueError as exc:
            raise InvalidArgumentError(f"checkpoint metadata is JSON text: {exc}") from exc
        self._start("a checkpoint")
        try:
            return await self._save(place, metadata)
        finally:
            self._busy = ""

    async def _save(self, place: _durable.Place, metadata: Any) -> CheckpointReply:
        started = time.perf_counter()
        generation = f"gen-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S%f}-{secrets.token_hex(4)}"
        dir_fd, gen_fd = await asyncio.to_thread(_make_generation, place, generation)
        try:
            return await self._save_into(place, dir_fd, gen_fd, generation, metadata, started)
        except BaseException:
            await asyncio.to_thread(_durable.remove_generation, dir_fd, generation)
            raise
        finally:
            os.close(gen_fd)
            os.close(dir_fd)

    async def _save_into(
        self, place: _durable.Place, dir_fd: int, gen_fd: int, generation: str, metadata: Any, started: float
    ) -> CheckpointReply:
        await self._landed(MOVES_WAIT)
        # --- one loop step: the metadata's copy, and SaveUnit on its way to every unit ---
        t0 = time.perf_counter()
        state = self.state
        images = [capture(p) for p in state.partitions.values()]
        uids = [img.uid for img in images]
        gen_dir = os.path.join(place.path, generation)
        units = [(uid, u) for uid, u in state.units.items() if u.alive and uid in state.units.peers]
        pending = list(state.grants)  # writes the copy does not hold: the units leave them out
        saves = [
            asyncio.ensure_future(state.units.peers[uid].request(
                SaveUnit(directory=gen_dir, partitions=uids, unit=uid, exclude=pending), expect=UnitSaved, timeout=math.inf
            ))
            for uid, _ in units
        ]
        trainer = {
            "version": state.trainer.version, "weights": state.trainer.weights,
            "admission": list(state.trainer.admission) if state.trainer.admission is not None else None,
            # admission taken by puts that will never commit is not the restored cluster's
            "admitted": state.trainer.admitted - sum(g.admitted for g in state.grants.values()),
        }
        controller_pause = time.perf_counter() - t0
        # --- the files, in threads here and on the units ---
        try:
            written = await asyncio.to_thread(_write_images, gen_fd, images)
            saved = [reply for reply, _ in await all_or_none(*saves)]
        except BaseException:
            for fut in saves:
                fut.cancel()
            raise
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "generation": generation,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "metadata": metadata, "trainer": trainer,
            "partitions": [
                {"name": img.name, "uid": img.uid, "path": f"partitions/p{img.uid}.arrow", "nbytes": size,
                 "samples": _live(img), "crc32c": crc}
                for img, (size, crc) in zip(images, written)
            ],
            "units": [
                {"unit_id": uid, "name": u.name, "files": [msgspec.to_builtins(f) for f in reply.files]}
                for (uid, u), reply in zip(units, saved)
            ],
        }
        await asyncio.to_thread(_durable.commit_manifest, dir_fd, manifest, place.name)
        path = os.path.join(place.path, MANIFEST)
        unit_pause = max((r.pause for r in saved), default=0.0)
        reply = CheckpointReply(
            manifest=path, generation=generation, partitions=len(images),
            samples=sum(p["samples"] for p in manifest["partitions"]),
            payload_bytes=sum(f.nbytes for r in saved for f in r.files), seconds=time.perf_counter() - started,
            pause=max(controller_pause, unit_pause), controller_pause=controller_pause, unit_pause=unit_pause,
        )
        log.info(
            "checkpoint %s: %d partitions, %d samples, %d payload bytes in %.2f s (loops held %.1f ms at most)",
            path, reply.partitions, reply.samples, reply.payload_bytes, reply.seconds, 1e3 * reply.pause,
        )
        return reply

    async def restore(self, ident: bytes, msg: Restore, bufs: list[Any]) -> Restored:
        place = _durable.asked(msg.directory, msg.base, self.root)
        self._start("a restore")
        try:
            return await self._restore(place, replace=msg.replace)
        finally:
            self._busy = ""

    async def _restore(self, place: _durable.Place, *, replace: bool = False) -> Restored:
        started = time.perf_counter()
        state = self.state
        config = state.config
        fresh = not state.partitions  # a fresh (or restarted) cluster takes the trainer's state too
        # every path and number of the checkpoint checked, in a thread, before anything is sized by one
        manifest, images = await asyncio.to_thread(read_checkpoint, place, config)
        gen_dir = os.path.join(place.path, manifest["generation"])
        self._check_room(images, replace)
        live = sorted(uid for uid, u in state.units.items() if u.alive and not u.suspect and uid in state.units.peers)
        old_units = [(u["unit_id"], [msgspec.convert(f, UnitFile) for f in u["files"]]) for u in manifest["units"]]
        if not live and any(files for _, files in old_units):
            raise UnavailableError("load_checkpoint needs at least one live storage unit to take the payload")
        uids = self._new_uids(images)
        by_name = {state.units[uid].name: uid for uid in live}
        same = {int(u["unit_id"]): by_name[u["name"]] for u in manifest["units"] if u["name"] in by_name}
        mapping = _assign(old_units, live, same)
        try:
            parts = await asyncio.to_thread(_rebuild_all, images, mapping, config, place.name)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            if isinstance(exc, TQueueError):
                raise
            raise InvalidArgumentError(f"checkpoint {place.name}: a partition file does not rebuild: {exc!r}") from None
        loads: dict[int, list[UnitFile]] = {}
        for old, files in old_units:
            loads.setdefault(mapping[old], []).extend(files)
        try:
            # every unit's load runs to its end, failed or not, before what they loaded is
            # dropped: a drop overtaking a load still under way would leave its payload there
            results = await asyncio.gather(*(
                state.units.peers[new].request(
                    LoadUnit(directory=gen_dir, files=files, uids=uids), expect=UnitLoaded, timeout=math.inf
                )
                for new, files in loads.items()
            ), return_exceptions=True)
            replies: list[UnitLoaded] = []
            for result in results:
                if isinstance(result, BaseException):
                    raise result
                replies.append(result[0])
            self._check_room(images, replace)  # partitions made while the payload loaded
            # --- one loop step: the partitions replaced, the checkpoint's in their place ---
            replaced = [state.partitions[img.name] for img in images if img.name in state.partitions]
            for old_part in replaced:
                self._forget(old_part, f"partition {old_part.name!r} was replaced by load_checkpoint while get_meta waited")
            self._install(parts, dict(zip(loads, replies)))
        except BaseException:
            await self._unload(list(loads), [img.uid for img in images])
            raise
        if fresh:
            self._trainer(manifest["trainer"])
        for img in images:
            self._wake(img.name)
        self._copy_again()
        await all_or_none(*(self._free(p) for p in replaced))  # their payload, freed on every unit
        log.info(
            "loaded %s: %d partitions (%d replaced), units %s, uids %s",
            place.name, len(images), len(replaced), mapping, {o: n for o, n in uids.items() if o != n},
        )
        return Restored(
            metadata=json.dumps(manifest["metadata"]), partitions=len(images),
            samples=sum(_live(img) for img in images),
            payload_bytes=sum(f.nbytes for _, files in old_units for f in files),
            seconds=time.perf_counter() - started, units=mapping,
        )

    def _check_room(self, images: list[Image], replace: bool) -> None:
        """Refuse a load whose partitions' names are taken here (unless ``replace``), or that
        would pass ``max_partitions``; nothing is changed."""
        state = self.state
        names = [img.name for img in images]
        clash = sorted(set(names) & set(state.partitions))
        if clash and not replace:
            raise InvalidArgumentError(
                f"load_checkpoint: {len(clash)} of the checkpoint's partitions exist in this cluster "
                f"({', '.join(repr(n) for n in clash[:5])}{', ...' if len(clash) > 5 else ''}); clear them first, "
                "or pass replace=True to replace them with the checkpoint's"
            )
        total = len(state.partitions) - len(clash) + len(set(names))
        if total > state.config.max_partitions:
            raise InvalidArgumentError(
                f"load_checkpoint would make {total} partitions: max_partitions={state.config.max_partitions}"
            )

    def _new_uids(self, images: list[Image]) -> dict[int, int]:
        """Give each image a partition uid this controller never gave out: its own where it
        can (a fresh or restarted controller: every uid), else a new one. Returns the
        checkpoint's uid -> the new one; the images carry the new."""
        state = self.state
        first = next(state.partitions.uids)  # every uid below it was given out here
        kept = [img.uid for img in images if img.uid >= first]
        counter = itertools.count(max([first, *(u + 1 for u in kept)]))
        uids = {img.uid: img.uid if img.uid >= first else next(counter) for img in images}
        state.partitions.uids = counter  # partitions created from now on get uids past these
        for img in images:
            img.header["uid"] = uids[img.uid]
        return uids

    def _install(self, parts: list[Partition], loaded: dict[int, UnitLoaded]) -> None:
        state = self.state
        for part in parts:
            state.partitions[part.name] = part
            state.partitions.by_uid[part.uid] = part
            state.partitions.tombstones.pop(part.name, None)  # an explicit new start, as create_partition
        for new, reply in loaded.items():
            for uid, nbytes in reply.partition_bytes.items():
                owner = state.partitions.by_uid.get(uid)
                if owner is not None:
                    owner.unit_bytes[new] = nbytes
            state.units[new].nbytes = reply.unit_bytes

    def _trainer(self, trainer: dict[str, Any]) -> None:
        state = self.state
        state.trainer.version, state.trainer.weights = int(trainer["version"]), str(trainer["weights"])
        admission = trainer["admission"]
        state.trainer.admission = (int(admission[0]), int(admission[1])) if admission is not None else None
        state.trainer.admitted = int(trainer["admitted"])

    async def resume(self, directory: str, manifest: dict[str, Any], registered: asyncio.Event, wait: float) -> None:
        """A restarted controller's restore: once every unit the checkpoint names has
        registered again (they keep their ids, see ``Liveness.known``), or ``wait`` seconds
        have passed and at least one unit lives, load the checkpoint (``registered`` is set
        at each registration)."""
        names = {str(u["name"]) for u in manifest["units"]}
        loop = self.state.loop  # its clock, which the timers follow (a test may move it on)
        deadline = loop.time() + wait
        while True:
            live = {u.name for u in self.state.units.values() if u.alive and not u.suspect}
            if names <= live or (live and loop.time() >= deadline):
                break
            registered.clear()
            left = deadline - loop.time()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(registered.wait(), left if left > 0 else None)
        if names - live:
            log.warning(
                "restoring %s without units %s (not back after %g s): their files go to the units that are",
                directory, sorted(names - live), wait,
            )
        self._start("a restore")
        try:
            reply = await self._restore(_durable.confined(directory, self.root))
        finally:
            self._busy = ""
        log.info(
            "resumed from %s: %d partitions, %d samples, %d payload bytes in %.2f s",
            directory, reply.partitions, reply.samples, reply.payload_bytes, reply.seconds,
        )

    async def _unload(self, units: list[int], uids: list[int]) -> None:
        """Drop what a failed restore may have loaded (best effort: the restore failed anyway)."""
        calls = [
            (unit, peer.request(Drop(partition_uid=uid), expect=Dropped, timeout=self.state.config.unit_timeout))
            for unit in units if (peer := self.state.units.peers.get(unit)) is not None
            for uid in uids
        ]
        results = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        for (unit_id, _), result in zip(calls, results):
            if isinstance(result, BaseException):
                log.warning("dropping a failed restore's payload: %s", result)
            elif (unit := self.state.units.get(unit_id)) is not None:
                unit.nbytes = result[0].unit_bytes

    def _start(self, what: str) -> None:
        if self._busy:
            raise UnavailableError(f"{what} cannot start: {self._busy} is under way")
        self._busy = what


def _live(img: Image) -> int:
    mask = img.arrays["mask"]
    return int(((mask & (COMMITTED | EXCLUDED)) == COMMITTED).sum())


def _assign(old_units: list[tuple[int, list[UnitFile]]], live: list[int], same: dict[int, int] | None = None) -> dict[int, int]:
    """Each old unit's files to a live unit: to the unit of the same name (``same``: a
    restarted controller's units, back), the others the largest first, to the one given least."""
    given = {uid: 0 for uid in live}
    mapping: dict[int, int] = {}
    for old, files in old_units:
        new = (same or {}).get(old)
        if new is not None and new in given:
            mapping[old] = new
            given[new] += sum(f.payload for f in files)
    for old, files in sorted(old_units, key=lambda u: (-sum(f.payload for f in u[1]), u[0])):
        if not live or old in mapping:
            continue
        new = min(live, key=lambda uid: (given[uid], uid))
        mapping[old] = new
        given[new] += sum(f.payload for f in files)
    return mapping


# --- files (in a thread) ---------------------------------------------------------------


def _make_generation(place: _durable.Place, generation: str) -> tuple[int, int]:
    """The checkpoint's folder (made where missing) and its new generation folder, with
    ``partitions/`` in it, as descriptors; refused where the folder holds a manifest that is
    not a checkpoint's."""
    dir_fd = _durable.open_folder(place, create=True)
    try:
        _durable.foreign_manifest(dir_fd, place.name)
        gen_fd = _durable.make_generation(dir_fd, generation)
        os.mkdir("partitions", dir_fd=gen_fd)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd, gen_fd


def _write_images(gen_fd: int, images: list[Image]) -> list[tuple[int, int]]:
    """Each image's file, fsynced, then the folders: their sizes and CRC-32Cs."""
    folder = _durable.subfolder(gen_fd, "partitions", "partitions")
    try:
        written = [write_image(folder, f"p{img.uid}.arrow", img) for img in images]
        _durable.fsync_dir(folder)
    finally:
        os.close(folder)
    _durable.fsync_dir(gen_fd)
    return written


def _rebuild_all(images: list[Image], mapping: dict[int, int], config: Any, what: str) -> list[Partition]:
    """The checkpoint's partitions, made before any payload is loaded (in a thread: they are
    nobody's until installed)."""
    parts = []
    for img in images:
        part = rebuild(img, mapping, max_samples=config.max_partition_samples, max_tasks=config.max_tasks_per_partition)
        if (part.options.copies or config.copies) > 1:  # a checkpoint holds one copy of each
            part.single = int(((part.samples.mask[: part.n] & (COMMITTED | EXCLUDED)) == COMMITTED).sum())
        parts.append(part)
    return parts


def kept_on(unit_id: int, images: list[Image], by_uid: dict[int, Any]) -> dict[int, np.ndarray]:
    """Per partition uid, the samples a unit restarted from these images holds as they are
    now: on that unit in both, committed and not excluded in both, of the same revision and
    the same fields. Partitions with none are left out."""
    out: dict[int, np.ndarray] = {}
    for img in images:
        part = by_uid.get(img.uid)
        if part is None or part.name != img.name:  # gone, or the checkpoint was loaded under other uids
            continue
        s, a = part.samples, img.arrays
        n = min(part.n, int(img.header["n"]))
        live = COMMITTED | EXCLUDED
        sel = (a["unit"][:n] == unit_id) & ((a["mask"][:n] & live) == COMMITTED)
        sel &= (s.unit[:n] == unit_id) & ((s.mask[:n] & live) == COMMITTED)
        sel &= (s.revision[:n] == a["revision"][:n]) & (s.mask[:n] == a["mask"][:n])
        idx = np.flatnonzero(sel)
        if len(idx):
            out[img.uid] = idx
    return out


def read_checkpoint(where: _durable.Place | str, config: Any = None) -> tuple[dict[str, Any], list[Image]]:
    """The manifest and partition images of a checkpoint, every one checked (paths inside its
    folder, no link followed; sizes and CRC-32Cs as the manifest says; numbers within
    ``config``'s limits) before anything is sized by them. ``where``: a place, or an absolute
    path (under ``config.checkpoint_root`` where it has one)."""
    root = getattr(config, "checkpoint_root", "")
    place = where if isinstance(where, _durable.Place) else _durable.confined(where, root)
    max_samples = getattr(config, "max_partition_samples", 1 << 40)
    max_tasks = getattr(config, "max_tasks_per_partition", 1 << 20)
    what = place.name
    dir_fd = _durable.open_folder(place)
    try:
        manifest = _durable.manifest_of(dir_fd, what)
        generation = manifest["generation"]
        gen_fd = _durable.subfolder(dir_fd, generation, what)
    finally:
        os.close(dir_fd)
    images = []
    try:
        if manifest["partitions"]:
            folder = _durable.subfolder(gen_fd, "partitions", what)
            try:
                for entry in manifest["partitions"]:
                    name = entry["path"].split("/")[1]
                    data = _durable.read_file(folder, name, what)
                    file = f"{generation}/{entry['path']}"
                    detail = f" (partition {entry['name']!r})"
                    if len(data) != entry["nbytes"]:
                        raise DataCorruptionError(
                            f"checkpoint {what}: {file}{detail} has {len(data)} bytes, the manifest says "
                            f"{entry['nbytes']}: the checkpoint is damaged"
                        )
                    _durable.verify(data, entry["crc32c"], what, file, detail)
                    img = read_image(data, f"checkpoint {what}: {file}{detail}", max_samples=max_samples, max_tasks=max_tasks)
                    if img.uid != entry["uid"] or img.name != entry["name"]:
                        raise InvalidArgumentError(f"checkpoint {what}: {file} holds partition {img.name!r} (uid "
                                                   f"{img.uid}), the manifest says {entry['name']!r} (uid {entry['uid']})")
                    images.append(img)
            finally:
                os.close(folder)
        for unit in manifest["units"]:
            folders: dict[str, int] = {}
            try:
                for entry in unit["files"]:
                    sub, name = entry["path"].split("/")
                    if sub not in folders:
                        folders[sub] = _durable.subfolder(gen_fd, sub, what)
                    size = _durable.file_size(folders[sub], name, what)
                    if size != entry["nbytes"]:
                        raise DataCorruptionError(
                            f"checkpoint {what}: {generation}/{entry['path']} has {size} bytes, the manifest says "
                            f"{entry['nbytes']}: the checkpoint is damaged"
                        )
            finally:
                for fd in folders.values():
                    os.close(fd)
    finally:
        os.close(gen_fd)
    return manifest, images
