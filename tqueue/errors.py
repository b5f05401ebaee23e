"""Every error tqueue raises, in one tree.

::

    TQueueError                         base of everything below
    ├── ProtocolError                   a message that does not follow the wire protocol
    │   └── ProtocolVersionError        the peers speak different protocol versions
    ├── InvalidArgumentError            (also ValueError) a call's argument is wrong
    │   └── PartitionSealedError        a put to a sealed (or freed) partition: nothing stored
    ├── SchemaError                     (also ValueError) field data that does not fit:
    │                                   sample counts differ, a field is missing from a
    │                                   sample, dtype or shape differs from the partition's
    ├── FieldTypeError                  (also TypeError) a value the wire cannot carry
    ├── UnknownFieldError               (also KeyError) a field the partition does not have
    ├── PartitionClearedError           the partition was cleared under the call
    ├── WaitTimeoutError                (also TimeoutError) a wait ran out; says for what
    │   └── StorageFullError            a put waited for memory in vain; says asked/used/allowed
    ├── UnavailableError                (also ConnectionError) a server did not answer
    │   ├── ControllerUnavailableError
    │   └── StorageUnitUnavailableError
    │       └── DataLostError           samples whose storage unit is gone
    │           └── DataCorruptionError a sample's bytes fail their checksum (memory,
    │                                   wire or disk); names partition, sample, field, unit
    ├── PermissionDeniedError           (also PermissionError) another role's message, or
    │                                   another client's lease or hold
    ├── AuthenticationError             (also PermissionError) a server refused this peer's
    │                                   CurveZMQ handshake: keys missing, not admitted, or
    │                                   another cluster's
    ├── DiscoveryError                  (also LookupError) no cluster is registered where the
    │                                   look-up went (a Ray job's named actor); says where
    ├── EngineError                     an inference engine failed a request (the rollout
    │                                   bridges); says whether a retry is worth it
    └── RemoteError                     a server failed on a well-formed request

Servers never raise into their loop: a bad request becomes an error reply carrying a
``code`` from :data:`CODES`, and the client turns it back into the class above at one
place, :func:`from_code`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "AuthenticationError",
    "CODES",
    "ControllerUnavailableError",
    "DataCorruptionError",
    "DataLostError",
    "DiscoveryError",
    "EngineError",
    "FieldTypeError",
    "ForkedClientError",
    "InvalidArgumentError",
    "PartitionClearedError",
    "PartitionSealedError",
    "PermissionDeniedError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "SchemaError",
    "StorageFullError",
    "StorageUnitUnavailableError",
    "TQueueError",
    "UnavailableError",
    "UnknownFieldError",
    "WaitTimeoutError",
    "from_code",
]


class TQueueError(Exception):
    """Base class of every error tqueue raises."""

    code = "error"


class ProtocolError(TQueueError):
    """A message that does not follow the wire protocol (garbage, truncated, oversized)."""

    code = "protocol"


class ProtocolVersionError(ProtocolError):
    """Client and server speak different protocol versions; the message names both."""

    code = "protocol_version"


class InvalidArgumentError(TQueueError, ValueError):
    """A call's argument is wrong: a negative timeout, a batch size below one."""

    code = "invalid_argument"


class PartitionSealedError(InvalidArgumentError):
    """A put to a partition that is sealed (seal, or its over-sampling target reached) or that
    sealed and freed itself: nothing was stored. An over-sampling producer that expects this
    passes ``put(..., if_sealed="discard")`` and reads ``status="aborted"`` instead."""

    code = "partition_sealed"


class SchemaError(TQueueError, ValueError):
    """Field data that does not fit the call or the partition; names field, partition, sample."""

    code = "schema"


class FieldTypeError(TQueueError, TypeError):
    """A value of a type the wire cannot carry; names field, sample and type. Nothing was sent."""

    code = "field_type"


class UnknownFieldError(TQueueError, KeyError):
    """A field that the partition does not declare."""

    code = "unknown_field"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PartitionClearedError(TQueueError):
    """The partition was cleared while the call was waiting on it or writing to it."""

    code = "partition_cleared"


class WaitTimeoutError(TQueueError, TimeoutError):
    """A wait ran out of time; the message says what it waited for and what it saw."""

    code = "timeout"


class StorageFullError(WaitTimeoutError):
    """A write waited its whole timeout for memory; the message says how much it asked,
    how much is used and how much is allowed. Nothing already stored was dropped for it."""

    code = "full"


class UnavailableError(TQueueError, ConnectionError):
    """A server did not answer within the request timeout."""

    code = "unavailable"


class ControllerUnavailableError(UnavailableError):
    """The controller did not answer."""

    code = "controller_unavailable"


class StorageUnitUnavailableError(UnavailableError):
    """A storage unit did not answer."""

    code = "unit_unavailable"


class DataLostError(StorageUnitUnavailableError):
    """Samples cannot be read: the storage unit that held them is gone (the controller
    declares the samples of a unit silent for its liveness window lost). The message names
    the partition, the unit and the samples."""

    code = "data_lost"


class DataCorruptionError(DataLostError):
    """A sample's bytes do not match the CRC-32C its producer computed: they changed after
    the put, in a unit's memory, on the wire or in a checkpoint file. The message names the
    partition, the sample, the field and the unit (or file). The bytes are never served; with
    copies, the reader takes another copy and the bad one is dropped and copied again."""

    code = "data_corrupt"


class PermissionDeniedError(TQueueError, PermissionError):
    """The peer may not do this: the message is for another role (a unit's, with auth on),
    or the lease or hold it names belongs to another client."""

    code = "permission_denied"


class AuthenticationError(TQueueError, PermissionError):
    """A server refused this peer's CurveZMQ handshake, so nothing it sends arrives: its key
    is not on the cluster's allow-list, it has no keys where the cluster requires them (or
    keys where the cluster has none), or its ``cluster.key`` is another cluster's. The
    message names the address and what to check. Retrying with the same keys cannot help."""

    code = "authentication"


class ForkedClientError(TQueueError, RuntimeError):
    """A client was used in a process forked from the one that made it (a DataLoader worker,
    say): its sockets and threads belong to the parent. Make a client in the child."""

    code = "forked_client"


class EngineError(TQueueError):
    """An inference engine failed a request (an HTTP error, a broken stream, an output
    that is not what the engine's bridge reads); the message names the request.

    ``retryable``: the failure is worth another try (the connection was refused, reset or
    dropped, an HTTP 5xx, a timeout before any token). ``report``: on the error that
    ``tqueue.bridges.Rollouts.step`` raises, the step's ``StepReport`` (what it stored,
    aborted and failed); None elsewhere."""

    code = "engine"

    def __init__(self, message: str = "", *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.report: Any = None


class DiscoveryError(TQueueError, LookupError):
    """No cluster is registered where the look-up went (on Ray, the job's named actor); the
    message says where it looked and for how long."""

    code = "discovery"


class RemoteError(TQueueError):
    """A server failed while handling a well-formed request; its message is passed on."""

    code = "remote"


CODES: dict[str, type[TQueueError]] = {
    cls.code: cls
    for cls in (
        TQueueError,
        ProtocolError,
        ProtocolVersionError,
        InvalidArgumentError,
        PartitionSealedError,
        SchemaError,
        FieldTypeError,
        UnknownFieldError,
        PartitionClearedError,
        WaitTimeoutError,
        StorageFullError,
        UnavailableError,
        ControllerUnavailableError,
        StorageUnitUnavailableError,
        DataLostError,
        DataCorruptionError,
        PermissionDeniedError,
        AuthenticationError,
        ForkedClientError,
        DiscoveryError,
        EngineError,
        RemoteError,
    )
}


def from_code(code: str, message: str) -> TQueueError:
    """The exception for an error reply's ``code``; unknown codes become :class:`RemoteError`."""
    cls = CODES.get(code, RemoteError)
    return cls(message)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
