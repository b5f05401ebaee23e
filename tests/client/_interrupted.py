"""A blocking client in a process of its own, interrupted (SIGINT: Ctrl-C) while it waits.

``python -m tests.client._interrupted MODE ADDRESS`` connects a :class:`tqueue.Client`, says
``waiting``, and makes a call that parks at the controller:

* ``get_meta``: a ``get_meta`` of partition ``empty`` for task ``t`` (sent from the calling
  thread on its own connection);
* ``put``: a 2 MiB put of partition ``p`` that waits for memory (through the loop thread).

When the call is interrupted (``KeyboardInterrupt``), the process lives on, as a notebook
does: it makes one more request on the same connection as the interrupted call (so that the
controller has read everything sent before it), says ``interrupted``, and waits for its
stdin to close.
"""

from __future__ import annotations

import signal
import sys

import torch

import tqueue


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(mode: str, address: str) -> None:
    # Ctrl-C as a terminal delivers it, even where this test runs as a background job (whose
    # children inherit SIGINT ignored, and Python then installs no handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    client = tqueue.Client(address)
    client.connect()
    say("waiting")
    try:
        if mode == "get_meta":
            client.get_meta("empty", ["x"], 4, task="t", timeout=600)
        else:
            client.put("p", {"x": torch.zeros(8, 1 << 16)}, timeout=600)
    except KeyboardInterrupt:
        if mode == "get_meta":  # this thread's connection, the one the get_meta was parked on
            try:
                client.get_meta("probe", ["x"], 1, task="t", timeout=0)
            except tqueue.WaitTimeoutError:
                pass
        else:
            client.status()  # the loop thread's connection, the one the put was parked on
        say("interrupted")
        sys.stdin.read()
    else:
        say("not interrupted")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
