"""A producer or consumer process for fault tests, to be SIGKILLed at a known point.

``python -m tests.faults._child MODE ADDRESS`` connects a real :class:`tqueue.Client`, does
what MODE says up to the point the test wants it killed at, prints one line saying so
(the handshake the test waits for), and then blocks until it is killed:

* ``put-arena`` / ``put-tcp``: a 32 MiB put (same-host arena, or plain sockets) that stops
  just before its bytes are stored: the grant (and the arena range) are held.
* ``hold``: reads a 96 MiB batch of partition ``big`` through the unit's arena and keeps
  the views (the unit keeps the bytes for it).
* ``park``: parks ``get_meta`` on partition ``empty`` for task ``t``.
* ``stream``: fetches the 96 MiB batch of partition ``big`` as a client on another host (over
  a bulk stream) and stops reading before the first byte: the unit is left mid-send.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

import tqueue
from tqueue.transport import _zmq
from tqueue.wire import Store

PUT_BYTES = 32 << 20
HOLD_BYTES = 96 << 20


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(mode: str, address: str) -> None:
    forever = threading.Event()
    if mode.startswith("put-"):
        real = _zmq.Peer.request

        async def request(self: _zmq.Peer, msg: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(msg, Store):  # granted, and (arena) written: die here
                say("mid-put")
                await __import__("asyncio").Event().wait()
            return await real(self, msg, *args, **kwargs)

        _zmq.Peer.request = request  # type: ignore[method-assign]
        config = tqueue.ClientConfig(shm=mode == "put-arena", shm_min_bytes=0)
        client = tqueue.Client(address, config=config)
        client.put("p", {"x": torch.ones(PUT_BYTES // 4, dtype=torch.float32).reshape(4, -1)})
    elif mode == "hold":
        client = tqueue.Client(address)
        batch = client.get_data(client.get_meta("big", ["x"], 4, task="reader", timeout=60))
        assert batch["x"].numel() * 4 == HOLD_BYTES
        say("holding")
        forever.wait()
    elif mode == "stream":
        from tqueue.transport import _bulk

        def stalled(self: Any, targets: Any, timeout: float) -> None:
            say("mid-stream")
            forever.wait()

        _bulk.BulkStream.read = stalled  # type: ignore[method-assign]
        client = tqueue.Client(address, config=tqueue.ClientConfig(shm=False, host="elsewhere", bulk_lanes=1))
        client.get_data(client.get_meta("big", ["x"], 4, task="streamer", timeout=60))
    elif mode == "park":
        client = tqueue.Client(address)
        say("parking")
        client.get_meta("empty", ["x"], 4, task="t", timeout=600)
    forever.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
