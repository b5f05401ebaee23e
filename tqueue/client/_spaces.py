"""The client's namespaces: the calls beyond the first-learned verbs, grouped by what they
are for.

* ``client.keys``: a partition's user keys and each sample's tags (:class:`AsyncKeys`);
* ``client.samples``: reads without a lease, rows allocated for later writes, consumption
  reset, field statistics (:class:`AsyncSamples`);
* ``client.rollouts``: the rollout lifecycle: partial rollouts completed, postponed or
  failed, admission reserved, seals and versions waited for, the staleness bound
  (:class:`AsyncRollouts`);
* ``client.checkpoints``: the whole data plane saved and loaded (:class:`AsyncCheckpoints`).

Each is a thin front over the object that owns the work (:class:`~tqueue.client._key_calls.KeyCalls`,
:class:`~tqueue.client._lifecycle.Lifecycle`, :mod:`~tqueue.client._checkpoint_calls`); the blocking
:class:`~tqueue.client.Client` makes its namespaces from these (``client/_sync.py``), as it
makes its methods from :class:`~tqueue.client.AsyncClient`'s. The methods' old names on the
client (``bind_keys``, ``postpone``, ``save_checkpoint``...) work for one more release, with a
:class:`~tqueue.TQueueDeprecationWarning`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..wire import CheckpointReply
from . import _checkpoint_calls
from ._ask import Completion, takes
from ._connections import Connections
from ._key_calls import KeyCalls
from ._lifecycle import FieldStats, Lifecycle

__all__ = ["AsyncCheckpoints", "AsyncKeys", "AsyncRollouts", "AsyncSamples", "MOVED"]

P = ParamSpec("P")
T = TypeVar("T")
O = TypeVar("O")  # noqa: E741


def _to(
    method: Callable[Concatenate[O, P], Coroutine[Any, Any, T]], name: str
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    """A namespace method ``name`` that hands the call to ``method`` of the namespace's owner
    (``self._owner``), with its signature and docstring."""

    @functools.wraps(method)
    async def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await method(self._owner, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class AsyncKeys:
    """``client.keys``: a partition's index from user keys to samples, and each sample's
    tags (MessagePack values). Nothing here leases or consumes: a meta found by key is read
    with ``get_data(found.meta)`` by anyone, any number of times."""

    def __init__(self, owner: KeyCalls) -> None:
        self._owner = owner

    bind = _to(KeyCalls.bind_keys, "bind")
    tag = _to(KeyCalls.tag_keys, "tag")
    set_tags = _to(KeyCalls.set_tags, "set_tags")
    lookup = _to(KeyCalls.lookup_keys, "lookup")
    of = _to(KeyCalls.keys_of, "of")
    all = _to(KeyCalls.list_keys, "all")
    drop = _to(KeyCalls.drop_keys, "drop")


class AsyncSamples:
    """``client.samples``: samples read without a lease, made without fields, made readable
    again, and summed up."""

    def __init__(self, keys: KeyCalls, lifecycle: Lifecycle) -> None:
        self._owner = keys
        self._lifecycle = lifecycle

    select = _to(KeyCalls.select, "select")
    allocate = _to(KeyCalls.allocate, "allocate")
    reset = _to(KeyCalls.reset_consumption, "reset")

    async def stats(self, partition: str, field: str) -> FieldStats:
        """count, mean, std, min and max of a scalar field over the partition's live samples:
        aborted, failed, postponed and partial samples and pad rows are left out."""
        return await self._lifecycle.field_stats(partition, field)


class AsyncRollouts:
    """``client.rollouts``: the rollout lifecycle beyond put and get: partial rollouts
    completed after a weight update or postponed to a later step, failures reported,
    admission reserved before generating, the staleness bound, and waits for a seal or a new
    trainer version (parked at the controller, no polling)."""

    def __init__(self, owner: Lifecycle) -> None:
        self._owner = owner

    @takes(Completion)
    async def complete(self, call: Completion) -> list[int]:
        """Finish (or, with ``finished=False``, extend) partial rollouts after a weight
        update: a new segment of tokens produced by ``version``, starting at response token
        ``first_token``. Token offsets count response tokens, prompt left out (0: the
        first generated token); ``first_token`` is how many response tokens the sample
        held before this segment.

        Fields in ``append`` (the new response tokens, their log-probs) are appended to
        what is stored. Fields in ``splice`` map to a row offset (one, or one per sample):
        the engine returned the field for the whole sequence (routed experts
        ``[tokens, layers, top_k]``), and the stored rows before the offset, produced by
        earlier segments' weights, are kept; the new array supplies the rest. That offset
        counts rows of the field, prompt included: the prompt length plus ``first_token``.
        With ``lengths`` each spliced result must have exactly that many rows (prompt plus
        response tokens). Other fields are replaced. The samples record the segment
        ``(version, first_token)``; once ``finished`` they are visible to consumers.
        :meth:`Batch.token_versions` gives each row's version, given the prompt lengths
        for a whole-sequence field.

        Finishing samples takes places of the partition's ``target``, as a put does: where
        it has no room left (sealed), the samples stay partial and untouched, and their
        indexes are returned (an empty list: all done), so that the caller may
        :meth:`postpone` them to the next step. Each storage unit's share is written whole
        or not at all.
        """
        return await self._owner.complete(call)

    postpone = _to(Lifecycle.postpone, "postpone")
    fail = _to(Lifecycle.fail, "fail")
    reserve = _to(Lifecycle.reserve, "reserve")
    wait_sealed = _to(Lifecycle.sealed, "wait_sealed")
    wait_version = _to(Lifecycle.wait_version, "wait_version")
    set_staleness = _to(Lifecycle.set_staleness, "set_staleness")


class AsyncCheckpoints:
    """``client.checkpoints``: the whole data plane written to a directory and loaded back,
    into this cluster or another."""

    def __init__(self, conns: Connections) -> None:
        self._conns = conns

    async def save(self, directory: str | os.PathLike[str], *, metadata: Any = None) -> CheckpointReply:
        """Write the whole data plane into ``directory``: every partition's metadata (samples,
        fields, groups, versions and segments, each task's consumption, partial and recycled
        samples), the trainer's version and staleness bound, and every unit's payload, as
        Apache Arrow IPC files beside a JSON manifest, with ``metadata`` (JSON values only)
        kept in it. The directory must be reachable under the same path by the controller
        and every storage unit (one host, or a shared filesystem).

        Atomic: files go into a new folder, are fsynced, and the manifest is renamed into
        place last; a checkpoint that stops halfway leaves the previous one as it was. Puts
        and gets go on while the bytes are written: the checkpoint holds a server's loop only
        while it copies that server's bookkeeping (the reply's ``pause``). Waits as long as
        the controller and units are alive. Returns what was written and what it cost."""
        return await _checkpoint_calls.save(self._conns, directory, metadata)

    async def load(self, directory: str | os.PathLike[str], *, replace: bool = False) -> Any:
        """Load the checkpoint in ``directory`` into this cluster, fresh or running, with any
        number of storage units. Every sample comes back bit-exact, with every task's
        consumption and its keys; samples that were leased come back ready. Returns the
        ``metadata`` given to :meth:`save`. Nothing in a checkpoint is executed: JSON, and
        Arrow files read as bytes.

        The cluster's partitions that the checkpoint does not hold are untouched and serve
        on. A checkpoint partition whose name a live partition has: by default the whole
        load is refused before anything is loaded (:class:`InvalidArgumentError` naming
        them); with ``replace=True`` the live one is replaced, as by ``clear`` (its
        waiting readers get :class:`PartitionClearedError`, its payload is freed), but only
        once the checkpoint's payload is fully loaded: a load that fails keeps it, and
        leaves nothing of the checkpoint behind. Loaded partitions get partition uids of
        their own in a running cluster (a meta made before the load no longer reads them:
        take samples anew, or look them up by key). The trainer's version, weights and
        staleness bound come from the checkpoint only into a cluster without partitions."""
        return await _checkpoint_calls.load(self._conns, directory, replace=replace)


# the client's old method names, each with the namespace and name that replace it
MOVED: dict[str, tuple[str, str]] = {
    "bind_keys": ("keys", "bind"),
    "tag_keys": ("keys", "tag"),
    "set_tags": ("keys", "set_tags"),
    "lookup_keys": ("keys", "lookup"),
    "keys_of": ("keys", "of"),
    "list_keys": ("keys", "all"),
    "drop_keys": ("keys", "drop"),
    "select": ("samples", "select"),
    "allocate": ("samples", "allocate"),
    "reset_consumption": ("samples", "reset"),
    "field_stats": ("samples", "stats"),
    "complete": ("rollouts", "complete"),
    "postpone": ("rollouts", "postpone"),
    "fail": ("rollouts", "fail"),
    "reserve": ("rollouts", "reserve"),
    "sealed": ("rollouts", "wait_sealed"),
    "wait_version": ("rollouts", "wait_version"),
    "set_staleness": ("rollouts", "set_staleness"),
    "save_checkpoint": ("checkpoints", "save"),
    "load_checkpoint": ("checkpoints", "load"),
}
