"""An SGLang-shaped HTTP server for the driver's tests: real HTTP (aiohttp), responses shaped
exactly as SGLang 0.5.23 streams them from ``/generate`` (see docs/bridges.md), a model that
is a formula so tests know every token, log-prob and routed-expert row in advance.

Not SGLang: SGLang needs CUDA kernels on PyPI (ENGINES.md); its formats are cited from its
source. ``hold``: the first ``hold[0]`` requests wait until ``hold[1]`` have arrived, then run
to the end; the others of the first ``hold[1]`` stream ``PARK_AFTER`` tokens and wait until
aborted (``/abort_request`` or a closed connection). Every other request runs to the end.

``fail`` maps a request's arrival number (1 for the first) to how it fails, once the held
requests have all arrived and the first ``hold[0]`` have finished: ``"500"`` or ``"503"``
(an HTTP error), ``"drop"`` (one token streamed, then the connection closed) or ``"error"``
(an error event in the stream, as SGLang sends one). As SGLang does, ``/abort_request`` drops
an abort of a request not on the engine yet (``dropped``). ``admit``, if set to an unset event,
keeps each request off the engine (no response opened) until it is set; such a request, once
admitted, streams ``PARK_AFTER`` tokens and waits ``late_wait`` seconds for an abort before it
runs to its end. ``stop_at``: sequence lengths at which the model emits its stop token
(the call ends with ``finish_reason`` stop there, an agent's turn ending). ``park``, if set, is
asked of each request's body: where it says so, the request streams ``PARK_AFTER`` tokens and
waits until aborted, as a held one does. ``running`` counts the requests on the
engine; a request stops counting before its last event is sent, so that a client that has
read every answer sees the count it left behind.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
from aiohttp import web

LAYERS, TOP_K = 2, 2
PARK_AFTER = 3


def token(position: int) -> int:
    """The token the model generates at sequence position ``position``."""
    return (position * 7) % 997 + 3


def logprob(position: int) -> float:
    return -0.25 * (position % 8) - 0.5  # exact in float32


def experts(position: int, version: int) -> list[list[int]]:
    """Routed experts of the token at ``position`` under weights ``version``."""
    return [[version * 10_000 + position * 10 + layer * 2 + k for k in range(TOP_K)] for layer in range(LAYERS)]


class FakeSGLang:
    def __init__(self, hold: tuple[int, int] | None = None, fail: dict[int, str] | None = None) -> None:
        self.hold = hold
        self.fail = dict(fail or {})
        self.failed: list[list[int]] = []  # the input ids of the requests failed on purpose
        self.version = "0"
        self.arrived = 0
        self.all_arrived = asyncio.Event()
        self.finished = 0  # requests run to their end
        self.held_finished = asyncio.Event()  # the first hold[0] have run to their end
        self.running = 0
        self.idle = asyncio.Event()  # no request is running
        self.ignore_aborts = False  # /abort_request answers 200 and aborts nothing
        self.parked_rids: set[str] = set()
        self.aborted: set[str] = set()  # by /abort_request
        self.dropped: set[str] = set()  # aborts of requests not on the engine yet
        self.admit: asyncio.Event | None = None
        self.late_wait = 10.0
        self.waiting = 0  # requests kept off the engine by admit
        self.waiting_event = asyncio.Event()
        self.disconnected: set[str] = set()  # client closed the stream
        self.abort_events: dict[str, asyncio.Event] = {}
        self.parked = 0
        self.parked_event = asyncio.Event()
        self.requests: list[dict[str, Any]] = []
        self.stop_at: set[int] = set()
        self.park: Any = None  # (body) -> bool
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def release(self) -> None:
        """Let every parked request end (as aborted), as if someone had aborted it."""
        for event in self.abort_events.values():
            event.set()

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self.version = (await request.json())["new_version"]
        return web.json_response({"success": True, "new_version": self.version})

    async def abort_request(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        if self.ignore_aborts:
            return web.Response()
        if rid not in self.abort_events:  # not on the engine (yet): SGLang answers 200 and drops it
            self.dropped.add(rid)
            return web.Response()
        self.aborted.add(rid)
        self.abort_events[rid].set()
        return web.Response()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.arrived += 1
        order = self.arrived
        if self.hold is not None and self.arrived >= self.hold[1]:
            self.all_arrived.set()
        self.running += 1
        self.idle.clear()
        counted = [True]

        def ended() -> None:  # the request leaves the engine (once)
            if counted[0]:
                counted[0] = False
                self.running -= 1
                if not self.running:
                    self.idle.set()

        try:
            if order in self.fail:
                return await self._fail(request, body, self.fail[order], ended)
            return await self._generate(request, body, order, ended)
        finally:
            ended()

    async def _fail(self, request: web.Request, body: dict[str, Any], how: str, ended: Any) -> web.StreamResponse:
        if self.hold is not None:
            await self.all_arrived.wait()
            await self.held_finished.wait()
        self.failed.append(body["input_ids"])
        if how in ("500", "503"):
            ended()
            return web.Response(status=int(how), text="Service Unavailable" if how == "503" else "Internal Server Error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids = body["input_ids"]
        spans = [{"version": self.version, "start": 0, "end": 1}]
        await self._send(resp, body["rid"], ids, [token(len(ids))], spans, None, body)
        ended()
        if how == "drop":
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write(b'data: {"error": {"message": "the scheduler failed this request"}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _generate(self, request: web.Request, body: dict[str, Any], order: int, ended: Any) -> web.StreamResponse:
        rid, ids = body["rid"], body["input_ids"]
        budget = body["sampling_params"]["max_new_tokens"]
        late = self.admit is not None
        parks = self.park is not None and self.park(body)
        if self.admit is not None:
            self.waiting += 1
            self.waiting_event.set()
            await self.admit.wait()
        aborted = self.abort_events.setdefault(rid, asyncio.Event())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        out: list[int] = []
        spans: list[dict[str, Any]] = []
        finish: dict[str, Any] | None = None
        version = int(self.version)
        try:
            while finish is None:
                if len(out) == budget:
                    finish = {"type": "length", "length": budget}
                    break
                if aborted.is_set() or (late and len(out) == PARK_AFTER and await _within(aborted, self.late_wait)):
                    finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
                    break
                held = self.hold is not None and order <= self.hold[1]
                if len(out) == PARK_AFTER and (parks or (held and order > self.hold[0])):
                    self.parked += 1
                    self.parked_rids.add(rid)
                    self.parked_event.set()
                    await aborted.wait()
                    finish = {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None}
                    break
                if len(out) == PARK_AFTER and held:
                    await self.all_arrived.wait()
                out.append(token(len(ids) + len(out)))
                if spans and spans[-1]["version"] == str(version):
                    spans[-1]["end"] = len(out)
                else:
                    spans.append({"version": str(version), "start": len(out) - 1, "end": len(out)})
                await self._send(resp, rid, ids, out, spans, None, body)
                if len(ids) + len(out) in self.stop_at:
                    finish = {"type": "stop", "matched": out[-1]}
            ended()
            await self._send(resp, rid, ids, out, spans, finish, body)
            await resp.write(b"data: [DONE]\n\n")
            if finish["type"] in ("length", "stop"):
                self.finished += 1
                if self.hold is not None and self.finished >= self.hold[0]:
                    self.held_finished.set()
        except asyncio.CancelledError:
            self.disconnected.add(rid)
            raise
        return resp

    async def _send(self, resp: web.StreamResponse, rid: str, ids: list[int], out: list[int],
                    spans: list[dict[str, Any]], finish: dict[str, Any] | None, body: dict[str, Any]) -> None:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "output_token_logprobs": [(logprob(len(ids) + i), t, None) for i, t in enumerate(out)],
            "weight_version": self.version,
        }
        if finish is not None:
            meta["weight_versions"] = [dict(s) for s in spans]
            if body.get("return_routed_experts"):
                start = body.get("routed_experts_start_len", 0)
                seqlen = len(ids) + len(out)
                version = int(self.version)
                rows = np.array([experts(p, version) for p in range(start, seqlen - 1)], dtype=np.int32)
                meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
        event = {"text": "", "output_ids": list(out), "meta_info": meta}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")


async def _within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds``."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True
