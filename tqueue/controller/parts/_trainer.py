"""The trainer's version and its weights' pointer, waits for a newer one, and staleness
admission's settings (``SetVersion``, ``VersionWait``, ``Admission``); admission itself is
applied to puts by ``Writes``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...errors import InvalidArgumentError, WaitTimeoutError
from ...wire import Admission, Ok, SetVersion, VersionReply, VersionWait
from ..model._state import ControllerState, Waiter

log = logging.getLogger(__name__)


class Versions:
    """Over ``state``; ``retry_parked``: puts parked for admission may go in now."""

    def __init__(self, state: ControllerState, *, retry_parked: Callable[[], None]) -> None:
        self.state = state
        self._retry_parked = retry_parked

    def set_version(self, ident: bytes, msg: SetVersion, bufs: list[Any]) -> Ok:
        """A newer version replaces the version and its weights' pointer together (so that a
        version and a pointer seen together always belong together); any other changes nothing."""
        if msg.version > self.state.trainer.version:
            self.state.trainer.version, self.state.trainer.weights = msg.version, msg.weights
            log.info("trainer version %d (weights %s)", msg.version, msg.weights or "not said")
            self.state.loop.call_soon(self._retry_parked)  # after this reply
            self.state.loop.call_soon(self._answer_versions)
        return Ok()

    def wait_version(self, ident: bytes, msg: VersionWait, bufs: list[Any]) -> VersionReply | None:
        """The version and its pointer once the version is past ``msg.after``: at once, or
        parked (bounded by ``max_parked``) until ``set_version`` passes it or its timeout."""
        if self.state.trainer.version > msg.after:
            return VersionReply(version=self.state.trainer.version, weights=self.state.trainer.weights)
        if msg.timeout <= 0:
            raise WaitTimeoutError(f"the trainer's version is {self.state.trainer.version}, not past {msg.after}")
        self.state.parked.check(f"a wait for a version past {msg.after}")
        self.state.parked.versions.park(Waiter(ident, msg), msg.timeout, self._expire_version)
        return None  # answered by set_version, at its deadline, or withdrawn by Cancel

    def _answer_versions(self) -> None:
        reply = VersionReply(version=self.state.trainer.version, weights=self.state.trainer.weights)
        for waiter in [w for w in self.state.parked.versions if self.state.trainer.version > w.req.after]:
            self.state.parked.versions.remove(waiter)
            self.state.parked.answer(waiter.ident, waiter.req.rid, reply)

    def _expire_version(self, waiter: Waiter) -> None:
        self.state.parked.answer(waiter.ident, waiter.req.rid, WaitTimeoutError(
            f"the trainer's version stayed at {self.state.trainer.version} for {waiter.req.timeout} s "
            f"(waited for a version past {waiter.req.after})"
        ))

    def set_admission(self, ident: bytes, msg: Admission, bufs: list[Any]) -> Ok:
        if msg.max_staleness < 0:
            self.state.trainer.admission = None
        else:
            if msg.batch_size < 1:
                raise InvalidArgumentError(f"batch_size must be at least 1, got {msg.batch_size}")
            self.state.trainer.admission = (msg.max_staleness, msg.batch_size)
        self.state.loop.call_soon(self._retry_parked)  # after this reply
        return Ok()
