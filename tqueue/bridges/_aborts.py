"""Aborts asked before a call's first output.

An engine drops an abort of a request it does not hold yet: vLLM's ``AsyncLLM.abort`` and
SGLang's ``/abort_request`` ignore an id they do not know. A request is the engine's only once
its handler has added it, some time after the call was sent (after the HTTP headers, for
vLLM's token API, whose generator adds it). An abort asked in that window is lost, and the
request runs to its end. So an engine sends an abort asked before a call's first output once
more at that output, when the engine holds the request for sure; a closed-stream abort closes
a stream that opens after it was asked.
"""

from __future__ import annotations

import time
from collections.abc import Iterable


class EarlyAborts:
    """The calls an abort was asked for, until they end. ``horizon``: how long an entry
    outlives its ask at most (a call cancelled before it started never ends here)."""

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self._asked: dict[str, float] = {}

    def ask(self, rids: Iterable[str]) -> None:
        now = time.monotonic()
        if self._asked:
            old = [rid for rid, at in self._asked.items() if now - at > self.horizon]
            for rid in old:
                del self._asked[rid]
        for rid in rids:
            self._asked.setdefault(rid, now)

    def asked(self, rid: str) -> bool:
        return rid in self._asked

    def forget(self, rid: str) -> None:
        self._asked.pop(rid, None)

    def __len__(self) -> int:
        return len(self._asked)
