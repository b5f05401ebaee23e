"""The benchmark suite's quick mode runs and writes its three outputs (figures are not
asserted: speed targets live in benchmarks/, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_quick_writes_table_json_and_skips_missing_peers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tqueue", "bench", "--quick", "--systems", "tqueue,tqueue-wide,tqueue-shm,zmq-raw", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    systems = {r["system"] for r in data["results"]}
    assert systems == {"tqueue", "tqueue-wide", "tqueue-shm", "zmq-raw"}
    assert {r["scenario"] for r in data["results"]} == {"1to1", "1to4"}
    text = (tmp_path / "results.md").read_text()
    assert "| 1to1 | 256 |" in text and "zmq-raw" in text and "Copies of each payload byte" in text
