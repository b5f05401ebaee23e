"""Waits that may never end: a put parked for memory and a ``get_meta`` parked for that put's
partition wait on each other. Unless memory is freed elsewhere (another task's acks, a clear),
neither ends before its timeout; after ``ControllerConfig.cycle_notice`` seconds each caller
is warned with a ``Notice`` on its parked request, and the controller logs it once.
"""

from __future__ import annotations

import logging

from ...wire import Grant, Notice
from ..model._state import ControllerState, ParkedWrite

log = logging.getLogger(__name__)


class Cycles:
    """Watches the parked puts of a partition that a reader waits on, over ``state``."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state

    def watch(self, partition: str) -> None:
        """A put parked for memory and a read parked for that put's partition wait on each
        other: unless the memory is freed elsewhere (another task's acks, a clear) neither
        ends before its timeout. If both still wait after ``cycle_notice`` seconds, each
        caller is warned with a ``Notice`` (and the controller logs it once)."""
        delay = self.state.config.cycle_notice
        if delay <= 0 or partition not in self.state.parked.reads:
            return
        for parked in self.state.parked.writes:
            if parked.full and parked.cycle is None and isinstance(parked.req, Grant) and parked.req.partition == partition:
                parked.cycle = self.state.loop.call_later(delay, self._notice_cycle, parked)

    def _notice_cycle(self, parked: ParkedWrite) -> None:
        partition = parked.req.partition
        readers = self.state.parked.reads.get(partition)
        if not self.state.parked.writes.has(parked) or not parked.full or not readers:
            parked.cycle = None  # the cycle broke; a new reader watches again
            return
        tasks = sorted({w.req.task for w in readers})
        text = (
            f"a wait that may never end: get_meta of task(s) {tasks} on partition {partition!r} waits for "
            f"samples that a put of {parked.req.count} parked at the controller would bring, and that put waits "
            f"for memory ({parked.reason}); only acks of other partitions, or a clear, free memory for it"
        )
        log.warning("%s", text)
        self.state.server.reply(parked.ident, parked.req.rid, Notice(text=text))
        for reader in readers:
            self.state.server.reply(reader.ident, reader.req.rid, Notice(text=text))
