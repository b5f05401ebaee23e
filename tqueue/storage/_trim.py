"""Giving freed memory back to the OS: at once when more than ``retain_bytes`` is free but
mapped, else once writes pause for ``trim_delay``; and freed payload that unsent replies still
keep in memory, given back once they are gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .. import _memory
from .._memory import BufferPool
from ..config import StorageConfig
from ..transport._arena import Arena


class Trimmer:
    """Returns a unit's freed memory (heap, idle ``buffers``, ``arena`` pages) to the OS.
    ``held_bytes``: bytes of replies not yet taken by their readers."""

    def __init__(self, config: StorageConfig, arena: Arena | None, buffers: BufferPool, held_bytes: Callable[[], int]) -> None:
        self.config = config
        self.arena = arena
        self.buffers = buffers
        self._held_bytes = held_bytes
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        # freed payload that unsent replies still keep in memory: given back once they are gone
        self._owed = False

    def freed(self) -> None:
        """Payload was freed: give it back now or soon; replies not yet taken may keep some
        of it, given back when they are gone (``sent``)."""
        self._owed = self._owed or self._held_bytes() > 0
        self.reclaim()

    def forgot(self) -> None:
        """Everything was freed: give it back now (what replies keep, once they are gone)."""
        self._owed = self._held_bytes() > 0
        self.now()

    def busy(self) -> None:
        """A write arrived: while a trim is pending, keep the freed pages for these writes."""
        if self._timer is not None:
            self.schedule()

    def sent(self) -> None:
        """Once the replies that kept freed payload in memory are gone, give it back."""
        if self._owed and not self._held_bytes():
            self._owed = False
            self.reclaim()

    def reclaim(self) -> None:
        """Memory was freed: give it back to the OS now if more than ``retain_bytes`` is free
        but mapped (the heap's free bytes, idle buffers, the arena's free pages), or if
        nothing is to be retained; else once writes pause for ``trim_delay``."""
        idle = _memory.heap_free() + self.buffers.idle_bytes
        idle += self.arena.free_touched if self.arena is not None else 0
        if idle > self.config.retain_bytes or not self.config.retain_bytes:
            self.now()
        else:
            self.schedule()

    def schedule(self) -> None:
        """(Re)arm the idle timer that returns retained memory to the OS."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self.config.trim_delay, self.now)

    def now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.buffers.clear()
        _memory.trim()
        if self.arena is not None:
            self.arena.punch()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
