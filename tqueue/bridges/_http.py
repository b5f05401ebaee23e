"""HTTP engines: server-sent events as the engines stream them: ``data: <json>`` blocks ended by a blank
line, ``data: [DONE]`` last. Read with a bound: one event may not exceed ``max_bytes`` (a
routed-experts payload over a long sequence is large, but not without limit)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from ..errors import EngineError, InvalidArgumentError

MAX_EVENT = 256 << 20


async def events(content: Any, what: str, max_bytes: int = MAX_EVENT) -> AsyncIterator[Any]:
    """The decoded JSON of each ``data:`` event of an aiohttp response body, until
    ``[DONE]`` or the end of the stream. ``what`` names the request in errors."""
    buf = bytearray()
    async for piece in content.iter_any():
        buf += piece
        while True:
            end = _boundary(buf)
            if end is None:
                break
            block, cut = bytes(buf[: end[0]]), end[1]
            del buf[:cut]
            data = b"\n".join(
                line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:")
            )
            if not data:
                continue  # a comment or a keep-alive
            if data.strip() == b"[DONE]":
                return
            try:
                yield msgspec.json.decode(data)
            except msgspec.DecodeError as exc:
                raise EngineError(f"{what}: a streamed event is not JSON ({exc}): {data[:200]!r}") from None
        if len(buf) > max_bytes:
            raise EngineError(f"{what}: a streamed event exceeds {max_bytes} bytes")


def _boundary(buf: bytearray) -> tuple[int, int] | None:
    """Where the first event ends and the next begins (``\\n\\n`` or ``\\r\\n\\r\\n``)."""
    a, b = buf.find(b"\n\n"), buf.find(b"\r\n\r\n")
    if a < 0 and b < 0:
        return None
    if b >= 0 and (a < 0 or b < a):
        return b, b + 4
    return a, a + 2


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
                async for event in events(resp.content, what):
                    started = True
                    yield event
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
