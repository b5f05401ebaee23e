"""TransferQueue's storage errors. tqueue's storage units are its own (``tqueue storage-unit``);
TransferQueue's storage managers and backends have no counterpart here."""


class StorageKeyNotFoundError(KeyError):
    """A key that the partition does not hold."""


__all__ = ["StorageKeyNotFoundError"]
