"""The process's sockets at their lowest: the one ZeroMQ context, how every socket is tuned,
binding to a port the OS picks, and the address peers reach a bound socket at. Below both the
request transport (:mod:`._zmq`) and the authenticator (:mod:`._auth`), which make their
sockets here.
"""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Sequence
from typing import Any, cast

import zmq

_CONTEXT: tuple[int, zmq.Context] | None = None


def context() -> zmq.Context:
    """The process's one ZeroMQ context (made anew in a forked child). It may hold as many
    sockets as the process may open files (ZeroMQ's own default is 1023: about 250 clients a
    process, each with its connections and their monitors), up to ``MAX_SOCKETS``."""
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT[0] != os.getpid():
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, max_sockets())
        _CONTEXT = (os.getpid(), ctx)
    return _CONTEXT[1]


MAX_SOCKETS = 65_536


def max_sockets() -> int:
    """ZeroMQ sockets a process's context may hold: its open-file limit, at least ZeroMQ's
    default (1023) and at most ``MAX_SOCKETS``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_SOCKETS
    return max(1023, min(int(soft), MAX_SOCKETS))


def tune(sock: zmq.Socket) -> None:
    # Unbounded queues: a plain ROUTER drops what exceeds its HWM silently, and dropping a
    # reply would leave a caller waiting for its timeout. Requests are bounded by their
    # callers; a Server bounds its replies per peer itself (ROUTER_MANDATORY, SendQueues).
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # Closing must not wait for peers that are gone; what matters was acknowledged.
    sock.setsockopt(zmq.LINGER, 0)


def bind(sock: zmq.Socket, endpoint: str, advertise: str = "") -> str:
    """Bind, letting the OS pick the port for ``:0``, and return the endpoint peers reach:
    the real one, with a wildcard host replaced by ``advertise`` (or this machine's address)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    sock.bind(endpoint)
    return reachable(sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise)


WILDCARDS = ("0.0.0.0", "*", "::", "[::]", "")


def reachable(endpoint: str, advertise: str = "") -> str:
    """``endpoint`` (``tcp://host:port``) with a wildcard host replaced by one peers can
    reach: ``advertise``, else this machine's address."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host not in WILDCARDS:
        return endpoint
    if not advertise:
        try:
            advertise = socket.gethostbyname(socket.gethostname())
        except OSError:
            advertise = "127.0.0.1"
    return f"tcp://{advertise}:{port}"


# The hot path's calls, each a frame: the flags as plain ints (``flags | zmq.SNDMORE`` makes a
# ``zmq.Flag`` member, about 0.8 µs) and pyzmq's compiled send and receive, below its Python
# ``Socket.send`` (routing_id and group, which tqueue does not use; 0.25 µs a frame).
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
_BASE = zmq.backend.Socket  # the compiled one, below zmq.Socket
_send = _BASE.send
_recv = _BASE.recv
_get = _BASE.get


def events(sock: zmq.Socket) -> int:
    """``sock``'s ``zmq.EVENTS``, read by the compiled call with a plain int (pyzmq's Python
    ``getsockopt``, and ``&`` with a ``zmq`` enum, cost 1.6 µs more)."""
    return cast(int, _get(sock, EVENTS))


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """The next message's frames (zero-copy), read frame by frame, each frame saying whether
    more follow: pyzmq's ``recv_multipart`` asks the socket (``RCVMORE``) after each frame,
    a call into libzmq that costs as much as the frame. ZeroMQ delivers a message whole, so
    the frames after the first are there."""
    frame = _recv(sock, flags, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, flags, False)
        frames.append(frame)
    return frames


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
    """Send ``frames`` as one message, frame by frame (pyzmq's ``send_multipart`` checks each
    frame's type first)."""
    more = flags | SNDMORE
    for frame in frames[:-1]:
        _send(sock, frame, more, copy)
    _send(sock, frames[-1], flags, copy)
