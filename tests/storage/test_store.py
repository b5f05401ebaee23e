"""The unit's columnar store alone: bytes kept as received, reads coalesced, rollback exact."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tqueue.errors import SchemaError
from tqueue.storage._store import SMALL_RUN
from tqueue.storage._store import PayloadStore as Store
from tqueue.transport._arena import Arena
from tqueue.wire import FieldBlock, FieldSpec

ROW = 1 << 17  # bigger than SMALL_RUN: each run goes out as its own zero-copy slice


def dense(name, counts, row_bytes=ROW):
    return FieldBlock(name=name, spec=FieldSpec(kind="tensor", dtype="uint8", shape=(row_bytes,)), counts=counts)


def rows(values, row_bytes=ROW):
    return bytearray(b"".join(bytes([v]) * row_bytes for v in values))


def test_read_slices_received_frames_without_copy():
    s = Store()
    frame = rows(range(6))
    s.write(1, "p", np.arange(6), [dense("x", [6])], [frame])
    r = s.read(1, "p", np.array([1, 2, 3]), ["x"])
    blocks, frames = r.blocks, r.frames
    assert blocks[0].counts == [3] and len(frames) == 1
    assert bytes(frames[0]) == bytes(rows([1, 2, 3]))
    frame[ROW] = 99  # the answer is a view of the stored frame
    assert frames[0][0] == 99 and s.copied == 0


def test_scattered_read_gives_one_frame_per_run():
    s = Store()
    s.write(1, "p", np.arange(6), [dense("x", [3, 3])], [rows([0, 1, 2]), rows([3, 4, 5])])
    r = s.read(1, "p", np.array([5, 0, 1, 2, 3]), ["x"])
    blocks, frames = r.blocks, r.frames
    # 5 | 0 1 2 | 3: runs break at the frame edge and where order jumps
    assert blocks[0].counts == [1, 3, 1] and len(frames) == 3
    assert b"".join(bytes(f) for f in frames) == bytes(rows([5, 0, 1, 2, 3]))


def test_tiny_runs_are_joined_into_one_frame():
    s = Store()
    small = 16
    s.write(1, "p", np.arange(8), [dense("x", [8], small)], [rows(range(8), small)])
    r = s.read(1, "p", np.array([7, 5, 3, 1]), ["x"])
    blocks, frames = r.blocks, r.frames
    assert blocks[0].counts == [4] and len(frames) == 1
    assert bytes(frames[0]) == bytes(rows([7, 5, 3, 1], small))
    assert s.copied == 4 * small < SMALL_RUN


def test_overwrite_frees_the_old_piece_and_rollback_restores_it():
    s = Store()
    s.write(1, "p", np.arange(2), [dense("x", [2])], [rows([1, 2])])
    assert s.nbytes == 2 * ROW
    pending = s.write(1, "p", np.arange(2), [dense("x", [2])], [rows([7, 8])])
    assert s.nbytes == 2 * ROW  # the first piece has no live sample left
    assert bytes(s.read(1, "p", np.arange(2), ["x"]).frames[0]) == bytes(rows([7, 8]))
    pending.rollback()
    assert s.nbytes == 2 * ROW
    assert bytes(s.read(1, "p", np.arange(2), ["x"]).frames[0]) == bytes(rows([1, 2]))


def test_rollback_of_a_first_write_forgets_the_partition():
    s = Store()
    s.write(3, "p", np.arange(2), [dense("x", [2])], [rows([1, 2])]).rollback()
    assert s.nbytes == 0 and 3 not in s.partitions


def test_drop_then_rollback_does_not_double_count():
    s = Store()
    pending = s.write(3, "p", np.arange(2), [dense("x", [2])], [rows([1, 2])])
    assert s.drop(3) == 2 * ROW and s.nbytes == 0
    pending.rollback()
    assert s.nbytes == 0


def test_reading_a_missing_field_names_sample_and_field():
    s = Store()
    s.write(1, "p", np.arange(2), [dense("x", [2])], [rows([1, 2])])
    with pytest.raises(SchemaError, match=r"sample 5 of partition 'p' has no field 'x' on this unit"):
        s.read(1, "p", np.array([0, 5]), ["x"])
    with pytest.raises(SchemaError, match=r"sample 0 of partition 'p' has no field 'y'"):
        s.read(1, "p", np.array([0]), ["y"])


# --- the shared-memory arena -------------------------------------------------------------


def test_arena_allocates_frees_and_coalesces():
    arena = Arena(1 << 20)
    try:
        a, b, c = arena.alloc(100), arena.alloc(5000), arena.alloc(4096)
        assert (a.offset, b.offset, c.offset) == (0, 4096, 4096 * 3)  # page-aligned sizes
        assert arena.alloc(1 << 21) is None  # full: the caller falls back to sockets
        arena.decref(b)
        arena.decref(a)
        assert arena.alloc(3 * 4096).offset == 0  # a and b merged back into one range
        arena.incref(c)
        arena.decref(c)
        assert arena.used == 3 * 4096 + 4096  # c still has its first reference
    finally:
        arena.close()


def test_arena_pages_freed_after_a_punch_go_back_at_the_next():
    """A region that frees after a punch (its reader released it once the partition was
    cleared) is punched by the next one: its pages did stay mapped."""
    import os

    arena = Arena(8 << 20)
    try:
        a, b = arena.alloc(1 << 20), arena.alloc(1 << 20)
        arena.view[a.offset : b.end] = b"\1" * (2 << 20)
        assert arena.decref(a)  # a is free
        assert arena.punch() == (8 << 20) - (1 << 20)  # all but b, still held
        assert os.fstat(arena.fd).st_blocks * 512 == 1 << 20
        assert arena.decref(b)  # its last reference: free
        assert arena.punch() == 8 << 20 and os.fstat(arena.fd).st_blocks == 0
    finally:
        arena.close()


def arena_store():
    arena = Arena(8 << 20)
    released = []
    store = Store(arena, lambda region: released.append(region) or arena.decref(region))
    region = arena.alloc(4 * ROW)
    arena.view[region.offset : region.offset + 4 * ROW] = rows([1, 2, 3, 4])
    view = arena.view[region.offset : region.offset + 4 * ROW]
    store.write(1, "p", np.arange(4), [dense("x", [4])], [view], arena=[region.offset], region=region).commit()
    arena.decref(region)  # the allocation's own reference; the piece holds one now
    return arena, store, region, released


def test_same_host_reads_are_ranges_and_hold_the_region():
    arena, store, region, _ = arena_store()
    try:
        r = store.read(1, "p", np.array([1, 2]), ["x"], shm=True)
        assert r.frames == [] and r.refs == [[region.offset + ROW, 2 * ROW]]
        assert r.held == [region] and region.refs == 2
        store.drop(1)
        assert region.refs == 1 and arena.used == region.length  # the reader still holds it
        arena.decref(region)  # Release
        assert arena.used == 0
    finally:
        arena.close()


def test_socket_reads_of_arena_bytes_hold_until_the_send_is_done():
    arena, store, region, released = arena_store()
    try:
        r = store.read(1, "p", np.array([0, 1, 2, 3]), ["x"])
        assert r.refs is None and len(r.frames) == 1 and region.refs == 2
        assert bytes(r.frames[0]) == bytes(rows([1, 2, 3, 4]))
        store.drop(1)
        assert arena.used == region.length
        del r
        gc.collect()  # ZeroMQ letting go of the frame
        assert released == [region] and arena.used == 0
    finally:
        arena.close()


@pytest.mark.parametrize("order", [pytest.param("first-fails", id="first-fails"), pytest.param("second-fails", id="second-fails")])
def test_two_uncommitted_writes_of_the_same_samples_roll_back_in_any_order(order):
    """Both writes are installed before either commits (each waits on the controller); the
    one whose commit fails must not undo the other (it raised KeyError before)."""
    s = Store()
    s.write(1, "p", np.arange(2), [dense("x", [2])], [rows([1, 2])]).commit()
    a = s.write(1, "p", np.arange(2), [dense("x", [2])], [rows([3, 4])])
    b = s.write(1, "p", np.array([1]), [dense("x", [1])], [rows([5])])
    if order == "first-fails":
        a.rollback()
        b.commit()
        want, held = [1, 5], 3 * ROW  # a goes; sample 0 is the committed one again, whose
        # frame (two rows) stays held beside b's
    else:
        b.rollback()
        a.commit()
        want, held = [3, 4], 2 * ROW
    got = s.read(1, "p", np.arange(2), ["x"]).frames
    assert bytes(b"".join(bytes(f) for f in got)) == bytes(rows(want))
    assert s.nbytes == held
    s.drop(1)
    assert s.nbytes == 0 and s.resident == 0
