"""The client library used inside producers and consumers."""

from ._async import AsyncClient, ClientStats
from ._batch import Batch
from ._lifecycle import FieldStats
from ._micro import MicroBatch
from ._sync import Client

__all__ = ["AsyncClient", "Batch", "Client", "ClientStats", "FieldStats", "MicroBatch"]
