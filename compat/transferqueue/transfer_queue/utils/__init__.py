"""TransferQueue's ``transfer_queue.utils``: of its modules, the one that programs written for
TransferQueue import (``logging_utils``). The others hold TransferQueue's own ZeroMQ messages,
serializers and storage clients, which tqueue replaces (docs/migrating.md)."""
