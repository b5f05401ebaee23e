"""The controller's state, in one object: what every part of the controller reads and changes.

:class:`ControllerState` owns the partitions, the storage units and their peers, the grants
and parked writes, the parked reads and seal waits, the leases, the DP rounds, the trainer's
version and the staleness admission counters. The objects that act on it (``Writes``,
``Reads``, ``Moves``, ``Cleanup``) each take it in their constructor; none holds state of its
own beyond what it is given. It also answers parked requests (:meth:`answer`), since a parked
request is state too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import secrets
import struct
from collections.abc import Iterator
from typing import Any, Final

import numpy as np

from .._tasks import Tasks
from ..config import ControllerConfig
from ..errors import InvalidArgumentError, PartitionClearedError, UnavailableError
from ..transport import _zmq
from ..wire import Message
from ._metrics import Totals
from ._parked import Parked
from ._partition import Options, Partition, step_in
from ._policies import Policy
from ._records import GrantRecord, Unit
from ._rounds import RoundBook

log = logging.getLogger(__name__)

# Fixed bounds on what the controller remembers (settings are in ControllerConfig):
MAX_SERVED: Final = 4096  # answered get_meta and puts remembered (request -> lease, grant) for a late Cancel
MAX_TOMBSTONES: Final = 10_000  # names of freed partitions refused for tombstone_seconds; past it the oldest go


@dataclasses.dataclass(eq=False)
class Waiter:
    """A parked request (``get_meta``, ``sealed`` or a version wait) with its deadline timer
    (see :class:`._parked.Parked`)."""

    ident: bytes
    req: Any
    timer: asyncio.TimerHandle | None = None
    principal: str = ""  # of the caller, for the lease it will get


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    partition_uid: int
    task: str
    indexes: np.ndarray
    timer: asyncio.TimerHandle | None = None
    principal: str = ""  # with auth on: the client it was given to, the only one that acks or renews it
    session: bytes = b""  # the client session it was sent to (not a DP round's share: its peers hold it too)
    given: float = 0.0  # loop time it was sent


@dataclasses.dataclass(eq=False)
class ParkedWrite:
    """A grant (or reserve) waiting for memory or for the trainer's version."""

    ident: bytes
    req: Any  # Grant | Reserve
    reason: str = ""
    full: bool = False  # waiting for memory (else for admission)
    timer: asyncio.TimerHandle | None = None
    cycle: asyncio.TimerHandle | None = None  # a reader waits for it: warn both if it lasts


class ControllerState:
    """Everything the controller knows. Create inside the running loop."""

    def __init__(self, config: ControllerConfig, server: _zmq.Server, policies: dict[str, Policy]) -> None:
        self.config = config
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.policies = policies
        self.partitions: dict[str, Partition] = {}
        self.by_uid: dict[int, Partition] = {}
        self.units: dict[int, Unit] = {}
        self.unit_peers: dict[int, _zmq.Peer] = {}
        self.grants: dict[int, GrantRecord] = {}
        self.staleness = np.zeros(17, dtype=np.int64)  # samples served, by versions behind (16: 16 or more)
        self.totals = Totals()  # freed partitions' counts, for the metrics' counters
        self.waiters: Parked[Waiter] = Parked(self.loop, _partition_of)  # parked get_meta
        self.sealed_waiters: Parked[Waiter] = Parked(self.loop, _partition_of)
        self.version_waiters: Parked[Waiter] = Parked(self.loop)  # for the trainer's version to pass theirs
        self.parked: Parked[ParkedWrite] = Parked(self.loop)  # writes and reserves waiting for budget, in order
        self.leases: dict[int, Lease] = {}
        self.served: collections.OrderedDict[tuple[bytes, int], int] = collections.OrderedDict()  # (ident, rid) -> lease
        self.granted: collections.OrderedDict[tuple[bytes, int], int] = collections.OrderedDict()  # (ident, rid) -> grant
        self.committed: collections.OrderedDict[int, None] = collections.OrderedDict()  # lately committed grants
        self.rounds: dict[tuple[int, str, str], RoundBook] = {}  # (partition uid, task, replica group)
        self.prefetching: set[int] = set()  # partitions a prefetch is moving samples into
        self.moving = 0  # moves sent to units, not landed yet
        self.moved = asyncio.Event()  # set while no move is under way (a checkpoint waits for it)
        self.moved.set()
        self.tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()  # name -> until
        self.version = 0
        self.weights = ""  # where the weights of ``version`` are, as the trainer said
        self.admission: tuple[int, int] | None = None  # (max_staleness, batch_size)
        self.admitted = 0
        self.uids = itertools.count(1)
        self.grant_ids = _random_ids()  # not guessable: a stray Store naming another writer's grant finds none
        self.lease_ids = _random_ids()  # not guessable: a lease id is what an ack names
        self.placements = itertools.count()
        self.tasks = Tasks("controller")  # background work (drops, moves, probes): cancelled at close

    # --- partitions -----------------------------------------------------------------

    def partition(self, name: str, options: Options | None = None) -> Partition:
        """The partition of this name, created (with ``options``) if there is none."""
        part = self.partitions.get(name)
        if part is None:
            self.check_new(name)
            part = Partition(
                name, next(self.uids), options,
                max_samples=self.config.max_partition_samples, max_tasks=self.config.max_tasks_per_partition,
            )
            self.partitions[name] = part
            self.by_uid[part.uid] = part
            log.info("partition %r created (uid %d)", name, part.uid)
        return part

    def step_of(self, name: str) -> int:
        """The step of partition ``name`` (NO_STEP: none), whether or not it exists yet."""
        part = self.partitions.get(name)
        return part.step if part is not None else step_in(name)

    def check_new(self, name: str) -> None:
        """Refuse a partition of this name before anything is recorded for it."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("a partition name is a non-empty string")
        if len(self.partitions) >= self.config.max_partitions:
            raise InvalidArgumentError(
                f"partition {name[:100]!r} would be partition {len(self.partitions) + 1}: "
                f"max_partitions={self.config.max_partitions}"
            )

    def live(self, name: str, uid: int) -> Partition:
        part = self.partitions.get(name)
        if part is None or (uid and part.uid != uid):
            raise PartitionClearedError(f"partition {name!r} was cleared (or never existed)")
        return part

    def bury(self, name: str) -> None:
        self.tombstones.pop(name, None)
        self.tombstones[name] = self.loop.time() + self.config.tombstone_seconds
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    def buried(self, name: str) -> bool:
        """A put to ``name`` is refused: its partition sealed and freed itself lately."""
        now = self.loop.time()
        while self.tombstones and next(iter(self.tombstones.values())) <= now:
            self.tombstones.popitem(last=False)  # in order of expiry: oldest first
        return name in self.tombstones

    # --- parked requests ------------------------------------------------------------

    def answer(self, ident: bytes, rid: int, reply: Message | BaseException) -> None:
        """Reply to a parked request; an exception becomes its typed error reply (one that
        is not a tqueue error is logged by the server)."""
        if isinstance(reply, BaseException):
            self.server.reply_error(ident, rid, reply)
        else:
            self.server.reply(ident, rid, reply)

    def check_park(self, what: str) -> None:
        """Refuse to park one more request past ``max_parked`` (nothing is recorded)."""
        parked = sum(map(len, self._parked()))
        if parked >= self.config.max_parked:
            raise UnavailableError(
                f"{what} cannot wait: {parked} requests are parked at the controller "
                f"(max_parked={self.config.max_parked}); retry later"
            )

    def finish(self, waiter: Waiter) -> None:
        """Unpark a ``get_meta`` (answered, expired or withdrawn)."""
        self.waiters.remove(waiter)

    def withdraw(self, ident: bytes, rid: int) -> bool:
        """Drop the request ``rid`` of connection ``ident`` wherever it is parked, unanswered."""
        return any(parked.withdraw(ident, rid) for parked in self._parked())

    def _parked(self) -> tuple[Parked[Any], ...]:
        return (self.waiters, self.parked, self.sealed_waiters, self.version_waiters)


def _partition_of(waiter: Waiter) -> str:
    return str(waiter.req.partition)


def _random_ids() -> Iterator[int]:
    """Random positive 63-bit ids that no peer can guess (distinct but by a chance of about
    n^2 / 2^63), 1024 of them to each read of the OS's random source."""
    while True:
        for (value,) in struct.iter_unpack("<Q", secrets.token_bytes(8 * 1024)):
            yield (value >> 1) | 1
