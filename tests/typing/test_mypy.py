"""The public API is type-tested, as msgspec's is: mypy checks examples.py, a user's program
written against the API, with an ``assert_type`` for what each call returns."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).with_name("examples.py")


@pytest.mark.slow  # a cold mypy over torch's stubs: 23 s of the README command; .ci/run runs it
def test_the_examples_type_check():
    pytest.importorskip("mypy")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--python-version", "3.12", str(EXAMPLES)],
        capture_output=True, text=True, timeout=110, cwd=EXAMPLES.parents[2],
    )
    assert out.returncode == 0, out.stdout + out.stderr
