"""The standard rollout fields: what every producer bridge writes, and every consumer reads.

One trajectory is one sample. Sequence-aligned fields count in one of two coordinates, said
per field below: *response* coordinates (index 0 is the first generated token) or *sequence*
coordinates (index 0 is the first prompt token; the response starts at ``len(prompt_ids)``).

================== ========= ================================ ===========================
field              dtype     shape per sample                 coordinates
================== ========= ================================ ===========================
``prompt_ids``     int64     ``[P]``                          sequence (the prompt)
``response_ids``   int64     ``[R]``                          response
``response_logprobs`` float32 ``[R]``                         response: the sampling
                                                              log-prob of each token
``loss_mask``      int8      ``[R]``                          response: 1 = trained on
``finish``         str       one of :data:`FINISHES`          --
``version_spans``  int64     ``[k, 3]``: (version, start,     response: ``[start, end)``
                             end)                             generated under ``version``
``routed_experts`` as given  ``[P + R - 1, layers, top_k]``   sequence: row i routed the
                   (int32                                     token at position i (the
                   SGLang,                                    last token routes nothing
                   uint8/16                                   that is kept)
                   vLLM)
``turn_spans``     int64     ``[t, 3]``: (kind, start, end)   response: turn ``[start,
                                                              end)``, kind
                                                              :data:`ASSISTANT` or
                                                              :data:`TOOL` (multi-turn only)
================== ========= ================================ ===========================

A multi-turn trajectory (an agent: :class:`Trajectory` made with ``turn_spans=[]``) holds
assistant turns, the engine's tokens (loss mask 1, their log-probs and version spans), and
tool turns, tokens inserted by the agent between them (loss mask 0, log-prob 0.0, no version
span). An assistant turn continued after an abort stays one turn; its version spans say
which weights produced which of its tokens.

The rollout driver splices ``routed_experts`` with ``complete(splice=...)``, and the controller
keeps, for each of the sample's version segments, the first row of ``routed_experts`` that the
segment's engine call computed (``meta.splices``): ``Batch.token_versions`` reads it to give
each row its version.

The group id travels as the put's ``groups``; the oldest span's version as its ``version`` (what
staleness admission counts). Other fields (``reward``, metadata) go alongside under their own
names. A trajectory continued after an abort (a partial rollout resumed) appends its new tokens,
log-probs, mask and spans, and *splices* its routed experts: the resumed call recomputes rows
from the point it was asked to start at, so those rows replace the old ones from there on
(concatenating them would misalign every later row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, SchemaError

FINISHES = ("stop", "length", "abort", "error")
FIELDS = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "finish", "version_spans", "routed_experts")
#: the kinds of ``turn_spans``: the engine's tokens, and tokens an agent inserted between them
ASSISTANT, TOOL = 0, 1


@dataclasses.dataclass
class Trajectory:
    """One rollout, built from one engine call and extended by the calls that resume it."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    response_logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    finish: str = "abort"
    version_spans: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None  # [rows, layers, top_k], rows from sequence position 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: (kind, start, end) per turn, in response coordinates; None: a single-turn trajectory
    turn_spans: list[tuple[int, int, int]] | None = None

    @property
    def length(self) -> int:
        """Prompt and response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def experts_start(self) -> int:
        """The row a continuing call asks routed experts from: the rows held so far (every
        position but the last, once a call has returned them; 0 before)."""
        return 0 if self.routed_experts is None else int(self.routed_experts.shape[0])

    @property
    def tool_tokens(self) -> int:
        """Response tokens inserted by tool turns (the rest came from the engine)."""
        return sum(end - start for kind, start, end in self.turn_spans or () if kind == TOOL)

    @property
    def generated(self) -> int:
        """Response tokens the engine generated (assistant turns)."""
        return len(self.response_ids) - self.tool_tokens

    @property
    def turns(self) -> int:
        """Assistant turns begun (0 for a single-turn trajectory)."""
        return sum(1 for kind, _, _ in self.turn_spans or () if kind == ASSISTANT)

    @property
    def version(self) -> int:
        """The oldest weight version that produced any of its tokens (-1: none known)."""
        return min((v for v, _, _ in self.version_spans), default=-1)

    def append(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        finish: str,
        spans: Sequence[tuple[int, int, int]],
        experts: np.ndarray | None = None,
        experts_start: int = 0,
    ) -> None:
        """Add one engine call's output. ``spans`` count from this call's first token;
        ``experts`` are its routed-expert rows from sequence position ``experts_start``."""
        if len(logprobs) != len(ids):
            raise SchemaError(f"{len(logprobs)} log-probs for {len(ids)} generated tokens")
        if finish not in FINISHES:
            raise InvalidArgumentError(f"finish is one of {list(FINISHES)}, got {finish!r}")
        offset = len(self.response_ids)
        for version, start, end in spans:
            if not 0 <= start <= end <= len(ids):
                raise SchemaError(f"weight-version span [{start}, {end}) lies outside the call's {len(ids)} tokens")
            self.version_spans.append((int(version), offset + start, offset + end))
        self.response_ids += [int(t) for t in ids]
        self.response_logprobs += [float(x) for x in logprobs]
        self.loss_mask += [1] * len(ids)
        self.finish = finish
        if self.turn_spans is not None:  # an assistant turn: a new one, or the one an abort cut short, continued
            if self.turn_spans and self.turn_spans[-1][0] == ASSISTANT:
                self.turn_spans[-1] = (ASSISTANT, self.turn_spans[-1][1], len(self.response_ids))
            else:
                self.turn_spans.append((ASSISTANT, offset, len(self.response_ids)))
        if experts is not None:
            self.splice_experts(experts, experts_start)

    def add_tool(self, ids: Sequence[int]) -> None:
        """Insert a tool turn: ``ids`` with loss mask 0 and log-prob 0.0, under no version span.
        The next engine call continues after them (and computes their routed-expert rows)."""
        if self.turn_spans is None:
            raise InvalidArgumentError("a tool turn goes into a multi-turn trajectory: Trajectory(..., turn_spans=[])")
        tokens = [int(t) for t in ids]
        start = len(self.response_ids)
        self.response_ids += tokens
        self.response_logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.turn_spans.append((TOOL, start, len(self.response_ids)))

    @property
    def awaits_engine(self) -> bool:
        """Its last call was cut short, or a tool turn awaits the assistant's answer."""
        return self.finish == "abort" or bool(self.turn_spans and self.turn_spans[-1][0] == TOOL)

    def splice_experts(self, rows: np.ndarray, start: int) -> None:
        """Routed-expert rows of one call, covering sequence positions ``[start, length - 1)``:
        they replace what was held from ``start`` on."""
        want = self.length - 1 - start
        if rows.ndim != 3 or rows.shape[0] != want:
            raise SchemaError(
                f"routed experts of shape {tuple(rows.shape)}: expected {want} rows (positions {start} to "
                f"{self.length - 2}) of [layers, top_k]"
            )
        held = self.routed_experts
        if start == 0 or held is None:
            if start != 0:
                raise SchemaError(f"routed experts start at row {start} but none are held before it")
            self.routed_experts = rows.copy()
            return
        if held.shape[0] < start or held.shape[1:] != rows.shape[1:] or held.dtype != rows.dtype:
            raise SchemaError(
                f"routed experts from row {start} of {tuple(rows.shape[1:])} {rows.dtype} cannot follow "
                f"{held.shape[0]} held rows of {tuple(held.shape[1:])} {held.dtype}"
            )
        self.routed_experts = np.concatenate([held[:start], rows])

    def fields(self) -> dict[str, Any]:
        """The sample, as one ``put`` takes it (a mapping of field name to value)."""
        out: dict[str, Any] = {
            "prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.int64),
            "response_ids": torch.tensor(self.response_ids, dtype=torch.int64),
            "response_logprobs": torch.tensor(self.response_logprobs, dtype=torch.float32),
            "loss_mask": torch.tensor(self.loss_mask, dtype=torch.int8),
            "finish": self.finish,
            "version_spans": torch.tensor(self.version_spans, dtype=torch.int64).reshape(-1, 3),
        }
        if self.routed_experts is not None:
            out["routed_experts"] = torch.from_numpy(np.ascontiguousarray(self.routed_experts))
        if self.turn_spans is not None:
            out["turn_spans"] = torch.tensor(self.turn_spans, dtype=torch.int64).reshape(-1, 3)
        out.update(self.extra)
        return out
