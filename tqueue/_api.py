"""Stability tiers of the public names, and how a deprecated spelling says so.

Every name a user reaches carries a tier, as Ray's ``util/annotations.py`` marks its own:

* **public**: the small core a user learns first; it changes only after a release of
  deprecation warnings (:class:`TQueueDeprecationWarning`) that name the replacement.
* **developer**: for those who extend tqueue (policies, routes, bridges, the TransferQueue
  shim) or read its wire; it may change between minor releases, noted in the changelog.

``PUBLIC`` and ``DEVELOPER`` hold the names, ``tqueue.<name>`` for the package's and
``Client.<name>`` for the client's methods and namespaces; ``tests/test_public_api.py``
holds the surface to them.
"""

from __future__ import annotations

import warnings
from typing import Final

__all__ = ["DEVELOPER", "PUBLIC", "TQueueDeprecationWarning", "deprecated", "tier"]

# the release in which a spelling deprecated now stops working
REMOVED_IN: Final = "0.3"


class TQueueDeprecationWarning(DeprecationWarning):
    """A spelling that works for one more release; the message names its replacement.
    ``warnings.filterwarnings("error", category=tqueue.TQueueDeprecationWarning)`` finds
    every use."""


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (``stacklevel`` 3: the caller of
    the function that calls this)."""
    warnings.warn(
        f"{old} is deprecated and stops working in tqueue {REMOVED_IN}: use {new}",
        TQueueDeprecationWarning,
        stacklevel=stacklevel,
    )


PUBLIC: Final = frozenset(
    {
        # the package
        "tqueue.AsyncClient",
        "tqueue.Batch",
        "tqueue.Client",
        "tqueue.ClientConfig",
        "tqueue.DataParallel",
        "tqueue.Grouping",
        "tqueue.LocalCluster",
        "tqueue.Meta",
        "tqueue.MicroBatch",
        "tqueue.MicroBatches",
        "tqueue.OverSampling",
        "tqueue.Timeouts",
        "tqueue.TQueueDeprecationWarning",
        # the errors a user catches
        "tqueue.TQueueError",
        "tqueue.InvalidArgumentError",
        "tqueue.WaitTimeoutError",
        "tqueue.StorageFullError",
        "tqueue.UnavailableError",
        "tqueue.ControllerUnavailableError",
        "tqueue.StorageUnitUnavailableError",
        "tqueue.PartitionClearedError",
        "tqueue.PartitionSealedError",
        "tqueue.DataLostError",
        "tqueue.DataCorruptionError",
        "tqueue.FieldTypeError",
        "tqueue.SchemaError",
        "tqueue.UnknownFieldError",
        "tqueue.ForkedClientError",
        "tqueue.AuthenticationError",
        "tqueue.PermissionDeniedError",
        # the client's verbs (Client and AsyncClient alike)
        "Client.address",
        "Client.config",
        "Client.stats",
        "Client.connect",
        "Client.close",
        "Client.create_partition",
        "Client.put",
        "Client.update",
        "Client.get_meta",
        "Client.get_data",
        "Client.renew",
        "Client.ack",
        "Client.seal",
        "Client.clear",
        "Client.status",
        "Client.set_version",
        # its namespaces
        "Client.keys",
        "Client.samples",
        "Client.rollouts",
        "Client.checkpoints",
    }
)

DEVELOPER: Final = frozenset(
    {
        "tqueue.ControllerConfig",
        "tqueue.StorageConfig",
        "tqueue.FieldSpec",
        "tqueue.ClientStats",
        "tqueue.FieldStats",
        "tqueue.DiscoveryError",
        "tqueue.EngineError",
        "tqueue.ProtocolError",
        "tqueue.ProtocolVersionError",
        "tqueue.RemoteError",
        # a blocking caller's own route to the controller (the Client's get_meta uses it)
        "AsyncClient.thread_route",
        # the wire's own struct, under the public Meta, and the protocol's version
        "tqueue.wire.BatchMeta",
        "tqueue.wire.PROTOCOL_VERSION",
    }
)


def tier(name: str) -> str:
    """``"public"``, ``"developer"``, or ``"internal"`` for a name in neither registry."""
    return "public" if name in PUBLIC else "developer" if name in DEVELOPER else "internal"
