"""The command line: servers started from a shell take every config setting as a flag, limits
included; errors are one line with an exit code; the help and the docs say the same."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError
from tqueue.launch._serve import READY

from .servers import server


def test_a_controller_started_with_a_limit_flag_enforces_it():
    with server("controller", "--max-samples-per-request", "4") as address:
        with server("storage-unit", "--controller", address, "--max-frames", "1024"):
            with tqueue.Client(address) as client:
                with pytest.raises(InvalidArgumentError, match=r"count=5 is out of bounds: at most 4"):
                    client.put("p", {"x": torch.arange(5)})
                client.put("p", {"x": torch.arange(4)})
                batch = client.get_data("p", ["x"], 4, task="t", timeout=10)
                assert torch.equal(batch["x"], torch.arange(4))
                assert {u.address for u in client.status().units} != set()


def test_every_config_field_has_a_flag():
    import dataclasses

    from tqueue.cli import _parser

    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command, config, handled in (
        ("controller", tqueue.ControllerConfig, {"policies": "--policy"}),
        ("storage-unit", tqueue.StorageConfig, {}),
    ):
        flags = {opt for action in commands[command]._actions for opt in action.option_strings}
        for field in dataclasses.fields(config):
            assert handled.get(field.name, "--" + field.name.replace("_", "-")) in flags, (command, field.name)


def _cli(*args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tqueue", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_a_unit_joins_late_and_status_and_top_show_the_cluster():
    """Servers as separate processes, as from Slurm or Kubernetes: a second unit joins a
    running controller and receives placements; ``tqueue status`` and ``tqueue top`` show
    partitions, tasks, units and what each waiting call waits for."""
    import json

    with server("controller", "--metrics-port", "0") as address, server("storage-unit", "--controller", address, "--name", "first"):
        with tqueue.Client(address) as client:
            client.put("early", {"x": torch.arange(8)})
            with server("storage-unit", "--controller", address, "--name", "late"):
                units = {u.name: u for u in client.status().units}
                assert set(units) == {"first", "late"} and units["late"].nbytes == 0
                metas = [client.put(f"later-{i}", {"x": torch.arange(64)}) for i in range(4)]
                late = units["late"].unit_id
                assert any(late in m.units for m in metas)  # the least loaded unit: placements reach it
                client.get_meta("early", ["x"], 3, task="train", timeout=5)  # leased, not acked
                text = _cli("status", address)
                assert f"tqueue at {address}: trainer version 0; metrics http://127.0.0.1:" in text
                assert "partitions (5)" in text and "storage units (2)" in text
                line = next(x for x in text.splitlines() if x.startswith("early "))
                assert line.split()[1:3] == ["8", "8"] and "open" in line
                assert "  task train" in text and "leased 3, consumed 0" in text
                assert any(x.split()[1] == "late" and "alive" in x for x in text.splitlines() if x[:1].isdigit())
                status = json.loads(_cli("status", address, "--json"))
                assert {p["name"] for p in status["partitions"]} == {"early", "later-0", "later-1", "later-2", "later-3"}
                # a call waiting for samples that are not there: status says what it waits for
                import threading

                waiting = threading.Thread(
                    target=lambda: pytest.raises(tqueue.PartitionClearedError, client.get_meta, "early", ["x"], 9,
                                                 task="other", timeout=20))
                waiting.start()
                try:
                    from tests.faults._proc import until

                    until(lambda: client.status().waiting, 10, "the call parked")
                    text = _cli("status", address)
                    assert "waiting calls (1)" in text
                    assert "get_meta  early      other  get_meta for 9 samples with fields ['x']: 8 ready for this task" in text
                    frames = _cli("top", address, "--iterations", "2", "--interval", "0.2")
                    assert frames.count("--- ") == 2 and frames.count("partitions (5)") == 2
                    assert "consumed 0, 0.0/s" in frames  # rates from the second frame on
                finally:
                    client.clear("early")  # the waiting call ends (cleared)
                    waiting.join(30)


# --- the command line as a new user meets it --------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
COMMANDS = ["controller", "storage-unit", "status", "top", "checkpoint", "restore", "ingest", "demo", "bench"]


def _run(*args: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tqueue", *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        pytest.param([], 2, "the following arguments are required: COMMAND", id="no-command"),
        pytest.param(["demo", "--steps", "x"], 2, "argument --steps: expected a positive integer, got 'x'", id="bad-value"),
        pytest.param(["--log-level", "loud", "status", "a"], 2, "argument --log-level: invalid choice", id="bad-level"),
        pytest.param(["demo", "--trainer", "megatron"], 2, "--trainer megatron needs --engine vllm", id="trainer-alone"),
        pytest.param(["demo", "--verbose"], 2, "--verbose needs --engine vllm", id="verbose-alone"),
        pytest.param(["demo", "--prompts", "7"], 2, "--prompts (7) must be a multiple of --consumers (2)", id="prompts"),
        pytest.param(["ingest", "tcp://127.0.0.1:9"], 2, "tqueue ingest needs a bearer token", id="no-token"),
        pytest.param(["ingest", "tcp://127.0.0.1:9", "--token-file", "/nonexistent/token"], 1,
                     "No such file or directory: '/nonexistent/token'", id="os-error"),
    ],
)
def test_an_error_is_one_line_and_an_exit_code(args, code, message):
    out = _run(*args, env={**os.environ, "TQUEUE_INGEST_TOKEN": ""})
    assert out.returncode == code, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("tqueue: error: "), out.stderr
    assert message in out.stderr


def test_an_unreachable_controller_is_one_line_and_exit_code_1():
    address = f"tcp://127.0.0.1:{_closed_port()}"
    out = _run("status", address)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("tqueue: error: "), out.stderr
    assert address in out.stderr


@pytest.mark.parametrize("where", ["first", "last"])
def test_debug_anywhere_shows_the_traceback(where):
    args = ["ingest", "tcp://127.0.0.1:9", "--token-file", "/nonexistent/token"]
    out = _run(*(["--debug", *args] if where == "first" else [*args, "--debug"]))
    assert out.returncode == 1
    assert out.stderr.startswith("Traceback (most recent call last):")
    assert out.stderr.splitlines()[-1] == "tqueue: error: [Errno 2] No such file or directory: '/nonexistent/token'"


def test_ctrl_c_prints_one_line_and_exits_130():
    """The terminal's Ctrl-C reaches the whole process group: the demo, its producer and
    consumer processes and its servers. None of them prints a traceback."""
    # SIGINT's default action restored before tqueue starts, as in a terminal: a background job
    # (the tests run as one in some CI) hands its children SIGINT ignored
    start = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", start, sys.executable, "-m", "tqueue", "demo", "--steps", "50", "--prompts", "8",
         "--group-size", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        seen = _read_until(proc.stderr, "samples trained on", 90)  # its children run
        os.killpg(proc.pid, signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, seen + rest
    assert rest.splitlines()[-1] == "tqueue: interrupted", rest
    assert "Traceback" not in seen + rest and "Fatal Python error" not in seen + rest, seen + rest


def _read_until(stream: Any, text: str, timeout: float) -> str:
    """What ``stream`` printed until it printed ``text`` (within ``timeout`` s); read from its
    descriptor, so that nothing stays buffered in the file object for a later read."""
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} within {timeout} s: {seen}"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 1 << 16).decode()
            assert chunk, f"the stream ended before {text!r}: {seen}"
            seen += chunk
    return seen


def test_version():
    import importlib.metadata

    out = _run("--version")
    assert out.returncode == 0 and out.stdout == f"tqueue {tqueue.__version__}\n"
    try:
        installed = importlib.metadata.version("tqueue")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH (the GPU host's run)
        return
    assert tqueue.__version__ == installed


def test_log_level_and_debug_are_accepted_after_the_command(cluster):
    out = _run("status", cluster.address, "--log-level", "info", "--debug")
    assert out.returncode == 0, out.stderr
    assert f"tqueue at {cluster.address}" in out.stdout


def test_bench_help_is_the_benchmarks_own():
    out = _run("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: tqueue bench [-h] [--quick]")
    assert "--systems SYSTEMS" in out.stdout and "usage: tqueue [" not in out.stdout


def _help(command: str) -> str:
    out = _run(*([command] if command else []), "--help")
    assert out.returncode == 0, out.stderr
    return out.stdout


def _flags(help_text: str) -> set[str]:
    """The options a --help lists: its option lines start with two spaces and a dash; what
    follows two more spaces is the option's help."""
    return {flag for line in help_text.splitlines() if line.startswith("  -")
            for flag in re.findall(r"--?[a-z][a-z0-9-]*", line[2:].split("  ")[0])}


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {command: _help(command) for command in ["", *COMMANDS]}


def test_help_is_plain_text_and_says_what_settings_mean(helps):
    for command, text in helps.items():
        assert "``" not in text and "(later)" not in text, command
        assert "usage: tqueue " + command in text.replace("\n", " "), command
    controller, unit = " ".join(helps["controller"].split()), " ".join(helps["storage-unit"].split())
    for config, text in ((tqueue.ControllerConfig, controller), (tqueue.StorageConfig, unit)):
        for field in dataclasses.fields(config):
            assert " ".join(field.metadata["help"].split()) in text, (config.__name__, field.name)
    assert "(0: the OS picks; -1: none)" in controller and "(0: no limit beyond the units' own)" in controller
    assert "(default: 16777216 = 16 MiB)" in controller and "0: no arena" in unit
    demo = " ".join(helps["demo"].split())
    assert "pip install -e '.[vllm]'" in demo and "pip install -e '.[megatron]'" in demo


def _documented_flags() -> dict[str, set[str]]:
    """Per command, the arguments that docs/operations.md's reference lists."""
    text = (ROOT / "docs" / "operations.md").read_text()
    tables: dict[str, set[str]] = {}
    for title, body in re.findall(r"^### `tqueue ?([a-z-]*)`\n(.*?)(?=^### |<!-- end)", text, flags=re.S | re.M):
        tables[title] = {flag for cell in re.findall(r"^\| `([^`]*)`", body, flags=re.M)
                         for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", cell)}
    return tables


def test_the_docs_list_every_flag_of_every_command_and_no_other(helps):
    documented = _documented_flags()
    assert set(documented) == set(helps)
    for command, text in helps.items():
        shown = _flags(text) - {"-h", "--help"}
        assert shown == documented[command] - {"-h", "--help"}, command


def test_the_reference_in_the_docs_is_the_parsers():
    from tqueue.cli import reference

    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("<!-- generated: tqueue.cli.reference() -->\n")[1].split("<!-- end of the generated section -->")[0]
    assert section.strip() == reference().strip(), (
        "docs/operations.md's command-line reference differs from the parsers; regenerate it with "
        "python -c 'import tqueue.cli; print(tqueue.cli.reference())'"
    )


def _documented_command_lines() -> list[str]:
    """Every tqueue command line in README.md, docs/operations.md and docs/api.md: the lines
    of shell code blocks, and inline code that gives a command arguments."""
    lines = []
    for name in ("README.md", "docs/operations.md", "docs/api.md"):
        text = (ROOT / name).read_text()
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                for part in line.split("&&"):
                    part = part.split("#")[0].strip().removeprefix(".venv/bin/")
                    if part.startswith("tqueue "):
                        lines.append(part)
        for span in re.findall(r"(?<!`)`(tqueue [a-z-]+ [^`]+)`(?!`)", text):
            lines.append(" ".join(span.split()))
    return lines


def _concrete(line: str, address: str) -> list[str]:
    """A documented line as argv: optional [groups] and '...' dropped, ADDR filled in."""
    while re.search(r"\[[^\[\]]*\]", line):
        line = re.sub(r"\s*\[[^\[\]]*\]", "", line)
    line = line.replace("...", "").replace("$HOSTNAME", "host")
    argv = [address if word in ("ADDR", "CONTROLLER") else word for word in line.split()[1:]]
    return argv


def _quick(argv: list[str]) -> bool:
    """Lines that end by themselves within seconds here (servers serve until stopped; the
    full demo and the engine demos take minutes or extras)."""
    if "--help" in argv or "--version" in argv:
        return True
    if argv[0] == "demo":
        return "--quick" in argv and "--engine" not in argv
    return argv[0] == "status" or (argv[0] == "top" and "--iterations" in argv)


@pytest.mark.slow
def test_every_documented_command_line_parses_and_the_quick_ones_run(cluster):
    from tqueue.cli import _parser

    lines = _documented_command_lines()
    assert {"tqueue --version", "tqueue demo --quick", "tqueue status ADDR"} <= {" ".join(x.split()[:3]) for x in lines}
    ran = []
    for line in lines:
        argv = _concrete(line, cluster.address)
        if argv[0] != "bench":
            try:
                _parser().parse_args(argv)
            except SystemExit as exc:
                assert exc.code == 0, f"documented, but does not parse: {line}"
        if _quick(argv) and argv not in ran:
            ran.append(argv)
            out = _run(*argv, timeout=300)
            assert out.returncode == 0, (line, out.stderr)
    assert ["--version"] in ran and ["demo", "--quick"] in ran and ["status", cluster.address] in ran


def test_the_ready_line_is_documented_as_printed():
    printed = []
    with server("controller", ready=lambda line: line) as line:
        printed.append(line)
        address = json.loads(line.split(" ", 1)[1])["address"]
        with server("storage-unit", "--controller", address, ready=lambda line: line) as unit_line:
            printed.append(unit_line)
    docs = {line.split(" ", 1)[0]: [] for line in printed}
    text = (ROOT / "docs" / "operations.md").read_text()
    for line in text.splitlines():
        if line.startswith("TQUEUE-"):
            docs.setdefault(line.split(" ", 1)[0], []).append(json.loads(line.split(" ", 1)[1]))
    for line in printed:
        prefix, info = line.split(" ", 1)
        assert prefix == READY and any(d.keys() == json.loads(info).keys() and d["role"] == json.loads(info)["role"]
                                       for d in docs[prefix]), line


@pytest.mark.slow
def test_checkpoint_and_restore_from_the_command_line(tmp_path):
    """``tqueue checkpoint ADDR DIR`` writes what ``tqueue restore ADDR DIR`` loads into
    another cluster, metadata included; metadata that is not JSON is a usage error."""

    def tq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tqueue", *args], capture_output=True, text=True, timeout=120)

    with tqueue.LocalCluster(num_storage_units=1) as old, tqueue.Client(old.address) as c:
        c.put("cli", {"x": torch.arange(6).reshape(3, 2)})
        bad = tq("checkpoint", old.address, str(tmp_path), "--metadata", "{step")
        assert bad.returncode == 2 and "tqueue: error: --metadata is JSON" in bad.stderr
        out = tq("checkpoint", old.address, str(tmp_path), "--metadata", '{"step": 9}')
        assert out.returncode == 0, out.stderr
        assert re.match(r"tqueue checkpoint: .*manifest\.json: 1 partitions, 3 samples, \d+ payload bytes", out.stdout)
    with tqueue.LocalCluster(num_storage_units=2) as new, tqueue.Client(new.address) as c:
        out = tq("restore", new.address, str(tmp_path))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f'tqueue restore: 1 partitions from {tmp_path}; metadata {{"step": 9}}'
        assert c.get_data("cli", ["x"], 3, task="t").get("x").tolist() == [[0, 1], [2, 3], [4, 5]]
        again = tq("restore", new.address, str(tmp_path))
        assert again.returncode == 1 and "1 of the checkpoint's partitions exist in this cluster ('cli')" in again.stderr
        replaced = tq("restore", new.address, str(tmp_path), "--replace")
        assert replaced.returncode == 0, replaced.stderr
        assert c.get_data("cli", ["x"], 3, task="t").get("x").tolist() == [[0, 1], [2, 3], [4, 5]]
