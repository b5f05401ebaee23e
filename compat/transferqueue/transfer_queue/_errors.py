"""Why a TransferQueue call does not run under tqueue.

``NotSupportedError``: refused by design (it would execute code or unpickle objects that came
from the network, or find a cluster through a Ray named actor); the message names the
alternative. ``NotYetSupportedError`` (kept for code that catches it; no call raises it now):
a call the shim would not carry out yet. Both are ``NotImplementedError``.
"""

from __future__ import annotations


class NotSupportedError(NotImplementedError):
    """Refused by design; the message names what to do instead (docs/migrating.md)."""


class NotYetSupportedError(NotImplementedError):
    """Not carried out over tqueue yet; the message names the missing tqueue feature."""


def refused(what: str, instead: str) -> NotSupportedError:
    return NotSupportedError(f"{what} is refused by tqueue by design (nothing executes code from the network); {instead}")
