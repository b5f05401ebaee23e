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
3. Once all are written, ``manifest.json`` is written as ``manifest.json.tmp``, fsynced and
   renamed over the old one (then the directory is fsynced): the rename is the commit. Older
   generations are deleted after it. A checkpoint that stops anywhere before the rename
   leaves the previous manifest, and the generation it names, as they were.

**A restore** (``Restore``) reads the manifest and refuses, before anything is loaded, a
checkpoint partition whose name a live partition has (unless ``replace``) or one partition
past ``max_partitions``. Each checkpoint partition gets a uid this controller never gave out
(its own in a fresh or restarted controller, else a new one: the units store its payload
under it, ``LoadUnit.uids``), so nothing of it meets a live partition's samples, leases,
grants or pending drops. It gives each old unit's files to a live unit (to the unit of the
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
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import numpy as np

from .._tasks import all_or_none
from ..errors import InvalidArgumentError, ProtocolError, UnavailableError
from ..wire import (
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
)
from ..wire._durable import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest
from ._partition import Partition
from ._samples import COMMITTED, EXCLUDED
from ._snapshot import Image, capture, read_image, rebuild, write_image
from ._state import ControllerState

log = logging.getLogger(__name__)

MOVES_WAIT: Final = 30.0  # seconds a checkpoint waits for moves under way to land


class Checkpoints:
    """Handlers of ``Checkpoint`` and ``Restore`` over ``state``; ``wake`` serves readers
    parked on a partition that a restore brought back; ``forget`` and ``free`` clear a live
    partition that a restore replaces (``Cleanup.forget``, ``Cleanup.drop_everywhere``)."""

    def __init__(
        self, state: ControllerState, *, wake: Callable[[str], None], copy_again: Callable[[], None] = lambda: None,
        forget: Callable[[Partition, str], object], free: Callable[[Partition], Awaitable[None]],
    ) -> None:
        self._copy_again = copy_again  # a restored replicated partition holds one copy: copy them again
        self.state = state
        self._wake = wake
        self._forget = forget
        self._free = free
        self._busy = ""  # "a checkpoint" or "a restore" while one runs

    async def save(self, ident: bytes, msg: Checkpoint, bufs: list[Any]) -> CheckpointReply:
        directory = _absolute(msg.directory)
        try:
            metadata = json.loads(msg.metadata)
        except ValueError as exc:
            raise InvalidArgumentError(f"checkpoint metadata is JSON text: {exc}") from exc
        self._start("a checkpoint")
        try:
            return await self._save(directory, metadata)
        finally:
            self._busy = ""

    async def _save(self, directory: str, metadata: Any) -> CheckpointReply:
        started = time.perf_counter()
        await self._moves_landed()
        # --- one loop step: the metadata's copy, and SaveUnit on its way to every unit ---
        t0 = time.perf_counter()
        state = self.state
        images = [capture(p) for p in state.partitions.values()]
        uids = [img.uid for img in images]
        generation = f"gen-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S%f}-{secrets.token_hex(4)}"
        gen_dir = os.path.join(directory, generation)
        units = [(uid, u) for uid, u in state.units.items() if u.alive and uid in state.unit_peers]
        pending = list(state.grants)  # writes the copy does not hold: the units leave them out
        saves = [
            asyncio.ensure_future(state.unit_peers[uid].request(
                SaveUnit(directory=gen_dir, partitions=uids, unit=uid, exclude=pending), expect=UnitSaved, timeout=math.inf
            ))
            for uid, _ in units
        ]
        trainer = {
            "version": state.version, "weights": state.weights,
            "admission": list(state.admission) if state.admission is not None else None,
            # admission taken by puts that will never commit is not the restored cluster's
            "admitted": state.admitted - sum(g.admitted for g in state.grants.values()),
        }
        controller_pause = time.perf_counter() - t0
        # --- the files, in threads here and on the units ---
        try:
            sizes = await asyncio.to_thread(_write_images, gen_dir, images)
            saved = [reply for reply, _ in await all_or_none(*saves)]
        except BaseException:
            for fut in saves:
                fut.cancel()
            await asyncio.to_thread(shutil.rmtree, gen_dir, True)
            raise
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "generation": generation,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "metadata": metadata, "trainer": trainer,
            "partitions": [
                {"name": img.name, "uid": img.uid, "path": f"partitions/p{img.uid}.arrow", "nbytes": size,
                 "samples": _live(img)}
                for img, size in zip(images, sizes)
            ],
            "units": [
                {"unit_id": uid, "name": u.name, "files": [msgspec.to_builtins(f) for f in reply.files]}
                for (uid, u), reply in zip(units, saved)
            ],
        }
        path = await asyncio.to_thread(_commit_manifest, directory, manifest)
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

    async def _moves_landed(self) -> None:
        state = self.state
        deadline = time.monotonic() + MOVES_WAIT
        while state.moving:
            try:
                await asyncio.wait_for(state.moved.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise UnavailableError(
                    f"a checkpoint waits for no move between partitions to be under way; {state.moving} "
                    f"still were after {MOVES_WAIT:g} s"
                ) from None

    async def restore(self, ident: bytes, msg: Restore, bufs: list[Any]) -> Restored:
        directory = _absolute(msg.directory)
        self._start("a restore")
        try:
            return await self._restore(directory, replace=msg.replace)
        finally:
            self._busy = ""

    async def _restore(self, directory: str, *, replace: bool = False) -> Restored:
        started = time.perf_counter()
        state = self.state
        fresh = not state.partitions  # a fresh (or restarted) cluster takes the trainer's state too
        manifest, images = await asyncio.to_thread(read_checkpoint, directory)
        gen_dir = os.path.join(directory, manifest["generation"])
        self._check_room(images, replace)
        uids = self._new_uids(images)
        live = sorted(uid for uid, u in state.units.items() if u.alive and not u.suspect and uid in state.unit_peers)
        old_units = [(u["unit_id"], [msgspec.convert(f, UnitFile) for f in u["files"]]) for u in manifest["units"]]
        if not live and any(files for _, files in old_units):
            raise UnavailableError("load_checkpoint needs at least one live storage unit to take the payload")
        by_name = {state.units[uid].name: uid for uid in live}
        same = {int(u["unit_id"]): by_name[u["name"]] for u in manifest["units"] if u["name"] in by_name}
        mapping = _assign(old_units, live, same)
        loads: dict[int, list[UnitFile]] = {}
        for old, files in old_units:
            loads.setdefault(mapping[old], []).extend(files)
        try:
            # every unit's load runs to its end, failed or not, before what they loaded is
            # dropped: a drop overtaking a load still under way would leave its payload there
            results = await asyncio.gather(*(
                state.unit_peers[new].request(
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
        except BaseException:
            await self._unload(list(loads), [img.uid for img in images])
            raise
        # --- one loop step: the partitions replaced, the checkpoint's in their place ---
        replaced = [state.partitions[img.name] for img in images if img.name in state.partitions]
        for old_part in replaced:
            self._forget(old_part, f"partition {old_part.name!r} was replaced by load_checkpoint while get_meta waited")
        self._install(images, mapping, dict(zip(loads, replies)))
        if fresh:
            self._trainer(manifest["trainer"])
        for img in images:
            self._wake(img.name)
        self._copy_again()
        await all_or_none(*(self._free(p) for p in replaced))  # their payload, freed on every unit
        log.info(
            "loaded %s: %d partitions (%d replaced), units %s, uids %s",
            directory, len(images), len(replaced), mapping, {o: n for o, n in uids.items() if o != n},
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
        first = next(state.uids)  # every uid below it was given out here
        kept = [img.uid for img in images if img.uid >= first]
        counter = itertools.count(max([first, *(u + 1 for u in kept)]))
        uids = {img.uid: img.uid if img.uid >= first else next(counter) for img in images}
        state.uids = counter  # partitions created from now on get uids past these
        for img in images:
            img.header["uid"] = uids[img.uid]
        return uids

    def _install(self, images: list[Image], mapping: dict[int, int], loaded: dict[int, UnitLoaded]) -> None:
        state = self.state
        config = state.config
        for img in images:
            part = rebuild(img, mapping, max_samples=config.max_partition_samples, max_tasks=config.max_tasks_per_partition)
            if (part.options.replicas or config.replicas) > 1:  # a checkpoint holds one copy of each
                part.single = int(((part.samples.mask[: part.n] & (COMMITTED | EXCLUDED)) == COMMITTED).sum())
            state.partitions[part.name] = part
            state.by_uid[part.uid] = part
            state.tombstones.pop(part.name, None)  # an explicit new start, as create_partition
        for new, reply in loaded.items():
            for uid, nbytes in reply.partition_bytes.items():
                owner = state.by_uid.get(uid)
                if owner is not None:
                    owner.unit_bytes[new] = nbytes
            state.units[new].nbytes = reply.unit_bytes

    def _trainer(self, trainer: dict[str, Any]) -> None:
        state = self.state
        state.version, state.weights = int(trainer["version"]), str(trainer["weights"])
        admission = trainer["admission"]
        state.admission = (int(admission[0]), int(admission[1])) if admission is not None else None
        state.admitted = int(trainer["admitted"])

    async def resume(self, directory: str, manifest: dict[str, Any], registered: asyncio.Event, wait: float) -> None:
        """A restarted controller's restore: once every unit the checkpoint names has
        registered again (they keep their ids, see ``Liveness.known``), or ``wait`` seconds
        have passed and at least one unit lives, load the checkpoint (``registered`` is set
        at each registration)."""
        names = {str(u["name"]) for u in manifest["units"]}
        deadline = time.monotonic() + wait
        while True:
            live = {u.name for u in self.state.units.values() if u.alive and not u.suspect}
            if names <= live or (live and time.monotonic() >= deadline):
                break
            registered.clear()
            left = deadline - time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(registered.wait(), left if left > 0 else None)
        if names - live:
            log.warning(
                "restoring %s without units %s (not back after %g s): their files go to the units that are",
                directory, sorted(names - live), wait,
            )
        self._start("a restore")
        try:
            reply = await self._restore(directory)
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
            for unit in units if (peer := self.state.unit_peers.get(unit)) is not None
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


def _absolute(directory: str) -> str:
    if not isinstance(directory, str) or not os.path.isabs(directory):
        raise InvalidArgumentError(f"a checkpoint directory is an absolute path, got {directory!r}")
    return os.path.normpath(directory)


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


def _write_images(gen_dir: str, images: list[Image]) -> list[int]:
    folder = os.path.join(gen_dir, "partitions")
    os.makedirs(folder, exist_ok=True)
    sizes = [write_image(os.path.join(folder, f"p{img.uid}.arrow"), img) for img in images]
    _fsync_dir(folder)
    _fsync_dir(gen_dir)
    return sizes


def _commit_manifest(directory: str, manifest: dict[str, Any]) -> str:
    """Write the manifest beside the old one, then rename it over: the checkpoint's commit.
    Generations the new manifest does not name are deleted after."""
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)
    for entry in os.listdir(directory):
        if entry.startswith("gen-") and entry != manifest["generation"]:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    return path


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


def read_checkpoint(directory: str) -> tuple[dict[str, Any], list[Image]]:
    manifest = read_manifest(directory)
    gen_dir = os.path.join(directory, str(manifest["generation"]))
    images = []
    for entry in manifest["partitions"]:
        file = os.path.join(gen_dir, entry["path"])
        size = os.path.getsize(file) if os.path.exists(file) else -1
        if size != entry["nbytes"]:
            raise ProtocolError(f"{file} has {size} bytes, the manifest says {entry['nbytes']}: the checkpoint is damaged")
        images.append(read_image(file))
    for unit in manifest["units"]:
        for entry in unit["files"]:
            file = os.path.join(gen_dir, entry["path"])
            size = os.path.getsize(file) if os.path.exists(file) else -1
            if size != entry["nbytes"]:
                raise ProtocolError(f"{file} has {size} bytes, the manifest says {entry['nbytes']}: the checkpoint is damaged")
    return manifest, images


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
