"""64 producers and 16 consumers (each client its own session) on a local cluster for a
bounded time: every sample's bytes are checked on arrival against the CRC put with them and
against their generator, and every acknowledged put is consumed exactly once."""

from __future__ import annotations

import pytest

from benchmarks import soak


@pytest.mark.soak
def test_64_producers_and_16_consumers_lose_nothing_and_corrupt_nothing():
    result = soak.run(producers=64, consumers=16, seconds=8.0, processes=2, units=2, rows=1024)
    print(f"\nsoak: {result}")
    assert result["consumed"] == result["samples"] > 64 * soak.SAMPLES_PER_PUT
    assert result["bytes_verified"] == result["samples"] * 1024 * 4
    assert result["lost"] == result["twice"] == result["stray"] == 0
