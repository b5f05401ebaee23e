"""TransferQueue 0.1.11's own tests and tutorials, run against the transfer_queue shim
(compat/transferqueue) on loopback. What runs and what is expected is in _tier.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.compat import _tier

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
WHEEL = f"transferqueue-{_tier.VERSION}-py3-none-any.whl"


def _cache() -> Path:
    return Path(os.environ.get("TQUEUE_COMPAT_CACHE") or Path.home() / ".cache" / "tqueue-compat")


def _wheel() -> Path:
    cache = _cache()
    wheel = cache / WHEEL
    if wheel.exists():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"transferqueue=={_tier.VERSION}", "-d", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not wheel.exists():
        pytest.skip(f"cannot download TransferQueue {_tier.VERSION} ({' '.join(cmd)}): {done.stderr.strip()[-500:]}")
    return wheel


@pytest.fixture(scope="module")
def tq_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TransferQueue's tests/, tutorial/ and recipe/, unpacked without its transfer_queue package."""
    import transfer_queue

    if getattr(transfer_queue, "BACKEND", "") != "tqueue":
        pytest.fail(
            f"import transfer_queue found {transfer_queue.__file__}, not the tqueue shim: "
            "pip uninstall transferqueue; pip install -e compat/transferqueue"
        )
    root = tmp_path_factory.mktemp("transferqueue")
    with zipfile.ZipFile(_wheel()) as wheel:
        members = [m for m in wheel.namelist() if m.startswith(("tests/", "tutorial/", "recipe/"))]
        wheel.extractall(root, members)
    (root / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(HERE / "tq_conftest.py", root / "tests" / "conftest.py")
    yield root


def _run(root: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TQUEUE_ADDRESS")}
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _outcomes(report: Path) -> dict[str, str]:
    """test id (file::class::name) -> passed / failed / skipped, from a JUnit XML report."""
    out = {}
    for case in ElementTree.parse(report).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        parts = path.split("/")
        # classname is tests.test_x.TestClass (or tests.test_x): split the file from the class
        for cut in range(len(parts), 0, -1):
            if parts[cut - 1].startswith("test_"):
                file, cls = "/".join(parts[:cut]) + ".py", parts[cut:]
                break
        test_id = "::".join([file, *cls, case.get("name", "")])
        kinds = {child.tag for child in case}
        out[test_id] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def test_transferqueue_tests(tq_files: Path) -> None:
    """TransferQueue's unit and e2e tests: every one passes but those listed in _tier.py, each
    of which must fail (so the lists stay true)."""
    pytest.importorskip("ray", reason="TransferQueue's e2e tests import ray (the ray extra)")
    report = tq_files / "report.xml"
    done = _run(tq_files, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *_tier.TEST_FILES, timeout=850)
    outcomes = _outcomes(report)
    failed = {t for t, o in outcomes.items() if o == "failed"}
    expected = set(_tier.NOT_APPLICABLE) | set(_tier.NOT_YET)
    assert not failed - expected, f"failing: {sorted(failed - expected)}\n{done.stdout[-6000:]}"
    assert not expected - failed, f"these pass now, take them off _tier.py's lists: {sorted(expected - failed)}"
    assert sum(o == "passed" for o in outcomes.values()) >= 190, done.stdout[-3000:]  # 121 unit, 56 KV, 8 checkpoint, 5 lifecycle


def _script_ok(root: Path, script: str) -> None:
    done = _run(root, str(HERE / "run_script.py"), script, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Error during tutorial" not in output, output[-4000:]


@pytest.mark.parametrize("script", _tier.TUTORIALS_PASSING, ids=lambda s: Path(s).stem)
def test_tutorial_runs(tq_files: Path, script: str) -> None:
    pytest.importorskip("ray", reason="TransferQueue's tutorials import ray (the ray extra)")
    _script_ok(tq_files, script)


@pytest.mark.parametrize(
    "script",
    [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=why)) for p, why in _tier.TUTORIALS_NOT_YET.items()],
    ids=lambda p: Path(p).stem,
)
def test_tutorial_not_yet(tq_files: Path, script: str) -> None:
    """Tutorials that need what issue 27 has yet to add: each still fails (strict)."""
    pytest.importorskip("ray", reason="TransferQueue's tutorials import ray (the ray extra)")
    _script_ok(tq_files, script)
