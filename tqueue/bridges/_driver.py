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

Engines implement :class:`Engine`; the SGLang and vLLM bridges provide them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..errors import InvalidArgumentError, PartitionClearedError
from ..wire import BatchMeta, GroupId
from ._fields import Trajectory

if TYPE_CHECKING:
    from ..client import AsyncClient

#: the fields ``complete`` appends when a partial rollout is resumed
APPENDED = ("response_ids", "response_logprobs", "loss_mask", "version_spans")


class Engine(Protocol):
    """What the driver needs of an inference engine."""

    async def generate(self, rid: str, trajectory: Trajectory, max_new_tokens: int) -> None:
        """Continue ``trajectory`` (its prompt and response so far are the input) by at most
        ``max_new_tokens``, and append the call's output to it when the call ends, finished
        or aborted. Routed experts, if any, are asked for from row
        ``trajectory.experts_start`` and spliced there."""
        ...

    async def abort(self, rids: Sequence[str]) -> None:
        """Abort these requests; their ``generate`` calls end with what they have."""
        ...

    async def set_version(self, version: int) -> None:
        """The engine now runs weights of trainer step ``version``."""
        ...


@dataclasses.dataclass
class StepReport:
    """What one step did. ``stored``: trajectories put and kept (finished, or resumed and
    finished); ``aborted``: calls cut short on the engine because the step sealed;
    ``recycled``: of those, kept as partial rollouts in the next partition; ``discarded``:
    put after the seal with nowhere to go; ``resumed``: partial rollouts of earlier steps
    continued here; ``abort_seconds``: from the seal until the last aborted call ended."""

    partition: str
    requests: int = 0
    stored: int = 0
    aborted: int = 0
    recycled: int = 0
    discarded: int = 0
    resumed: int = 0
    sealed: bool = False
    abort_seconds: float | None = None
    versions: dict[int, int] = dataclasses.field(default_factory=dict)  # oldest version -> stored samples


@dataclasses.dataclass
class _Partial:
    meta: BatchMeta
    trajectory: Trajectory
    group: GroupId
    budget: int  # max_new_tokens of the whole trajectory


class Rollouts:
    """Drive ``engine`` through steps, storing with ``client``.

    ``max_new_tokens``: the budget of one trajectory, resumes included. ``retries``: how
    often a call the engine aborted on its own (not the driver, at a seal) is continued
    before the trajectory is stored as it is (``finish="abort"``). ``extra(group, prompt_ids,
    trajectory)``, if given, returns more fields for each finished sample (a reward, say).
    """

    def __init__(
        self,
        client: AsyncClient,
        engine: Engine,
        *,
        max_new_tokens: int,
        retries: int = 2,
        extra: Any = None,
    ) -> None:
        if max_new_tokens <= 0:
            raise InvalidArgumentError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.client = client
        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.retries = retries
        self.extra = extra
        self.version = 0
        self._partials: list[_Partial] = []
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
        call has ended and every trajectory has its fate."""
        if groups is not None and len(groups) != len(prompts):
            raise InvalidArgumentError(f"{len(groups)} groups for {len(prompts)} prompts")
        if max_new_tokens is not None and len(max_new_tokens) != len(prompts):
            raise InvalidArgumentError(f"{len(max_new_tokens)} token budgets for {len(prompts)} prompts")
        report = StepReport(partition=partition)
        step = _Step(self, partition, report)
        resumes = [p for p in self._partials if p.meta.partition == partition]
        self._partials = [p for p in self._partials if p.meta.partition != partition]
        calls = [step.resume(p) for p in resumes]
        for i, prompt in enumerate(prompts):
            group = groups[i] if groups is not None else f"{partition}/{i}"
            budget = max_new_tokens[i] if max_new_tokens is not None else self.max_new_tokens
            calls += [step.fresh([int(t) for t in prompt], group, budget) for _ in range(n)]
        report.requests = len(calls)
        watch = asyncio.ensure_future(step.watch())
        try:
            await asyncio.gather(*calls)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        return report

    def rid(self) -> str:
        return f"tq-{self._prefix}-{next(self._rids)}"


class _Step:
    """One step's calls, the seal watch and the abort of the surplus."""

    def __init__(self, driver: Rollouts, partition: str, report: StepReport) -> None:
        self.d = driver
        self.partition = partition
        self.report = report
        self.running: set[str] = set()
        self.sealed_at: float | None = None

    async def watch(self) -> None:
        """Park on the partition's seal; then abort what is still running."""
        try:
            await self.d.client.sealed(self.partition, timeout=math.inf)
        except PartitionClearedError:
            return
        self.sealed_at = time.monotonic()
        self.report.sealed = True
        if self.running:
            await self.d.engine.abort(sorted(self.running))

    async def call(self, traj: Trajectory, budget: int) -> None:
        """Engine calls on ``traj`` until it ends: continues the calls the engine aborted by
        itself (not at a seal), ``retries`` times at most."""
        for _ in range(self.d.retries + 1):
            if self.sealed_at is not None:  # sealed before it started: nothing to run
                return
            rid = self.d.rid()
            self.running.add(rid)
            try:
                await self.d.engine.generate(rid, traj, budget - len(traj.response_ids))
            finally:
                self.running.discard(rid)
            if traj.finish != "abort":
                return

    def ended(self, traj: Trajectory) -> None:
        if traj.finish == "abort" and self.sealed_at is not None:
            self.report.aborted += 1
            took = time.monotonic() - self.sealed_at
            self.report.abort_seconds = max(self.report.abort_seconds or 0.0, took)

    async def fresh(self, prompt: list[int], group: GroupId, budget: int) -> None:
        traj = Trajectory(prompt_ids=prompt)
        await self.call(traj, budget)
        self.ended(traj)
        fields = traj.fields()
        if self.d.extra is not None and traj.finish != "abort":
            fields.update(self.d.extra(group, prompt, traj))
        version = traj.version if traj.version >= 0 else self.d.version
        meta = await self.d.client.put(self.partition, [fields], groups=[group], version=version)
        self.fate(meta, _Partial(meta, traj, group, budget))

    async def resume(self, p: _Partial) -> None:
        traj = p.trajectory
        before, spans_before = len(traj.response_ids), len(traj.version_spans)
        held = traj.routed_experts is not None
        start = traj.experts_start  # the first routed-experts row the resumed call computes
        self.report.resumed += 1
        if traj.finish == "abort":
            await self.call(traj, p.budget)
            self.ended(traj)
        spans = traj.version_spans[spans_before:]
        version = min((v for v, _, _ in spans), default=self.d.version)
        data: dict[str, Any] = {
            "response_ids": torch.tensor(traj.response_ids[before:], dtype=torch.int64),
            "response_logprobs": torch.tensor(traj.response_logprobs[before:], dtype=torch.float32),
            "loss_mask": torch.tensor(traj.loss_mask[before:], dtype=torch.int8),
            "version_spans": torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
            "finish": traj.finish,
        }
        splice, lengths = None, None
        if traj.routed_experts is not None:
            data["routed_experts"] = torch.from_numpy(np.ascontiguousarray(traj.routed_experts))
            if held:
                splice, lengths = {"routed_experts": start}, [traj.length - 1]
        finished = traj.finish != "abort"
        if finished and self.d.extra is not None:
            data.update(self.d.extra(p.group, traj.prompt_ids, traj))
        columns = {name: [value] for name, value in data.items()}
        refused = await self.d.client.complete(
            p.meta, columns, version=version, first_token=before, append=APPENDED, splice=splice, lengths=lengths,
            finished=finished,
        )
        if refused:  # the step's target filled first: keep the tokens, still partial, for the next step
            finished = False
            await self.d.client.complete(
                p.meta, columns, version=version, first_token=before, append=APPENDED, splice=splice, lengths=lengths,
                finished=False,
            )
        if finished:
            self.report.stored += 1
            self.report.versions[traj.version] = self.report.versions.get(traj.version, 0) + 1
            return
        # aborted again, or finished too late: on to the partition this one recycles into, still partial
        nxt = await self.recycle_target()
        if not nxt:
            await self.d.client.clear(p.meta)
            self.report.discarded += 1
            return
        moved = await self.d.client.postpone(p.meta, nxt)
        self.d._partials.append(dataclasses.replace(p, meta=moved))
        self.report.recycled += 1

    async def recycle_target(self) -> str:
        for part in (await self.d.client.status()).partitions:
            if part.name == self.partition:
                return part.recycle_to
        return ""

    def fate(self, meta: BatchMeta, p: _Partial) -> None:
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
