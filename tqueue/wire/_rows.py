"""Rows allocated ahead of their data (TransferQueue's ``get_meta(mode="insert")``): samples
with no fields, on no unit, that writes fill later; and where samples live."""

from __future__ import annotations

from ._messages import Kind, Message, register


class AllocateRows(Message):
    """``count`` new samples of ``partition`` (made if need be) with no fields yet, on no unit
    until their first write (an update) places them; readers see a sample once it holds the
    fields they ask for. Answered with ``MetaReply``."""

    KIND = Kind.ALLOCATE_ROWS
    partition: str
    count: int


class Locate(Message):
    """The unit of each of ``indexes``; samples on no unit yet (allocated rows) are placed
    now, preferring units on ``host``. Answered with ``Located``."""

    KIND = Kind.LOCATE
    partition: str
    partition_uid: int
    indexes: list[int]
    host: str = ""
    # a reader whose fetch from this unit failed: where the partition keeps copies and some of
    # the samples are on it while it is alive, the answer waits (up to ``timeout`` s) until the
    # controller declares it dead and promotes the copies
    moved_from: int = -1
    timeout: float = 0.0


class Located(Message):
    """Per sample asked: its unit; ``gone``: that unit is dead (the sample is lost, or its
    copy is being promoted); ``two_copies``: the partition keeps two copies."""

    KIND = Kind.LOCATED
    units: list[int]
    gone: list[bool] = []
    two_copies: bool = False
    second_units: list[int] = []  # per sample, the unit of its second copy (-1: none)


class Corrupt(Message):
    """A reader found ``indexes`` of ``field`` on unit ``unit_id`` failing their CRC-32C: the
    controller drops that copy (the unit frees it), serves the samples from their other copy
    where there is one (and copies them again), else counts them lost for every task.
    Answered with ``Located`` (``gone`` where a sample has no good copy left)."""

    KIND = Kind.CORRUPT
    partition: str
    partition_uid: int
    unit_id: int
    indexes: list[int]
    field: str = ""


register(globals())
