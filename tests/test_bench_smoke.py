"""The benchmark harness runs end to end and writes what it says it wrote (figures are not
asserted: speed targets live in benchmarks/, not in tests)."""

from __future__ import annotations

import json
import pathlib
import platform
import subprocess
import sys

from benchmarks import e2e


def wrote(stdout: str) -> list[pathlib.Path]:
    lines = [line for line in stdout.splitlines() if line.startswith("wrote ")]
    assert len(lines) == 1, stdout
    return [pathlib.Path(p) for p in lines[0][len("wrote ") :].split(", ")]


def test_bench_smoke_runs_two_systems_and_writes_table_and_json(tmp_path):
    """One run of 32 samples through tqueue and raw ZeroMQ: every sample reached its consumer
    (the systems check that), and both outputs hold both systems and the comparison tables."""
    out = subprocess.run(
        [sys.executable, "-m", "tqueue", "bench", "--smoke", "--systems", "tqueue,zmq-raw", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert {(r["system"], r["scenario"], r["size"]) for r in data["results"]} == {
        ("tqueue", "1to1", 32),
        ("zmq-raw", "1to1", 32),
    }
    assert all(r["nbytes"] > 32 * 100_000 and r["e2e_s"] > 0 for r in data["results"])
    assert not [n for n in data["notes"] if "failed" in n]
    text = (tmp_path / "results.md").read_text()
    assert "| 1to1 | 32 |" in text and "| 1to1 | 32 | tqueue | zmq-raw |" in text
    assert "Copies of each payload byte" in text
    assert all(p.exists() for p in wrote(out.stdout))


def test_without_matplotlib_no_plot_is_claimed(tmp_path, monkeypatch, capsys):
    """Without matplotlib the run says "no plot" and does not say it wrote throughput.png."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = e2e.Result("tqueue", "1to1", 32, "tcp", 4_000_000, 0.01, 0.001, 0.01, 0.02)
    fake = {
        "results": [{**vars(result), "gbps": result.gbps}],
        "notes": [],
        "copies": {"tqueue": "none"},
        "machine": {"cpus": 2, "python": platform.python_version(), "platform": "test"},
        "seconds": 1.0,
        "args": {},
    }
    monkeypatch.setattr(e2e, "run", lambda args: fake)
    assert e2e.main(["--quick", "--out", str(tmp_path)]) == 0
    paths = wrote(capsys.readouterr().out)
    assert tmp_path / "throughput.png" not in paths
    assert all(p.exists() for p in paths) and len(paths) == 2
    assert "no plot" in (tmp_path / "results.md").read_text()


def test_compare_puts_two_labelled_sets_of_runs_side_by_side(tmp_path):
    from benchmarks import compare

    def runs(folder: str, gbps: list[float]) -> str:
        records = [{"system": "tqueue", "scenario": "1to1", "size": 1024, "gbps": g, "put_s": 0.1, "get_s": 0.2} for g in gbps]
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps({"results": records}))
        return str(tmp_path / folder)

    before = f"before={runs('b1', [1.0, 3.0])},{runs('b2', [2.0])}"
    after = f"after={runs('a1', [3.0, 5.0, 4.0])}"
    assert compare.main([before, after, "--out", str(tmp_path / "t.md")]) == 0
    row = (tmp_path / "t.md").read_text().splitlines()[2]
    assert row == "| 1to1 | 1024 | tqueue | 2.00 | 4.00 | 100 / 200 | 100 / 200 | 3 + 3 | 2.00x |"
