"""`import tqueue` never loads the transfer_queue shim (default suite: no extra packages)."""

from __future__ import annotations

import subprocess
import sys


def test_import_tqueue_leaves_transfer_queue_unloaded() -> None:
    code = (
        "import sys, tqueue, tqueue.errors, tqueue.launch\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transfer_queue')\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
