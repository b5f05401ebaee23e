"""What several parts of the controller share, in one object of ten attributes, and the
records it keeps.

:class:`ControllerState` holds the partitions (:class:`Partitions`: by name and uid, and the
tombstones of freed ones), the storage units (:class:`Unit` records) with their peers and
where a write goes among them (:class:`Units`, :meth:`Units.pick`), the grants not yet
committed (:class:`Grants`), the parked requests
(:class:`Requests`: reads, seal waits, version waits, writes; it answers them too, since a
parked request is state), the partitions a prefetch fills and the trainer's version and
admission (:class:`Trainer`). What only one part uses is that part's own: the leases, DP
rounds, policies and served staleness are ``Reads``', the request-to-grant memory and
placement turns ``Writes``', the moves under way ``Moves``', the freed partitions' totals the
server's.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import secrets
import struct
from collections.abc import Iterator
from typing import Any, Final

from ..._tasks import Tasks
from ...config import ControllerConfig
from ...errors import InvalidArgumentError, PartitionClearedError, UnavailableError
from ...transport import _zmq, _zmq_server
from ...wire import Grant, Message, UnitInfo
from ._parked import Parked
from ._partition import GrantRecord, Options, Partition, step_in

log = logging.getLogger(__name__)

# Fixed bounds on what the controller remembers (settings are in ControllerConfig):
MAX_SERVED: Final = 4096  # answered get_meta and puts remembered (request -> lease, grant) for a late Cancel
MAX_TOMBSTONES: Final = 10_000  # names of freed partitions refused for tombstone_seconds; past it the oldest go


class Wait(Exception):
    """A write cannot be admitted yet; ``reason`` says why, ``full`` if for memory."""

    def __init__(self, reason: str, *, full: bool, never: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.full = full
        self.never = never  # waiting cannot help


@dataclasses.dataclass
class Unit:
    info: UnitInfo
    capacity: int = 0  # bytes the unit may hold; 0: no limit
    nbytes: int = 0  # stored, as the unit last reported
    reserved: int = 0  # granted to writes not yet committed
    name: str = ""  # its identity: registering again under it gives the same unit id
    alive: bool = True  # false once it missed its heartbeats: its samples are lost
    suspect: bool = False  # a client failed to store on it: no placements until a probe answers
    heard: float = 0.0  # loop time of its last heartbeat
    session: bytes = b""  # its connection's session at the controller (any message from it is a sign of life)
    ident: bytes = b""  # its connection at the controller, whose messages are handled first
    arena_used: int = 0  # as its last heartbeat said
    held_bytes: int = 0  # replies not yet taken by their readers, as its last heartbeat said
    bytes_shared: int = 0  # what its samples hold beyond what it stores (values shared by content)
    metrics: str = ""  # its Prometheus endpoint

    @property
    def load(self) -> int:
        return self.nbytes + self.reserved

    def fits(self, nbytes: int) -> bool:
        return not self.capacity or self.load + nbytes <= self.capacity


@dataclasses.dataclass(eq=False)
class Waiter:
    """A parked request (``get_meta``, ``sealed`` or a version wait) with its deadline timer
    (see :class:`._parked.Parked`)."""

    ident: bytes
    req: Any
    timer: asyncio.TimerHandle | None = None
    principal: str = ""  # of the caller, for the lease it will get


@dataclasses.dataclass(eq=False)
class ParkedWrite:
    """A grant (or reserve) waiting for memory or for the trainer's version."""

    ident: bytes
    req: Any  # Grant | Reserve
    reason: str = ""
    full: bool = False  # waiting for memory (else for admission)
    timer: asyncio.TimerHandle | None = None
    cycle: asyncio.TimerHandle | None = None  # a reader waits for it: warn both if it lasts


@dataclasses.dataclass
class Trainer:
    """What the trainer said (``SetVersion``, ``Admission``: ``parts._trainer``) and what
    admission counted of puts (``parts._writes``)."""

    version: int = 0
    weights: str = ""  # where the weights of ``version`` are, as the trainer said
    admission: tuple[int, int] | None = None  # (max_staleness, batch_size); None: no bound
    admitted: int = 0  # samples admitted so far (a lapsed grant gives its back)


class Partitions(dict[str, Partition]):
    """The partitions by name (a dict), and by uid; the tombstones of those freed lately."""

    def __init__(self, config: ControllerConfig, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._config = config
        self._loop = loop
        self.by_uid: dict[int, Partition] = {}
        self.tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()  # name -> until
        self.uids = itertools.count(1)

    def get_or_create(self, name: str, options: Options | None = None) -> Partition:
        """The partition of this name, created (with ``options``) if there is none."""
        part = self.get(name)
        if part is None:
            self.check_new(name)
            part = Partition(
                name, next(self.uids), options,
                max_samples=self._config.max_partition_samples, max_tasks=self._config.max_tasks_per_partition,
            )
            self[name] = part
            self.by_uid[part.uid] = part
            log.info("partition %r created (uid %d)", name, part.uid)
        return part

    def step_of(self, name: str) -> int:
        """The step of partition ``name`` (NO_STEP: none), whether or not it exists yet."""
        part = self.get(name)
        return part.step if part is not None else step_in(name)

    def check_new(self, name: str) -> None:
        """Refuse a partition of this name before anything is recorded for it."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("a partition name is a non-empty string")
        if len(self) >= self._config.max_partitions:
            raise InvalidArgumentError(
                f"partition {name[:100]!r} would be partition {len(self) + 1}: "
                f"max_partitions={self._config.max_partitions}"
            )

    def live(self, name: str, uid: int) -> Partition:
        part = self.get(name)
        if part is None or (uid and part.uid != uid):
            raise PartitionClearedError(f"partition {name!r} was cleared (or never existed)")
        return part

    def bury(self, name: str) -> None:
        self.tombstones.pop(name, None)
        self.tombstones[name] = self._loop.time() + self._config.tombstone_seconds
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    def buried(self, name: str) -> bool:
        """A put to ``name`` is refused: its partition sealed and freed itself lately."""
        now = self._loop.time()
        while self.tombstones and next(iter(self.tombstones.values())) <= now:
            self.tombstones.popitem(last=False)  # in order of expiry: oldest first
        return name in self.tombstones


class Units(dict[int, Unit]):
    """The storage units by id (a dict), the peer each one is reached on, and where a write
    goes among them (:meth:`pick`)."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[int, _zmq.Peer] = {}

    def pick(self, msg: Grant, cap: int, placements: Iterator[int]) -> Unit:
        """Placement of ``msg``: a unit on the producer's host with room, the least loaded among those;
        Wait where none can take ``msg`` now (saying why, and whether it never will)."""
        units = [u for u in self.values() if u.alive and not u.suspect]  # nothing new to a dead unit
        if not units:
            suspect = sum(u.alive and u.suspect for u in self.values())
            raise Wait(
                f"no live storage unit ({len(self)} registered: {suspect} being probed after a failed store, "
                f"{len(self) - suspect} dead)" if self
                else "no storage unit is registered with the controller yet",
                full=True,
            )
        need = msg.nbytes
        used = sum(u.load for u in units)
        if cap and used + need > cap:
            raise Wait(
                f"a write of {need} bytes to partition {msg.partition!r} needs memory: {used} "
                f"bytes used of {cap} allowed in the cluster",
                full=True,
                never=need > cap,
            )
        roomy = [u for u in units if u.fits(need)]
        if not roomy:
            largest = max((u.capacity or math.inf) for u in units)
            per_unit = ", ".join(f"unit {u.info.unit_id}: {u.load} of {u.capacity}" for u in units)
            raise Wait(
                f"a write of {need} bytes to partition {msg.partition!r} fits on no storage unit "
                f"({per_unit} bytes used of allowed)",
                full=True,
                never=need > largest,
            )
        local = [u for u in roomy if msg.host and u.info.host == msg.host]
        pool = local or roomy
        turn = next(placements)  # ties rotate so that equal units share the work
        return min(pool, key=lambda u: (u.load, (u.info.unit_id - turn) % len(pool)))


class Grants(dict[int, GrantRecord]):
    """The grants not yet committed or lapsed, by id (a dict); ``ids`` makes new ids, which
    no peer can guess (a stray Store naming another writer's grant finds none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = random_ids()


class Requests:
    """The parked requests, one :class:`Parked` registry per kind of wait: ``reads``
    (``get_meta``, by partition), ``seals`` (``sealed`` waits, by partition), ``versions``
    (for the trainer's version to pass theirs) and ``writes`` (grants and reserves waiting
    for budget, in order); together they count toward ``max_parked``. A parked request is
    answered here too (:meth:`answer`)."""

    def __init__(self, config: ControllerConfig, server: _zmq_server.Server, loop: asyncio.AbstractEventLoop) -> None:
        self._config = config
        self._server = server
        self.reads: Parked[Waiter] = Parked(loop, _partition_of)
        self.seals: Parked[Waiter] = Parked(loop, _partition_of)
        self.versions: Parked[Waiter] = Parked(loop)
        self.writes: Parked[ParkedWrite] = Parked(loop)

    def answer(self, ident: bytes, rid: int, reply: Message | BaseException) -> None:
        """Reply to a parked request; an exception becomes its typed error reply (one that
        is not a tqueue error is logged by the server)."""
        if isinstance(reply, BaseException):
            self._server.reply_error(ident, rid, reply)
        else:
            self._server.reply(ident, rid, reply)

    def check(self, what: str) -> None:
        """Refuse to park one more request past ``max_parked`` (nothing is recorded)."""
        parked = sum(map(len, self._all()))
        if parked >= self._config.max_parked:
            raise UnavailableError(
                f"{what} cannot wait: {parked} requests are parked at the controller "
                f"(max_parked={self._config.max_parked}); retry later"
            )

    def finish(self, waiter: Waiter) -> None:
        """Unpark a ``get_meta`` (answered, expired or withdrawn)."""
        self.reads.remove(waiter)

    def withdraw(self, ident: bytes, rid: int) -> bool:
        """Drop the request ``rid`` of connection ``ident`` wherever it is parked, unanswered."""
        return any(parked.withdraw(ident, rid) for parked in self._all())

    def withdraw_session(self, session: bytes, error: BaseException) -> list[int]:
        """Withdraw every parked request of a client session that ended, each answered with
        ``error``: how many of the parked reads, seal waits, version waits and writes."""
        withdrawn = []
        for registry in (self.reads, self.seals, self.versions, self.writes):
            mine = registry.withdraw_session(session)
            for entry in mine:
                self.answer(entry.ident, entry.req.rid, error)
            withdrawn.append(len(mine))
        return withdrawn

    def _all(self) -> tuple[Parked[Any], ...]:
        return (self.reads, self.writes, self.seals, self.versions)


class ControllerState:
    """What several parts share, in ten attributes. Create inside the running loop."""

    def __init__(self, config: ControllerConfig, server: _zmq_server.Server) -> None:
        self.config = config
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.partitions = Partitions(config, self.loop)
        self.units = Units()
        self.grants = Grants()
        self.parked = Requests(config, server, self.loop)
        self.prefetching: set[int] = set()  # partitions a prefetch is moving samples into
        self.trainer = Trainer()
        self.tasks = Tasks("controller")  # background work (drops, moves, probes): cancelled at close


def _partition_of(waiter: Waiter) -> str:
    return str(waiter.req.partition)


def random_ids() -> Iterator[int]:
    """Random positive 63-bit ids that no peer can guess (distinct but by a chance of about
    n^2 / 2^63), 1024 of them to each read of the OS's random source (taking one is a C
    iterator's step: the batch is made in Python once per 1024)."""
    return itertools.chain.from_iterable(map(_id_batch, itertools.repeat(1024)))


def _id_batch(count: int) -> list[int]:
    return [(value >> 1) | 1 for (value,) in struct.iter_unpack("<Q", secrets.token_bytes(8 * count))]
