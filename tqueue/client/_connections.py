"""A client's connections: the controller peer, unit peers, the payload route of each unit
(which keeps its own bulk streams) and arena maps."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .. import _env, _memory
from .._memory import BufferPool
from .._tasks import Tasks
from ..config import ClientConfig
from ..errors import (
    ControllerUnavailableError,
    InvalidArgumentError,
    ProtocolError,
    ProtocolVersionError,
    StorageUnitUnavailableError,
    UnavailableError,
)
from ..transport import _auth, _zmq
from ..transport._arena import ArenaMap, open_arena
from ..transport._liveness import Session
from ..wire import PROTOCOL_VERSION, Hello, HelloReply, Ok, Release, UnitInfo
from ._routes import ArenaRoute, BulkRoute, InlineRoute, Route
from ._routes.device import DeviceRoutes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ClientStats:
    """Payload counters of one client, for throughput and copy accounting.

    ``put_bytes`` and ``get_bytes`` count payload as the fields hold it; ``wire_bytes``
    what of it was sent or received, after integer fields were packed (tqueue/wire/_pack.py).
    ``copied_bytes`` counts copies tqueue made in this process (contiguous copies, joins
    and narrowing on put, assembly and widening on get, staging into bounce buffers on a
    read onto a device); kernel socket copies are not included. ``device_bytes`` counts what
    reads copied to a device; ``corrupt`` the samples this client read whose bytes failed
    their checksum.
    """

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    copied_bytes: int = 0
    wire_bytes: int = 0
    device_bytes: int = 0  # copied to a device by reads with get_data(device=...)
    corrupt: int = 0  # samples whose bytes failed their CRC-32C here (reported, never served)


class Connections:
    """Everything a client holds open: the controller peer (after the protocol handshake),
    one peer and one payload route per storage unit (a bulk route keeps the unit's idle
    streams), and the arenas of units on this host with the holds on them that wait to be
    released. Puts and gets share one.

    The route of a unit is picked once, by :attr:`choose` (:meth:`pick` unless replaced:
    tests put a route of their own there). A get or a put asks for it once per unit and then
    talks to the route alone."""

    def __init__(self, address: str, config: ClientConfig) -> None:
        self.address = address
        self.config = config
        self.host = config.host or _env.host()
        self.arenas: dict[int, ArenaMap | None] = {}
        self._releases: dict[int, list[int]] = {}
        self.tasks = Tasks("client")  # background work (releases of arena holds): cancelled at close
        self._loop: asyncio.AbstractEventLoop | None = None
        self.controller: _zmq.Peer | None = None
        self.before: Callable[[], Awaitable[None]] | None = None  # see ctl (Puts.sent)
        self.units: dict[int, UnitInfo] = {}
        self.unit_peers: dict[int, _zmq.Peer] = {}
        self.routes: dict[int, Route] = {}
        self.choose: Callable[[UnitInfo], Route] = self.pick
        # device reads and device-to-arena writes: accelerators, the arena pages they registered
        self.devices = DeviceRoutes(config.buffer_pool_bytes, config.device_chunk_bytes, config.device_lock_bytes)
        self._nixl: Any = None  # this client's NIXL agent, made for the first unit that offers NIXL
        self.pool = BufferPool(0)  # the client's batch buffers (AsyncClient sets its own)
        self._connecting: asyncio.Lock | None = None
        self._closed = False
        # every connection of this client shares one session id: a server frees what the
        # session held (parked calls, grants, arena holds) once it ends (tqueue/transport/_liveness.py)
        self.session = Session()
        self.curve = _auth.client_keys(config.auth_dir)
        self.heartbeat = 0.0  # the cluster's interval, from the controller's HelloReply

    async def connect(self) -> None:
        """Handshake with the controller (protocol version) and learn the storage units."""
        if self.controller is not None:
            return
        if self._closed:
            raise InvalidArgumentError("the client is closed")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.controller is not None:
                return
            self._loop = asyncio.get_running_loop()
            if self.config.keep_freed_bytes > 0:
                _memory.keep_freed(self.config.keep_freed_bytes)
            peer = _zmq.Peer(
                self.address,
                name="controller",
                unavailable=ControllerUnavailableError,
                timeout=self.config.request_timeout,
                routing_id=self.session.routing_id(),
                curve=self.curve,
                watch=True,  # nothing listening, or a refused handshake, fails the Hello at once
                restartable=True,  # a controller that restarts loses what was in flight: those calls fail
            )
            try:
                reply, _ = await peer.request(
                    Hello(protocol=PROTOCOL_VERSION, role="client", host=self.host),
                    expect=HelloReply,
                )
            except BaseException:
                await peer.close()
                raise
            _check_hello(reply, "controller")
            self.units = {u.unit_id: u for u in reply.units}
            self.heartbeat = reply.heartbeat
            peer.heartbeat(reply.heartbeat)
            self.controller = peer

    async def ctl(self, *, ordered: bool = True) -> _zmq.Peer:
        """The controller's peer, connecting first if need be. ``ordered``: once the puts
        this client was asked for before have sent their requests (``before``: coalesced
        puts wait a turn of the loop), so that a request comes after them on the connection,
        as its caller made them; a put's own requests pass ``ordered=False``."""
        await self.connect()
        if ordered and self.before is not None:
            await self.before()
        assert self.controller is not None
        return self.controller

    def thread_peer(self) -> _zmq.BlockingPeer:
        """A blocking connection to the controller for one calling thread, in this client's
        session (after :meth:`connect`)."""
        if self.controller is None:
            raise InvalidArgumentError("connect the client before asking for a thread's connection")
        return _zmq.BlockingPeer(
            self.address,
            name="controller",
            unavailable=ControllerUnavailableError,
            routing_id=self.session.routing_id(),  # one session with the client's other connections
            heartbeat=self.heartbeat,
            curve=self.curve,
            restartable=True,
        )

    async def unit(self, unit_id: int) -> _zmq.Peer:
        """The peer of a storage unit; asks the controller about units it does not know yet."""
        peer = self.unit_peers.get(unit_id)
        if peer is not None and unit_id in self.units:
            return peer
        info = self.units.get(unit_id)
        if info is None:
            ctl = await self.ctl()
            reply, _ = await ctl.request(Hello(protocol=PROTOCOL_VERSION, host=self.host), expect=HelloReply)
            self.units.update({u.unit_id: u for u in reply.units})
            info = self.units.get(unit_id)
            if info is None:
                raise StorageUnitUnavailableError(f"storage unit {unit_id} is not registered")
        return self.connect_unit(info)

    def connect_unit(self, info: UnitInfo) -> _zmq.Peer:
        peer = self.unit_peers.get(info.unit_id)
        if peer is None:
            self.units[info.unit_id] = info
            peer = self.unit_peers[info.unit_id] = _zmq.Peer(
                info.address,
                name=f"storage unit {info.unit_id}",
                unavailable=StorageUnitUnavailableError,
                timeout=self.config.request_timeout,
                routing_id=self.session.routing_id(),
                curve=self.curve,
                lasting=True,  # a unit that died fails what is in flight to it at once (a put goes elsewhere)
                on_closed=lambda: self.forget_unit(info.unit_id),
            )
            peer.heartbeat(self.heartbeat)
        return peer

    def forget_unit(self, unit_id: int) -> None:
        """A unit's connection closed: it died, or restarted at its address with an arena and
        a bulk port of its own. Its route, arena map and description are forgotten, so the
        next call asks the controller and maps anew (an old map would read another process's
        pages: bytes that are not the sample's). The connection itself stays: ZeroMQ
        reconnects it, at the same address."""
        route = self.routes.pop(unit_id, None)
        if route is not None:
            route.close()
        self.arenas.pop(unit_id, None)
        self.units.pop(unit_id, None)

    # --- routes ---------------------------------------------------------------------------

    async def route(self, unit_id: int) -> Route:
        """The payload route of a unit (asking the controller about units it does not know)."""
        route = self.routes.get(unit_id)
        if route is not None:
            return route
        await self.unit(unit_id)
        return self.route_to(self.units[unit_id])

    def route_to(self, info: UnitInfo) -> Route:
        """The payload route of the unit ``info`` describes, picked the first time."""
        route = self.routes.get(info.unit_id)
        if route is None:
            self.units[info.unit_id] = info
            route = self.routes[info.unit_id] = self.choose(info)
        return route

    def pick(self, info: UnitInfo) -> Route:
        """The unit's arena where it is on this host, else NIXL transfers of its arena where
        both sides use NIXL, else its bulk streams where it offers them, else ZeroMQ frames."""
        peer = self.connect_unit(info)
        arena = self.arena(info)
        if arena is not None:
            return ArenaRoute(
                info, peer, arena, self, self.config.shm_min_bytes, self.devices, self.config.arena_lease_bytes
            )
        if self._use_nixl(info):
            from ._routes.nixl import NixlRoute  # the nixl extra, imported where it is used

            return NixlRoute(
                info, peer, self._nixl, self, self.pool, self.config.shm_min_bytes, self.config.request_timeout
            )
        if self.config.bulk and info.bulk:
            return BulkRoute(info, peer, self.config)
        return InlineRoute(info, peer)

    def _use_nixl(self, info: UnitInfo) -> bool:
        """Whether to reach ``info``'s unit by NIXL (ClientConfig.nixl); makes this client's
        agent the first time."""
        mode = self.config.nixl  # checked by the client
        if mode == "off" or not info.nixl:
            return False
        from ..transport import _nixl

        if mode == "auto" and not (info.rdma and _nixl.rdma_devices() and _nixl.available()):
            return False
        if self._nixl is None:
            self._nixl = _nixl.Agent("client")  # 'on' without the extra: its ImportError
        return True

    async def close(self) -> None:
        """Close every connection. Idempotent."""
        self._closed = True
        await self.tasks.close()
        await self.flush_releases()
        peers = list(self.unit_peers.values())
        if self.controller is not None:
            peers.append(self.controller)
        self.unit_peers.clear()
        routes = list(self.routes.values())
        self.routes.clear()
        for route in routes:
            route.close()  # a bulk route's idle streams
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        self.controller = None
        for peer in peers:
            await peer.close(bye=True)  # what the servers hold for this session is freed now

    # --- arenas -----------------------------------------------------------------------

    def arena(self, unit: UnitInfo) -> ArenaMap | None:
        """The unit's arena, mapped once, where the unit is on this host; else None."""
        if unit.unit_id not in self.arenas:
            local = self.config.shm and unit.shm and unit.host == self.host
            self.arenas[unit.unit_id] = open_arena(unit.shm) if local else None
        return self.arenas[unit.unit_id]

    def release_soon(self, unit_id: int, hold: int) -> None:
        """Queue a hold's release; called from whichever thread dropped the last view."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # the unit lets the hold lapse after its hold_timeout
        try:
            loop.call_soon_threadsafe(self._queue_release, unit_id, hold)
        except RuntimeError:
            pass

    def _queue_release(self, unit_id: int, hold: int) -> None:
        if self._closed or self.tasks.closed:
            return  # a batch that outlived its client: the unit lets the hold lapse after its hold_timeout
        if not self._releases:
            self.tasks.start(self.flush_releases(), "release arena holds")
        self._releases.setdefault(unit_id, []).append(hold)

    async def flush_releases(self) -> None:
        pending, self._releases = self._releases, {}
        for unit_id, holds in pending.items():
            peer = self.unit_peers.get(unit_id)
            if peer is None or peer.closed:
                continue
            try:
                await peer.request(Release(holds=holds), expect=Ok)
            except (UnavailableError, ProtocolError) as exc:
                # the unit lets holds lapse after its hold_timeout; nothing is lost
                log.info("could not release %d arena holds on unit %d: %s", len(holds), unit_id, exc)


def _check_hello(reply: Any, server: str) -> None:
    if not isinstance(reply, HelloReply) or reply.protocol != PROTOCOL_VERSION:
        got = getattr(reply, "protocol", "?")
        raise ProtocolVersionError(
            f"the {server} speaks tqueue protocol {got}, this client speaks {PROTOCOL_VERSION}"
        )
