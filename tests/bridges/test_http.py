"""The server-sent-events reader the HTTP engines share (tqueue/bridges/_http.py), fed the
pieces a socket could deliver: every split of a stream, one piece of thousands of events."""

from __future__ import annotations

import asyncio
import json

import pytest

from tqueue.bridges._http import YIELD_EVERY, events
from tqueue.errors import EngineError


class Pieces:
    """An aiohttp body that delivers ``pieces`` as they are."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def read(pieces: list[bytes], **kw) -> list:
    async def main():
        return [e async for e in events(Pieces(pieces), "test request", **kw)]

    return asyncio.run(main())


def stream(eol: bytes) -> tuple[bytes, list]:
    want = [{"n": i, "text": "a\nb" if i % 2 else ""} for i in range(5)]
    body = b""
    for i, event in enumerate(want):
        if i == 2:
            body += b": a comment" + eol + eol  # no data: skipped
        body += b"data: " + json.dumps(event).encode() + eol + eol
    body += b"data: [DONE]" + eol + eol + b"data: {\"after\": 1}" + eol + eol  # nothing after [DONE]
    return body, want


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_every_split_of_a_stream_reads_the_same_events(eol):
    body, want = stream(eol)
    assert read([body]) == want
    for cut in range(1, len(body)):
        assert read([body[:cut], body[cut:]]) == want, cut
    assert read([body[i : i + 1] for i in range(len(body))]) == want


def test_an_event_split_across_lines_is_joined():
    assert read([b'data: {"a":\ndata: 1}\n\n']) == [{"a": 1}]


def test_one_piece_of_thousands_of_events_lets_the_loop_run_between_them():
    """A resumed call's stream arrived as one piece of thousands of events; reading it held the
    loop (and the client's heartbeats) for seconds. The loop now runs every YIELD_EVERY events."""
    n = 20 * YIELD_EVERY
    body = b"".join(b'data: {"i": %d}\n\n' % i for i in range(n))

    async def main():
        turns = []
        got = []

        def tick():
            turns.append(len(got))
            loop.call_soon(tick)

        loop = asyncio.get_running_loop()
        loop.call_soon(tick)
        async for event in events(Pieces([body]), "test request"):
            got.append(event["i"])
        return got, turns

    got, turns = asyncio.run(main())
    assert got == list(range(n))
    inside = [t for t in turns if 0 < t < n]
    assert len(inside) >= 19 and all(t % YIELD_EVERY == 0 for t in inside), inside[:5]


def test_an_event_over_the_bound_is_an_engine_error_naming_the_request():
    with pytest.raises(EngineError, match=r"test request: a streamed event exceeds 64 bytes"):
        read([b"data: " + b"x" * 40, b"y" * 40], max_bytes=64)


def test_an_event_that_is_not_json_is_an_engine_error():
    with pytest.raises(EngineError, match=r"test request: a streamed event is not JSON"):
        read([b"data: {oops\n\n"])
