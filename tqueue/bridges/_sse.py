"""Server-sent events as the engines stream them: ``data: <json>`` blocks ended by a blank
line, ``data: [DONE]`` last. Read with a bound: one event may not exceed ``max_bytes`` (a
routed-experts payload over a long sequence is large, but not without limit)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from ..errors import EngineError

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
