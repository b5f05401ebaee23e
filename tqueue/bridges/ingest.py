"""HTTP ingestion: rollout fleets that push trajectories over HTTP, without a ZeroMQ client.

An aiohttp server in front of one :class:`~tqueue.AsyncClient`. A fleet posts records (an
SGLang ``/generate`` response plus its key, group and version, or a token-level record) to a
partition; each record becomes one sample of the standard rollout fields, validated as a put
validates, stored with one ``put`` per body. What is not stored is never silently dropped:
every record of a body gets its fate in the answer, or the whole body is refused with a status
that says why.

It also tells the fleet what it needs without per-engine calls: the trainer's weight version
and where those weights were published (long-poll or server-sent events), and when a
partition seals (its target reached: the fleet aborts what it still runs for it).

See docs/ingest.md for the endpoints, bodies and status codes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import hmac
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import numpy as np
import torch
from aiohttp import web

from ..errors import (
    FieldTypeError,
    InvalidArgumentError,
    PartitionClearedError,
    SchemaError,
    StorageFullError,
    TQueueError,
    UnavailableError,
    UnknownFieldError,
    WaitTimeoutError,
)
from ._fields import Trajectory
from .sglang import from_generate

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
OFF_LOOP_BYTES = 1 << 20
Extra = float | str | list[float]
_DTYPES = {"int32": np.int32, "uint8": np.uint8, "uint16": np.uint16}


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """One trajectory. Either ``sglang`` (a ``/generate`` response) or ``response_ids`` and
    ``response_logprobs`` (a token-level record) is given."""

    key: str
    prompt_ids: list[int]
    group: str | int | None = None
    version: int | None = None  # the weights' version when no spans say it
    reward: float | None = None
    extra: dict[str, Extra] = {}
    sglang: dict[str, Any] | None = None
    response_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    finish: Literal["stop", "length", "abort", "error"] = "stop"
    version_spans: list[tuple[int, int, int]] | None = None
    routed_experts: str | None = None  # base64 of the raw array, rows from routed_experts_start
    routed_experts_dtype: Literal["int32", "uint8", "uint16"] = "int32"
    routed_experts_shape: tuple[int, int] | None = None  # (layers, top_k)
    routed_experts_start: int = 0


class _Refused(Exception):
    """An HTTP answer other than 200, with a JSON body."""

    def __init__(self, status: int, error: str, retry: dict[str, str] | None = None, **more: Any) -> None:
        super().__init__(error)
        self.status = status
        self.body = {"error": error, **more}
        self.headers = retry or {}


class Ingest:
    """The ingestion server over ``client``.

    ``token``: the bearer token every call but ``/healthz`` must carry (None: no auth, for
    tests and trusted networks only). ``max_body``: bytes of one request body (413 beyond).
    ``max_records``: records of one body. ``retry_after``: seconds a 429 asks the fleet to
    wait. ``experts_shape``: ``(layers, top_k)`` of SGLang routed experts, which SGLang does not
    state. ``remember``: partitions whose accepted keys are remembered (for 409 on a
    duplicate), the most recently used.
    """

    def __init__(
        self,
        client: Any,
        *,
        token: str | None,
        max_body: int = 64 << 20,
        max_records: int = 4096,
        retry_after: float = 1.0,
        experts_shape: tuple[int, int] | None = None,
        remember: int = 1024,
    ) -> None:
        self.client = client
        self.token = token
        self.max_body = max_body
        self.max_records = max_records
        self.retry_after = str(max(1, math.ceil(retry_after)))
        self.experts_shape = experts_shape
        self.remember = remember
        self.version = -1
        self.where = ""
        self._changed = asyncio.Condition()
        self._keys: collections.OrderedDict[str, set[str]] = collections.OrderedDict()
        self._waits: set[asyncio.Future[Any]] = set()  # long polls and event streams, ended by stop()
        self._puts: set[asyncio.Future[Any]] = set()  # puts in flight, finished by stop()
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=max_body, middlewares=[self._auth])
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_post("/v1/partitions/{partition}/trajectories", self._post)
        self.app.router.add_get("/v1/partitions/{partition}/sealed", self._sealed)
        self.app.router.add_get("/v1/version", self._version)
        self.app.router.add_get("/v1/events", self._events)
        self.url = ""

    # --- lifecycle ------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: the OS picks); returns the base URL."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        """End the long polls and event streams, then the server. Idempotent."""
        for task in list(self._waits):
            task.cancel()
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def publish(self, version: int, where: str) -> None:
        """The trainer's weights of step ``version`` are at ``where`` (the pointer fleets pull
        from): sets the trainer's version for staleness, and answers the fleet's waits."""
        await self.client.set_version(version)
        async with self._changed:
            self.version, self.where = version, where
            self._changed.notify_all()

    # --- plumbing -------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if self.token is not None and request.path != "/healthz":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response(
                    {"error": "a bearer token is required: Authorization: Bearer <token>"
                     if not given else "the bearer token is not this server's"},
                    status=401, headers={"WWW-Authenticate": "Bearer"},
                )
        try:
            return await handler(request)
        except _Refused as refused:
            return web.json_response(refused.body, status=refused.status, headers=refused.headers)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"the body exceeds {self.max_body} bytes"}, status=413)

    async def _parked(self, work: Awaitable[Any]) -> Any:
        """Run a long wait so that :meth:`stop` can end it."""
        task = asyncio.ensure_future(work)
        self._waits.add(task)
        try:
            return await task
        finally:
            self._waits.discard(task)

    @staticmethod
    async def _healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    # --- trajectories ---------------------------------------------------------------

    async def _post(self, request: web.Request) -> web.Response:
        partition = request.match_info["partition"]
        kind = request.content_type if request.headers.get("Content-Type") else ""
        body = await request.read()
        if len(body) > OFF_LOOP_BYTES:  # a large body is decoded beside the loop, which serves others meanwhile
            records, samples, groups, given = await asyncio.to_thread(self._validate, partition, body, kind)
        else:
            records, samples, groups, given = self._validate(partition, body, kind)
        keys = self._reserve(partition, records)
        # the put runs to its end even if the poster leaves: its keys' fate is then known
        put = asyncio.ensure_future(self.client.put(partition, samples, groups=groups, version=given or None, timeout=0))
        self._puts.add(put)
        put.add_done_callback(lambda task: self._put_done(task, partition, keys))
        try:
            meta = await asyncio.shield(put)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._refusal(exc, partition) from exc
        fates = meta.fates if meta.status == "trimmed" and meta.fates else [meta.status] * len(records)
        indexes = meta.indexes if meta.status in ("ok", "trimmed", "recycled") else [-1] * len(records)
        accepted = [
            {"key": r.key, "partition": meta.partition, "index": int(ix), "status": fate}
            for r, ix, fate in zip(records, indexes, fates)
        ]
        return web.json_response({"accepted": accepted})

    def _validate(self, partition: str, body: bytes, kind: str) -> tuple[list[Record], list[dict[str, Any]], list[Any], list[int]]:
        """The body's records, each as the fields of one sample, with groups and versions
        (all or none given); a bad one refuses the whole body."""
        records = self._decode(body, kind)
        samples, groups, versions = [], [], []
        for i, record in enumerate(records):
            fields, version = self._sample(partition, i, record)
            samples.append(fields)
            groups.append(record.group)
            versions.append(version)
        given = [v for v in versions if v is not None]
        if given and len(given) != len(versions):
            i = versions.index(None)
            raise _Refused(422, f"record {i} (key {records[i].key!r}) has no version while others of the body do: "
                                "give version or version_spans", record=i, key=records[i].key, field=f"records[{i}].version")
        return records, samples, groups, given

    def _decode(self, body: bytes, content_type: str) -> list[Record]:
        if content_type not in (MSGPACK, "application/json"):
            raise _Refused(415, f"the body is application/json or {MSGPACK}, not {content_type or 'untyped'}")
        try:
            raw = msgspec.msgpack.decode(body) if content_type == MSGPACK else msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise _Refused(422, f"the body is not {'MessagePack' if content_type == MSGPACK else 'JSON'}: {exc}") from None
        many = isinstance(raw, dict) and "records" in raw
        try:
            if many:
                records = msgspec.convert(raw["records"], list[Record])
            else:
                records = [msgspec.convert(raw, Record)]
        except msgspec.ValidationError as exc:
            message = str(exc)
            path = message.rsplit(" - at `", 1)[1].rstrip("`") if " - at `" in message else "$"
            field = ("records" + path[1:]) if many else path[2:] or "$"
            raise _Refused(422, f"{message.split(' - at ')[0]} at {field}", field=field) from None
        if not records:
            raise _Refused(422, "records is empty", field="records")
        if len(records) > self.max_records:
            raise _Refused(413, f"{len(records)} records in one body; at most {self.max_records}")
        return records

    def _sample(self, partition: str, i: int, r: Record) -> tuple[dict[str, Any], int | None]:
        """The fields of record ``i``, validated, and the version its put carries."""
        where: dict[str, Any] = {"record": i, "key": r.key}
        try:
            if r.sglang is not None:
                if r.response_ids is not None or r.response_logprobs is not None:
                    raise SchemaError("a record is either an SGLang response (sglang) or a token-level one (response_ids), not both")
                traj = from_generate(r.sglang, r.prompt_ids, experts_shape=self.experts_shape)
            else:
                traj = self._tokens(r)
        except (SchemaError, InvalidArgumentError) as exc:
            raise _Refused(422, f"record {i} (key {r.key!r}) of partition {partition!r}: {exc}", **where) from None
        fields = traj.fields()
        fields["key"] = r.key
        if r.reward is not None:
            fields["reward"] = torch.tensor(r.reward, dtype=torch.float32)
        for name, value in r.extra.items():
            if name in fields:
                raise _Refused(422, f"record {i} (key {r.key!r}): extra field {name!r} is a standard field", field=f"extra.{name}", **where)
            fields[name] = torch.tensor(value, dtype=torch.float64) if not isinstance(value, str) else value
        version = traj.version if traj.version >= 0 else r.version
        return fields, version

    def _tokens(self, r: Record) -> Trajectory:
        if r.response_ids is None or r.response_logprobs is None:
            raise SchemaError("a token-level record has response_ids and response_logprobs (or give sglang)")
        traj = Trajectory(prompt_ids=list(r.prompt_ids))
        if r.version_spans is not None:
            spans = list(r.version_spans)
        else:
            spans = [(r.version, 0, len(r.response_ids))] if r.version is not None and r.response_ids else []
        experts = None
        if r.routed_experts is not None:
            if r.routed_experts_shape is None:
                raise SchemaError("routed_experts needs routed_experts_shape: [layers, top_k]")
            try:
                raw = base64.b64decode(r.routed_experts, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise SchemaError(f"routed_experts is not base64: {exc}") from None
            dtype = np.dtype(_DTYPES[r.routed_experts_dtype])
            layers, top_k = r.routed_experts_shape
            per_row = layers * top_k * dtype.itemsize
            if per_row <= 0 or len(raw) % per_row:
                raise SchemaError(f"routed_experts holds {len(raw)} bytes, not rows of {layers} x {top_k} {dtype}")
            experts = np.frombuffer(raw, dtype=dtype).reshape(-1, layers, top_k)
        if r.routed_experts_start and experts is not None:
            raise SchemaError("a new trajectory's routed experts start at row 0 (routed_experts_start is for resumes)")
        traj.append(r.response_ids, r.response_logprobs, r.finish, spans, experts, 0)
        if r.loss_mask is not None:
            if len(r.loss_mask) != len(r.response_ids):
                raise SchemaError(f"{len(r.loss_mask)} loss_mask values for {len(r.response_ids)} response tokens")
            if any(m not in (0, 1) for m in r.loss_mask):
                raise SchemaError("loss_mask values are 0 or 1")
            traj.loss_mask = list(r.loss_mask)
        return traj

    def _reserve(self, partition: str, records: list[Record]) -> list[str]:
        """Claim the keys, or answer 409 naming the first taken (in this body, accepted
        before, or in a body still being stored)."""
        held = self._keys.get(partition)
        if held is None:
            held = self._keys[partition] = set()
            while len(self._keys) > self.remember:
                self._keys.popitem(last=False)
        self._keys.move_to_end(partition)
        seen: set[str] = set()
        for r in records:
            if r.key in held or r.key in seen:
                raise _Refused(409, f"key {r.key!r} of partition {partition!r} was already posted", key=r.key)
            seen.add(r.key)
        held |= seen
        return list(seen)

    def _put_done(self, task: asyncio.Future[Any], partition: str, keys: list[str]) -> None:
        self._puts.discard(task)
        if task.cancelled() or task.exception() is not None:  # nothing stored: the keys are free again
            self._release(partition, keys)

    def _release(self, partition: str, keys: list[str]) -> None:
        held = self._keys.get(partition)
        if held is not None:
            held.difference_update(keys)

    def _refusal(self, exc: BaseException, partition: str) -> BaseException:
        retry = {"Retry-After": self.retry_after}
        if isinstance(exc, StorageFullError):
            return _Refused(429, f"the memory budget is full: {exc}", retry, reason="memory")
        if isinstance(exc, WaitTimeoutError):
            return _Refused(429, f"the staleness bound holds puts back: {exc}", retry, reason="staleness")
        if isinstance(exc, (SchemaError, FieldTypeError, InvalidArgumentError, UnknownFieldError)):
            return _Refused(422, str(exc))
        if isinstance(exc, PartitionClearedError):
            return _Refused(409, str(exc))
        if isinstance(exc, UnavailableError):
            return _Refused(503, str(exc), retry)
        if isinstance(exc, TQueueError):
            log.warning("a post to partition %r failed: %s", partition, exc)
            return _Refused(500, f"{type(exc).__name__}: {exc}")
        return exc

    # --- what the fleet waits for -----------------------------------------------------

    @staticmethod
    def _timeout(request: web.Request, default: float = 30.0) -> float:
        try:
            value = float(request.query.get("timeout", default))
        except ValueError:
            raise _Refused(422, "timeout is a number of seconds", field="timeout") from None
        if not 0 <= value <= 3600:
            raise _Refused(422, "timeout is between 0 and 3600 seconds", field="timeout")
        return value

    def _pointer(self, changed: bool) -> dict[str, Any]:
        return {"version": self.version, "where": self.where, "changed": changed}

    async def _version(self, request: web.Request) -> web.Response:
        """Answers at once if the version is past ``after``, else when it is, or at ``timeout``
        (``changed: false``)."""
        try:
            after = int(request.query.get("after", "-2"))
        except ValueError:
            raise _Refused(422, "after is an integer version", field="after") from None
        timeout = self._timeout(request)

        async def newer() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.version > after)

        try:
            await self._parked(asyncio.wait_for(newer(), timeout))
        except asyncio.TimeoutError:
            return web.json_response(self._pointer(False))
        return web.json_response(self._pointer(True))

    async def _sealed(self, request: web.Request) -> web.Response:
        partition = request.match_info["partition"]
        try:
            await self._parked(self.client.sealed(partition, timeout=self._timeout(request)))
        except WaitTimeoutError:
            return web.json_response({"partition": partition, "sealed": False})
        except PartitionClearedError:
            return web.json_response({"partition": partition, "sealed": True, "cleared": True})
        return web.json_response({"partition": partition, "sealed": True})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``version`` now and on every publish; ``sealed`` once for each
        partition listed in ``partitions`` (comma-separated)."""
        names = [p for p in request.query.get("partitions", "").split(",") if p]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        async def seal(name: str) -> None:
            try:
                await self.client.sealed(name, timeout=math.inf)
            except PartitionClearedError:
                pass
            await queue.put(("sealed", {"partition": name}))

        async def versions() -> None:
            seen = [-2]
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self.version != seen[0])
                    seen[0] = self.version
                    await queue.put(("version", self._pointer(True)))

        async def pump() -> None:
            workers = [asyncio.ensure_future(versions())] + [asyncio.ensure_future(seal(n)) for n in names]
            try:
                while True:
                    kind, data = await queue.get()
                    await resp.write(f"event: {kind}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode())
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

        try:
            await self._parked(pump())
        except (asyncio.CancelledError, ConnectionResetError):
            pass
        return resp
