"""Checksums end to end: each sample's CRC-32C, computed once by its producer over the bytes
it put, kept by the unit beside them, and checked by every reader as the bytes arrive.

The CRC covers a sample's bytes as readers get them back: a tensor's raw bytes in C order,
an object value's MessagePack bytes. Integers narrowed for the trip (``pack_ints``) are
checked as they would be widened, through a small buffer (:func:`crcs_widened`): a reader that
keeps them narrow never holds them wide. A mismatch is a :class:`~tqueue.errors.DataCorruptionError` naming the
partition, the samples, the field and the unit; :mod:`._gets` reports it to the controller,
which drops that copy, and reads the other copy where the partition keeps one.

``ClientConfig.checksums`` turns it on for every route that crosses a socket (the default);
``ClientConfig.arena_checksums`` adds the same-host arena, where checking costs more than the
bytes' trip (docs/performance.md gives the figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._threads import on_two_threads, worth_splitting
from ..errors import DataCorruptionError
from ..wire import BatchMeta, FieldBlock
from ..wire._crc import extend, ranges
from ..wire._layout import frame_layout, int_dtype
from ..wire._pack import PACKED, widen
from ._args import listed
from ._assemble import Part
from ._encode import Encoded

__all__ = ["checksum", "crcs_of", "verify", "verify_rows"]


def _bytes(frame: Any) -> np.ndarray:
    return np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)


def crcs_of(block: FieldBlock, frames: Sequence[Any]) -> np.ndarray:
    """Per sample of ``block`` (wide frames, checked against it), the CRC-32C of its bytes;
    a big block's samples on two threads (the CRC releases the GIL)."""
    frame_of, offsets, sizes = frame_layout(block, frames)
    out = np.empty(len(sizes), dtype=np.int64)
    bufs = [_bytes(f) for f in frames]
    if len(bufs) == 1:
        _fill(out, bufs[0], offsets, sizes)
        return out
    for f, buf in enumerate(bufs):
        sel = np.flatnonzero(frame_of == f)
        if len(sel):
            out[sel] = _fill(np.empty(len(sel), dtype=np.int64), buf, offsets[sel], sizes[sel])
    return out


def _fill(out: np.ndarray, buf: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``out[i]``: the CRC-32C of ``buf[offsets[i] : offsets[i] + sizes[i]]``; halves on two
    threads where the bytes are many."""
    n = len(out)
    if n > 1 and worth_splitting(int(sizes.sum())):
        half = n // 2

        def lower() -> None:
            out[:half] = ranges(buf, offsets[:half], sizes[:half])

        def upper() -> None:
            out[half:] = ranges(buf, offsets[half:], sizes[half:])

        on_two_threads(lower, upper)
    else:
        out[:] = ranges(buf, offsets, sizes)
    return out


def checksum(enc: Encoded) -> None:
    """Give every block of ``enc`` whose bytes are on the host its samples' CRC-32Cs (once;
    the blocks of a put travel to every copy, narrowed or not, with them)."""
    at = 0
    for i, block in enumerate(enc.blocks):
        k = len(block.counts)
        frames = enc.buffers[at : at + k]
        at += k
        if block.crcs is not None or i in enc.on_device:
            continue  # done, or still on its device (the arena route copies it there directly)
        block.crcs = crcs_of(block, frames).tolist()


def verify(meta: BatchMeta, unit_id: int, part: Part, *, assembled: bool = True) -> None:
    """Check every sample of ``part`` (one unit's answer) against its CRC-32C; raise
    :class:`DataCorruptionError` naming the samples of the first field that fails. With
    ``assembled``, dense fields whose frames are packed are left to :func:`verify_rows`
    (listed in ``part.unchecked``): they are checked in the batch's rows, once widened there,
    rather than widened once more here."""
    part.unit = unit_id
    for name, (block, frames) in part.blocks.items():
        if block.crcs is None:
            continue
        want = np.asarray(block.crcs, dtype=np.int64)
        packed = block.packed is not None and any(block.packed)
        if packed and assembled and block.spec.layout == "dense":
            part.unchecked.append(name)
            continue
        got = crcs_widened(block, frames) if packed else crcs_of(block, frames)
        _compare(meta, unit_id, name, _holders(part.positions, block), want, got)


_SCRATCH = 1 << 20  # bytes of widened values one pass of crcs_widened checks


def crcs_widened(block: FieldBlock, frames: Sequence[Any]) -> np.ndarray:
    """:func:`crcs_of` for a block whose frames hold packed integers: each value's CRC-32C
    as the reader gets it back, widened, computed through a small buffer a run of values at a
    time, so no widened copy of the block is made (a reader that keeps the field narrow,
    ``get_data(dtype=...)``, never holds it wide)."""
    wide = int_dtype(block.spec)
    assert wide is not None and block.packed is not None  # only integer fields are packed
    frame_of, offsets, sizes = frame_layout(block, frames)  # checks the header against the frames
    out = np.empty(len(sizes), dtype=np.int64)
    scratch = np.empty(_SCRATCH // wide.itemsize, dtype=wide)
    for f, frame in enumerate(frames):
        sel = np.flatnonzero(frame_of == f)
        if not len(sel):
            continue
        buf = _bytes(frame)
        if not block.packed[f]:
            out[sel] = _fill(np.empty(len(sel), dtype=np.int64), buf, offsets[sel], sizes[sel])
            continue
        narrow = PACKED[block.packed[f]]
        values = buf.view(narrow)
        firsts = (offsets[sel] // narrow.itemsize).tolist()
        counts = (sizes[sel] // narrow.itemsize).tolist()
        i = 0
        while i < len(sel):
            if counts[i] > len(scratch):  # a big value: its CRC extended a buffer at a time
                value = 0
                for a in range(firsts[i], firsts[i] + counts[i], len(scratch)):
                    k = min(len(scratch), firsts[i] + counts[i] - a)
                    widen(scratch[:k], values[a : a + k])
                    value = extend(value, scratch[:k].view(np.uint8))
                out[sel[i]] = value
                i += 1
                continue
            j, end = i + 1, firsts[i] + counts[i]  # a run of values back to back that fits the buffer
            while j < len(sel) and firsts[j] == end and end + counts[j] - firsts[i] <= len(scratch):
                end += counts[j]
                j += 1
            widen(scratch[: end - firsts[i]], values[firsts[i] : end])
            starts = (np.asarray(firsts[i:j], dtype=np.int64) - firsts[i]) * wide.itemsize
            out[sel[i:j]] = ranges(scratch.view(np.uint8), starts, np.asarray(counts[i:j], dtype=np.int64) * wide.itemsize)
            i = j
    return out


def _holders(positions: np.ndarray, block: FieldBlock) -> np.ndarray:
    """The batch position that names each of a block's values: its sample's, or for a block
    of values shared by content (``value_of``), its first holder's."""
    if block.rows_per_sample is not None:  # a sample appends grew: each of its rows
        return np.repeat(positions, np.asarray(block.rows_per_sample, dtype=np.int64))
    if block.value_of is None:
        return positions
    _, first = np.unique(np.asarray(block.value_of, dtype=np.int64), return_index=True)
    return positions[first]


def verify_rows(meta: BatchMeta, parts: Sequence[Part], values: Mapping[str, Any]) -> None:
    """Check the fields :func:`verify` left for later in the assembled batch ``values``."""
    for part in parts:
        for name in part.unchecked:
            block = part.blocks[name][0]
            value = values[name]
            raw = (value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)).reshape(-1).view(np.uint8)
            row = raw.nbytes // max(len(meta.indexes), 1)
            got = _fill(np.empty(len(part.positions), dtype=np.int64), raw, part.positions.astype(np.int64) * row,
                        np.full(len(part.positions), row, dtype=np.int64))
            _compare(meta, part.unit, name, part.positions, np.asarray(block.crcs, dtype=np.int64), got)


def _compare(meta: BatchMeta, unit_id: int, name: str, positions: np.ndarray, want: np.ndarray, got: np.ndarray) -> None:
    bad = np.flatnonzero((want >= 0) & (got != want)) if len(want) == len(got) else np.arange(len(got))
    if not len(bad):
        return
    samples = np.asarray(meta.indexes, dtype=np.int64)[positions][bad].tolist()
    err = DataCorruptionError(
        f"partition {meta.partition!r}: field {name!r} of samples {listed(samples)} on storage unit "
        f"{unit_id} fails its CRC-32C check (stored {int(want[bad[0]]):#010x}, read "
        f"{int(got[bad[0]]):#010x} for sample {samples[0]}): the bytes changed after the put; "
        "they are not served"
    )
    err.partition, err.field, err.samples, err.unit_id = meta.partition, name, samples, unit_id  # type: ignore[attr-defined]
    raise err
