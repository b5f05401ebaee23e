"""The servers started from a shell take every config setting as a flag, limits included."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError
from tqueue.launch._serve import READY


@contextlib.contextmanager
def server(*args: str) -> Iterator[str]:
    """``tqueue ARGS`` as a process; its address once it says it is ready; SIGTERM at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "tqueue", *args], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith(READY), line
        yield json.loads(line[len(READY) :])["address"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


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
