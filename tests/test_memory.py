"""Batch buffers are recycled only once nothing refers to them any more."""

from __future__ import annotations

import gc

import torch

from tqueue._memory import MIN_POOLED, BufferPool


def test_a_buffer_is_reused_after_its_tensors_are_gone():
    pool = BufferPool(max_idle_bytes=64 << 20)
    a = pool.take(4 << 20)
    addr = a.ctypes.data
    t = torch.from_numpy(a).view(torch.float32)[10:]  # a view of a view keeps it alive
    del a
    gc.collect()
    b = pool.take(4 << 20)
    assert b.ctypes.data != addr  # t still uses the first buffer
    del t, b
    gc.collect()
    assert pool.idle_bytes >= 8 << 20
    c = pool.take(4 << 20)
    assert pool.reused == 1 and c.nbytes == 4 << 20


def test_best_fit_and_limits():
    pool = BufferPool(max_idle_bytes=10 << 20)
    big, small = pool.take(8 << 20), pool.take(2 << 20)
    del big, small
    gc.collect()
    assert pool.idle_bytes == 10 << 20
    _held = pool.take((2 << 20) - 100)  # the 2 MiB buffer fits; the 8 MiB one would waste too much
    assert pool.idle_bytes == 8 << 20 and pool.reused == 1  # the 8 MiB one is still idle
    y = pool.take(16 << 20)  # too big for either: a new buffer
    assert pool.allocated == 3
    del y
    gc.collect()
    assert pool.idle_bytes == 8 << 20  # the 2 MiB one is back; 16 MiB would exceed max_idle_bytes: freed instead
    assert pool.take(MIN_POOLED - 1).base is None  # tiny requests are plain allocations


def test_a_slice_keeps_its_buffer_out_of_the_pool():
    """numpy points a slice at the memory's exporter, not at the array it was cut from:
    a slice alone must still hold the buffer, or the next take() would reuse it."""
    pool = BufferPool(max_idle_bytes=64 << 20)
    whole = pool.take(4 << 20)
    part = whole[1 << 20 : 2 << 20]
    part[:] = 7
    del whole
    gc.collect()
    assert pool.idle_bytes == 0
    other = pool.take(4 << 20)
    other[:] = 1
    assert pool.allocated == 2 and int(part.min()) == 7
    del part
    gc.collect()
    assert pool.idle_bytes == 4 << 20
