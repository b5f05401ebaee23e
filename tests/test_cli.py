"""The servers started from a shell take every config setting as a flag, limits included."""

from __future__ import annotations

import pytest
import torch

import tqueue
from tqueue.errors import InvalidArgumentError

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
