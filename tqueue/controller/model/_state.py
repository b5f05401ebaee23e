"""What several parts of the controller share, in one object.

:class:`ControllerState` holds the partitions, the storage units and their peers, the grant
records, the parked requests (reads, seal waits, version waits, writes), the partitions a
prefetch fills, the tombstones of freed partitions and the trainer's version and admission
(:class:`Trainer`). It also answers parked requests (:meth:`answer`), since a parked request
is state too. What only one part uses is that part's own: the leases, DP rounds, policies and
served staleness are ``Reads``', the request-to-grant memory and placement turns ``Writes``',
the moves under way ``Moves``', the freed partitions' totals the server's.
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

from ..._tasks import Tasks
from ...config import ControllerConfig
from ...errors import InvalidArgumentError, PartitionClearedError, UnavailableError
from ...transport import _zmq
from ...wire import Message
from ._parked import Parked
from ._partition import Options, Partition, step_in
from ._records import GrantRecord, Unit

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


class ControllerState:
    """Everything the controller knows. Create inside the running loop."""

    def __init__(self, config: ControllerConfig, server: _zmq.Server) -> None:
        self.config = config
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.partitions: dict[str, Partition] = {}
        self.by_uid: dict[int, Partition] = {}
        self.units: dict[int, Unit] = {}
        self.unit_peers: dict[int, _zmq.Peer] = {}
        self.grants: dict[int, GrantRecord] = {}
        self.waiters: Parked[Waiter] = Parked(self.loop, _partition_of)  # parked get_meta
        self.sealed_waiters: Parked[Waiter] = Parked(self.loop, _partition_of)
        self.version_waiters: Parked[Waiter] = Parked(self.loop)  # for the trainer's version to pass theirs
        self.parked: Parked[ParkedWrite] = Parked(self.loop)  # writes and reserves waiting for budget, in order
        self.prefetching: set[int] = set()  # partitions a prefetch is moving samples into
        self.tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()  # name -> until
        self.trainer = Trainer()
        self.uids = itertools.count(1)
        self.grant_ids = random_ids()  # not guessable: a stray Store naming another writer's grant finds none
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

    def withdraw_session(self, session: bytes, error: BaseException) -> list[int]:
        """Withdraw every parked request of a client session that ended, each answered with
        ``error``: how many of the parked reads, seal waits, version waits and writes."""
        withdrawn = []
        for registry in (self.waiters, self.sealed_waiters, self.version_waiters, self.parked):
            mine = registry.withdraw_session(session)
            for entry in mine:
                self.answer(entry.ident, entry.req.rid, error)
            withdrawn.append(len(mine))
        return withdrawn

    def _parked(self) -> tuple[Parked[Any], ...]:
        return (self.waiters, self.parked, self.sealed_waiters, self.version_waiters)


def _partition_of(waiter: Waiter) -> str:
    return str(waiter.req.partition)


def random_ids() -> Iterator[int]:
    """Random positive 63-bit ids that no peer can guess (distinct but by a chance of about
    n^2 / 2^63), 1024 of them to each read of the OS's random source."""
    while True:
        for (value,) in struct.iter_unpack("<Q", secrets.token_bytes(8 * 1024)):
            yield (value >> 1) | 1
