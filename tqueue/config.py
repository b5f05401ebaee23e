"""Typed, frozen configuration of each component.

Every field carries its meaning in its ``help`` metadata: the class docstrings list them,
grouped by concern (each class's ``GROUPS``: network, memory, limits, liveness...; see
:func:`grouped`), and ``tqueue controller --help`` / ``tqueue storage-unit --help`` (and the flag tables of
docs/operations.md) show the same text. Defaults come from :mod:`tqueue._env` (environment
overrides) when built with ``from_env()``; plain construction uses the literal defaults below.

The fields stay flat (``ClientConfig(shm=False)``, the command-line flags and the environment
name them so); options that travel together are also one object: :class:`Timeouts` is
``ClientConfig.timeouts``, and ``config.replace(timeouts=Timeouts(get=5))`` sets them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, ClassVar, TypeVar

from . import _env
from ._api import deprecated

__all__ = ["ClientConfig", "ControllerConfig", "StorageConfig", "Timeouts", "grouped"]

MiB = 1 << 20
# Seconds of silence after which a peer pings its server (see tqueue/transport/_liveness.py).
# The controller's setting is the cluster's: units learn it when they register, clients
# in the controller's HelloReply.
HEARTBEAT_INTERVAL = 1.0

_T = TypeVar("_T")
_C = TypeVar("_C")

_BIND = "ZeroMQ endpoint to listen on; port 0: the OS picks one, and the ready line reports it"
_HEADER = "largest request header accepted; a larger one gets a protocol error reply"
_ADVERTISE = "the host peers reach this server at when it binds to a wildcard (0.0.0.0, *); empty: this machine's address"
_METRICS = "serve Prometheus metrics over HTTP on this port of the bind host (0: the OS picks; -1: none)"
FROM_CAPACITY = -1  # a bound of StorageConfig made from the unit's capacity_bytes (queued_bounds)


def _setting(default: _T, help: str) -> _T:
    """A field and what it means (``help``: one or two plain-text sentences, no markup)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _groups(cls: type[Any]) -> dict[str, list[dataclasses.Field[Any]]]:
    """The fields of a config class by concern, in its ``GROUPS`` order; a field no group
    names is under ``"other"``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {group: [fields[n] for n in names if n in fields] for group, names in getattr(cls, "GROUPS", {}).items()}
    named = {n for names in getattr(cls, "GROUPS", {}).values() for n in names}
    rest = [f for name, f in fields.items() if name not in named]
    if rest:
        out["other"] = rest
    return out


def grouped(config: Any) -> dict[str, dict[str, Any]]:
    """A config's values by concern: ``{"timeouts": {"request_timeout": 30.0, ...}, ...}``."""
    return {group: {f.name: getattr(config, f.name) for f in fields} for group, fields in _groups(type(config)).items()}


def _documented(cls: _C) -> _C:
    """Append each field's default and meaning to the class docstring (``help(cls)``), by group."""
    lines = []
    for group, fields in _groups(cls).items():  # type: ignore[arg-type]
        lines.append(f"    {group.capitalize()}:\n")
        for f in fields:
            default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
            lines.append(f"    ``{f.name}`` ({default}): {f.metadata['help']}.")
        lines.append("")
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Fields:\n\n" + "\n".join(lines)
    return cls


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """A client's default timeouts, in seconds (``ClientConfig.timeouts``): ``request``, how
    long a server may take to answer; ``get``, how long ``get_meta`` waits for samples;
    ``put``, how long a put waits for memory or admission; ``lease``, how long a consumer
    holds samples before they return to its task's pool unless acked. ``math.inf``: no
    limit (not for ``request``)."""

    request: float = 30.0
    get: float = 60.0
    put: float = 60.0
    lease: float = 600.0


def field_help(config: type[Any], name: str) -> str:
    """What field ``name`` of config class ``config`` means (its ``help`` metadata)."""
    return str(next(f for f in dataclasses.fields(config) if f.name == name).metadata["help"])


def _renamed(cls: type[_C]) -> type[_C]:
    """Each old field name of the config class's ``RENAMED`` (old -> new) still works for one
    release as a keyword of its constructor, with a deprecation warning naming the new one
    (the class keeps the old attribute as a deprecated property of its own, and the command
    line the old flag: see tqueue/cli.py)."""
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for old, new in renamed.items():
            if old in kwargs:
                deprecated(f"{cls.__name__}({old}=)", f"{cls.__name__}({new}=)")
                if new in kwargs:
                    raise TypeError(f"{cls.__name__}: give {new}= or {old}=, not both")
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_renamed
@_documented
@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """The controller process.

    The ``max_*`` limits bound what one request may make the controller allocate or scan,
    checked before anything is recorded: a request past one gets ``InvalidArgumentError``
    naming the field, its value and the limit, and changes nothing. Liveness follows
    ``heartbeat_interval``, see tqueue/transport/_liveness.py; keys for ``auth_dir``,
    tqueue/transport/_auth.py.
    """

    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "network": ("bind", "advertise", "metrics_port", "auth_dir"),
        "data": ("capacity_bytes", "copies", "policies", "tombstone_seconds"),
        "liveness": ("heartbeat_interval", "cycle_notice", "grant_timeout", "unit_timeout"),
        "checkpoints": ("restore", "checkpoint_root", "restore_wait"),
        "limits": ("max_header_bytes", "max_samples_per_request", "max_partition_samples", "max_tasks_per_partition",
                   "max_partitions", "max_parked", "max_tag_bytes", "max_tag_bytes_per_partition", "max_tag_bytes_total",
                   "max_keys_per_partition", "max_keys_total"),
    }
    # old field names that still work for one release (deprecated): old -> new
    RENAMED: ClassVar[dict[str, str]] = {"replicas": "copies"}

    bind: str = _setting("tcp://127.0.0.1:0", _BIND)
    max_header_bytes: int = _setting(16 * MiB, _HEADER)
    capacity_bytes: int = _setting(
        0, "payload the whole cluster may hold; a put that would exceed it waits, up to its timeout, for memory to be "
        "freed (0: no limit beyond the units' own)")
    policies: tuple[str, ...] = _setting(
        (), "batch policies to load besides the built-in ones, as name=module:attribute (see tqueue.controller._policies)")
    max_samples_per_request: int = _setting(
        1_000_000, "samples that one put, read (batch size times DP size), reserve, ack, fail, clear or postpone may name")
    max_partition_samples: int = _setting(
        100_000_000, "samples a partition may ever hold (its per-sample arrays take about 50 bytes each, plus 9 per task)")
    max_tasks_per_partition: int = _setting(1024, "distinct task names that may read one partition")
    copies: int = _setting(
        1, "copies of each put, on as many storage units (on different hosts where there are): 1, or 2 so that one "
        "unit's death loses no acknowledged sample; a partition's own (create_partition(copies=)) overrides it")
    max_partitions: int = _setting(100_000, "partitions that may exist at once")
    max_parked: int = _setting(
        100_000, "requests parked at once (reads, writes, seal waits); past it a request that would wait is refused "
        "with UnavailableError instead")
    heartbeat_interval: float = _setting(
        HEARTBEAT_INTERVAL, "seconds between signs of life, for the whole cluster: a client silent for 3 intervals is "
        "gone (its parked calls and grants are freed), a storage unit silent for 5 is dead (its samples are lost)")
    auth_dir: str = _setting(
        "", "directory of CurveZMQ keys: only clients whose key is in its clients/ folder may connect, and only the "
        "cluster's key registers units; empty: no authentication (bind to loopback or a private network)")
    advertise: str = _setting("", _ADVERTISE)
    metrics_port: int = _setting(-1, _METRICS + "; the URL is in status().metrics")
    cycle_notice: float = _setting(
        5.0, "seconds a put parked for memory and a get_meta parked for that put's partition may wait on each other "
        "before both callers are warned that the wait may never end (0: never)")
    grant_timeout: float = _setting(
        600.0, "seconds a put's bytes may take to be stored after its grant; then the grant lapses (a producer that "
        "died between grant and store) and its memory, admission and target places return")
    unit_timeout: float = _setting(
        30.0, "seconds a storage unit may take to answer the controller's drop or move; a drop that fails is retried")
    restore: str = _setting(
        "", "a checkpoint directory (save_checkpoint) to load at start: a controller restarted after a crash resumes "
        "from it once the units it names have registered again, or restore_wait seconds have passed; requests other "
        "than status wait until then (empty: start without partitions)")
    checkpoint_root: str = _setting(
        "", "the folder checkpoints go in: a client's save_checkpoint / load_checkpoint directory is then a name "
        "under it (no absolute path, no '..', no symbolic link below it followed), and restore a name under it or a "
        "path inside it; required with auth_dir; empty: any path (bind to loopback or a private network)")
    restore_wait: float = _setting(
        30.0, "seconds a restoring controller waits for the checkpoint's units to register before it loads the "
        "checkpoint into the units it has (at least one)")
    tombstone_seconds: float = _setting(
        600.0, "seconds puts to the name of a partition that sealed and freed itself are refused (stragglers start no "
        "partition nobody consumes); create_partition lifts it")
    max_tag_bytes: int = _setting(
        16 * 1024, "bytes of one sample's (or one key's) tags, as MessagePack; a bind_keys, tag_keys or set_tags with "
        "larger tags is refused with InvalidArgumentError naming the partition, and changes nothing")
    max_tag_bytes_per_partition: int = _setting(
        64 * MiB, "bytes of tags (as MessagePack) one partition may hold; a tag write past it is refused likewise "
        "(status().keys shows the use of each bound)")
    max_tag_bytes_total: int = _setting(
        256 * MiB, "bytes of tags (as MessagePack) all partitions together may hold; a tag write past it is refused "
        "likewise, until tags are dropped or their partitions freed")
    max_keys_per_partition: int = _setting(
        1_000_000, "keys one partition may hold (each costs the controller about 220 bytes, tags aside); a bind_keys "
        "or tag_keys that would make more is refused with InvalidArgumentError")
    max_keys_total: int = _setting(
        4_000_000, "keys all partitions together may hold; a bind_keys or tag_keys past it is refused likewise")

    @property
    def replicas(self) -> int:
        """Deprecated spelling of ``copies``."""
        deprecated("ControllerConfig.replicas", "ControllerConfig.copies")
        return self.copies


@_documented
@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """A storage unit process.

    ``max_index`` to ``max_queued_replies`` bound what one peer or one message can make the
    unit hold: each refusal is a typed error or a closed connection, never an allocation.
    """

    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "network": ("controller", "bind", "host", "name", "advertise", "metrics_port", "auth_dir"),
        "memory": ("capacity_bytes", "retain_bytes", "trim_delay", "shm_bytes", "nixl", "hold_timeout", "alloc_timeout"),
        "bulk": ("bulk", "bulk_streams", "bulk_streams_per_peer", "bulk_stall_timeout", "bulk_min_rate"),
        "checkpoints": ("restore", "checkpoint_root"),
        "limits": ("max_header_bytes", "max_index", "max_frames", "max_frame_bytes", "max_queued_bytes",
                   "max_queued_bytes_total", "max_queued_replies"),
    }

    controller: str = dataclasses.field(metadata={"help": "the controller's address, where the unit registers"})
    bind: str = _setting("tcp://127.0.0.1:0", _BIND)
    host: str = _setting("", "the host name placement compares with producers'; empty: this machine's name")
    capacity_bytes: int = _setting(
        0, "payload this unit may hold; a put that would exceed it goes to another unit, or waits (0: no limit)")
    max_header_bytes: int = _setting(64 * MiB, _HEADER)
    retain_bytes: int = _setting(
        4096 * MiB, "freed payload memory kept mapped for the next writes, which then land in warm pages (about twice "
        "as fast as fresh ones); once more than this is free, it all goes back to the OS (0: give memory back on "
        "every free)")
    trim_delay: float = _setting(60.0, "seconds without writes after which retained memory goes back to the OS too")
    shm_bytes: int = _setting(
        8192 * MiB, "size of the shared-memory arena that clients on this host write and read directly (address "
        "space: pages are used only as data arrives; 0: no arena)")
    nixl: bool = _setting(
        False, "register the arena with a NIXL agent (the 'nixl' extra, tqueue/transport/_nixl.py), so that clients "
        "with ClientConfig.nixl read and write it by one-sided transfers: RDMA where the hosts have InfiniBand or "
        "RoCE, TCP elsewhere. Needs an arena (shm_bytes > 0); its free pages then stay mapped (registered memory is "
        "never handed back), and on a NIC without on-demand paging registration pins all of shm_bytes")
    hold_timeout: float = _setting(
        3600.0, "seconds after which a same-host reader's zero-copy hold on arena bytes lapses if it never released "
        "it (a reader that died)")
    alloc_timeout: float = _setting(
        120.0, "seconds a same-host writer may take to store what it copied into an arena range it was given; then "
        "the range goes back to the arena (a writer that died)")
    bulk: bool = _setting(
        True, "also listen on a plain TCP port beside the ZeroMQ one, over which clients on other hosts receive "
        "fetched payload straight into their batch tensors (tcp:// binds only; see tqueue.transport._bulk)")
    max_index: int = _setting(
        1 << 26, "sample indexes at or above this are refused (a field's index arrays cost 16 bytes per index up to "
        "the highest one held: 1 GiB at the default)")
    max_frames: int = _setting(1 << 16, "frames in one ZeroMQ message; a message with more gets a protocol error reply, unread")
    max_frame_bytes: int = _setting(
        1024 * MiB, "ZeroMQ disconnects a peer that sends a larger frame (clients cut payload into frames of "
        "ClientConfig.chunk_bytes; one object sample is one frame)")
    bulk_streams: int = _setting(
        512, "bulk streams open at once, in all; one more is refused at its hello and its client falls back to ZeroMQ "
        "(streams are reclaimed as soon as their client closes or dies)")
    bulk_streams_per_peer: int = _setting(128, "bulk streams open at once from one peer address; one more is refused likewise")
    bulk_stall_timeout: float = _setting(
        30.0, "seconds a bulk stream may move no byte of a fetch's reply (or a put) before the unit cuts it off: the "
        "stream is closed, the reader's fetch fails, and the bytes it kept in memory (a cleared partition's too) go "
        "(0: no limit)")
    bulk_min_rate: int = _setting(
        1 * MiB, "bytes a second a bulk stream must average: a reply (or put) of N bytes is cut off once "
        "bulk_stall_timeout + N / bulk_min_rate seconds have passed since it began, so a reader that trickles holds "
        "it no longer (0: no rate bound)")
    max_queued_bytes: int = _setting(
        FROM_CAPACITY, "reply bytes queued for one peer that does not read them; past it that peer's fetches get "
        "UnavailableError replies instead, until it reads (-1: capacity_bytes / 32, between 16 MiB and 256 MiB; "
        "256 MiB without a capacity)")
    max_queued_bytes_total: int = _setting(
        FROM_CAPACITY, "reply bytes queued on ZeroMQ for all peers together (status() counts them in held_bytes, "
        "with what bulk streams have yet to send); past it fetches get UnavailableError replies instead, until "
        "readers catch up. A peer that holds replies of a cleared partition and takes none of their bytes for a "
        "second, or whose session ends, is cut off and they are freed (-1: capacity_bytes / 8, between 64 MiB and "
        "1 GiB; 1 GiB without a capacity)")
    max_queued_replies: int = _setting(
        10_000, "replies queued for one peer (ZeroMQ's send high-water mark); past it replies to that peer are "
        "dropped, counted and logged")
    name: str = _setting(
        "", "the unit's identity at the controller (empty: its ZeroMQ address); a unit that registers again under a "
        "known name (restarted, or back after it was declared dead) gets its old unit id back and starts empty")
    restore: str = _setting(
        "", "a checkpoint directory (save_checkpoint) whose payload of this unit (found by name) the unit loads "
        "before it registers: restarted before the controller noticed its death, it keeps the samples the "
        "checkpoint holds as they still are; what changed or came since is lost (empty: start empty)")
    auth_dir: str = _setting(
        "", "directory of the cluster's CurveZMQ keys (see tqueue/transport/_auth.py); empty: no authentication")
    checkpoint_root: str = _setting(
        "", "the folder checkpoints go in (the controller's checkpoint_root, as this host reaches it): the unit "
        "writes and loads payload files only under it, following no symbolic link below it; required with "
        "auth_dir; empty: wherever the controller says")
    advertise: str = _setting("", _ADVERTISE)
    metrics_port: int = _setting(-1, _METRICS)

    def queued_bounds(self) -> tuple[int, int]:
        """``(max_queued_bytes, max_queued_bytes_total)``, each one left at FROM_CAPACITY made
        from ``capacity_bytes`` (see the fields)."""
        cap = self.capacity_bytes
        peer, total = self.max_queued_bytes, self.max_queued_bytes_total
        if total == FROM_CAPACITY:
            total = min(max(cap // 8, 64 * MiB), 1024 * MiB) if cap > 0 else 1024 * MiB
        if peer == FROM_CAPACITY:
            peer = min(max(cap // 32, 16 * MiB), 256 * MiB, total) if cap > 0 else min(256 * MiB, total)
        return peer, total


@_documented
@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """A client inside a producer or consumer."""

    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "timeouts": ("request_timeout", "get_timeout", "put_timeout", "lease_timeout"),
        "routes": ("host", "shm", "shm_min_bytes", "arena_lease_bytes", "nixl", "bulk", "bulk_lanes", "bulk_put_min_bytes",
                   "bulk_lane_min_bytes", "chunk_bytes", "coalesce_puts"),
        "memory": ("buffer_pool_bytes", "keep_freed_bytes", "pin_memory", "device_chunk_bytes", "device_lock_bytes"),
        "integrity": ("checksums", "arena_checksums", "pack_ints"),
        "security": ("auth_dir",),
    }

    request_timeout: float = _setting(
        30.0, "seconds a server may take to answer before the client raises UnavailableError (a get_meta wait is "
        "added on top)")
    get_timeout: float = _setting(60.0, "default seconds get_meta waits for enough samples")
    put_timeout: float = _setting(60.0, "default seconds a put waits for memory or staleness admission")
    lease_timeout: float = _setting(
        600.0, "default seconds a consumer holds samples before they return to its task's pool unless acked or "
        "renewed (a consumer that died loses nothing)")
    chunk_bytes: int = _setting(
        1 * MiB, "payload is cut into frames of at most this size on sample boundaries; 1-8 MiB frames move fastest "
        "over loopback")
    host: str = _setting(
        "", "the host name used to place this client's puts on a nearby unit; empty: TQUEUE_HOST, or this machine's name")
    buffer_pool_bytes: int = _setting(
        4096 * MiB, "idle batch buffers kept for reuse, so that assembling a batch copies into memory that is already "
        "mapped (0: no pool)")
    shm: bool = _setting(
        True, "use a unit's shared-memory arena when the unit is on this host (same host name and its arena can be "
        "mapped); otherwise payload goes over the socket")
    nixl: str = _setting(
        "auto", "move payload to and from units that offer NIXL (StorageConfig.nixl) by one-sided reads and writes "
        "of their arenas (tqueue/transport/_nixl.py), where the unit is not reached through its arena on this host: "
        "'auto' where this host and the unit's both have RDMA devices (/sys/class/infiniband) and the 'nixl' extra "
        "imports here, 'on' wherever a unit offers it (UCX then takes TCP where there is no RDMA), 'off' never. "
        "Puts under shm_min_bytes and samples outside the arena go over the socket")
    shm_min_bytes: int = _setting(
        1 * MiB, "smaller writes go over the socket even on the unit's host (the arena costs one more round trip, "
        "which only pays off for bigger writes)")
    arena_lease_bytes: int = _setting(
        4 * MiB, "a writer on a unit's host takes arena ranges of up to this size (eight times its put, at most) and "
        "puts into them one after another, so that most puts skip the round trip that asks the unit for a range; "
        "puts above half of it get a range of their own (0: a range per put)")
    keep_freed_bytes: int = _setting(
        4096 * MiB, "let glibc keep this much freed heap mapped in this process (see tqueue._memory.keep_freed), so "
        "that received payload lands in warm pages, about twice as fast; process-wide (0: leave malloc's settings alone)")
    bulk: bool = _setting(
        True, "receive fetched payload from units that offer a bulk stream straight into the batch's tensors (no "
        "assembly copy); otherwise it comes in ZeroMQ frames and is copied")
    bulk_lanes: int = _setting(
        2, "a big fetch from one unit is split over this many bulk streams at once (one TCP stream on loopback leaves "
        "the cores half idle)")
    checksums: bool = _setting(
        True, "a CRC-32C of each sample's bytes, computed at put, kept by the unit and checked at get, on every "
        "route that crosses a socket (a mismatch: DataCorruptionError; the copy is dropped, another is read)")
    arena_checksums: bool = _setting(
        False, "checksums on the same-host arena route too (puts into a unit's arena, reads of its pages); off by "
        "default: there the check costs more than the bytes' trip (docs/performance.md)")
    pack_ints: bool = _setting(
        True, "an integer field (dense, or jagged frame by frame) whose values all fit a narrower type (token ids in int32, masks in int8, expert ids in uint8) "
        "is sent and stored in that type; readers get the field's own dtype back (see tqueue.wire._pack)")
    arena_pack_dense: bool = _setting(
        False, "dense integer fields are held narrow in a same-host unit's arena too (jagged ones always are): "
        "a half to an eighth of their resident bytes, but every read widens them instead of viewing the pages "
        "in place (docs/performance.md, 'Integer widths'); off by default")
    pin_memory: bool = _setting(
        False, "assemble batches in page-locked (pinned) host memory, which a trainer moves to its GPU by DMA "
        "(.to('cuda', non_blocking=True)): 54 against 10 GB/s from pageable memory on an H100 host "
        "(benchmarks/cuda.py); needs CUDA; batches read through a unit's arena stay pageable views of it, and idle "
        "pinned buffers count towards buffer_pool_bytes")
    device_chunk_bytes: int = _setting(
        4 * MiB, "a read onto a device (get_data(device=...)) copies in chunks of this size, and stages bytes "
        "that are not page-locked through two page-locked bounce buffers of this size that take turns")
    device_lock_bytes: int = _setting(
        0, "most bytes of same-host arena pages a client registers with the device driver (cudaHostRegister, in "
        "64 MiB blocks as device reads and CUDA puts first touch them), so those copies run by DMA in place, one "
        "crossing each way (0.85x of the pinned round trip at 1 GiB on an H100, against about 0.35x without); they "
        "stay locked until the unit hands the arena's free pages back to the OS, then are registered again as "
        "touched. Off by default: once pages are registered, the driver refuses a copy from a host tensor that "
        "spans two registered blocks, such as .to('cuda') of a same-host batch's zero-copy view (read onto the "
        "device with get_data(device=...) instead). 0: never register; past the budget, or where the driver "
        "refuses, a log line says so once and copies go through page-locked buffers")
    bulk_put_min_bytes: int = _setting(
        8 * MiB, "puts from this size up (as the caller's values hold them) send their frames over the unit's bulk "
        "streams (parallel lanes); smaller ones go inline on ZeroMQ, whose frames the unit keeps as they arrived")
    bulk_lane_min_bytes: int = _setting(
        4 * MiB, "a put or fetch is split over parallel bulk streams only where each stream gets at least this much")
    coalesce_puts: bool = _setting(
        True, "concurrent puts of this client to one partition, with the same fields and options, that are "
        "waiting in one turn of its event loop go as one put (one grant, one store, one commit); each caller "
        "still gets its own samples' meta once they are stored. Cancelling one of them then withdraws its "
        "samples only until the put has gone out")
    auth_dir: str = _setting(
        "", "this client's CurveZMQ keys (client.key_secret, cluster.key; see tqueue/transport/_auth.py), or "
        "TQUEUE_AUTH_DIR; empty: no authentication")

    @property
    def timeouts(self) -> Timeouts:
        """The four timeouts as one object."""
        return Timeouts(self.request_timeout, self.get_timeout, self.put_timeout, self.lease_timeout)

    def replace(self, *, timeouts: Timeouts | None = None, **fields: Any) -> ClientConfig:
        """A copy with ``fields`` changed, and with ``timeouts`` all four timeouts."""
        if timeouts is not None:
            fields = {"request_timeout": timeouts.request, "get_timeout": timeouts.get, "put_timeout": timeouts.put,
                      "lease_timeout": timeouts.lease, **fields}
        return dataclasses.replace(self, **fields)

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
            shm_min_bytes=int(_env.number("TQUEUE_SHM_MIN_BYTES", cls.shm_min_bytes)),
            arena_lease_bytes=int(_env.number("TQUEUE_ARENA_LEASE_BYTES", cls.arena_lease_bytes)),
            nixl=os.environ.get("TQUEUE_NIXL", cls.nixl),
            keep_freed_bytes=int(_env.number("TQUEUE_KEEP_FREED_BYTES", cls.keep_freed_bytes)),
            bulk=bool(_env.number("TQUEUE_BULK", 1)),
            bulk_lanes=int(_env.number("TQUEUE_BULK_LANES", cls.bulk_lanes)),
            checksums=bool(_env.number("TQUEUE_CHECKSUMS", 1)),
            arena_checksums=bool(_env.number("TQUEUE_ARENA_CHECKSUMS", 0)),
            pack_ints=bool(_env.number("TQUEUE_PACK_INTS", 1)),
            pin_memory=bool(_env.number("TQUEUE_PIN_MEMORY", 0)),
            coalesce_puts=bool(_env.number("TQUEUE_COALESCE_PUTS", 1)),
            auth_dir=os.environ.get("TQUEUE_AUTH_DIR", ""),
        )
