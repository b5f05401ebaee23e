"""The batch every system moves: the same bytes, generated the same way in every process.

Per sample: ``input_ids``, ``attention_mask``, ``position_ids`` int64 [4096]; ``responses``
int64 [2048]; ``old_log_probs`` and ``advantages`` float32 [2048]; a ~2 KB prompt string;
a metadata dict. About 133 KB per sample (136 MB at 1024 samples). The multimodal variant
adds ``pixel_values``: one uint8 image [3, h, w] per sample, h and w from 112 to 448.
"""

from __future__ import annotations

from typing import Any

import torch

SEQ = 4096
RESP = 2048
TENSOR_FIELDS = ["input_ids", "attention_mask", "position_ids", "responses", "old_log_probs", "advantages"]
OBJECT_FIELDS = ["prompt", "meta"]
IMAGE_FIELD = "pixel_values"


def fields(multimodal: bool = False) -> list[str]:
    return TENSOR_FIELDS + OBJECT_FIELDS + ([IMAGE_FIELD] if multimodal else [])


def make_batch(size: int, *, multimodal: bool = False, seed: int = 0, start: int = 0) -> dict[str, Any]:
    """``size`` samples numbered from ``start`` (so streamed groups differ)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + start)
    ids = torch.randint(0, 151_936, (size, SEQ), generator=g)
    mask = torch.ones(size, SEQ, dtype=torch.int64)
    pos = torch.arange(SEQ, dtype=torch.int64).expand(size, SEQ).contiguous()
    batch: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": pos,
        "responses": ids[:, SEQ - RESP :].clone(),
        "old_log_probs": -torch.rand(size, RESP, generator=g),
        "advantages": torch.randn(size, RESP, generator=g),
        "prompt": [f"sample {start + i}: " + "Solve the following problem step by step. " * 48 for i in range(size)],
        "meta": [{"uid": f"p{(start + i) // 8}", "index": start + i, "finish_reason": "stop", "weight_version": 3} for i in range(size)],
    }
    if multimodal:
        sides = torch.randint(8, 33, (size, 2), generator=g) * 14
        batch[IMAGE_FIELD] = [torch.randint(0, 256, (3, int(h), int(w)), dtype=torch.uint8, generator=g) for h, w in sides.tolist()]
    return batch


def nbytes(batch: dict[str, Any]) -> int:
    """Payload bytes: tensor storage plus UTF-8 prompt text plus a rough size for the dicts."""
    total = 0
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif name == "prompt":
            total += sum(len(s.encode()) for s in value)
        elif name == "meta":
            total += 64 * len(value)
        else:
            total += sum(t.numel() * t.element_size() for t in value)
    return total


def select(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Samples ``[start, stop)`` as views (tensors) and list slices."""
    return {k: v[start:stop] for k, v in batch.items()}


def verify(batch: Any, start: int, stop: int, *, multimodal: bool = False) -> None:
    """Cheap proof (outside timing) that a consumer holds samples ``[start, stop)`` in order."""
    n = stop - start
    meta = list(batch["meta"])
    if len(meta) != n or [m["index"] for m in meta] != list(range(start, stop)):
        raise AssertionError(f"expected samples {start}..{stop - 1}, got {[m['index'] for m in meta][:5]}...")
    ids = batch["input_ids"]
    if tuple(ids.shape) != (n, SEQ) or not bool((batch["position_ids"][:, -1] == SEQ - 1).all()):
        raise AssertionError("input_ids / position_ids do not have the expected shape and content")
    if not str(batch["prompt"][0]).startswith(f"sample {start}:"):
        raise AssertionError("prompts out of order")
    if multimodal and len(batch[IMAGE_FIELD]) != n:
        raise AssertionError("images missing")
