"""The tutorial runs as written, and ``tqueue demo`` completes its simulated RL flow."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import tqueue
import tqueue.bridges

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tutorial_runs(tmp_path):
    text = (ROOT / "docs" / "tutorial.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    script = tmp_path / "tutorial.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sample 0 of field 'info' of partition 'train/step-0' holds a value of type builtins.object" in out.stdout
    assert "torch.Size([8, 250])" in out.stdout
    assert "0 ready for this task" in out.stdout
    assert "[8, 8] [" in out.stdout  # two DP shares of 8 samples
    assert "['ok', 'ok', 'ok', 'aborted', 'aborted']" in out.stdout


def test_demo_quick_runs_end_to_end():
    out = subprocess.run(
        [sys.executable, "-m", "tqueue", "demo", "--quick"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| samples consumed +\| 64 of 64 \|", out.stdout), out.stdout
    assert re.search(r"\| result +\| OK \|", out.stdout)
    assert re.search(r"\| steps left unfreed at the end +\| 0 \|", out.stdout)  # sealed steps freed themselves
    assert re.search(r"\| DP token imbalance .*\| 1\.\d+ \|", out.stdout)
    assert "100.0%" in out.stderr  # the progress display reached the end


def test_the_engine_demo_without_its_extra_names_the_install_command():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the integration tier runs the demo")
    out = subprocess.run([sys.executable, "-m", "tqueue", "demo", "--engine", "vllm"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError: tqueue demo --engine vllm needs vLLM: pip install 'tqueue[vllm]'" in out.stderr
    with pytest.raises(ImportError, match=r"the vLLM bridge needs vLLM: pip install 'tqueue\[vllm\]'"):
        tqueue.bridges.VLLMEngine(object())
