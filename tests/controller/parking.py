"""Parking a request on the controller deterministically, over one raw connection.

ZeroMQ orders messages per connection only, so a test that must know a request is parked
sends it and then a status request on the same socket: the status reply proves the
controller has handled (and parked) everything sent before it.
"""

from __future__ import annotations

from typing import Any

from tqueue import wire


def park(peer: Any, *requests: wire.Message) -> wire.StatusReply:
    """Send ``requests`` on ``peer``, then return a status taken after they were handled."""
    for req in requests:
        peer.send(wire.encode(req))
    reply = peer.ask(wire.encode(wire.StatusRequest(rid=0)))
    assert isinstance(reply, wire.StatusReply), reply
    return reply


def replies(peer: Any, count: int, timeout: float = 30.0) -> dict[int, wire.Message]:
    """The next ``count`` replies on ``peer``, by request id."""
    out = {}
    for _ in range(count):
        msg, _ = peer.recv(timeout)
        out[msg.rid] = msg
    return out


def waiting(status: wire.StatusReply, partition: str) -> list[str]:
    return [w.kind for w in status.waiting if w.partition == partition]
