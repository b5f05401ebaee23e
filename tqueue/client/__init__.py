"""The client library used inside producers and consumers.

Described in docs/api.md, "Clients", "Batch" and "Meta".

Map: docs/architecture.md#the-client
"""

from ._ask import DataParallel, Grouping, MicroBatches, OverSampling
from ._async import AsyncClient, ClientStats
from ._batch import Batch
from ._lifecycle import FieldStats
from ._micro import MicroBatch
from ._spaces import AsyncCheckpoints, AsyncKeys, AsyncRollouts, AsyncSamples
from ._sync import Checkpoints, Client, Keys, Rollouts, Samples

__all__ = [
    "AsyncCheckpoints",
    "AsyncClient",
    "AsyncKeys",
    "AsyncRollouts",
    "AsyncSamples",
    "Batch",
    "Checkpoints",
    "Client",
    "ClientStats",
    "DataParallel",
    "FieldStats",
    "Grouping",
    "Keys",
    "MicroBatch",
    "MicroBatches",
    "OverSampling",
    "Rollouts",
    "Samples",
]
