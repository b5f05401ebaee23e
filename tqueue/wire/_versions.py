"""Messages of the trainer's weight versions and of admission by staleness (AReaL-style): the
trainer says its version, producers wait for a newer one, and puts are admitted only while
they stay within ``max_staleness`` versions of it."""

from __future__ import annotations

import math

from ._messages import Kind, Message, register


class SetVersion(Message):
    """The trainer's current policy weight version, and ``weights``: where those weights are
    published (an opaque pointer for engines that pull them; "": not said)."""

    KIND = Kind.SET_VERSION
    version: int
    weights: str = ""


class VersionWait(Message):
    """Wait until the trainer's version is past ``after``: answered with ``VersionReply`` then
    (at once if it already is), or with a timeout error at ``timeout`` seconds (``math.inf``: none)."""

    KIND = Kind.VERSION_WAIT
    after: int
    timeout: float = math.inf


class VersionReply(Message):
    """The trainer's version and the pointer to its weights (``SetVersion.weights``)."""

    KIND = Kind.VERSION_REPLY
    version: int
    weights: str = ""


class Admission(Message):
    """Producers may hold at most ``(version + max_staleness + 1) * batch_size`` samples
    produced or in flight (AReaL-style); ``max_staleness`` < 0 turns the bound off."""

    KIND = Kind.ADMISSION
    max_staleness: int
    batch_size: int


class Reserve(Message):
    """Admit ``count`` samples ahead of their put (waits like a put)."""

    KIND = Kind.RESERVE
    count: int
    timeout: float = math.inf


register(globals())
