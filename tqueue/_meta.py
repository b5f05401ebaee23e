"""The public type of a batch's meta: what a user reads of it.

``put``, ``get_meta`` and the key calls return the wire's struct
(:class:`tqueue.wire.BatchMeta`), which also carries what only the client and the servers
read (units, schema, partition uid, lease id, segments...). :class:`Meta` names the part a
user may rely on: a change of the protocol that keeps these attributes is no change of the
API. The struct is a :class:`Meta` as it is (a structural type: nothing is wrapped or
copied), so a meta passes to ``get_data``, ``ack``, ``update`` and the rest unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Meta"]


@runtime_checkable
class Meta(Protocol):
    """A batch of samples as ``put`` and ``get_meta`` hand it back: where it is, no payload.

    ``partition`` and ``indexes`` name the samples (index -1: a pad row); ``task`` the
    consumer task that leased them (None for a put's meta) and ``lease_timeout`` for how
    long; ``groups`` and ``versions`` each sample's group id and policy version (None:
    none given); ``dp_rank``, ``dp_size`` and ``round`` the data-parallel share it is
    (-1, 0, -1: none), ``micro_batch_indices`` its micro-batches (positions in this meta),
    ``num_microbatches`` and ``global_batch_size`` the round's; ``status`` a put's fate
    (``"ok"``, ``"aborted"``, ``"recycled"``, ``"trimmed"``), with ``fates`` per sample and
    ``sealed``. ``len(meta)``, ``size`` and ``pads`` count samples and pad rows;
    ``select(positions)`` is the meta of some of them.
    """

    @property
    def partition(self) -> str: ...
    @property
    def indexes(self) -> list[int]: ...
    @property
    def fields(self) -> list[str]: ...
    @property
    def task(self) -> str | None: ...
    @property
    def lease_timeout(self) -> float: ...
    @property
    def groups(self) -> list[str | int | None] | None: ...
    @property
    def versions(self) -> list[int] | None: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def round(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def micro_batch_indices(self) -> list[list[int]] | None: ...
    @property
    def status(self) -> str: ...
    @property
    def fates(self) -> Sequence[str] | None: ...
    @property
    def sealed(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def pads(self) -> int: ...
    def __len__(self) -> int: ...
    def select(self, positions: Sequence[int]) -> Meta: ...
