"""Servers started the way an operator starts them: ``python -m tqueue ...`` as a process."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

from tqueue.launch._serve import READY


def _ready_address(line: str) -> str:
    assert line.startswith(READY), line
    return json.loads(line[len(READY) :])["address"]


@contextlib.contextmanager
def server(*args: str, ready: Callable[[str], str] = _ready_address) -> Iterator[str]:
    """``tqueue ARGS`` as a process; what ``ready`` reads from its first line (by default the
    address of a server saying it is ready). Leaving the block normally sends SIGTERM and
    requires a clean exit (rc 0); the process is killed by pid if it is still there."""
    proc = subprocess.Popen([sys.executable, "-m", "tqueue", *args], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield ready(proc.stdout.readline().decode())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
