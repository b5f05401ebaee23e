"""Who is alive: storage units (registration, heartbeats, death, rejoin) and client sessions.

A unit sends ``Heartbeat`` every interval (the controller's ``heartbeat_interval``, which
the unit learns when it registers). One timer checks every unit once an interval; a unit
silent for ``UNIT_LIVENESS`` intervals is *dead*: it gets no new placements, the grants
placed on it lapse, drops and moves owed to it are forgotten, and every sample it held is
*lost*: excluded for good (reason ``lost``), counted per partition and per task in
``status()``, and reported to its partition's member-failure policy. Lost is final: those
samples were already reported, so a dead unit that comes back (its heartbeat is answered
``known=False``) registers again, gets its unit id back by name, and starts empty.

A controller that restarted does not know the units: their heartbeats are answered
``known=False``, and they register again (empty), each proposing the id it had. The id is
given back where no other unit has it (a checkpoint the controller restores from names its
units' ids, which are then theirs): clients, which know units by id, keep connections that
stay right.

A client session that ends (it said ``Bye``, or the server heard nothing from any of its
connections for the liveness window, see :mod:`tqueue.transport._liveness`) loses at once
what waits for it here: its parked ``get_meta`` (so no samples are leased to a dead
consumer), its parked puts, reserves and seal waits, and its uncommitted grants (their
budget, reservation and staleness admission return). Its leases follow the lease rules:
they expire at their lease timeout, or are acked by another process of the same trainer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from ...errors import StorageUnitUnavailableError, TQueueError, UnavailableError
from ...transport import _zmq
from ...transport._liveness import UNIT_LIVENESS, session_of, window
from ...wire import Heartbeat, HeartbeatReply, Ping, Pong, Registered, RegisterUnit, UnitInfo
from ..model._state import ControllerState, Unit
from ._checkpoints import kept_on, read_checkpoint
from ._cleanup import Cleanup
from ._writes import Writes

log = logging.getLogger(__name__)

MAX_UNIT_ID = (1 << 15) - 1  # a sample's unit is an int16


class Liveness:
    """Units' registration and heartbeats, and the end of client sessions, over ``state``."""

    def __init__(
        self,
        state: ControllerState,
        *,
        writes: Writes,
        cleanup: Cleanup,
        wake: Callable[[str], None],
        leases_gone: Callable[[bytes, float], int],
        copy_again: Callable[[], None] = lambda: None,
        promote: Callable[[int], None] = lambda unit_id: None,
        unit_gone: Callable[[int], None] = lambda unit_id: None,
    ) -> None:
        self.state = state
        self._promote = promote  # a dead unit's samples served from their copies (_copies)
        self._unit_gone = unit_gone  # reads waiting for the copies of a unit (_copies): answered
        self._copy_again = copy_again  # copy samples held once again (a death, or a unit to copy onto)
        self._leases_gone = leases_gone  # (session, silent since): its leases sent since, released (their count)
        self.writes = writes
        self.cleanup = cleanup
        self._wake = wake  # serve parked reads of a partition (lost samples end their wait)
        self.interval = state.config.heartbeat_interval
        self._names: dict[str, int] = {}  # unit name -> unit id
        self._timer = state.loop.call_later(self.interval, self._sweep) if self.interval > 0 else None
        state.server.sessions.on_gone(self.session_gone)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- units ----------------------------------------------------------------------

    def known(self, units: list[tuple[int, str]]) -> None:
        """Units of a checkpoint (id, name): each gets its id back when it registers."""
        for unit_id, name in units:
            self._names.setdefault(name, unit_id)

    def _new_id(self, proposed: int) -> int:
        """``proposed`` (the id a unit had with this controller's predecessor) where no other
        unit has it, else the lowest id never given."""
        taken = set(self._names.values())
        if 0 <= proposed <= MAX_UNIT_ID and proposed not in taken:
            return proposed
        unit_id = max(taken, default=-1) + 1
        if unit_id > MAX_UNIT_ID:
            raise UnavailableError(f"this controller has given out every storage unit id (0 to {MAX_UNIT_ID})")
        return unit_id

    def register(self, msg: RegisterUnit, ident: bytes = b"") -> Registered | Awaitable[Registered]:
        """A unit registers (again). One that loaded its payload from a checkpoint and
        restarted before its death was noticed keeps what the checkpoint holds of it as it
        still is (:meth:`_rejoin`); otherwise it starts empty."""
        name = msg.name or msg.address
        unit_id = self._names.get(name)
        old = self.state.units.get(unit_id) if unit_id is not None else None
        if msg.restored and old is not None and old.alive:
            return self._rejoin(old, msg, name, ident)
        reply = self._admit(msg, name, ident=ident)
        if msg.restored:  # declared dead while away, or unknown here: nothing it loaded is kept
            reply.reset = True
        return reply

    async def _rejoin(self, old: Unit, msg: RegisterUnit, name: str, ident: bytes) -> Registered:
        unit_id = old.info.unit_id
        old.suspect = True  # no placements while the checkpoint is read
        images = None
        try:
            manifest, images = await asyncio.to_thread(read_checkpoint, msg.restored, self.state.config)
            if manifest["generation"] != msg.generation:
                log.warning("unit %d restored generation %s of %s, which now holds %s: it keeps nothing",
                            unit_id, msg.generation, msg.restored, manifest["generation"])
                images = None
        except TQueueError as exc:
            log.warning("unit %d restored from %s, which cannot be read now (%s): it keeps nothing", unit_id, msg.restored, exc)
        if self.state.units.get(unit_id) is not old or not old.alive:  # declared dead meanwhile: lost is final
            reply = self._admit(msg, name, ident=ident)
            reply.reset = True
            return reply
        keep = kept_on(unit_id, images, self.state.partitions.by_uid) if images is not None else {}
        reply = self._admit(msg, name, keep=keep, ident=ident)
        reply.partitions = sorted(keep)
        log.warning(
            "storage unit %d rejoined with the payload of checkpoint %s: %d samples kept in %d partitions",
            unit_id, msg.generation, sum(len(v) for v in keep.values()), len(keep),
        )
        return reply

    def _admit(self, msg: RegisterUnit, name: str, keep: dict[int, np.ndarray] | None = None, ident: bytes = b"") -> Registered:
        """Register the unit, ending the incarnation before it (``keep``: the samples of it,
        per partition uid, that the new one holds as they are)."""
        unit_id = self._names.get(name)
        if unit_id is None:
            unit_id = self._names[name] = self._new_id(msg.unit_id)
        else:
            old = self.state.units.get(unit_id)
            if old is not None and old.alive:  # it restarted before its silence was noticed
                why = "registered again (it restarted)"
                why += ": what the checkpoint it loaded does not hold as it is now is gone" if keep else ": what it held is gone"
                self.unit_dead(old, why, keep=keep)
            peer = self.state.units.peers.pop(unit_id, None)
            if peer is not None:
                self.state.tasks.start(peer.close(), f"close the connection to unit {unit_id}")
        info = UnitInfo(
            unit_id=unit_id, address=msg.address, host=msg.host, shm=msg.shm, bulk=msg.bulk, nixl=msg.nixl,
            nixl_base=msg.nixl_base, rdma=msg.rdma,
        )
        self.state.units[unit_id] = Unit(info=info, capacity=msg.capacity, name=name, heard=self.state.loop.time(),
                                     metrics=msg.metrics, session=session_of(ident) if ident else b"", ident=ident)
        if ident:  # its commits finish many clients' puts: handled ahead of the clients' requests
            self.state.server.serve_first(ident)
        self.state.units.peers[unit_id] = _zmq.Peer(
            msg.address, name=f"storage unit {unit_id}", unavailable=StorageUnitUnavailableError,
            curve=self.state.server.curve,  # the cluster's keys: the unit admits only those for drops and moves
            lasting=True,  # a probe of a unit that died fails at once
        )
        log.info("storage unit %d (%s) registered at %s (host %s)", unit_id, name, msg.address, msg.host)
        self.state.loop.call_soon(self.writes.retry_parked)
        self.state.loop.call_soon(self._copy_again)  # samples held once may have a unit to go to now
        return Registered(unit_id=unit_id, heartbeat=self.interval)

    def suspect(self, unit_id: int, why: str) -> None:
        """A client could not store on this unit: evidence that it died, ahead of its
        heartbeats. No placements go to it while the controller probes it (a ``Ping``); no
        answer within two intervals declares it dead now, an answer clears it."""
        unit = self.state.units.get(unit_id)
        peer = self.state.units.peers.get(unit_id)
        if unit is None or not unit.alive or unit.suspect or peer is None:
            return
        unit.suspect = True
        log.warning("storage unit %d suspected: %s; probing it", unit_id, why)
        self.state.tasks.start(self._probe(unit, peer, why), f"probe unit {unit_id}")

    async def _probe(self, unit: Unit, peer: _zmq.Peer, why: str) -> None:
        limit = max(2 * self.interval, 0.5)
        try:
            await peer.request(Ping(), expect=Pong, timeout=limit)
        except UnavailableError as exc:
            if unit.alive and self.state.units.get(unit.info.unit_id) is unit:
                self.unit_dead(unit, f"{why}, and the probe that followed failed ({exc})")
        else:
            log.info("storage unit %d answered the probe: placements resume", unit.info.unit_id)
        finally:
            unit.suspect = False
            self.writes.retry_parked()

    def heartbeat(self, msg: Heartbeat, ident: bytes = b"") -> HeartbeatReply:
        unit = self.state.units.get(msg.unit_id)
        if unit is None or not unit.alive or (msg.name and msg.name != unit.name):
            return HeartbeatReply(known=False)  # it registers again, and starts empty
        unit.heard = self.state.loop.time()
        if ident and ident != unit.ident:  # it reconnected
            self.state.server.serve_first(unit.ident, False)
            self.state.server.serve_first(ident)
            unit.ident, unit.session = ident, session_of(ident)
        # what it stores now: a commit reports it before the unit drops the values it found it
        # holds already (shared by content), and this connection orders the two
        unit.nbytes = msg.nbytes
        unit.arena_used = msg.arena_used
        unit.held_bytes = msg.held_bytes
        unit.bytes_shared = msg.bytes_shared
        return HeartbeatReply(known=True)

    def _sweep(self) -> None:
        self.state.server.drain()  # what arrived while the loop was busy counts (taken in, not yet handled)
        limit = self.state.loop.time() - window(self.interval, UNIT_LIVENESS)
        sessions = self.state.server.sessions
        for unit in list(self.state.units.values()):
            if unit.alive and unit.session:  # any message from the unit, as it arrived: a backlog is not silence
                unit.heard = max(unit.heard, sessions.heard(unit.session))
            if unit.alive and unit.heard < limit:
                silent = self.state.loop.time() - unit.heard
                self.unit_dead(unit, f"no heartbeat for {silent:.1f} s (one is due every {self.interval:g} s)")
        self._timer = self.state.loop.call_later(self.interval, self._sweep)

    def unit_dead(self, unit: Unit, why: str, *, keep: dict[int, np.ndarray] | None = None) -> None:
        """Declare ``unit`` dead: nothing new goes to it and what it held is lost (but the
        samples in ``keep``, per partition uid: its next incarnation holds them)."""
        unit.alive = False
        if unit.ident:
            self.state.server.serve_first(unit.ident, False)
        unit_id = unit.info.unit_id
        unit.nbytes = unit.reserved = 0
        lapsed = self.writes.lapse_on(unit_id, f"was placed on storage unit {unit_id}, which died")
        self.cleanup.drops.forget_unit(unit_id)
        self._promote(unit_id)  # first: what has a copy on a live unit is not lost
        lost = 0
        for part in list(self.state.partitions.values()):
            n = part.lose(unit_id, keep=(keep or {}).get(part.uid))
            part.unit_bytes.pop(unit_id, None)
            if n:
                lost += n
                log.error("partition %r: %d samples lost with storage unit %d", part.name, n, unit_id)
                self._wake(part.name)  # a wait for groups that will never complete ends
                self.cleanup.maybe_free(part)
        named = f" ({unit.name})" if unit.name != unit.info.address else ""
        log.error(
            "storage unit %d%s at %s is dead: %s; %d samples lost, %d grants lapsed",
            unit_id, named, unit.info.address, why, lost, lapsed,
        )
        peer = self.state.units.peers.pop(unit_id, None)
        if peer is not None:
            self.state.tasks.start(peer.close(), f"close the connection to unit {unit_id}")
        self.writes.retry_parked()  # puts parked for room may fit on the live units
        self._unit_gone(unit_id)
        self._copy_again()

    # --- client sessions ------------------------------------------------------------

    def session_gone(self, session: bytes) -> None:
        """Free at once what a client session that ended held here."""
        s = self.state
        # Each withdrawn call is answered too: a caller that is only silent (one that does
        # not heartbeat) then fails loudly instead of waiting for an answer that never comes.
        ended = UnavailableError(
            f"the controller heard nothing from this client for {window(self.interval):.1f} s "
            f"(heartbeat every {self.interval:g} s) and ended its session; its parked calls are withdrawn"
        )
        withdrawn = s.parked.withdraw_session(session, ended)
        reads, sealed, versions, parked = withdrawn
        lapsed = self.writes.lapse_owned(session, "belonged to a client that is gone")
        unheard = self._leases_gone(session, s.server.sessions.last_heard)
        if any(withdrawn) or lapsed or unheard:
            log.info(
                "client session %s ended: %d parked reads, %d seal waits, %d version waits, %d parked writes "
                "withdrawn, %d grants lapsed, %d leases released", session.hex(), reads, sealed, versions,
                parked, lapsed, unheard,
            )
        if parked:
            self.writes.retry_parked()
