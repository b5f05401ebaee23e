"""The engine demo's settings, without an engine: its flag, and the environment that sends
vLLM's logs to stderr (warnings only unless ``--verbose``) before vLLM is imported. The demo
itself runs in the integration tier (test_vllm_engine.py)."""

from __future__ import annotations

import argparse
import os

import pytest

from tqueue.demos.engine import _engine_environment, add_engine_arguments


def test_add_engine_arguments_gives_the_parser_verbose():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser.add_argument_group("engine"))
    assert parser.parse_args([]).verbose is False
    assert parser.parse_args(["--verbose"]).verbose is True


@pytest.mark.parametrize(
    ("verbose", "preset", "level", "bars"),
    [(False, {}, "WARNING", "1"), (True, {}, "INFO", None), (False, {"VLLM_LOGGING_LEVEL": "DEBUG"}, "DEBUG", "1"),
     (True, {"VLLM_LOGGING_LEVEL": "ERROR"}, "INFO", None)],
    ids=["quiet", "verbose", "quiet-level-set", "verbose-level-set"],
)
def test_vllm_logs_go_to_stderr_at_warning_unless_verbose(monkeypatch, tmp_path, verbose, preset, level, bars):
    environ = dict(preset)
    monkeypatch.setattr(os, "environ", environ)
    _engine_environment(str(tmp_path), verbose=verbose)
    assert environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and environ["VLLM_CONFIGURE_LOGGING"] == "1"
    assert environ["VLLM_LOGGING_LEVEL"] == level
    assert environ.get("TQDM_DISABLE") == bars
    assert environ["TMPDIR"] == str(tmp_path) and environ["HF_HUB_OFFLINE"] == "1"
