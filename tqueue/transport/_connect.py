"""Reaching a server: the one reading of an address, and a watch on a first connection.

:func:`endpoint` turns what a user typed (``tcp://host:port``, or ``host:port`` alone) into
the endpoint every socket connects to, and refuses anything else with the expected form.

ZeroMQ connects in the background and retries for ever: a request to an address where
nothing listens, or to a server that refuses the handshake, waits in the socket's queue for
its whole timeout and then reads as "did not answer". A :class:`ConnectWatch` reads the
socket's monitor events (ZeroMQ's own account of each attempt) until the first handshake
succeeds, and turns the first failure into an error naming the address, at once:

* ``CONNECT_RETRIED``: the TCP connect failed: refused, no answer within
  :data:`CONNECT_TIMEOUT`, or the host not found; the peer's ``unavailable`` error;
* ``HANDSHAKE_FAILED_AUTH``: the server's allow-list refused this client's key;
  ``HANDSHAKE_FAILED_PROTOCOL``: one side uses CurveZMQ and the other does not, or the
  encryption failed; ``HANDSHAKE_FAILED_NO_DETAIL``: the server dropped the connection
  mid-handshake (a CURVE server whose key is not the one this client holds, or that this
  client reached without keys; or no ZeroMQ server at all). Each an
  :class:`~tqueue.errors.AuthenticationError` whose message says what to check, except a
  protocol failure without keys (:class:`~tqueue.errors.ProtocolError`: not a tqueue server).

Why the monitor rather than a plain TCP probe before the first request: it watches the very
connection ZeroMQ makes (a probe that connects says nothing of the handshake after it, and
costs the server a second connection per client), it is the only place a refused
handshake shows, and it costs the usual path two inproc sockets and no thread (about 0.15 ms
of a client's 1.5 ms connect and close, on two busy cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import re
import struct
import time
from collections.abc import Callable

import zmq

from ..errors import AuthenticationError, InvalidArgumentError, ProtocolError, TQueueError, UnavailableError

log = logging.getLogger(__name__)

ADDRESS_FORM = "tcp://host:port"
CONNECT_TIMEOUT = 3.0
"""Seconds a TCP connect may go unanswered (a host that is down, a firewall that drops)
before it counts as failed; the kernel's own limit is about two minutes."""

_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]")


def endpoint(address: str) -> str:
    """``address`` as the endpoint ``tcp://host:port``; ``host:port`` alone means the same.
    Anything else raises :class:`InvalidArgumentError` showing the expected form."""
    text = address.strip() if isinstance(address, str) else ""
    rest = text[len("tcp://") :] if text.startswith("tcp://") else text
    host, colon, port = rest.rpartition(":")
    if not colon:
        why = "no port"
    elif not _HOST.fullmatch(host):
        why = f"host {host!r} is not a host name or address" if host else "no host"
    elif not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        why = f"port {port!r} is not a number from 1 to 65535"
    else:
        return f"tcp://{host}:{int(port)}"
    raise InvalidArgumentError(
        f"address {address!r}: {why}; expected {ADDRESS_FORM} (or host:port), e.g. tcp://127.0.0.1:5555"
    )


_EVENTS = (
    zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_EVENT = struct.Struct("=Hi")  # a monitor message's first frame: event, value
_KEYS = "ClientConfig.auth_dir / TQUEUE_AUTH_DIR"
_ids = itertools.count()


class ConnectWatch:
    """Watches the first connection of ``sock`` (made before it connects) and hands the
    first failure, as an error naming ``name`` and ``address``, to ``on_failure``; stops at
    the first handshake that succeeds, or at :meth:`close`. Runs on the running loop.

    ``keys``: whether ``sock`` is a CurveZMQ client (what a dropped handshake means).
    Without ``on_lost``, later reconnects are not watched: by then the peer's heartbeats judge
    the server. With it, the watch lasts: once connected, a closed connection (the server
    died or restarted: what was in flight on it is lost; ``gone`` False) and each failed
    reconnect after it (nothing listens there any more; ``gone`` True) go to
    ``on_lost(error, gone)``, and ``on_connected`` hears each new handshake, so that a request to a server that died fails in milliseconds, not at the
    end of its heartbeat window.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        name: str,
        address: str,
        keys: bool,
        unavailable: type[UnavailableError],
        on_failure: Callable[[TQueueError], None],
        on_lost: Callable[[TQueueError, bool], None] | None = None,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._on_lost = on_lost
        self._on_connected = on_connected
        self._connected_once = False
        self.address = address
        self._keys = keys
        self._unavailable = unavailable
        self._on_failure = on_failure
        self._sock = sock
        sock.setsockopt(zmq.CONNECT_TIMEOUT, int(CONNECT_TIMEOUT * 1000))
        # an address of our own: pyzmq's default is named after the socket's descriptor,
        # which a socket closed a moment ago may still hold bound
        events = _EVENTS | (zmq.EVENT_DISCONNECTED if on_lost is not None else 0)
        self._mon = sock.get_monitor_socket(events, f"inproc://tqueue-connect-{os.getpid()}-{next(_ids)}")
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._mon.FD, self._drain)
        self._delayed = 0.0  # when the pending TCP connect began (0: none is pending)
        self._dropped = ""  # why the first handshake was dropped, while the reconnect decides
        self._accepted = False  # a TCP connection was made (a server listened there)
        self._reaccepted = False  # and the reconnect after a dropped handshake made one again
        self._retried = False  # ZeroMQ has scheduled that reconnect
        self.closed = False
        self._judged = asyncio.Event()  # the first connection handshook, failed, or the watch closed
        # ZeroMQ's descriptor signals only once the socket has found its queue empty
        self._drain()

    def _drain(self) -> None:
        while not self.closed:
            try:
                frames = self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # the watch only speeds errors up: without it, timeouts
                log.debug("%s at %s: connect watch stopped: %s", self.name, self.address, exc)
                self.close()
                return
            if len(frames) != 2 or len(frames[0]) != _EVENT.size:
                continue
            event, value = _EVENT.unpack(frames[0])
            if event == zmq.EVENT_CONNECT_DELAYED:
                self._delayed = time.monotonic()
                continue
            if self._on_lost is not None and self._lasting(event):
                continue
            if event == zmq.EVENT_CONNECTED:
                self._accepted = True
                self._reaccepted = self._retried  # the reconnect found a listener again
                continue
            if event == zmq.EVENT_CONNECT_RETRIED and self._accepted and not self._dropped:
                # the connection was made and closed before any handshake event (a reset that
                # came while the greetings crossed): as a dropped handshake, the reconnect decides
                self._dropped = "the connection was reset before the handshake ended"
            if self._dropped and (event == zmq.EVENT_DISCONNECTED or (event == zmq.EVENT_CONNECT_RETRIED and not self._retried)):
                # the dropped handshake's own disconnect and the reconnect ZeroMQ schedules for it:
                # the reconnect itself decides
                self._retried = self._retried or event == zmq.EVENT_CONNECT_RETRIED
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value > 0 and not self._dropped:
                # a server that refuses the handshake drops it, and so does one killed during it:
                # ZeroMQ's reconnect tells them apart (refused: it is gone; dropped again: refused)
                self._dropped = os.strerror(value)
                continue
            failure = None if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else self._failure(event, value)
            self.close()
            if failure is not None:
                self._on_failure(failure)

    def _lasting(self, event: int) -> bool:
        """A lasting watch's events once connected (True: handled here)."""
        assert self._on_lost is not None
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected_once = True
            self._judged.set()
            if self._on_connected is not None:
                self._on_connected()
            return True
        if not self._connected_once:
            return False  # the first connection: judged as a short watch judges it
        if event == zmq.EVENT_DISCONNECTED:
            self._on_lost(self._unavailable(
                f"{self.name} at {self.address} closed the connection (it died or restarted): "
                "requests in flight on it are lost"
            ), False)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._on_lost(self._unavailable(
                f"{self.name} at {self.address} no longer answers (connection refused): it is gone"
            ), True)
        return True

    def _failure(self, event: int, value: int) -> TQueueError:
        where = f"{self.name} at {self.address}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return AuthenticationError(
                f"{where} refused this client's authentication (ZAP status {value}): its public key "
                f"is not on the cluster's allow-list (the clients/ directory of the cluster's auth_dir); "
                f"use a client key the cluster admits, in {_KEYS}"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return self._protocol(where, value)
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # a CURVE server drops a peer it cannot decrypt; either side drops a peer of the other
            # mechanism (racing the mismatch the client would report); so does anything that does
            # not speak ZeroMQ. The client cannot tell these apart: the message names each
            dropped = f"it dropped the connection during the handshake ({os.strerror(value) if value > 0 else 'no detail'})"
            if self._keys:
                check = (f"the cluster.key in {_KEYS} may not be this cluster's public key, or the "
                         "cluster may run without authentication (then connect without keys)")
            else:
                check = f"it may require CurveZMQ keys, and this client has none (set {_KEYS})"
            return AuthenticationError(
                f"{where} refused this client's authentication: {dropped}; {check}, "
                f"or it is not a tqueue {self.name}"
            )
        if self._dropped and event == zmq.EVENT_CONNECT_RETRIED and self._reaccepted:
            # accepted, dropped, accepted again and dropped again: a listener that drops this peer
            return self._failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
        if self._dropped and event == zmq.EVENT_CONNECT_RETRIED:
            return self._unavailable(
                f"{where} dropped the connection during the handshake ({self._dropped}) and no longer answers "
                "(connection refused): it died"
            )
        if self._delayed and time.monotonic() - self._delayed >= 0.9 * CONNECT_TIMEOUT:
            why = f"no answer to the TCP connect within {CONNECT_TIMEOUT:g} s: host down or unreachable, or a firewall"
        elif self._delayed:
            why = "connection refused"
        else:  # the connect failed before it could start
            why = "host not found, or no route to it"
        return self._unavailable(f"nothing answers at {self.address} ({why}): is a tqueue {self.name} running there?")

    def _protocol(self, where: str, code: int) -> TQueueError:
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self._keys:
                why = f"this client has CurveZMQ keys ({_KEYS}) and the server uses none; connect without them"
            else:
                why = f"the server requires CurveZMQ keys and this client has none; set {_KEYS}"
            return AuthenticationError(f"{where} refused this client's authentication: {why}")
        what = _code_name(code)
        if self._keys:
            return AuthenticationError(
                f"{where} refused this client's authentication: the CurveZMQ handshake failed ({what}); "
                f"is the cluster.key in {_KEYS} this cluster's public key?"
            )
        return ProtocolError(f"{where} broke the ZeroMQ handshake ({what}): is a tqueue {self.name} running there?")

    async def judged(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the verdict on the first connection. ZeroMQ drops a
        refused handshake's queue before its monitor reports why: a send that finds no
        connection may come first, and the verdict names the cause."""
        self._drain()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._judged.wait(), timeout)

    def close(self) -> None:
        """Stop watching (idempotent); the watched socket stays as it is."""
        if self.closed:
            return
        self.closed = True
        self._judged.set()
        try:
            self._loop.remove_reader(self._mon.FD)
        except (RuntimeError, ValueError, zmq.ZMQError):
            pass  # the loop is already closed
        if not self._sock.closed:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError as exc:
                if exc.errno != errno.ENOTSOCK:
                    raise
        self._mon.close(linger=0)


def _code_name(code: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == code:
            return name[len("PROTOCOL_ERROR_") :].lower()
    return f"code {code:#x}"
