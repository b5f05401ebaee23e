"""Servers started the way an operator starts them: ``python -m tqueue ...`` as a process."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator

from tqueue.launch._serve import READY


@contextlib.contextmanager
def server(*args: str) -> Iterator[str]:
    """``tqueue ARGS`` as a process; its address once it says it is ready. Leaving the block
    normally sends SIGTERM and requires a clean exit (rc 0); the process is killed by pid if
    it is still there."""
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
