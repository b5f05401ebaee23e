"""Why a TransferQueue call does not run under tqueue.

``NotSupportedError``: refused by design (it would execute code or unpickle objects that came
from the network, or find a cluster through a Ray named actor); the message names the
alternative. ``NotYetSupportedError``: a call the shim does not carry out yet, naming the tqueue
feature it waits for. Both are ``NotImplementedError``.
"""

from __future__ import annotations


class NotSupportedError(NotImplementedError):
    """Refused by design; the message names what to do instead (docs/migrating.md)."""


class NotYetSupportedError(NotImplementedError):
    """Not carried out over tqueue yet; the message names the missing tqueue feature."""


KEY_INDEX = "tqueue's key index (keys to samples, with per-sample tags; issue 27)"


def not_yet(call: str, needs: str) -> NotYetSupportedError:
    return NotYetSupportedError(
        f"transfer_queue.{call} is not available over tqueue yet: it needs {needs}. See docs/migrating.md."
    )


def refused(what: str, instead: str) -> NotSupportedError:
    return NotSupportedError(f"{what} is refused by tqueue by design (nothing executes code from the network); {instead}")
