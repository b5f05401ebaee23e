"""TransferQueue 0.1.11's API over tqueue (``import transfer_queue as tq``).

Installed from a tqueue checkout with ``pip install -e compat/transferqueue``; see
docs/migrating.md for what maps to what, what is refused by design and what is not there yet.
``import tqueue`` never loads this package.
"""

from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset
from transfer_queue.interface import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    get_metrics_endpoint,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    save_checkpoint,
)
from transfer_queue.metadata import BatchMeta, KVBatchMeta
from transfer_queue.sampler import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler, SequentialSampler
from transfer_queue.storage import StorageKeyNotFoundError

__version__ = "0.1.11"  # the TransferQueue API this package implements (verl gates on it)
BACKEND = "tqueue"  # tells this package from TransferQueue itself: transfer_queue.BACKEND

__all__ = [
    "AsyncTransferQueueClient",
    "BatchMeta",
    "BaseSampler",
    "GRPOGroupNSampler",
    "KVBatchMeta",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StorageKeyNotFoundError",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]
