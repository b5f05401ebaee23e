"""The shim on Ray as verl deploys it: a TaskRunner actor calls ``tq.init(conf)``, worker
actors call ``tq.init()`` and put, the TaskRunner reads. Each actor is a process of its own
with the raylet's environment (no ``TQUEUE_ADDRESS``), on a real local Ray cluster pinned to
127.0.0.1; a second job on the same Ray cluster is a second driver process.
Needs the shim and the ray extra, hence the integration tier."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

CONF = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    saved = os.environ.pop("TQUEUE_ADDRESS", None)
    os.environ["TQUEUE_DISCOVERY_TIMEOUT"] = "20"  # the raylet's environment, so every worker's
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False, num_cpus=4)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        del os.environ["TQUEUE_DISCOVERY_TIMEOUT"]
        if saved is not None:
            os.environ["TQUEUE_ADDRESS"] = saved


@ray.remote(num_cpus=0)
class TaskRunner:
    """verl's TaskRunner: starts the data plane with the job's config, reads what workers put."""

    def init(self, conf: dict[str, Any]) -> str:
        import transfer_queue

        return str(transfer_queue.init(conf).controller.zmq_info)

    def read(self, keys: list[str], partition: str) -> list[int]:
        import transfer_queue

        x = transfer_queue.kv_batch_get(keys, partition, ["x"])["x"]  # nested, as TransferQueue packs it
        return (x.values() if x.is_nested else x).view(-1).tolist()

    def close(self) -> None:
        import transfer_queue

        transfer_queue.close()


@ray.remote(num_cpus=0)
class Worker:
    """verl's AgentLoopWorkerTQ: ``tq.init()`` with no config, then puts."""

    def init(self) -> str:
        import transfer_queue

        return str(transfer_queue.init().controller.zmq_info)

    def env(self) -> str | None:
        return os.environ.get("TQUEUE_ADDRESS")

    def put(self, keys: list[str], partition: str, values: list[int]) -> None:
        import torch
        import transfer_queue
        from tensordict import TensorDict

        fields = TensorDict({"x": torch.tensor(values).view(-1, 1)}, batch_size=[len(values)])
        transfer_queue.kv_batch_put(keys, partition, fields)

    def close(self) -> None:
        import transfer_queue

        transfer_queue.close()


def test_workers_find_the_task_runners_cluster_without_an_address(ray_cluster: str) -> None:
    runner = TaskRunner.remote()
    worker = Worker.remote()  # started before the cluster exists: its init waits for it
    try:
        assert ray.get(worker.env.remote()) is None  # nothing reached it through the environment
        waiting = worker.init.remote()
        address = ray.get(runner.init.remote(CONF), timeout=120)
        assert address.startswith("tcp://127.0.0.1:")  # the Ray node's address (pinned to loopback here)
        assert ray.get(waiting, timeout=60) == address
        ray.get(worker.put.remote(["a", "b"], "train", [3, 4]), timeout=60)
        assert ray.get(runner.read.remote(["a", "b"], "train"), timeout=60) == [3, 4]
        # TransferQueue's name answers get_config as TransferQueue's does (tutorial 06 reads it)
        actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        assert ray.get(actor.get_config.remote()).controller.zmq_info == address
        # the actor killed while clients run: they keep working by address
        ray.kill(actor)
        ray.get(worker.put.remote(["c"], "train", [5]), timeout=60)
        assert ray.get(runner.read.remote(["c"], "train"), timeout=60) == [5]
    finally:
        ray.get([worker.close.remote(), runner.close.remote()], timeout=60)
        ray.kill(worker)
        ray.kill(runner)


def test_a_worker_that_finds_no_cluster_says_where_it_looked(ray_cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker.options(runtime_env={"env_vars": {"TQUEUE_DISCOVERY_TIMEOUT": "0.5"}}).remote()
    try:
        with pytest.raises(Exception, match=r"no cluster is registered for Ray job .*TransferQueueController.* in namespace "
                                            r"'transfer_queue' for 0.5 s") as info:
            ray.get(worker.init.remote(), timeout=60)
        assert "DiscoveryError" in str(info.value)
    finally:
        ray.kill(worker)


def test_the_cluster_actor_dies_with_the_process_that_started_it(ray_cluster: str) -> None:
    runner = TaskRunner.remote()
    ray.get(runner.init.remote(CONF), timeout=120)
    job = ray.get_runtime_context().get_job_id()
    ray.get_actor(f"TransferQueueController.{job}", namespace="transfer_queue")
    ray.kill(runner)  # SIGKILL of its process: the cluster it started and its actor go with it
    worker = Worker.options(runtime_env={"env_vars": {"TQUEUE_DISCOVERY_TIMEOUT": "30"}}).remote()
    try:
        # the registry is gone once Ray has reaped its owner: a late init waits and then says so
        with pytest.raises(Exception, match="no cluster is registered"):
            ray.get(worker.init.remote(), timeout=90)
    finally:
        ray.kill(worker)


SECOND_JOB = textwrap.dedent("""
    import sys, ray
    ray.init(address=sys.argv[1], log_to_driver=False)

    @ray.remote(num_cpus=0)
    def task(value):
        import transfer_queue as tq
        import torch
        from tensordict import TensorDict
        tq.init()
        tq.kv_batch_put(["k"], "train", TensorDict({"x": torch.tensor([[value]])}, batch_size=[1]))
        return tq.get_client()._client.address

    import transfer_queue as tq
    own = tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}).controller.zmq_info
    seen = ray.get(task.remote(int(sys.argv[2])), timeout=120)
    value = tq.kv_batch_get(["k"], "train", ["x"])["x"].values().item()
    print(own == seen, value, flush=True)
    tq.close()
""")


def test_two_jobs_on_one_ray_cluster_each_find_their_own(ray_cluster: str, tmp_path: Any) -> None:
    runner = TaskRunner.remote()
    try:
        address = ray.get(runner.init.remote(CONF), timeout=120)
        script = tmp_path / "second_job.py"
        script.write_text(SECOND_JOB)
        env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
        done = subprocess.run([sys.executable, str(script), ray_cluster, "7"], capture_output=True, text=True,
                              timeout=240, env=env, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-2:] == ["True", "7"]  # the second job's task put into its own cluster
        # and nothing of it reached this job's
        with pytest.raises(Exception, match="not found"):
            ray.get(runner.read.remote(["k"], "train"), timeout=60)
        assert ray.get(runner.init.remote(CONF), timeout=60) == address
    finally:
        ray.get(runner.close.remote(), timeout=60)
        ray.kill(runner)


def test_two_task_runners_that_start_at_once_end_on_one_cluster(ray_cluster: str) -> None:
    """Both inits start a cluster; the second to register stops its own and attaches to the
    first's, so the job never has two."""
    runners = [TaskRunner.remote(), TaskRunner.remote()]
    worker = Worker.remote()
    try:
        addresses = ray.get([r.init.remote(CONF) for r in runners], timeout=180)
        assert addresses[0] == addresses[1]
        assert ray.get(worker.init.remote(), timeout=60) == addresses[0]
    finally:
        ray.get([worker.close.remote(), *[r.close.remote() for r in runners]], timeout=60)
        for actor in [worker, *runners]:
            ray.kill(actor)
