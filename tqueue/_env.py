"""The one place that reads environment variables.

``TQUEUE_HOST``             host name used for placement (default: this machine's name)
``TQUEUE_REQUEST_TIMEOUT``  seconds a server may take to answer an ordinary request
``TQUEUE_GET_TIMEOUT``      default seconds ``get_meta`` waits for samples
``TQUEUE_PUT_TIMEOUT``      default seconds a put waits for memory or staleness admission
``TQUEUE_LEASE_TIMEOUT``    default seconds a consumer's lease lasts before it expires
``TQUEUE_CHUNK_BYTES``      largest payload frame a client sends
``TQUEUE_BUFFER_POOL_BYTES`` idle batch buffers a client keeps for reuse
``TQUEUE_SHM``              0: never use a unit's shared-memory arena, even on its host
``TQUEUE_KEEP_FREED_BYTES`` freed heap glibc may keep mapped in a client process (0: leave
                          malloc alone)
``TQUEUE_BULK``             0: keep all payload on ZeroMQ, never on the units' bulk streams
``TQUEUE_BULK_LANES``       bulk streams one big transfer is split over
``TQUEUE_PACK_INTS``        0: send integer fields in their own dtype, never narrowed
``TQUEUE_CHECKSUMS``        0: no CRC-32C of samples' bytes at put, none checked at get
``TQUEUE_ARENA_CHECKSUMS``  1: CRC-32C on the same-host arena route too
``TQUEUE_DISCOVERY_TIMEOUT`` seconds a Ray worker waits for its job's cluster to be
                          registered (``tqueue.ray.address``, the transfer_queue shim's ``init()``)
"""

from __future__ import annotations

import os
import socket


def host() -> str:
    return os.environ.get("TQUEUE_HOST") or socket.gethostname()


def number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def discovery_timeout() -> float:
    return number("TQUEUE_DISCOVERY_TIMEOUT", 60.0)
