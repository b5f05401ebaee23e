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


def _cli(*args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tqueue", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


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
