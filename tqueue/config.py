"""Typed, frozen configuration of each component.

Defaults come from :mod:`tqueue._env` (environment overrides) when built with
``from_env()``; plain construction uses the literal defaults below.
"""

from __future__ import annotations

import dataclasses
import os

from . import _env

__all__ = ["ClientConfig", "ControllerConfig", "StorageConfig"]

MiB = 1 << 20
# Seconds of silence after which a peer pings its server (see tqueue/transport/_liveness.py).
# The controller's setting is the cluster's: units learn it when they register, clients
# in the controller's HelloReply.
HEARTBEAT_INTERVAL = 1.0


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """The controller process.

    ``bind``: ZeroMQ endpoint; port 0 lets the OS choose, the real one is read back.
    ``max_header_bytes``: larger request headers get a protocol error reply.
    ``capacity_bytes``: payload the whole cluster may hold (0: no limit beyond the units').
    A put that would exceed it waits, up to its timeout, for memory to be freed.
    ``policies``: batch policies to load besides the built-in ones, as
    ``"name=module:attribute"`` (see ``tqueue.controller._policies``).

    Limits on what one request may make the controller allocate or scan, checked before
    anything is recorded (a request past one gets ``InvalidArgumentError`` naming the field,
    its value and the limit, and changes nothing):
    ``max_samples_per_request``: samples one put, read (``batch_size * dp_size``), reserve,
    ack, fail, clear or postpone may name. ``max_partition_samples``: samples a partition
    may ever hold (its per-sample arrays take about 50 bytes each, plus 9 per task).
    ``max_tasks_per_partition``: distinct task names that read one partition.
    ``max_partitions``: partitions that exist at once.
    ``max_parked``: requests parked at once (reads, writes, seal waits); past it a request
    that would wait is refused instead (``UnavailableError``).

    ``heartbeat_interval``: seconds between signs of life, for the whole cluster. A client
    session silent for ``HEARTBEAT_LIVENESS`` intervals is gone (its parked calls and grants
    are freed); a storage unit silent for ``UNIT_LIVENESS`` intervals is dead (its samples
    are lost). See tqueue/transport/_liveness.py.

    ``auth_dir``: CurveZMQ keys (see tqueue/transport/_auth.py): with it, only clients whose
    key is in ``auth_dir/clients`` can connect, and only the cluster's key registers units.
    "": no authentication (trust the network; bind to loopback or a private network).
    ``advertise``: the host peers reach this server at, when it binds to a wildcard
    (``0.0.0.0``, ``*``); "": this machine's address.
    ``metrics_port``: serve Prometheus metrics over HTTP on this port of the bind host
    (0: the OS picks; -1: none); the URL is in ``status().metrics``.
    """

    bind: str = "tcp://127.0.0.1:0"
    max_header_bytes: int = 16 * MiB
    capacity_bytes: int = 0
    policies: tuple[str, ...] = ()
    max_samples_per_request: int = 1_000_000
    max_partition_samples: int = 100_000_000
    max_tasks_per_partition: int = 1024
    max_partitions: int = 100_000
    max_parked: int = 100_000
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    auth_dir: str = ""
    advertise: str = ""
    metrics_port: int = -1


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """A storage unit process.

    ``controller``: the controller's address, where the unit registers.
    ``host``: the host name placement compares with producers' (default: this machine).
    ``capacity_bytes``: payload this unit may hold (0: no limit); puts that would exceed it
    go to another unit, or wait.
    ``max_header_bytes``: larger request headers get a protocol error reply.
    ``retain_bytes``: freed payload memory the unit keeps mapped for the next writes, which
    then land in warm pages (about twice the receive rate of fresh ones). Once more than
    this is free but mapped, it all goes back to the OS at once; 0 returns memory on every
    free.
    ``trim_delay``: seconds without writes after which retained memory goes back too.
    ``shm_bytes``: size of the shared-memory arena that producers and consumers on this host
    write and read directly (address space; pages are used only as data arrives). 0: none.
    ``hold_timeout``: seconds after which a same-host reader's zero-copy hold on arena bytes
    lapses if it never released it (a reader that died).
    ``bulk``: also listen on a plain TCP port next to the ZeroMQ one, over which clients
    that are not on this host receive fetched payload straight into their batch tensors
    (see :mod:`tqueue.transport._bulk`). Only for ``tcp://`` binds.

    Limits on what one peer or one message can make the unit hold (each refusal is a typed
    error or a closed connection, never an allocation):
    ``max_index``: sample indexes at or above this are refused (a column's index arrays cost
    16 bytes per index up to the highest one held: 1 GiB per field at the limit).
    ``max_frames``: frames in one ZeroMQ message; more get a protocol error reply unread.
    ``max_frame_bytes``: ZeroMQ disconnects a peer that sends a larger frame (clients cut
    payload into ``ClientConfig.chunk_bytes`` frames; one object sample is one frame).
    ``bulk_streams``, ``bulk_streams_per_peer``: bulk streams open at once, in all and from
    one peer address; a stream beyond either is refused at its hello (the client falls back
    to ZeroMQ). Streams are reclaimed as soon as their client closes or dies.
    ``max_queued_bytes``: reply bytes queued for one peer that does not read them; past it
    the peer's fetches get an ``UnavailableError`` reply instead, until it reads.
    ``max_queued_replies``: replies queued for one peer (ZeroMQ's send high-water mark);
    past it replies to that peer are dropped, counted and logged.

    ``name``: the unit's identity at the controller ("": its ZeroMQ address). A unit that
    registers again under a known name (restarted, or back after the controller declared it
    dead) gets its old unit id back and starts empty: what it held was declared lost.
    ``auth_dir``, ``advertise``, ``metrics_port``: as for :class:`ControllerConfig`.
    """

    controller: str
    bind: str = "tcp://127.0.0.1:0"
    host: str = ""
    capacity_bytes: int = 0
    max_header_bytes: int = 64 * MiB
    retain_bytes: int = 4096 * MiB
    trim_delay: float = 60.0
    shm_bytes: int = 8192 * MiB
    hold_timeout: float = 3600.0
    bulk: bool = True
    max_index: int = 1 << 26
    max_frames: int = 1 << 16
    max_frame_bytes: int = 1024 * MiB
    bulk_streams: int = 512
    bulk_streams_per_peer: int = 128
    max_queued_bytes: int = 1024 * MiB
    max_queued_replies: int = 10_000
    name: str = ""
    auth_dir: str = ""
    advertise: str = ""
    metrics_port: int = -1


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """A client inside a producer or consumer.

    ``request_timeout``: seconds a server may take to answer before the client raises
    :class:`~tqueue.errors.UnavailableError` (a get_meta wait is added on top).
    ``get_timeout``: default seconds ``get_meta`` waits for enough samples.
    ``put_timeout``: default seconds a put waits for memory or staleness admission.
    ``lease_timeout``: default seconds a consumer holds samples before they return to its
    task's pool unless acked or renewed (a consumer that died loses nothing).
    ``chunk_bytes``: payload is cut into frames of at most this size on sample boundaries;
    1-8 MiB frames move fastest over loopback.
    ``host``: the host name used to place this client's puts on a nearby unit ("": this
    machine's name, or ``TQUEUE_HOST``).
    ``buffer_pool_bytes``: idle batch buffers kept for reuse, so that assembling a batch
    copies into memory that is already mapped (0 turns the pool off).
    ``shm``: use a unit's shared-memory arena when the unit is on this host (same ``host``
    name and its arena can be mapped); otherwise payload goes over the socket.
    ``shm_min_bytes``: smaller writes go over the socket even on the unit's host (the arena
    costs one more round trip, which only pays off for bigger writes).
    ``keep_freed_bytes``: let glibc keep this much freed heap mapped in this process (see
    :func:`tqueue._memory.keep_freed`), so that received payload lands in warm pages, about
    twice as fast. Process-wide; 0 leaves malloc's settings alone.
    ``bulk``: receive fetched payload from units that offer a bulk stream straight into the
    batch's tensors (no assembly copy); otherwise it comes in ZeroMQ frames and is copied.
    ``bulk_lanes``: a big fetch from one unit is split over this many bulk streams at once
    (one TCP stream on loopback leaves the cores half idle).
    ``pack_ints``: a dense integer field whose values all fit a narrower signed type (token
    ids in int32, masks in int8) is sent and stored in that type; readers get the field's
    own dtype back (see :mod:`tqueue.wire._pack`).
    ``pin_memory``: assemble batches in page-locked (pinned) host memory, which a trainer
    moves to its GPU by DMA (``.to("cuda", non_blocking=True)``): 54 against 10 GB/s from
    pageable memory on an H100 host (benchmarks/cuda.py). Needs CUDA. Batches read on a
    unit's host through its arena are views of the arena and stay pageable. Idle pinned
    buffers count towards ``buffer_pool_bytes``.
    ``auth_dir``: this client's CurveZMQ keys (``client.key_secret``, ``cluster.key``; see
    tqueue/transport/_auth.py), or ``TQUEUE_AUTH_DIR``; "": no authentication.
    """

    request_timeout: float = 30.0
    get_timeout: float = 60.0
    put_timeout: float = 60.0
    lease_timeout: float = 600.0
    chunk_bytes: int = 1 * MiB
    host: str = ""
    buffer_pool_bytes: int = 4096 * MiB
    shm: bool = True
    shm_min_bytes: int = 1 * MiB
    keep_freed_bytes: int = 4096 * MiB
    bulk: bool = True
    bulk_lanes: int = 2
    pack_ints: bool = True
    pin_memory: bool = False
    auth_dir: str = ""

    @classmethod
    def from_env(cls) -> ClientConfig:
        return cls(
            request_timeout=_env.number("TQUEUE_REQUEST_TIMEOUT", cls.request_timeout),
            get_timeout=_env.number("TQUEUE_GET_TIMEOUT", cls.get_timeout),
            put_timeout=_env.number("TQUEUE_PUT_TIMEOUT", cls.put_timeout),
            lease_timeout=_env.number("TQUEUE_LEASE_TIMEOUT", cls.lease_timeout),
            chunk_bytes=int(_env.number("TQUEUE_CHUNK_BYTES", cls.chunk_bytes)),
            host=_env.host(),
            buffer_pool_bytes=int(_env.number("TQUEUE_BUFFER_POOL_BYTES", cls.buffer_pool_bytes)),
            shm=bool(_env.number("TQUEUE_SHM", 1)),
            keep_freed_bytes=int(_env.number("TQUEUE_KEEP_FREED_BYTES", cls.keep_freed_bytes)),
            bulk=bool(_env.number("TQUEUE_BULK", 1)),
            bulk_lanes=int(_env.number("TQUEUE_BULK_LANES", cls.bulk_lanes)),
            pack_ints=bool(_env.number("TQUEUE_PACK_INTS", 1)),
            pin_memory=bool(_env.number("TQUEUE_PIN_MEMORY", 0)),
            auth_dir=os.environ.get("TQUEUE_AUTH_DIR", ""),
        )
