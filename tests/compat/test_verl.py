"""verl 0.9.1's own TransferQueue client code, run unchanged on the shim as verl deploys it.

The ``verl`` wheel is downloaded at test time (``pip download --no-deps verl==0.9.1``, cached
beside TransferQueue's under ``$TQUEUE_COMPAT_CACHE``) and unpacked; nothing of it is in this
repository. A TaskRunner actor calls ``tq.init(conf)`` and writes prompts with
``kv_batch_put``; a worker actor whose method carries verl's ``tqbridge`` decorator
(``verl/utils/transferqueue_utils.py``) gets a ``KVBatchMeta`` through Ray, calls ``tq.init()``
with no config (it finds the cluster through the Ray job's named actor), reads the fields,
computes, and writes its output back; the TaskRunner reads the output by key. Each actor is a
process of its own with the raylet's environment. Needs the shim, Ray and verl's imports
(transformers: the vllm extra brings it), hence the integration tier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")
pytest.importorskip("transformers", reason="verl's modules import transformers (the vllm extra brings it)")

VERL = "0.9.1"


def _verl_root(tmp: Path) -> Path:
    cache = Path(os.environ.get("TQUEUE_COMPAT_CACHE") or Path.home() / ".cache" / "tqueue-compat")
    wheel = cache / f"verl-{VERL}-py3-none-any.whl"
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"verl=={VERL}", "-d", str(cache)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not wheel.exists():
            pytest.skip(f"cannot download verl {VERL} ({' '.join(cmd)}): {done.stderr.strip()[-500:]}")
    root = tmp / "verl"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(root, [m for m in whl.namelist() if m.startswith("verl/")])
    return root


@pytest.fixture(scope="module")
def verl_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = _verl_root(tmp_path_factory.mktemp("verl"))
    saved = os.environ.pop("TQUEUE_ADDRESS", None)
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=4,
             runtime_env={"env_vars": {"PYTHONPATH": str(root), "TQUEUE_DISCOVERY_TIMEOUT": "60"}})
    try:
        yield str(root)
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["TQUEUE_ADDRESS"] = saved


@ray.remote(num_cpus=0)
class TaskRunner:
    def init(self) -> None:
        import transfer_queue as tq

        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})

    def put_prompts(self, keys: list[str]) -> Any:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        ids = torch.nested.as_nested_tensor([torch.arange(n + 1) for n in range(len(keys))], layout=torch.jagged)
        tags = [{"status": "pending", "global_steps": 1} for _ in keys]
        return tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"input_ids": ids}, batch_size=[len(keys)]),
                               tags=tags)

    def read(self, keys: list[str]) -> tuple[list[float], dict[str, Any]]:
        import transfer_queue as tq

        td = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["score"])
        return td["score"].view(-1).tolist(), tq.kv_list("train")["train"]

    def close(self) -> None:
        import transfer_queue as tq

        tq.close()


@ray.remote(num_cpus=0)
class RewardWorker:
    """A verl worker: its method takes a TensorDict; verl's tqbridge gives it one from a meta."""

    def __init__(self) -> None:
        from verl.utils.transferqueue_utils import tqbridge

        @tqbridge()
        def compute_score(data: Any) -> Any:
            import torch
            from tensordict import TensorDict

            ids = data["input_ids"]
            lengths = [float(len(t)) for t in ids.unbind()]
            return TensorDict({"score": torch.tensor(lengths)}, batch_size=[len(lengths)])

        self.compute_score = compute_score

    def env(self) -> str | None:
        return os.environ.get("TQUEUE_ADDRESS")

    def run(self, meta: Any) -> Any:
        return self.compute_score(meta)


def test_verls_tqbridge_worker_reads_and_writes_through_the_shim(verl_ray: str) -> None:
    runner = TaskRunner.remote()
    worker = RewardWorker.remote()
    try:
        ray.get(runner.init.remote(), timeout=120)
        assert ray.get(worker.env.remote(), timeout=60) is None  # no address in its environment
        keys = ["uid0_0", "uid0_1", "uid1_0"]
        meta = ray.get(runner.put_prompts.remote(keys), timeout=60)
        out = ray.get(worker.run.remote(meta), timeout=180)  # a KVBatchMeta through Ray, both ways
        assert list(out.keys) == keys and "score" in out.fields
        scores, tags = ray.get(runner.read.remote(keys), timeout=60)
        assert scores == [1.0, 2.0, 3.0]
        assert tags["uid0_0"] == {"status": "pending", "global_steps": 1}
    finally:
        ray.get(runner.close.remote(), timeout=60)
        ray.kill(worker)
        ray.kill(runner)
