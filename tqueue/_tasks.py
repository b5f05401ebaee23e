"""Background tasks with an owner, and fan-outs that fail whole.

asyncio keeps a task it was handed only by weak reference, nothing cancels it when its
starter closes, and a failure nobody awaited shows only as "exception never retrieved" at
garbage collection. :class:`Tasks` (modelled on the transport ``Server``'s own set) owns what
a server or a client starts in the background: it holds each task until it ends, logs a
failure once with the task's name, and :meth:`Tasks.close` cancels what is left and waits for
it. :func:`all_or_none` is ``gather`` for a fan-out whose parts are worthless alone: when one
fails, the others are cancelled (and awaited) before the first error is raised. Both work on
Python 3.10, which has no ``asyncio.TaskGroup``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Tasks:
    """The background tasks of one owner (``name`` says whose, in logs)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, T], what: str = "") -> asyncio.Task[T]:
        """Run ``coro`` in the background, held here until it ends or :meth:`close`."""
        if self.closed:
            coro.close()
            raise RuntimeError(f"{self.name} is closed: it starts no more background work")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}: {what or getattr(coro, '__qualname__', 'task')}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    def cancel(self) -> None:
        """Cancel every task now (for a closing owner that cannot wait)."""
        self.closed = True
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        """Cancel every task and wait until each has ended."""
        self.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def all_or_none(*aws: Awaitable[T]) -> list[T]:
    """The results of ``aws``, run at once; if one fails, the others are cancelled and
    awaited, then its error is raised (``gather`` would leave them running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
