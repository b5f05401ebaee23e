"""HTTP ingestion: rollout fleets that push trajectories over HTTP, without a ZeroMQ client.

An aiohttp server in front of one :class:`~tqueue.AsyncClient`. A fleet posts records (an
SGLang ``/generate`` response plus its key, group and version, or a token-level record) to a
partition; each record becomes one sample of the standard rollout fields, validated as a put
validates, stored with one ``put`` per distinct set of fields in the body (records that differ
in optional fields become samples that lack them). What is not stored is never silently
dropped: every record of a body gets its fate in the answer, or the body is refused with a
status that says why (a 422 names the record and its field).

It also tells the fleet what it needs without per-engine calls: the trainer's weight version
and where those weights were published (``set_version(v, weights=...)`` at the controller,
followed here with one parked wait however many engines wait; long-poll or server-sent
events), and when a partition seals (its target reached: the fleet aborts what it still runs
for it).

See docs/ingest.md for the endpoints, bodies and status codes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import hmac
import logging
import math
import re
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
from ._fields import FIELDS, Trajectory
from .sglang import from_generate

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
OFF_LOOP_BYTES = 1 << 20
FOLLOW_SECONDS = 300.0  # one parked version wait at the controller lasts this long, then is renewed
Extra = float | str | list[float]
_DTYPES = {"int32": np.int32, "uint8": np.uint8, "uint16": np.uint16}
_STANDARD = frozenset((*FIELDS, "key", "reward"))  # names an ``extra`` entry may not take
_NAMED = re.compile(r"\bfields? \[?'([^']+)'")  # the field a put's schema error names


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """One trajectory. Either ``sglang`` (a ``/generate`` response) or ``response_ids`` and
    ``response_logprobs`` (a token-level record) is given."""

    key: str
    prompt_ids: list[int]
    group: str | int | None = None
    version: int | None = None  # the weights' version when no spans say it
    reward: float | None = None
    extra: dict[str, Any] = {}  # each value an Extra, checked on its own to name it in an error
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


class _SGLangSpan(msgspec.Struct):
    version: int | str
    start: int
    end: int


class _SGLangMeta(msgspec.Struct):
    """What is read of an SGLang response's ``meta_info`` (other keys pass), typed so that a
    malformed one is refused naming where."""

    finish_reason: dict[str, Any] | str | None = None
    output_token_logprobs: list[tuple[float, int, Any]] | None = None  # (logprob, token_id, text)
    weight_version: int | str | None = None
    weight_versions: list[_SGLangSpan] | None = None
    routed_experts: str | None = None


class _SGLang(msgspec.Struct):
    output_ids: list[int]
    meta_info: _SGLangMeta


@dataclasses.dataclass
class _Body:
    """A validated body: its records, each as the fields of one sample, their groups and
    versions (all or none), and the puts that store them: record indexes per field set."""

    records: list[Record]
    samples: list[dict[str, Any]]
    groups: list[Any]
    versions: list[int] | None
    puts: list[list[int]]


class _Bad(Exception):
    """A fault in ``field`` of one record (a dotted path in the record: ``extra.score``)."""

    def __init__(self, field: str | None, error: str) -> None:
        super().__init__(error)
        self.field = field
        self.error = error


class _Refused(Exception):
    """An HTTP answer other than 200, with a JSON body."""

    def __init__(self, status: int, error: str, retry: dict[str, str] | None = None, **more: Any) -> None:
        super().__init__(error)
        self.status = status
        self.body = {"error": error, **more}
        self.headers = retry or {}


def _invalid(error: str, *, record: int | None, field: str | None, key: str | None = None, **more: Any) -> _Refused:
    """A 422 naming the record (None: the fault is in no one record, e.g. the body is not JSON)
    and its field (None: the record as a whole), with the record's key when known."""
    named: dict[str, Any] = {"record": record, "field": field}
    if key is not None:
        named["key"] = key
    return _Refused(422, error, **named, **more)


class _Reader:
    """Reads a body into samples: decodes it, checks each record's types and fields, and
    groups the records by the fields they carry (one put each); a bad record refuses the
    whole body, naming its record and field."""

    def __init__(self, max_records: int, experts_shape: tuple[int, int] | None) -> None:
        self.max_records = max_records
        self.experts_shape = experts_shape

    def validate(self, partition: str, raw: bytes, kind: str) -> _Body:
        """The body's records as samples, and the puts that store them; a bad record refuses
        the whole body."""
        records = self._decode(raw, kind)
        samples, versions = [], []
        for i, record in enumerate(records):
            fields, version = self._sample(partition, i, record)
            samples.append(fields)
            versions.append(version)
        given = [v for v in versions if v is not None]
        if given and len(given) != len(versions):
            i = versions.index(None)
            raise _invalid(f"record {i} (key {records[i].key!r}) has no version while others of the body do: "
                           "give version or version_spans", record=i, field="version", key=records[i].key)
        self._agree(partition, records, samples)
        sets: dict[frozenset[str], list[int]] = {}
        for i, fields in enumerate(samples):
            sets.setdefault(frozenset(fields), []).append(i)
        return _Body(records, samples, [r.group for r in records], given or None, list(sets.values()))

    def _decode(self, raw: bytes, content_type: str) -> list[Record]:
        if content_type not in (MSGPACK, "application/json"):
            raise _Refused(415, f"the body is application/json or {MSGPACK}, not {content_type or 'untyped'}")
        try:
            value = msgspec.msgpack.decode(raw) if content_type == MSGPACK else msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise _invalid(f"the body is not {'MessagePack' if content_type == MSGPACK else 'JSON'}: {exc}",
                           record=None, field="body") from None
        if not isinstance(value, dict):
            raise _invalid(f"the body is a record or {{\"records\": [...]}}, not {_kind(value)}", record=None, field="body")
        items = value["records"] if "records" in value else [value]
        if not isinstance(items, list) or not items:
            raise _invalid(f"records is a non-empty array of records, not {_kind(items)}", record=None, field="records")
        if len(items) > self.max_records:
            raise _Refused(413, f"{len(items)} records in one body; at most {self.max_records}")
        return [self._record(i, item) for i, item in enumerate(items)]

    @staticmethod
    def _record(i: int, item: Any) -> Record:
        """Record ``i`` of the body, its types checked (SGLang response and ``extra`` values
        included)."""
        key = item.get("key") if isinstance(item, dict) and isinstance(item.get("key"), str) else None
        named = f"record {i}" + (f" (key {key!r})" if key is not None else "")
        if not isinstance(item, dict):
            raise _invalid(f"{named} is {_kind(item)}, not an object", record=i, field=None)
        try:
            record = _convert(item, Record, "")
            if record.sglang is not None:
                _convert(record.sglang, _SGLang, "sglang")
            for name, value in record.extra.items():
                _convert(value, Extra, f"extra.{name}")
        except _Bad as bad:
            raise _invalid(f"{named}: {bad.error}", record=i, field=bad.field, key=key) from None
        return record

    def _sample(self, partition: str, i: int, r: Record) -> tuple[dict[str, Any], int | None]:
        """The fields of record ``i``, validated, and the version its put carries."""
        try:
            traj = self._generated(r) if r.sglang is not None else self._tokens(r)
            fields = traj.fields()
            fields["key"] = r.key
            if r.reward is not None:
                fields["reward"] = torch.tensor(r.reward, dtype=torch.float32)
            for name, value in r.extra.items():
                if name in _STANDARD:
                    raise _Bad(f"extra.{name}", f"extra field {name!r} is a standard field")
                fields[name] = torch.tensor(value, dtype=torch.float64) if not isinstance(value, str) else value
        except _Bad as bad:
            raise _invalid(f"record {i} (key {r.key!r}) of partition {partition!r}: {bad.error}",
                           record=i, field=bad.field, key=r.key) from None
        version = traj.version if traj.version >= 0 else r.version
        return fields, version

    def _generated(self, r: Record) -> Trajectory:
        if r.response_ids is not None or r.response_logprobs is not None:
            raise _Bad("sglang", "a record is either an SGLang response (sglang) or a token-level one (response_ids), not both")
        try:
            return from_generate(r.sglang or {}, r.prompt_ids, experts_shape=self.experts_shape)
        except (SchemaError, InvalidArgumentError) as exc:  # the response's types are checked: what is left is its content
            raise _Bad("sglang", str(exc)) from None

    @staticmethod
    def _tokens(r: Record) -> Trajectory:
        """The trajectory of a token-level record, each field checked before it is used."""
        if r.response_ids is None or r.response_logprobs is None:
            missing = "response_ids" if r.response_ids is None else "response_logprobs"
            raise _Bad(missing, "a token-level record has response_ids and response_logprobs (or give sglang)")
        n = len(r.response_ids)
        if len(r.response_logprobs) != n:
            raise _Bad("response_logprobs", f"{len(r.response_logprobs)} log-probs for {n} response tokens")
        if r.version_spans is not None:
            spans = list(r.version_spans)
            for version, start, end in spans:
                if not 0 <= start <= end <= n:
                    raise _Bad("version_spans", f"the span [{start}, {end}) of version {version} lies outside the {n} response tokens")
        else:
            spans = [(r.version, 0, n)] if r.version is not None and n else []
        if r.loss_mask is not None:
            if len(r.loss_mask) != n:
                raise _Bad("loss_mask", f"{len(r.loss_mask)} loss_mask values for {n} response tokens")
            if any(m not in (0, 1) for m in r.loss_mask):
                raise _Bad("loss_mask", "loss_mask values are 0 or 1")
        experts = _experts(r, len(r.prompt_ids) + n - 1) if r.routed_experts is not None else None
        traj = Trajectory(prompt_ids=list(r.prompt_ids))
        traj.append(r.response_ids, r.response_logprobs, r.finish, spans, experts, 0)
        if r.loss_mask is not None:
            traj.loss_mask = list(r.loss_mask)
        return traj

    @staticmethod
    def _agree(partition: str, records: list[Record], samples: list[dict[str, Any]]) -> None:
        """Refuse a field whose type differs between records (a partition holds one)."""
        first: dict[str, tuple[int, str]] = {}
        for i, fields in enumerate(samples):
            for name, value in fields.items():
                j, kind = first.setdefault(name, (i, _type(value)))
                if _type(value) != kind:
                    key = records[i].key
                    raise _invalid(
                        f"record {i} (key {key!r}) of partition {partition!r}: field {name!r} is {_type(value)}, "
                        f"record {j}'s is {kind} (a field has one type)", record=i, field=_path(name), key=key,
                    )


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
        self._reader = _Reader(max_records, experts_shape)
        self.remember = remember
        self.version = -1  # the trainer's, as last learned from the controller (-1: not yet)
        self.where = ""
        self._change = asyncio.Event()  # set, and replaced, when the version changes or its follower ends
        self._follower: asyncio.Task[None] | None = None
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
        self._following()
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
        if self._follower is not None:  # after the handlers: none can start another
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None

    async def publish(self, version: int, where: str) -> None:
        """In-process, what the trainer's ``client.set_version(version, weights=where)`` does
        from anywhere: the controller takes the version (for staleness) with the pointer to
        its weights, and this server answers the fleet's waits with them."""
        await self.client.set_version(version, weights=where)
        reply = await self.client.rollouts.wait_version(version - 1, timeout=0)  # the controller's, at once
        self._learn(reply.version, reply.weights)

    # --- the trainer's version, followed at the controller -----------------------------

    def _following(self) -> asyncio.Task[None]:
        """The task that follows the trainer's version, started if none runs (at start, and
        again at the first wait after one failed)."""
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self._follow())
            self._follower.add_done_callback(self._followed)
        return self._follower

    async def _follow(self) -> None:
        """Learn each new version from the controller: one wait parked there at a time,
        however many engines wait here. Ends at the first error (the controller cannot be
        reached); the waits here then answer 503."""
        while True:
            try:
                reply = await self.client.rollouts.wait_version(self.version, timeout=FOLLOW_SECONDS)
            except WaitTimeoutError:
                continue  # no new version in that long: wait again
            self._learn(reply.version, reply.weights)

    def _followed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("following the trainer's version at the controller failed: %s", task.exception())
        self._wake()

    def _learn(self, version: int, where: str) -> None:
        if version > self.version:  # answers may cross: an older one changes nothing
            self.version, self.where = version, where
            self._wake()

    def _wake(self) -> None:
        """Wake every wait here: each checks what it waits for, then waits on the next event."""
        self._change.set()
        self._change = asyncio.Event()

    def _unfollowed(self, follower: asyncio.Task[None]) -> _Refused:
        """The 503 of a wait whose follower ended."""
        why = "the server is stopping" if follower.cancelled() else str(follower.exception())
        return _Refused(503, f"the trainer's version cannot be learned from the controller: {why}",
                        {"Retry-After": self.retry_after})

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
        raw = await request.read()
        if len(raw) > OFF_LOOP_BYTES:  # a large body is decoded beside the loop, which serves others meanwhile
            body = await asyncio.to_thread(self._reader.validate, partition, raw, kind)
        else:
            body = self._reader.validate(partition, raw, kind)
        self._reserve(partition, body.records)
        # the puts run to their end even if the poster leaves: its keys' fate is then known
        store = asyncio.ensure_future(self._store(partition, body))
        self._puts.add(store)
        store.add_done_callback(self._puts.discard)
        accepted, failed, exc = await asyncio.shield(store)
        if exc is not None:
            raise self._refusal(exc, partition, body, failed, accepted)
        return web.json_response({"accepted": [accepted[i] for i in range(len(body.records))]})

    async def _store(self, partition: str, body: _Body) -> tuple[dict[int, dict[str, Any]], list[int], TQueueError | None]:
        """Store ``body`` with one put per field set, in order, up to the first that fails.
        Returns each stored record's entry by its index, and the failed put's records and
        error; the keys of the records not stored are free again."""
        accepted: dict[int, dict[str, Any]] = {}
        try:
            for put in body.puts:
                try:
                    meta = await self.client.put(
                        partition, [body.samples[i] for i in put], groups=[body.groups[i] for i in put],
                        version=[body.versions[i] for i in put] if body.versions else None, timeout=0,
                        if_sealed="discard",  # each record's status goes back to the poster
                    )
                except TQueueError as exc:
                    return accepted, put, exc
                fates = meta.fates if meta.status == "trimmed" and meta.fates else [meta.status] * len(put)
                indexes = meta.indexes if meta.status in ("ok", "trimmed", "recycled") else [-1] * len(put)
                for i, ix, fate in zip(put, indexes, fates):
                    accepted[i] = {"key": body.records[i].key, "partition": meta.partition, "index": int(ix), "status": fate}
            return accepted, [], None
        finally:
            self._release(partition, [r.key for i, r in enumerate(body.records) if i not in accepted])

    def _reserve(self, partition: str, records: list[Record]) -> None:
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

    def _release(self, partition: str, keys: list[str]) -> None:
        held = self._keys.get(partition)
        if held is not None:
            held.difference_update(keys)

    def _refusal(self, exc: TQueueError, partition: str, body: _Body, failed: list[int],
                 accepted: dict[int, dict[str, Any]]) -> _Refused:
        """The answer to a put that failed: the records stored by the puts before it, if any,
        are listed in ``accepted`` (their keys stay taken)."""
        retry = {"Retry-After": self.retry_after}
        more: dict[str, Any] = {"accepted": [accepted[i] for i in sorted(accepted)]} if accepted else {}
        if isinstance(exc, StorageFullError):
            return _Refused(429, f"the memory budget is full: {exc}", retry, reason="memory", **more)
        if isinstance(exc, WaitTimeoutError):
            return _Refused(429, f"the staleness bound holds puts back: {exc}", retry, reason="staleness", **more)
        if isinstance(exc, (SchemaError, FieldTypeError, InvalidArgumentError, UnknownFieldError)):
            named = _NAMED.search(str(exc))
            if named is None:  # about the partition, not a field: e.g. one partition too many
                return _invalid(str(exc), record=None, field=None, **more)
            i = failed[0]  # every record of a put has the same fields
            key = body.records[i].key
            return _invalid(f"record {i} (key {key!r}): {exc}", record=i, field=_path(named.group(1)), key=key, **more)
        if isinstance(exc, PartitionClearedError):
            return _Refused(409, str(exc), **more)
        if isinstance(exc, UnavailableError):
            return _Refused(503, str(exc), retry, **more)
        log.warning("a post to partition %r failed: %s", partition, exc)
        return _Refused(500, f"{type(exc).__name__}: {exc}", **more)

    # --- what the fleet waits for -----------------------------------------------------

    @staticmethod
    def _timeout(request: web.Request, default: float = 30.0) -> float:
        try:
            value = float(request.query.get("timeout", default))
        except ValueError:
            raise _invalid("timeout is a number of seconds", record=None, field="timeout") from None
        if not 0 <= value <= 3600:
            raise _invalid("timeout is between 0 and 3600 seconds", record=None, field="timeout")
        return value

    def _pointer(self, changed: bool) -> dict[str, Any]:
        return {"version": self.version, "where": self.where, "changed": changed}

    async def _version(self, request: web.Request) -> web.Response:
        """Answers at once if the version is past ``after``, else when it is, or at ``timeout``
        (``changed: false``); 503 if the controller cannot tell it."""
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            raise _invalid("after is an integer version", record=None, field="after") from None
        timeout = self._timeout(request)
        follower = self._following()

        async def newer() -> None:
            while not (self.version > after or follower.done()):
                await self._change.wait()

        try:
            await self._parked(asyncio.wait_for(newer(), timeout))
        except asyncio.TimeoutError:
            pass
        if self.version > after:
            return web.json_response(self._pointer(True))
        if follower.done():
            raise self._unfollowed(follower)
        if self.version < 0:  # not learned yet: there is no version to say
            raise _Refused(503, "the controller has not told the trainer's version yet", {"Retry-After": self.retry_after})
        return web.json_response(self._pointer(False))

    async def _sealed(self, request: web.Request) -> web.Response:
        partition = request.match_info["partition"]
        try:
            await self._parked(self.client.rollouts.wait_sealed(partition, timeout=self._timeout(request)))
        except WaitTimeoutError:
            return web.json_response({"partition": partition, "sealed": False})
        except PartitionClearedError:
            return web.json_response({"partition": partition, "sealed": True, "cleared": True})
        return web.json_response({"partition": partition, "sealed": True})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``version`` now and on every new version; ``sealed`` once for
        each partition listed in ``partitions`` (comma-separated); ``error``, and the stream
        ends, if the controller can no longer tell the version."""
        names = [p for p in request.query.get("partitions", "").split(",") if p]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        async def seal(name: str) -> None:
            try:
                await self.client.rollouts.wait_sealed(name, timeout=math.inf)
            except PartitionClearedError:
                pass
            await queue.put(("sealed", {"partition": name}))

        async def versions() -> None:
            follower, seen = self._following(), -1
            while True:
                while not (self.version > seen or follower.done()):
                    await self._change.wait()
                if self.version > seen:
                    seen = self.version
                    await queue.put(("version", self._pointer(True)))
                else:  # the follower ended: say why, and end the stream (the fleet reconnects)
                    await queue.put(("error", {"error": str(self._unfollowed(follower))}))
                    return

        async def pump() -> None:
            workers = [asyncio.ensure_future(versions())] + [asyncio.ensure_future(seal(n)) for n in names]
            try:
                while True:
                    kind, data = await queue.get()
                    await resp.write(f"event: {kind}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode())
                    if kind == "error":
                        return
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

        try:
            await self._parked(pump())
        except (asyncio.CancelledError, ConnectionResetError):
            pass
        return resp


def _convert(value: Any, kind: Any, prefix: str) -> Any:
    """``value`` as ``kind``, or :class:`_Bad` naming the field at fault as a dotted path
    under ``prefix`` (``extra.score``; indexes are in the message, not the field)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        what, _, at = str(exc).partition(" - at `")
        at = at.rstrip("`").removeprefix("$")
        where = prefix + at if at.startswith("[") else ".".join(p for p in (prefix, at.lstrip(".")) if p)
        named = re.search(r"field `([^`]+)`", what)  # a missing or unknown field, named in the message
        field = ".".join(p for p in (where, named.group(1) if named else "") if p)
        raise _Bad(re.sub(r"\[[^\]]*\]", "", field) or None, f"{what} at {where}" if where else what) from None


def _experts(r: Record, rows: int) -> np.ndarray:
    """The routed experts of a token-level record: ``rows`` rows (one per token but the last)."""
    if r.routed_experts_shape is None:
        raise _Bad("routed_experts_shape", "routed_experts needs routed_experts_shape: [layers, top_k]")
    layers, top_k = r.routed_experts_shape
    if layers < 1 or top_k < 1:
        raise _Bad("routed_experts_shape", f"routed_experts_shape is [layers, top_k], each at least 1, not [{layers}, {top_k}]")
    if r.routed_experts_start:
        raise _Bad("routed_experts_start", "a new trajectory's routed experts start at row 0 (routed_experts_start is for resumes)")
    try:
        raw = base64.b64decode(r.routed_experts or "", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _Bad("routed_experts", f"routed_experts is not base64: {exc}") from None
    dtype = np.dtype(_DTYPES[r.routed_experts_dtype])
    per_row = layers * top_k * dtype.itemsize
    if len(raw) != max(rows, 0) * per_row:
        raise _Bad("routed_experts", f"routed_experts holds {len(raw)} bytes; {max(rows, 0)} rows (one per token but the "
                                     f"last) of {layers} x {top_k} {dtype} are {max(rows, 0) * per_row}")
    return np.frombuffer(raw, dtype=dtype).reshape(-1, layers, top_k)


def _kind(value: Any) -> str:
    """The JSON type of ``value``, for a message."""
    for kind, name in ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _type(value: Any) -> str:
    """What a field's value is, as one put stores it."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} of {value.dim()} dimensions"
    return "a string" if isinstance(value, str) else type(value).__name__


def _path(name: str) -> str:
    """A stored field's place in a record: its own name, or under ``extra``."""
    return name if name in _STANDARD else f"extra.{name}"
