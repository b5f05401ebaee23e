"""HTTP engines: server-sent events as the engines stream them: ``data: <json>`` blocks ended by a blank
line, ``data: [DONE]`` last. Read with a bound: one event may not exceed ``max_bytes`` (a
routed-experts payload over a long sequence is large, but not without limit)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from ..errors import EngineError, InvalidArgumentError
from ._aborts import EarlyAborts

MAX_EVENT = 256 << 20

log = logging.getLogger(__name__)


#: events handed on from one received piece before the loop gets a turn (its timers: heartbeats)
YIELD_EVERY = 256


async def events(content: Any, what: str, max_bytes: int = MAX_EVENT) -> AsyncIterator[Any]:
    """The decoded JSON of each ``data:`` event of an aiohttp response body, until
    ``[DONE]`` or the end of the stream. ``what`` names the request in errors.

    Linear in the bytes received: each byte is searched for a boundary once (a search that
    started over at every event, or every piece, was quadratic: a resumed call's stream that
    arrived as one piece of thousands of events held the loop for seconds, past the cluster's
    liveness window). A piece of many events lets the loop run every ``YIELD_EVERY`` events."""
    buf = bytearray()
    scanned = 0  # buf[:scanned] holds no boundary's start but in its last 3 bytes
    async for piece in content.iter_any():
        buf += piece
        pos = 0  # where the next event starts
        handed = 0
        while True:
            end = _boundary(buf, max(pos, scanned - 3))
            if end is None:
                break
            block = bytes(buf[pos : end[0]])
            pos = scanned = end[1]
            data = b"\n".join(
                line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")
            )
            if not data:
                continue  # a comment or a keep-alive
            if data.strip() == b"[DONE]":
                return
            try:
                event = msgspec.json.decode(data)
            except msgspec.DecodeError as exc:
                raise EngineError(f"{what}: a streamed event is not JSON ({exc}): {data[:200]!r}") from None
            yield event
            handed += 1
            if handed % YIELD_EVERY == 0:
                await asyncio.sleep(0)
        del buf[:pos]
        scanned = len(buf)
        if len(buf) > max_bytes:
            raise EngineError(f"{what}: a streamed event exceeds {max_bytes} bytes")


def _boundary(buf: bytearray, start: int) -> tuple[int, int] | None:
    """Where the first event from ``start`` ends and the next begins (``\\n\\n`` or
    ``\\r\\n\\r\\n``): read line end by line end, no further than the boundary."""
    i = buf.find(b"\n", start)
    while i >= 0:
        if buf[i + 1 : i + 2] == b"\n":
            return i, i + 2
        if i > start and buf[i - 1] == 0x0D and buf[i + 1 : i + 3] == b"\r\n":
            return i - 1, i + 3
        i = buf.find(b"\n", i + 1)
    return None


class HTTPEngine:
    """What the HTTP engines share: one aiohttp session (``headers`` on every call, ``timeout``
    per call), streamed calls that :meth:`abort_streams` can close, and the choice of abort
    (``"request"``: the engine's abort endpoint; ``"close"``: close the stream)."""

    def __init__(self, url: str, *, abort: str, headers: Mapping[str, str] | None, timeout: float) -> None:
        if abort not in ("request", "close"):
            raise InvalidArgumentError(f"abort is 'request' or 'close', got {abort!r}")
        self.url = url.rstrip("/")
        self.abort_by = abort
        self.headers = dict(headers or {})
        self.timeout = timeout
        self._session: Any = None
        self._streams: dict[str, Any] = {}
        self._closed: set[str] = set()
        self._early = EarlyAborts(horizon=timeout)

    def _http(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=30)
            )
        return self._session

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def stream(self, rid: str, path: str, body: Mapping[str, Any], what: str) -> AsyncGenerator[Any, None]:
        """POST ``body`` to ``path`` and yield its events. A stream closed by
        :meth:`abort_streams` just ends; any other failure is an :class:`EngineError`,
        ``retryable`` where another try may succeed: the connection was refused, reset or
        dropped, an HTTP 5xx, a timeout before the first event."""
        import aiohttp

        started = False
        try:
            async with self._http().post(f"{self.url}{path}", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    raise EngineError(f"{what}: HTTP {resp.status}: {text}", retryable=resp.status >= 500)
                self._streams[rid] = resp
                if self.abort_by == "close" and self._early.asked(rid):  # asked before the stream opened
                    self._closed.add(rid)
                    resp.close()
                async for event in events(resp.content, what):
                    first = not started
                    started = True
                    yield event
                    if first and self.abort_by == "request" and self._early.asked(rid):
                        await self._abort_again(rid)
        except asyncio.TimeoutError:  # aiohttp's timeouts are asyncio's too
            if rid not in self._closed:
                when = "after its first event" if started else "before any event"
                raise EngineError(f"{what}: timed out {when} (timeout={self.timeout} s)", retryable=not started) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
            if rid not in self._closed:
                raise EngineError(f"{what}: {type(exc).__name__}: {exc}", retryable=True) from None
        except aiohttp.ClientError as exc:
            if rid not in self._closed:
                raise EngineError(f"{what}: {type(exc).__name__}: {exc}") from None
        finally:
            self._streams.pop(rid, None)
            self._early.forget(rid)

    async def post(self, path: str, body: Mapping[str, Any], what: str) -> None:
        """POST ``body`` to ``path``; anything but HTTP 200 is an :class:`EngineError` naming ``what``."""
        import aiohttp

        try:
            async with self._http().post(f"{self.url}{path}", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise EngineError(f"{what} at {self.url}: HTTP {resp.status}: {text}", retryable=resp.status >= 500)
        except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise EngineError(f"{what} at {self.url}: {type(exc).__name__}: {exc}", retryable=True) from None

    async def abort(self, rids: Sequence[str]) -> None:
        """:meth:`tqueue.bridges.Engine.abort`: close the streams, or ask the engine
        (:meth:`abort_requests`); an abort asked before a call's first event is asked again at
        that event (the engine drops an abort of a request it does not hold yet; see
        ``_aborts``)."""
        self._early.ask(rids)
        if self.abort_by == "close":
            self.abort_streams(rids)
            return
        await self.abort_requests(rids)

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Ask the engine to abort these requests (its abort endpoint)."""
        raise NotImplementedError

    async def _abort_again(self, rid: str) -> None:
        try:
            await self.abort_requests([rid])
        except EngineError as exc:  # the call then ends at the driver's abort bound
            log.warning("aborting %s again at its first event failed: %s", rid, exc)

    def closed(self, rid: str) -> bool:
        """Whether the driver closed this call's stream (and forget it)."""
        was = rid in self._closed
        self._closed.discard(rid)
        return was

    def abort_streams(self, rids: Sequence[str]) -> None:
        """Close the streams of these calls: the engine aborts a request whose client left."""
        for rid in rids:
            resp = self._streams.get(rid)
            if resp is not None:
                self._closed.add(rid)
                resp.close()
