"""The one boundary where failures of moving bytes become :mod:`tqueue.errors`.

Every transport call (a ZeroMQ send or receive, a decode, a bulk stream's connect, read or
write, the mapping of an arena) runs inside a :class:`Boundary`: an exception of a class in
its mapping is raised again as the mapped tqueue error, ``from`` the original, its message
naming the peer and the operation. A tqueue error passes as it is; anything not mapped (a
bug) passes unchanged too, so it is never disguised as a network failure.

A boundary is made once per peer and operation and entered for a whole send or a whole
drain, never per frame: entering it allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType

import msgspec
import zmq

from ..errors import ProtocolError, TQueueError, UnavailableError

ErrorMap = Mapping[type[BaseException], type[TQueueError]]

# a decode that fails for any reason costs that message only: msgspec's own errors, a frame
# nested too deep for the decoder (RecursionError), a length it cannot allocate (MemoryError),
# a value no type accepts (ValueError, TypeError)
DECODE_ERRORS: ErrorMap = {
    msgspec.DecodeError: ProtocolError,
    RecursionError: ProtocolError,
    MemoryError: ProtocolError,
    ValueError: ProtocolError,
    TypeError: ProtocolError,
}


def io_errors(unavailable: type[UnavailableError]) -> ErrorMap:
    """Failures of a socket to one peer: it is gone, or unreachable, or stalled
    (``socket.timeout`` is an ``OSError``); ``unavailable`` names which kind of peer."""
    return {zmq.ZMQError: unavailable, OSError: unavailable}


class Boundary:
    """A reusable context manager mapping exceptions raised inside it (see the module).

    ``what`` starts every message (``"bulk stream from 10.0.0.2:4100 broke mid-fetch"``);
    ``on_error`` runs first on any exception, e.g. to close a stream left out of step.
    """

    __slots__ = ("what", "mapping", "on_error")

    def __init__(self, what: str, mapping: ErrorMap, on_error: Callable[[], None] | None = None) -> None:
        self.what = what
        self.mapping = mapping
        self.on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            return
        if self.on_error is not None:
            self.on_error()
        if isinstance(exc, TQueueError) or not isinstance(exc, Exception):
            return  # already typed, or a cancellation / interrupt: pass on as it is
        for cls, to in self.mapping.items():
            if isinstance(exc, cls):
                raise to(f"{self.what}: {type(exc).__name__}: {exc}") from exc
