"""Run one server (controller or storage unit) as the body of a process.

The process announces itself with one line on stdout, ``TQUEUE-READY {json}``, once it
serves, and stops on SIGTERM, SIGINT, or (with ``watch_stdin``) when its stdin closes, so
a server started by a launcher never outlives the launcher.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from ..config import ControllerConfig, StorageConfig

READY = "TQUEUE-READY"
log = logging.getLogger(__name__)


def run(config: ControllerConfig | StorageConfig, *, watch_stdin: bool = False) -> None:
    asyncio.run(_main(config, watch_stdin))


async def _main(config: ControllerConfig | StorageConfig, watch_stdin: bool) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if watch_stdin:
        threading.Thread(target=_wait_eof, args=(loop, stop), daemon=True).start()
    server: Any
    if isinstance(config, ControllerConfig):
        from ..controller import Controller

        server = Controller(config)
        info = {"role": "controller", "address": server.address}
    else:
        from ..storage import StorageUnit

        server = StorageUnit(config)
        await server.start()
        info = {"role": "storage", "address": server.address, "unit_id": server.unit_id}
    serving = loop.create_task(server.serve())
    # what exists now (modules, the config, the server's own objects) lives as long as the
    # process: out of the cyclic collector's sight, a full collection walks only what came
    # later, and does not stop every request for tens of milliseconds (docs/performance-history.md,
    # "The collector's pauses"). The start's garbage goes first, not to be kept for good.
    gc.collect()
    gc.freeze()
    print(f"{READY} {json.dumps(info)}", flush=True)
    stopping = loop.create_task(stop.wait())
    done, _ = await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    serving.cancel()
    stopping.cancel()
    await server.close()
    if serving in done and serving.exception() is not None:
        raise serving.exception()  # type: ignore[misc]
    log.info("%s at %s stopped", info["role"], info["address"])


def _wait_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    # os.read on the descriptor, not sys.stdin: a daemon thread blocked in the buffered reader
    # holds its lock, and a process that stops for a signal meanwhile dies at shutdown with
    # "Fatal Python error: could not acquire lock for <stdin>"
    try:
        while os.read(sys.stdin.fileno(), 1 << 16):
            pass
    finally:
        loop.call_soon_threadsafe(stop.set)
