"""CRC-32C of many ranges of one buffer (tqueue/wire/_crc.py): the native pass (native/crc.c)
and the one-call-per-range fallback agree with the crc32c package on every range."""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest

from tqueue.wire import _crc


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    if request.param == "native":
        if _crc._native_crc is None:
            pytest.skip("tqueue.wire._native_crc is not built, or this CPU has no SSE4.2")
    else:
        monkeypatch.setattr(_crc, "_native_crc", None)
    return request.param


def test_every_range_agrees_with_the_crc32c_package(path):
    buf = np.frombuffer(os.urandom(1 << 16), dtype=np.uint8)
    rng = np.random.default_rng(3)
    offsets = rng.integers(0, 1 << 15, 500)
    sizes = np.concatenate([rng.integers(0, 1 << 15, 497), [0, 1, 7]])  # empty, and shorter than a word
    got = _crc.ranges(buf, offsets, sizes)
    assert got.tolist() == [crc32c.crc32c(buf[o : o + s]) for o, s in zip(offsets.tolist(), sizes.tolist())]
    check = np.frombuffer(b"123456789", dtype=np.uint8)
    assert _crc.ranges(check, np.array([0]), np.array([9])).tolist() == [0xE3069283]  # the CRC-32C check value


def test_a_range_outside_the_buffer_is_refused_before_any_byte_is_read():
    if _crc._native_crc is None:
        pytest.skip("tqueue.wire._native_crc is not built, or this CPU has no SSE4.2")
    buf = np.zeros(100, dtype=np.uint8)
    out = np.empty(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"range 1 \[90, \+11\) lies outside the buffer of 100 bytes"):
        _crc._native_crc.crc_ranges(buf, np.array([0, 90], dtype=np.int64), np.array([10, 11], dtype=np.int64), out)
    with pytest.raises(ValueError, match="range 0"):
        _crc._native_crc.crc_ranges(buf, np.array([-1], dtype=np.int64), np.array([1], dtype=np.int64), out[:1])
