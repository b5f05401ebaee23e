"""A storage unit's membership of the cluster: its registration with the controller, the
heartbeats that keep it alive there, and registering again when the controller forgot it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..config import StorageConfig
from ..errors import ControllerUnavailableError, TQueueError
from ..transport import _bulk, _zmq, _zmq_server
from ..transport._liveness import UNIT_LIVENESS, window
from ..wire import Heartbeat, HeartbeatReply, Registered, RegisterUnit

log = logging.getLogger(__name__)


class Membership:
    """The unit's standing with the controller. ``server``: the unit's own server (renamed,
    with its bulk listener, and told the cluster's heartbeat interval once registered). ``describe``: the unit's
    ``RegisterUnit``; ``beat``: its next ``Heartbeat`` (its id is filled in here);
    ``forgotten(why)``: free everything held, the controller declared it lost."""

    def __init__(
        self,
        config: StorageConfig,
        server: _zmq_server.Server,
        bulk: _bulk.BulkServer | None,
        *,
        describe: Callable[[], RegisterUnit],
        beat: Callable[[int], Heartbeat],
        forgotten: Callable[[str], None],
        keep_only: Callable[[set[int]], None] = lambda uids: None,
    ) -> None:
        self.config = config
        self._server = server
        self._bulk = bulk
        self._describe = describe
        self._beat = beat
        self._forgotten = forgotten
        self._keep_only = keep_only  # restored payload: the partitions the controller still has
        self._loop = asyncio.get_running_loop()
        self.unit_id = -1
        self.interval = 0.0  # the cluster's heartbeat interval, learned at registration
        self.controller: _zmq.Peer | None = None
        self._beats: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register; afterwards the unit sends its heartbeats."""
        self.controller = _zmq.Peer(
            self.config.controller, name="controller", unavailable=ControllerUnavailableError,
            curve=self._server.curve,  # the cluster's key: only it registers a unit
        )
        await self.register()
        self._beats = self._loop.create_task(self._heartbeats())

    def ctl(self) -> _zmq.Peer:
        assert self.controller is not None, "start() first"
        return self.controller

    async def register(self) -> None:
        reply, _ = await self.ctl().request(self._describe(), expect=Registered)
        if reply.reset:
            self._forgotten("the controller keeps nothing of this unit's restored payload")
        elif reply.partitions is not None:
            self._keep_only(set(reply.partitions))
        self.unit_id = reply.unit_id
        self.interval = reply.heartbeat
        self._server.sessions.set_interval(reply.heartbeat)
        # a commit waits no longer than the liveness window on a silent controller, so a
        # writer hears "controller unavailable" from this unit before its own timeout
        self.ctl().heartbeat(reply.heartbeat)
        self._server.name = f"storage unit {self.unit_id}"
        if self._bulk is not None:
            self._bulk.name = self._server.name
        log.info("storage unit %d serving at %s", self.unit_id, self._server.address)

    async def _heartbeats(self) -> None:
        """Tell the controller this unit lives, every interval. A controller that does not
        know the unit as alive (it restarted, or declared this unit dead and its samples
        lost) hears it register again; the unit starts empty then."""
        if self.interval <= 0:
            return
        silent_since: float | None = None
        while True:
            await asyncio.sleep(self.interval)  # the heartbeat's period, not a wait for an event
            try:
                reply, _ = await self.ctl().request(
                    self._beat(self.unit_id), expect=HeartbeatReply, timeout=window(self.interval, UNIT_LIVENESS)
                )
                if not reply.known:
                    self._forgotten("the controller no longer knows this unit")
                    await self.register()
                silent_since = None
            except TQueueError as exc:  # the next beat tries again
                if silent_since is None:
                    silent_since = self._loop.time()
                    log.warning("unit %d: the controller does not answer its heartbeat: %s", self.unit_id, exc)

    async def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        if self.controller is not None:
            await self.controller.close()
