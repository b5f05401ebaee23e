"""A unit's commits, one message a turn of its loop.

Each ``Store`` is acknowledged only once the controller has recorded its ``Commit``
(acknowledged means stored). Under many writers a unit handles tens of stores in one turn of
its loop; sending one ``Commit`` each made the controller receive, decode and answer one
message a put. Here the stores of one turn wait for the end of the turn (``call_soon``: after
the handlers already scheduled), and their commits go as one ``Commits`` message; a turn with
a single store sends the plain ``Commit``. Nothing is acknowledged earlier: each store still
waits for its own entry's answer, and an entry the controller refuses fails that store alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ProtocolError, TQueueError, from_code
from ..transport import _zmq
from ..wire import MAX_COMMITS, Commit, Commits, CommitsDone, Committed

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    grant_id: int
    fields: list[str]
    nbytes: int
    partition_bytes: int
    limit: float | None  # how long it may wait for the controller (None: the peer's own limit)
    done: asyncio.Future[bool]  # the partition is sealed now


class CommitQueue:
    """The commits of the stores handled in one turn, sent together at its end.

    ``controller`` is the unit's connection to the controller, ``unit`` what the message
    carries of the unit (its id, its resident bytes), read when the turn's commits leave.
    """

    def __init__(self, controller: Callable[[], _zmq.Peer], unit: Callable[[], tuple[int, int]]) -> None:
        self._controller = controller
        self._unit = unit
        self._loop = asyncio.get_running_loop()
        self._waiting: list[_Entry] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # messages sent, and the commits they carried (for tests and metrics)
        self.commits = 0

    async def commit(
        self, grant_id: int, fields: list[str], nbytes: int, partition_bytes: int, limit: float | None
    ) -> bool:
        """Wait until the controller has recorded this store's commit; whether the partition
        is sealed now. The controller's refusal is raised as its typed error, no answer
        within ``limit`` as ``ControllerUnavailableError``."""
        done: asyncio.Future[bool] = self._loop.create_future()
        if not self._waiting:
            self._loop.call_soon(self._send)
        self._waiting.append(_Entry(grant_id, fields, nbytes, partition_bytes, limit, done))
        return await done

    def _send(self) -> None:
        waiting, self._waiting = [e for e in self._waiting if not e.done.done()], []
        for at in range(0, len(waiting), MAX_COMMITS):
            task = self._loop.create_task(self._request(waiting[at : at + MAX_COMMITS]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _request(self, entries: list[_Entry]) -> None:
        unit_id, unit_bytes = self._unit()
        # the turn's stores arrived within a turn of each other: none waits past its own limit
        limits = [e.limit for e in entries if e.limit is not None]
        limit = min(limits) if limits else None
        self.sent += 1
        self.commits += len(entries)
        try:
            if len(entries) == 1:
                e = entries[0]
                reply, _ = await self._controller().request(
                    Commit(
                        grant_id=e.grant_id, unit_id=unit_id, fields=e.fields, nbytes=e.nbytes,
                        partition_bytes=e.partition_bytes, unit_bytes=unit_bytes,
                    ),
                    expect=Committed,
                    timeout=limit,
                )
                sealed, errors = [reply.sealed], []
            else:
                done, _ = await self._controller().request(
                    Commits(
                        unit_id=unit_id, grant_ids=[e.grant_id for e in entries], fields=[e.fields for e in entries],
                        nbytes=[e.nbytes for e in entries], partition_bytes=[e.partition_bytes for e in entries],
                        unit_bytes=unit_bytes,
                    ),
                    expect=CommitsDone,
                    timeout=limit,
                )
                sealed, errors = done.sealed, done.errors
        except Exception as exc:  # no answer, or a refusal of the whole message: every store of the turn fails
            _fail(entries, exc)
            return
        except BaseException:  # the unit is closing
            for e in entries:
                e.done.cancel()
            raise
        refused = {i: from_code(code, message) for i, code, message in errors}
        if len(sealed) != len(entries) or any(not 0 <= i < len(entries) for i in refused):
            _fail(entries, ProtocolError(f"the controller answered {len(entries)} commits with {len(sealed)}"))
            return
        for i, e in enumerate(entries):
            if e.done.done():  # its store was cancelled meanwhile: it rolled back on its own
                continue
            if i in refused:
                e.done.set_exception(refused[i])
            else:
                e.done.set_result(sealed[i])

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for e in self._waiting:
            if not e.done.done():
                e.done.cancel()
        self._waiting = []


def _fail(entries: list[_Entry], exc: Exception) -> None:
    """Fail each store still waiting with ``exc``: a typed error is raised in each store's
    task as an instance of its own (one instance raised in many tasks would gather all
    their tracebacks), caused by the one that happened."""
    for e in entries:
        if e.done.done():
            continue
        own: BaseException = exc
        if isinstance(exc, TQueueError):
            try:
                own = type(exc)(str(exc))
                own.__cause__ = exc
            except TypeError:  # a class with another signature: shared, then
                own = exc
        e.done.set_exception(own)
