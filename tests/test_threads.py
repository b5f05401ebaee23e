"""Large copies split over two threads land every byte where it belongs."""

from __future__ import annotations

import numpy as np
import pytest

from tqueue._threads import SPLIT_MIN, copy_bytes


@pytest.mark.parametrize("n", [0, 1, 4097, SPLIT_MIN - 1, SPLIT_MIN, SPLIT_MIN + 4095, 3 * SPLIT_MIN + 12345])
def test_copy_bytes_is_exact_on_both_sides_of_the_split(n: int) -> None:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.full(n + 2, 0xAB, dtype=np.uint8)  # a guard byte either side
    copy_bytes(dst[1 : n + 1], src)
    assert np.array_equal(dst[1 : n + 1], src)
    assert dst[0] == 0xAB and dst[-1] == 0xAB


def test_copy_bytes_raises_on_a_size_mismatch_and_leaves_no_thread_busy() -> None:
    src = np.ones(SPLIT_MIN * 2, dtype=np.uint8)
    with pytest.raises(ValueError):
        copy_bytes(np.zeros(SPLIT_MIN * 2 - 1, dtype=np.uint8), src)
    dst = np.zeros_like(src)
    copy_bytes(dst, src)  # the helper thread is free again
    assert int(dst.sum()) == src.nbytes
