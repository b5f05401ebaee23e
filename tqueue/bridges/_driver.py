"""The rollout driver: one engine, one step partition at a time, over-sampling and partial
rollouts handled the way the controller defines them.

A step sends every request of its groups to the engine and puts each trajectory the moment
its call ends. The controller seals the step's partition once its ``target`` is reached; the
driver learns that from a parked ``sealed`` call (no polling) and aborts the requests still
running on the engine. An aborted request ends with the tokens it had; put to the sealed
partition it is discarded, or, where the partition has a ``recycle_to``, stored there as a
partial sample, tagged with the versions that produced it. A later step on that partition
resumes it: the engine continues from prompt + response so far, and ``complete`` appends the
new tokens, log-probs, mask and version spans and splices the routed experts.

A step ends whole. An engine error worth another try (:attr:`EngineError.retryable`) is
retried after a backoff; a call that fails for good stops the step: its other calls are
aborted on the engine and given ``abort_timeout`` seconds to end (then cancelled), the failed
member is reported to its group's policy (``client.fail``), and ``step`` raises an
:class:`EngineError` that carries the step's report. Each request has a key, its group and
sample number; the driver remembers the keys each step partition is done with (stored, or
failed and reported), so running a step again sends only what is not.

Multi-turn agents: with a ``tool`` callback, a trajectory is built turn by turn. After each
assistant turn that ended with ``"stop"`` the tool returns the tokens of a tool (environment)
turn, inserted with loss mask 0, and the engine continues from prompt + everything so far;
``None`` ends the trajectory. The sample is put, partial, after its first assistant turn, and
each later write (the tool turn and the assistant turn after it) is a ``complete`` that appends
only the new rows; ``finished=True`` once the trajectory ends. A turn the seal cuts short is
kept partial and recycled like any partial rollout; the step that resumes it continues that
same turn, then the tool loop. A tool that raises fails its sample (``client.fail``) and the
step goes on.

Engines implement :class:`Engine`; the SGLang and vLLM bridges provide them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import operator
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .._meta import Meta
from ..errors import EngineError, InvalidArgumentError, PartitionClearedError
from ..wire import GroupId
from ._fields import ASSISTANT, Trajectory

if TYPE_CHECKING:
    from ..client import AsyncClient

log = logging.getLogger(__name__)

#: the fields ``complete`` appends when a partial rollout is resumed
APPENDED = ("response_ids", "response_logprobs", "loss_mask", "version_spans")
#: and for a multi-turn trajectory, its turns too
TURN_APPENDED = (*APPENDED, "turn_spans")
#: how many step partitions' done keys a driver remembers (the most recent ones)
REMEMBERED_STEPS = 64
#: the reason a failed member is reported with (``client.fail``)
FAILED = "engine call failed"
#: the reason a sample whose tool callback raised is reported with, before the exception's type
TOOL_FAILED = "tool failed"

#: a tool callback: the tokens of the next tool turn, or None to end the trajectory
Tool = Callable[[Any, Trajectory], "Awaitable[Sequence[int] | None] | Sequence[int] | None"]

#: a request of a step: its group and its sample number in the group
Key = tuple[GroupId, int]


class Engine(Protocol):
    """What the driver needs of an inference engine."""

    async def generate(self, rid: str, trajectory: Trajectory, max_new_tokens: int) -> None:
        """Continue ``trajectory`` (its prompt and response so far are the input) by at most
        ``max_new_tokens``, and append the call's output to it when the call ends, finished
        or aborted. Routed experts, if any, are asked for from row
        ``trajectory.experts_start`` and spliced there. A failure is an :class:`EngineError`
        (``retryable`` where another try may succeed) and leaves ``trajectory`` as it was."""
        ...

    async def abort(self, rids: Sequence[str]) -> None:
        """Abort these requests; their ``generate`` calls end with what they have."""
        ...

    async def set_version(self, version: int) -> None:
        """The engine now runs weights of trainer step ``version``."""
        ...


@dataclasses.dataclass
class StepReport:
    """What one step did. ``requests``: engine requests this run sent (resumes included);
    ``stored``: trajectories put and kept (finished, or resumed and finished); ``aborted``:
    calls the driver cut short on the engine, at the seal or because another call failed;
    ``recycled``: of those, kept as partial rollouts in the next partition; ``discarded``: put
    after the seal with nowhere to go; ``resumed``: partial rollouts of earlier steps continued
    here; ``failed``: calls that failed for good, each reported to its group's policy;
    ``retried``: engine calls tried again after an error worth retrying; ``skipped``: requests
    an earlier run of this step is done with, not sent again; ``tool_calls``: tool callbacks
    that returned; ``tool_failed``: samples whose tool callback raised (each reported to its
    group's policy, the step going on; ``errors`` names them); ``turn_limited``: trajectories
    ended by ``max_turns``; ``abort_seconds``: from the seal
    (or the failure) until the last aborted call ended; ``errors``: the engine errors met (the
    failures, failed aborts, errors of calls after the step stopped); ``keys``: the requests
    this step partition is done with, this run and earlier ones."""

    partition: str
    requests: int = 0
    stored: int = 0
    aborted: int = 0
    recycled: int = 0
    discarded: int = 0
    resumed: int = 0
    failed: int = 0
    retried: int = 0
    skipped: int = 0
    tool_calls: int = 0
    tool_failed: int = 0
    turn_limited: int = 0
    sealed: bool = False
    abort_seconds: float | None = None
    versions: dict[int, int] = dataclasses.field(default_factory=dict)  # oldest version -> stored samples
    errors: list[str] = dataclasses.field(default_factory=list)
    keys: set[Key] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Partial:
    meta: Meta | None  # None: not stored yet
    trajectory: Trajectory
    group: GroupId
    budget: int  # max_new_tokens of the whole trajectory (its assistant tokens)
    # what of the trajectory is stored: response rows, version spans, turn spans
    rows: int = 0
    spans: int = 0
    turns: int = 0
    ended: bool = False  # nothing more to generate: only its finishing write is left

    @property
    def stored(self) -> Meta:
        """Its meta: a partial waiting for a step, or continued by one, is stored."""
        assert self.meta is not None, "the trajectory is not stored yet"
        return self.meta


class _Ends:
    """What comes after a turn, where not a tool turn's tokens."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END = _Ends("END")  # the trajectory is finished
WAIT = _Ends("WAIT")  # the step stopped: kept partial for a later step (or the rerun)


class Rollouts:
    """Drive ``engine`` through steps, storing with ``client``.

    ``max_new_tokens``: the budget of one trajectory, resumes included. ``retries``: how
    often a call the engine aborted on its own (not the driver, at a seal) is continued
    before the trajectory is stored as it is (``finish="abort"``). ``error_retries``: how
    often a call that failed with an error worth retrying is tried again, after
    ``backoff`` seconds, doubled at each try. ``abort_timeout``: once a step stops (sealed,
    or a call failed), how long its calls still on the engine have to end before they are
    cancelled. ``extra(group, prompt_ids, trajectory)``, if given, returns more fields for
    each finished sample (a reward, say).

    ``tool(group, trajectory)``, if given, makes every trajectory a multi-turn one (its
    ``turn_spans`` stored): called after each assistant turn that ended with ``"stop"``, it
    returns the tokens of the next tool turn (an ``async def``, or a plain function), or None
    to end the trajectory. ``max_turns`` bounds the assistant turns of one trajectory (the
    tool is not called after the last). ``max_new_tokens`` counts assistant tokens only: tool
    tokens take none of the budget (the engine's context length bounds the whole).
    """

    def __init__(
        self,
        client: AsyncClient,
        engine: Engine,
        *,
        max_new_tokens: int,
        retries: int = 2,
        error_retries: int = 3,
        backoff: float = 0.5,
        abort_timeout: float = 30.0,
        extra: Any = None,
        tool: Tool | None = None,
        max_turns: int = 8,
    ) -> None:
        if max_new_tokens <= 0:
            raise InvalidArgumentError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if retries < 0 or error_retries < 0:
            raise InvalidArgumentError(f"retries and error_retries must be >= 0, got {retries} and {error_retries}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise InvalidArgumentError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if tool is not None and not callable(tool):
            raise InvalidArgumentError(f"tool is a callable (group, trajectory) -> tokens or None, got {type(tool).__name__}")
        if not backoff >= 0 or not 0 < abort_timeout < math.inf:
            raise InvalidArgumentError(f"backoff must be >= 0 and abort_timeout finite and positive, got {backoff} and {abort_timeout}")
        self.client = client
        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.retries = retries
        self.error_retries = error_retries
        self.backoff = backoff
        self.abort_timeout = abort_timeout
        self.extra = extra
        self.tool = tool
        self.max_turns = max_turns
        self.version = 0
        self._partials: list[_Partial] = []
        self._done: dict[str, set[Key]] = {}  # step partition -> keys it is done with, oldest first
        self._prefix = os.urandom(4).hex()
        self._rids = itertools.count()

    @property
    def partials(self) -> int:
        """Partial rollouts waiting to be resumed by a later step."""
        return len(self._partials)

    async def set_version(self, version: int) -> None:
        """The engine has loaded the trainer's weights of step ``version``."""
        await self.engine.set_version(version)
        self.version = version

    async def step(
        self,
        partition: str,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        groups: Sequence[GroupId] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> StepReport:
        """Run one step: ``n`` samples of each prompt (group ``groups[i]``, by default
        ``"{partition}/{i}"``; ``max_new_tokens[i]`` tokens at most, by default the
        driver's), plus the partial rollouts recycled into ``partition``. Returns when every
        call has ended and every trajectory has its fate.

        Raises :class:`EngineError` when a call failed for good, once the step's other calls
        have ended (aborted, or cancelled after ``abort_timeout``); its ``report`` says what
        was stored, aborted and failed. Running the step again, with the same prompts and
        groups, sends only the requests it is not done with (``report.skipped``)."""
        if groups is not None and len(groups) != len(prompts):
            raise InvalidArgumentError(f"{len(groups)} groups for {len(prompts)} prompts")
        if groups is not None and len(set(groups)) != len(groups):
            raise InvalidArgumentError(f"groups name each prompt's group once; got {list(groups)}")
        if max_new_tokens is not None and len(max_new_tokens) != len(prompts):
            raise InvalidArgumentError(f"{len(max_new_tokens)} token budgets for {len(prompts)} prompts")
        report = StepReport(partition=partition)
        done = self._done_with(partition)
        step = _Step(self, partition, report, done)
        resumes = [p for p in self._partials if p.stored.partition == partition]
        self._partials = [p for p in self._partials if p.stored.partition != partition]
        calls = [step.resume(p) for p in resumes]
        for i, prompt in enumerate(prompts):
            group = groups[i] if groups is not None else f"{partition}/{i}"
            budget = max_new_tokens[i] if max_new_tokens is not None else self.max_new_tokens
            for k in range(n):
                if (group, k) in done:
                    report.skipped += 1
                else:
                    calls.append(step.fresh((group, k), [int(t) for t in prompt], group, budget))
        report.requests = len(calls)
        try:
            await step.run(calls)
        finally:
            report.keys = set(done)
        if step.failures:
            raise step.error() from step.failures[0]
        return report

    def rid(self) -> str:
        # fixed width: SGLang aborts every request whose id starts with the one named
        return f"tq-{self._prefix}-{next(self._rids):012d}"

    def _done_with(self, partition: str) -> set[Key]:
        done = self._done.pop(partition, set())
        self._done[partition] = done  # the most recent last
        while len(self._done) > REMEMBERED_STEPS:
            del self._done[next(iter(self._done))]
        return done


class _Step:
    """One step's calls, the seal watch, the abort of what runs once the step stops, and
    the bound on waiting for it."""

    def __init__(self, driver: Rollouts, partition: str, report: StepReport, done: set[Key]) -> None:
        self.d = driver
        self.partition = partition
        self.report = report
        self.done = done
        self.running: dict[str, asyncio.Future[None]] = {}  # engine calls in flight, by request id
        self.tools: set[asyncio.Future[Any]] = set()  # tool callbacks in flight
        self.cut_tools: set[asyncio.Future[Any]] = set()  # cancelled at the abort bound
        self.aborting: set[str] = set()  # the engine was told to abort these
        self.cut: set[str] = set()  # cancelled: still running when the abort bound passed
        self.bound_passed = False
        self.aborts: list[asyncio.Future[None]] = []
        self.sealed_at: float | None = None
        self.stopped_at: float | None = None  # the seal, the first failure or error
        self.stopped = asyncio.Event()
        self.halted = False  # stopped by a failure or an error, not by the seal
        self.failures: list[EngineError] = []

    async def run(self, calls: list[Coroutine[Any, Any, None]]) -> None:
        """Every call to its fate. Once the step stops, the calls still on the engine have
        ``abort_timeout`` seconds to end, then they are cancelled. An error other than an
        engine's (the client's, say) stops the step too, and is raised once all have ended."""
        pending: set[asyncio.Future[Any]] = {asyncio.ensure_future(c) for c in calls}
        stop = asyncio.ensure_future(self.stopped.wait())
        helpers = {asyncio.ensure_future(self.watch()), stop}
        error: BaseException | None = None
        try:
            while pending:
                timeout = None
                if self.stopped_at is not None and not self.bound_passed:
                    timeout = self.stopped_at + self.d.abort_timeout - time.monotonic()
                    if timeout <= 0:
                        self.cut_running()
                        timeout = None
                ended, _ = await asyncio.wait(pending | helpers, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in ended:
                    pending.discard(task)
                    helpers.discard(task)
                    if task is stop or task.cancelled() or task.exception() is None or error is not None:
                        continue
                    error = task.exception()
                    log.warning("step %s stops: %s: %s", self.partition, type(error).__name__, error)
                    self.halted = True
                    self.stop()
        finally:
            for task in (*pending, *helpers):
                task.cancel()
            await asyncio.gather(*pending, *helpers, return_exceptions=True)
            await self.settle_aborts()
        if error is not None:
            raise error

    async def watch(self) -> None:
        """Park on the partition's seal; then stop the step."""
        try:
            await self.d.client.rollouts.wait_sealed(self.partition, timeout=math.inf)
        except PartitionClearedError:
            return
        self.sealed_at = time.monotonic()
        self.report.sealed = True
        self.stop()

    @property
    def stopping(self) -> bool:
        return self.stopped_at is not None

    def stop(self) -> None:
        """No call starts from now on; those on the engine are aborted there."""
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            self.stopped.set()
        rids = sorted(r for r in self.running if r not in self.aborting)
        if rids:
            self.aborting.update(rids)
            self.aborts.append(asyncio.ensure_future(self.abort(rids)))

    async def abort(self, rids: list[str]) -> None:
        try:
            await self.d.engine.abort(rids)
        except EngineError as exc:  # the calls then end at the abort bound
            self.report.errors.append(str(exc))
            log.warning("step %s: aborting %d requests failed: %s", self.partition, len(rids), exc)

    def cut_running(self) -> None:
        """Cancel the calls still running once the abort bound has passed (closing an HTTP
        call's connection: the engine aborts a request whose client went away)."""
        self.bound_passed = True
        if self.running:
            log.warning("step %s: %d calls still running %.1f s after the step stopped: cancelling them",
                        self.partition, len(self.running), self.d.abort_timeout)
        self.cut.update(self.running)
        for call in self.running.values():
            call.cancel()
        if self.tools:
            log.warning("step %s: %d tool callbacks still running %.1f s after the step stopped: cancelling them",
                        self.partition, len(self.tools), self.d.abort_timeout)
        self.cut_tools.update(self.tools)
        for task in self.tools:
            task.cancel()

    async def settle_aborts(self) -> None:
        """The abort requests, within what is left of the bound."""
        if not self.aborts:
            return
        left = (self.stopped_at or time.monotonic()) + self.d.abort_timeout - time.monotonic()
        _, late = await asyncio.wait(self.aborts, timeout=max(left, 0.0))
        for task in late:
            task.cancel()
        await asyncio.gather(*self.aborts, return_exceptions=True)

    async def call(self, traj: Trajectory, budget: int) -> None:
        """Engine calls on ``traj`` until it ends: calls the engine aborted by itself (not
        the driver) are continued ``retries`` times at most; calls that failed with an error
        worth retrying are tried again ``error_retries`` times at most, after a backoff."""
        continued = errors = 0
        while not self.stopping:  # a call the step stopped before it started is not sent
            rid = self.d.rid()
            call = asyncio.ensure_future(self.d.engine.generate(rid, traj, budget - traj.generated))
            self.running[rid] = call
            failure = None
            try:
                await call
            except asyncio.CancelledError:
                if rid not in self.cut:  # this request itself was cancelled
                    call.cancel()
                    raise
                return  # cut at the abort bound: the trajectory is as it was
            except EngineError as exc:
                if self.stopping:  # the step stopped meanwhile: cut short, not failed
                    self.report.errors.append(str(exc))
                    log.info("step %s: after the step stopped: %s", self.partition, exc)
                    return
                if not exc.retryable or errors >= self.d.error_retries:
                    raise
                failure = exc
            finally:
                del self.running[rid]
            if failure is not None:
                errors += 1
                self.report.retried += 1
                delay = self.d.backoff * 2 ** (errors - 1)
                log.info("step %s: %s; retry %d of %d in %.2f s", self.partition, failure, errors, self.d.error_retries, delay)
                with contextlib.suppress(asyncio.TimeoutError):  # woken early if the step stops
                    await asyncio.wait_for(self.stopped.wait(), delay)
                continue
            if traj.finish != "abort" or continued >= self.d.retries:
                return
            continued += 1

    async def failed(self, exc: EngineError, *, group: GroupId = None, meta: Meta | None = None) -> None:
        """A call failed for good: the step stops, and the partition's member-failure policy
        learns of the member (a fresh request of ``group``, or the partial sample ``meta``)."""
        self.failures.append(exc)
        self.report.failed += 1
        self.report.errors.append(str(exc))
        log.warning("step %s: %s", self.partition, exc)
        self.halted = True
        self.stop()
        if meta is not None:
            await self.d.client.rollouts.fail(meta, reason=FAILED)
        elif group is not None:
            await self.d.client.rollouts.fail(self.partition, reason=FAILED, group=group, count=1)

    def ended(self, traj: Trajectory) -> None:
        if traj.finish == "abort" and self.stopped_at is not None:
            self.report.aborted += 1
            took = time.monotonic() - self.stopped_at
            self.report.abort_seconds = max(self.report.abort_seconds or 0.0, took)

    def cut_short(self, traj: Trajectory) -> bool:
        """Aborted because the step failed (not sealed): nothing of it is stored; a rerun of
        the step sends it again."""
        return traj.finish == "abort" and self.halted and self.sealed_at is None

    async def fresh(self, key: Key, prompt: list[int], group: GroupId, budget: int) -> None:
        traj = Trajectory(prompt_ids=prompt, turn_spans=[] if self.d.tool is not None else None)
        try:
            await self.call(traj, budget)
        except EngineError as exc:
            await self.failed(exc, group=group)
            self.done.add(key)
            return
        self.ended(traj)
        if self.cut_short(traj):
            return
        p = _Partial(None, traj, group, budget)
        after = await self.next_turn(p)
        if after is None:  # the tool raised: reported
            self.done.add(key)
            return
        finished = after is END
        closed = _closed_turns(traj, finished)
        fields = traj.fields()
        if traj.turn_spans is not None:
            fields["turn_spans"] = _spans(traj.turn_spans[:closed])
        if self.d.extra is not None and finished and traj.finish != "abort":
            fields.update(self.d.extra(group, prompt, traj))
        version = traj.version if traj.version >= 0 else self.d.version
        meta = await self.d.client.put(
            self.partition, [fields], groups=[group], version=version, if_sealed="discard", partial=not finished,
        )
        self.done.add(key)
        p = dataclasses.replace(p, meta=meta, rows=len(traj.response_ids), spans=len(traj.version_spans), turns=closed,
                                ended=finished)
        if finished:
            self.fate(meta, p)
            return
        # a partial sample: an agent's first turn, or a trajectory the seal cut short
        if isinstance(after, list):
            traj.add_tool(after)
        if meta.status == "recycled":  # sealed meanwhile: stored partial in the next partition
            self.d._partials.append(p)
            self.report.recycled += 1
        elif meta.status != "ok":
            self.report.discarded += 1
        elif isinstance(after, list):
            await self.turns(p)
        else:
            await self.keep(p)

    async def resume(self, p: _Partial) -> None:
        self.report.resumed += 1
        await self.turns(p)

    async def turns(self, p: _Partial) -> None:
        """Continue the stored partial ``p``: each engine call (the turn an abort cut short,
        or the assistant turn after a tool turn) is written with ``complete``, appending what
        is new, until the trajectory ends or the step stops."""
        while True:
            traj = p.trajectory
            start = traj.experts_start  # the first routed-experts row the next call computes
            held = traj.routed_experts is not None
            if not p.ended and traj.awaits_engine:
                if self.stopping:  # not sent: anything it holds unwritten (a tool turn) stays with it
                    await self.keep(p)
                    return
                try:
                    await self.call(traj, p.budget)
                except EngineError as exc:
                    await self.failed(exc, meta=p.stored)
                    return
                self.ended(traj)
            after = END if p.ended else await self.next_turn(p)
            if after is None:
                return
            p, finished, refused = await self.write(p, start, held, after is END)
            if finished:
                self.report.stored += 1
                self.report.versions[traj.version] = self.report.versions.get(traj.version, 0) + 1
                return
            if isinstance(after, list):
                traj.add_tool(after)
                continue
            await self.keep(p, refused=refused)
            return

    async def next_turn(self, p: _Partial) -> list[int] | _Ends | None:
        """What follows the turn just generated: :data:`END`, :data:`WAIT`, the tokens of a
        tool turn, or None where the tool raised (the sample is reported failed)."""
        traj = p.trajectory
        if traj.awaits_engine:  # cut short by the step; or aborted by the engine, its retries spent: as it is
            return WAIT if self.stopping else END
        if self.d.tool is None or traj.turn_spans is None or traj.finish != "stop" or traj.generated >= p.budget:
            return END
        if traj.turns >= self.d.max_turns:
            self.report.turn_limited += 1
            return END
        if self.stopping:  # the tool runs in the step that resumes it
            return WAIT
        task = asyncio.ensure_future(_called(self.d.tool, p.group, traj))
        self.tools.add(task)
        try:
            out = await task
            tokens = None if out is None else [_token(t) for t in out]
        except asyncio.CancelledError:
            if task not in self.cut_tools:
                task.cancel()
                raise
            return WAIT  # cut at the abort bound: called again by the step that resumes it
        except Exception as exc:
            await self.tool_failed(p, exc)
            return None
        finally:
            self.tools.discard(task)
        self.report.tool_calls += 1
        return END if tokens is None else tokens

    async def tool_failed(self, p: _Partial, exc: Exception) -> None:
        """The tool raised: the sample fails alone (its group's policy learns of it), the
        step goes on."""
        self.report.tool_failed += 1
        what = f"step {self.partition!r}: the tool raised on a trajectory of group {p.group!r}: {type(exc).__name__}: {exc}"
        self.report.errors.append(what)
        log.warning("%s", what)
        reason = f"{TOOL_FAILED}: {type(exc).__name__}"
        if p.meta is not None:
            await self.d.client.rollouts.fail(p.meta, reason=reason)
        else:
            await self.d.client.rollouts.fail(self.partition, reason=reason, group=p.group, count=1)

    async def write(self, p: _Partial, start: int, held: bool, finished: bool) -> tuple[_Partial, bool, bool]:
        """``complete`` the stored partial with what its trajectory holds beyond what is
        stored. Returns the partial as stored now, whether it finished, and whether the
        partition refused to finish it (its target full)."""
        traj = p.trajectory
        before = p.rows
        closed = _closed_turns(traj, finished)
        now = (len(traj.response_ids), len(traj.version_spans), closed, traj.experts_start)
        if not finished and now == (p.rows, p.spans, p.turns, start):
            return p, False, False  # nothing new: no call, or one cut before its first token
        spans = traj.version_spans[p.spans:]
        version = min((v for v, _, _ in spans), default=self.d.version)
        data: dict[str, Any] = {
            "response_ids": torch.tensor(traj.response_ids[before:], dtype=torch.int64),
            "response_logprobs": torch.tensor(traj.response_logprobs[before:], dtype=torch.float32),
            "loss_mask": torch.tensor(traj.loss_mask[before:], dtype=torch.int8),
            "version_spans": torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
            "finish": traj.finish,
        }
        append: Sequence[str] = APPENDED
        if traj.turn_spans is not None:
            data["turn_spans"] = _spans(traj.turn_spans[p.turns:closed])
            append = TURN_APPENDED
        splice, lengths = None, None
        if traj.routed_experts is not None:
            # rows of every position but the last; fewer where a closed stream lost the call's
            # rows: those are not written, and the next call computes them from ``start``. The
            # controller keeps the row this segment's rows start at (``meta.splices``); where
            # none were held, the call computed every row: spliced at 0, written whole
            if traj.routed_experts.shape[0] == traj.length - 1:
                data["routed_experts"] = torch.from_numpy(np.ascontiguousarray(traj.routed_experts))
                splice, lengths = {"routed_experts": start if held else 0}, [traj.length - 1]
        if finished and self.d.extra is not None:
            data.update(self.d.extra(p.group, traj.prompt_ids, traj))
        columns = {name: [value] for name, value in data.items()}
        refused = await self.d.client.rollouts.complete(
            p.stored, columns, version=version, first_token=before, append=append, splice=splice, lengths=lengths,
            finished=finished,
        )
        if refused:  # the step's target filled first: keep the tokens, still partial, for the next step
            finished = False
            await self.d.client.rollouts.complete(
                p.stored, columns, version=version, first_token=before, append=append, splice=splice, lengths=lengths,
                finished=False,
            )
        stored = dataclasses.replace(p, rows=len(traj.response_ids), spans=len(traj.version_spans), turns=closed,
                                     ended=p.ended or bool(refused))
        return stored, finished, bool(refused)

    async def keep(self, p: _Partial, *, refused: bool = False) -> None:
        """A stored partial the step stopped (or could not finish): for the rerun where the
        step failed, else on to the partition this one recycles into, still partial."""
        if not refused and self.halted and self.sealed_at is None:  # a rerun of this step resumes it
            self.d._partials.append(p)
            return
        nxt = await self.recycle_target()
        if not nxt:
            await self.d.client.clear(p.stored)
            self.report.discarded += 1
            return
        moved = await self.d.client.rollouts.postpone(p.stored, nxt)
        self.d._partials.append(dataclasses.replace(p, meta=moved))
        self.report.recycled += 1

    async def recycle_target(self) -> str:
        for part in (await self.d.client.status()).partitions:
            if part.name == self.partition:
                return part.recycle_to
        return ""

    def fate(self, meta: Meta, p: _Partial) -> None:
        traj = p.trajectory
        status = meta.fates[0] if meta.status == "trimmed" and meta.fates else meta.status
        if status == "ok":
            self.report.stored += 1
            self.report.versions[traj.version] = self.report.versions.get(traj.version, 0) + 1
        elif status == "recycled":
            self.d._partials.append(p)
            self.report.recycled += 1
        else:
            self.report.discarded += 1

    def error(self) -> EngineError:
        """What ``step`` raises after a failure, with the report."""
        r = self.report
        err = EngineError(
            f"step {self.partition!r}: {r.failed} of {r.requests} requests failed (first: {self.failures[0]}); "
            f"{r.stored} stored, {r.aborted} aborted, {r.retried} retries; the failed members were reported to "
            f"their groups, and a rerun of the step sends only what it is not done with"
        )
        err.report = r
        return err


def _closed_turns(traj: Trajectory, finished: bool) -> int:
    """The turns of ``traj`` that are whole: every one but an assistant turn an abort cut
    short, which the call that resumes it continues (all of them once it is finished)."""
    spans = traj.turn_spans or []
    if not finished and spans and spans[-1][0] == ASSISTANT and traj.finish == "abort":
        return len(spans) - 1
    return len(spans)


def _spans(spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    return torch.tensor(list(spans), dtype=torch.int64).reshape(-1, 3)


async def _called(tool: Tool, group: GroupId, traj: Trajectory) -> Any:
    out = tool(group, traj)
    return await out if inspect.isawaitable(out) else out


def _token(t: Any) -> int:
    value = operator.index(t)  # an int, a numpy or 0-d tensor integer; not a float
    if value < 0:
        raise InvalidArgumentError(f"a tool turn's token is an id >= 0, got {value}")
    return value
