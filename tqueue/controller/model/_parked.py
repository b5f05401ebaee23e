"""Requests parked at the controller until an event answers them: each with its deadline
timer, answered, expired or withdrawn (by its caller's ``Cancel``, or when its session ends).
One :class:`Parked` registry per kind of wait; together they count toward ``max_parked``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ...transport._liveness import session_of


class Entry(Protocol):
    """What a registry needs of a parked request: who asked, what, and its timer."""

    ident: bytes
    req: Any
    timer: asyncio.TimerHandle | None


E = TypeVar("E", bound=Entry)


class Parked(Generic[E]):
    """Parked requests of one kind, by key (a partition's name; one key where the wait is not
    about a partition). ``len`` is how many are parked; ``get``, ``keys`` and ``values``
    read them by key."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: Callable[[E], str] = lambda entry: "") -> None:
        self._loop = loop
        self._key = key
        self.by_key: dict[str, list[E]] = {}  # read it (a commit's wake looks here first), change it only here
        self._count = 0

    def park(self, entry: E, timeout: float, expire: Callable[[E], None]) -> None:
        """Park ``entry``; at ``timeout`` seconds (``math.inf``: never) it is unparked and
        ``expire`` answers it."""
        if not math.isinf(timeout):
            entry.timer = self._loop.call_later(timeout, self._expire, entry, expire)
        self.by_key.setdefault(self._key(entry), []).append(entry)
        self._count += 1

    def _expire(self, entry: E, expire: Callable[[E], None]) -> None:
        entry.timer = None
        self.remove(entry)
        expire(entry)

    def remove(self, entry: E) -> bool:
        """Unpark ``entry`` (answered, expired or withdrawn): its timer ends with it."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        key = self._key(entry)
        entries = self.by_key.get(key)
        if entries is None or entry not in entries:
            return False
        entries.remove(entry)
        self._count -= 1
        if not entries:
            del self.by_key[key]
        return True

    def take(self, key: str) -> list[E]:
        """Unpark every request under ``key``, for the caller to answer."""
        entries = self.by_key.pop(key, [])
        self._count -= len(entries)
        for entry in entries:
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
        return entries

    def withdraw(self, ident: bytes, rid: int) -> bool:
        """Unpark request ``rid`` of connection ``ident``, unanswered; False if not parked here."""
        for entry in self:
            if entry.ident == ident and entry.req.rid == rid:
                return self.remove(entry)
        return False

    def withdraw_session(self, session: bytes) -> list[E]:
        """Unpark every request of a client session that ended, for the caller to answer."""
        mine = [entry for entry in self if session_of(entry.ident) == session]
        for entry in mine:
            self.remove(entry)
        return mine

    def get(self, key: str, default: Sequence[E] = ()) -> list[E]:
        """The requests parked under ``key`` (a copy: answering them may unpark them)."""
        return list(self.by_key.get(key, default))

    def has(self, entry: E) -> bool:
        """``entry`` is parked here still."""
        return entry in self.by_key.get(self._key(entry), ())

    def keys(self) -> list[str]:
        return list(self.by_key)

    def values(self) -> list[list[E]]:
        return [list(entries) for entries in self.by_key.values()]

    def __getitem__(self, key: str) -> list[E]:
        return list(self.by_key[key])

    def __contains__(self, key: object) -> bool:
        """Some request is parked under ``key``."""
        return key in self.by_key

    def __iter__(self) -> Iterator[E]:
        """Every parked request (a snapshot: answering them may unpark them)."""
        return iter([entry for entries in self.by_key.values() for entry in entries])

    def __len__(self) -> int:
        return self._count
