"""The client library used inside producers and consumers.

Described in docs/api.md, "Clients", "Batch" and "BatchMeta", and docs/architecture.md, "Payload routes".
"""

from ._async import AsyncClient, ClientStats
from ._batch import Batch
from ._lifecycle import FieldStats
from ._micro import MicroBatch
from ._sync import Client

__all__ = ["AsyncClient", "Batch", "Client", "ClientStats", "FieldStats", "MicroBatch"]
