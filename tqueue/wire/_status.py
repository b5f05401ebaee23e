"""The controller's report of itself (``status()``): partitions, tasks, units and parked calls."""

from __future__ import annotations

import msgspec

from .._api import deprecated
from ._messages import FieldSpec, Kind, Message, WaitCause, WaiterKind, register


class StatusRequest(Message):
    KIND = Kind.STATUS


class TaskStatus(msgspec.Struct, kw_only=True):
    """``lost``: samples this task had not consumed when their storage unit died, counted from
    the partition's first sample (a task that first reads after a death counts it too, and a
    task declared with the partition is listed, with its losses, before it reads)."""

    leased: int
    consumed: int
    refused: int = 0
    expired: int = 0
    lost: int = 0


class PartitionStatus(msgspec.Struct, kw_only=True):
    """``samples``: committed; ``ready``: committed and not excluded; ``excluded``: aborted,
    failed or cleared samples, by reason in ``reasons``."""

    name: str
    uid: int
    samples: int
    fields: dict[str, FieldSpec]
    tasks: dict[str, TaskStatus]
    nbytes: int
    ready: int = 0
    excluded: int = 0
    reasons: dict[str, int] = {}
    in_flight: int = 0
    groups_complete: int = 0
    sealed: bool = False
    lost: int = 0  # samples on storage units that died (also in ``reasons["lost"]``)
    recycle_to: str = ""  # where puts after the seal go, as partial samples
    copies: int = 1  # copies of each put
    single: int = 0  # samples held once now (a unit died, no second unit had room): not lost, aborted or cleared ones
    corrupt: int = 0  # copies dropped because a reader found their bytes changed (CRC-32C)
    dedup: list[str] = []  # fields shared by content (create_partition(dedup=...))

    @property
    def replicas(self) -> int:
        """Deprecated spelling of :attr:`copies`."""
        deprecated("PartitionStatus.replicas", "PartitionStatus.copies")
        return self.copies


class UnitStatus(msgspec.Struct, kw_only=True):
    unit_id: int
    address: str
    host: str
    nbytes: int
    capacity: int = 0
    undropped: int = 0  # partitions whose drop this unit has not confirmed (retried)
    name: str = ""
    alive: bool = True  # false: missed its heartbeats; its samples are lost
    silent: float = 0.0  # seconds since the controller last heard from it
    arena_used: int = 0  # of its shared-memory arena, as of its last heartbeat
    metrics: str = ""  # its Prometheus endpoint ("": none)
    # bytes of replies its readers have not taken yet, as of its last heartbeat: they stay in
    # memory, a cleared partition's too, until taken or cut off (StorageConfig.max_queued_bytes_total)
    held_bytes: int = 0
    # bytes its samples hold beyond what it stores, as of its last heartbeat: values of fields
    # shared by content (create_partition(dedup=...)), stored once and held by several samples
    bytes_shared: int = 0


class WaiterStatus(msgspec.Struct, kw_only=True):
    """A parked call: ``kind`` is ``get_meta``, ``put`` or ``reserve``."""

    partition: str
    task: str
    reason: str
    kind: WaiterKind = "get_meta"
    cause: WaitCause = "samples"  # samples to be ready (a read), memory or the staleness bound (a write)


class KeyUse(msgspec.Struct, kw_only=True):
    """One partition's keys, and the bytes of its tags as MessagePack."""

    keys: int = 0
    tag_bytes: int = 0


class KeyStatus(msgspec.Struct, kw_only=True):
    """Keys and tags held, in all and per partition (those with keys or tags), with the
    controller's bounds on them (``ControllerConfig.max_keys_total`` and the rest): a write
    past a bound is refused with ``InvalidArgumentError``."""

    keys: int = 0
    tag_bytes: int = 0
    max_keys_total: int = 0
    max_tag_bytes_total: int = 0
    max_keys_per_partition: int = 0
    max_tag_bytes_per_partition: int = 0
    max_tag_bytes: int = 0  # one sample's (or key's) tags
    partitions: dict[str, KeyUse] = {}


class StatusReply(Message):
    KIND = Kind.STATUS_REPLY
    partitions: list[PartitionStatus]
    units: list[UnitStatus]
    waiting: list[WaiterStatus] = []
    version: int = 0
    admitted: int = 0
    admission_limit: int = -1
    metrics: str = ""  # the controller's Prometheus endpoint ("": none)
    weights: str = ""  # where the weights of ``version`` are (SetVersion.weights)
    keys: KeyStatus = msgspec.field(default_factory=KeyStatus)

    @property
    def bytes_shared(self) -> int:
        """Bytes the units' samples hold beyond what the units store (values shared by
        content, stored once), as of their last heartbeats."""
        return sum(u.bytes_shared for u in self.units)


register(globals())
