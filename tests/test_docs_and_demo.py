"""The README's first commands and the tutorial work as a new user pastes them, and ``tqueue
demo`` completes its simulated RL flow, showing what it does and waits for."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import tqueue
import tqueue.bridges

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tutorial_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "tutorial.md").read_text(), flags=re.S)


def test_tutorial_blocks_can_be_pasted_into_a_python_prompt():
    """At the interactive prompt a compound statement (for, with, try) ends at a blank line:
    a line back at the left margin right after one is a SyntaxError there. Compiled here as
    the prompt compiles what it was given so far, without running it."""
    import code

    for block in _tutorial_blocks():
        pending: list[str] = []
        for line in [*block.splitlines(), ""]:
            pending.append(line)
            try:
                complete = code.compile_command("\n".join(pending), "<tutorial>", "single")
            except SyntaxError as exc:
                raise AssertionError(f"pasted at a Python prompt, {line!r} is a SyntaxError ({exc.msg}): "
                                     "a blank line must end the statement before it") from None
            if complete is not None:
                pending = []


_CONSOLE = """
import code, pathlib, re, sys

class Console(code.InteractiveConsole):
    failed = False

    def showtraceback(self):
        self.failed = True
        super().showtraceback()

    def showsyntaxerror(self, filename=None, **kwargs):
        self.failed = True
        super().showsyntaxerror(filename)

console = Console()
for block in re.findall(r"```python\\n(.*?)```", pathlib.Path(sys.argv[1]).read_text(), flags=re.S):
    for line in block.splitlines():
        console.push(line)
    console.push("")  # the Enter after a paste
sys.exit(1 if console.failed else 0)
"""


def test_tutorial_runs_pasted_into_a_python_prompt():
    """Each block, line by line, into the interactive console, as a reader pastes it."""
    out = subprocess.run([sys.executable, "-c", _CONSOLE, str(ROOT / "docs" / "tutorial.md")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sample 0 of field 'info' of partition 'train/step-0' holds a value of type builtins.object" in out.stdout
    assert "torch.Size([8, 250])" in out.stdout
    assert "0 ready for this task" in out.stdout
    assert "[8, 8] [" in out.stdout  # two DP shares of 8 samples
    assert "['ok', 'ok', 'ok', 'aborted', 'aborted']" in out.stdout


_RUNS = re.compile(r"<!-- runs: tests/test_docs_and_demo.py::(\w+) -->\n```python\n(.*?)```", re.S)


def test_the_api_pages_examples_run():
    """Each example of docs/api.md marked to run here, as a user runs it: a program of its own."""
    examples = _RUNS.findall((ROOT / "docs" / "api.md").read_text())
    assert {name for name, _ in examples} == {"test_the_api_pages_examples_run"} and len(examples) >= 3
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _, code in examples]  # side by side: each starts a cluster of its own
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert out.startswith("the unit holds"), out


def test_demo_quick_shows_progress_and_ends_with_its_table():
    """``--log-level`` after the command; an explicit ``--steps`` wins over ``--quick``'s; the
    micro-batch row has one count per step; the table is the last thing on stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "tqueue", "demo", "--quick", "--steps", "3", "--log-level", "INFO"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| samples consumed +\| 96 of 96 \|", out.stdout), out.stdout
    assert re.search(r"\| result +\| OK \|", out.stdout)
    assert re.search(r"\| steps left unfreed at the end +\| 0 \|", out.stdout)  # sealed steps freed themselves
    assert re.search(r"\| DP token imbalance .*\| 1\.\d+ \|", out.stdout)
    row = re.search(r"\| micro-batches per rank, steps 0-2 \(equal across ranks\) +\| ([^|]*) \|", out.stdout)
    assert row is not None and re.fullmatch(r"\d+, \d+, \d+", row[1]), out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("| result ")
    assert "tqueue.launch._local INFO local cluster up" in out.stderr
    progress = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(progress) >= 3 and "96/96 samples trained on, 96 generated" in progress[-1], out.stderr
    assert "100.0%" in progress[-1]


@pytest.mark.slow
def test_demo_says_what_it_waits_for_when_no_report_comes():
    """Its children take longer to start than the (here shortened) stall interval: the demo
    says what it waits for, then finishes as usual. (The children are spawned here, each
    importing torch, rather than forked from the demo's fork server, which starts them
    faster than any stall interval.)"""
    script = ("import multiprocessing, sys, tqueue.demos.simulated as demo, tqueue.cli; demo.STALL_SECONDS = 0.2; "
              "demo._children = lambda: multiprocessing.get_context('spawn'); "
              "sys.exit(tqueue.cli.main(['demo', '--quick', '--steps', '1']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^tqueue demo: no report for \d+ s; the 4 producer and consumer processes are starting "
                     r"\(importing torch, connecting\); (no call is parked at the controller|parked at the controller: )",
                     out.stderr, flags=re.M), out.stderr


def test_a_stalled_demo_names_the_calls_parked_at_the_controller(cluster, client, partition):
    import threading

    from tests.faults._proc import until
    from tqueue.demos.simulated import _waiting_for

    waiting = threading.Thread(target=lambda: pytest.raises(
        tqueue.PartitionClearedError, client.get_meta, partition, ["x"], 4, task="train", timeout=30))
    client.put(partition, {"x": torch.arange(2)})
    waiting.start()
    try:
        with tqueue.Client(cluster.address) as other:
            until(lambda: other.status().waiting, 10, "the call parked")
            assert _waiting_for(other, [], True).startswith(  # then the controller's own words
                f"parked at the controller: get_meta on {partition} (task train): "
                "get_meta for 4 samples with fields ['x']: 2 ready for this task")
    finally:
        client.clear(partition)
        waiting.join(30)


def test_readme_starts_with_the_two_commands_and_says_where_cpu_torch_comes_from():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)
    pin = "torch==2.13.0"
    assert blocks[:2] == [
        ("bash", f"python3 -m venv .venv && .venv/bin/pip install -q {pin} && .venv/bin/pip install -q -e . && "
                 ".venv/bin/tqueue demo\n"),
        ("bash", f"python3 -m venv .venv && .venv/bin/pip install -q {pin} && .venv/bin/pip install -q -e '.[test]' && "
                 ".venv/bin/python -m pytest -q\n"),
    ]
    top = text.split("\n---\n")[0]
    assert f"pip install -q {pin} --index-url https://download.pytorch.org/whl/cpu" in top
    assert "the name tqueue on PyPI belongs to another project" in top


def test_the_engine_demo_without_its_extra_names_the_install_command():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the integration tier runs the demo")
    out = subprocess.run([sys.executable, "-m", "tqueue", "demo", "--engine", "vllm"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1  # one line, no traceback
    assert out.stderr.count("\n") == 1 and re.match(r"tqueue: error: tqueue demo --engine vllm needs vllm\b.*pip install",
                                                     out.stderr, flags=re.I), out.stderr
    with pytest.raises(ImportError, match=r"VLLMEngine needs vllm \(the 'vllm' extra\): from a checkout of tqueue, pip install -e '\.\[vllm\]'"):
        tqueue.bridges.VLLMEngine(object())


def _fails(plan, rank, out):
    raise RuntimeError(f"simulated: rank {rank} lost its controller")


def test_a_demo_child_that_fails_reports_its_traceback_and_exits_1_without_printing_it(capfd):
    """A child's failure reaches the demo as a report, printed there (and not at all once
    the demo was interrupted): a Ctrl-C stops the servers first, and a child whose controller
    went away must not print a traceback of its own. A demo already gone is no error."""
    import multiprocessing

    from tqueue.demos.simulated import Plan, _child

    plan = Plan(address="tcp://127.0.0.1:1", steps=1, prompts=1, group_size=1, producers=1, consumers=1, units=1,
                max_response=16, max_tokens=64)
    recv, send = multiprocessing.Pipe(duplex=False)
    with pytest.raises(SystemExit) as stopped:
        _child(_fails, plan, 3, send)
    assert stopped.value.code == 1
    report = json.loads(recv.recv_bytes())
    assert report["kind"] == "error" and "RuntimeError: simulated: rank 3 lost its controller" in report["traceback"]
    recv.close()
    with pytest.raises(SystemExit):
        _child(_fails, plan, 3, send)  # nobody reads any more: the child still just exits
    send.close()
    assert "Traceback" not in capfd.readouterr().err
