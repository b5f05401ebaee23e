"""The public surface is small, sorted and importable without torch for servers."""

from __future__ import annotations

import subprocess
import sys

import tqueue
import tqueue.errors


def test_all_is_sorted_and_complete():
    assert tqueue.__all__ == sorted(tqueue.__all__)
    for name in tqueue.__all__:
        assert getattr(tqueue, name) is not None
    assert tqueue.errors.__all__ == sorted(tqueue.errors.__all__)


def test_every_error_is_a_tqueue_error_and_timeouts_are_timeouts():
    for name in tqueue.errors.__all__:
        obj = getattr(tqueue.errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, tqueue.TQueueError)
    assert issubclass(tqueue.WaitTimeoutError, TimeoutError)
    assert issubclass(tqueue.UnavailableError, ConnectionError)
    assert issubclass(tqueue.FieldTypeError, TypeError)
    assert issubclass(tqueue.SchemaError, ValueError)


def test_servers_do_not_import_torch():
    code = "import sys, tqueue.controller, tqueue.storage, tqueue.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
