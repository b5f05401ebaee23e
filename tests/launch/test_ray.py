"""Launch on Ray (the integration tier: the ``ray`` extra). A real local Ray cluster of two
logical nodes on this machine (custom resources tell them apart); the controller and units
become actors placed as asked; a client outside Ray uses the address."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tqueue.ray

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]

OUTSIDE = """
import sys, torch, tqueue
with tqueue.Client(sys.argv[1]) as c:
    meta = c.put("from-outside", {"x": torch.arange(6)})
    batch = c.get_data("from-outside", ["x"], 6, task="t", timeout=30)
    print(sorted(set(meta.units)), batch["x"].tolist())
"""


@pytest.fixture(scope="module")
def ray_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1, "tq": 1}})
    cluster.add_node(num_cpus=1, resources={"tq": 1, "second": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_units_round_robin_over_filtered_nodes_and_a_client_outside_ray(ray_nodes):
    _, nodes = ray_nodes
    head = next(n for n, r in nodes.items() if "head" in r)
    second = next(n for n, r in nodes.items() if "second" in r)
    cluster = tqueue.ray.start(2, resources={"tq": 1}, controller_resources={"head": 0.01}, bind_host="127.0.0.1",
                               name="rr")
    try:
        assert cluster.controller["node"] == head  # where its resources are
        assert sorted(u["node"] for u in cluster.units) == sorted([head, second])  # one per filtered node
        out = subprocess.run([sys.executable, "-c", OUTSIDE, cluster.address], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().endswith("[0, 1, 2, 3, 4, 5]")
        pids = [cluster.controller["pid"]] + [u["pid"] for u in cluster.units]
        assert all(alive(p) for p in pids)
    finally:
        cluster.stop()
    assert not any(alive(p) for p in pids)  # the servers stopped with their actors


def test_units_go_into_the_bundles_of_a_placement_group(ray_nodes):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pg = placement_group([{"tq": 0.1}, {"tq": 0.1}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    try:
        with tqueue.ray.start(2, placement_group=pg, bind_host="127.0.0.1", name="pg") as cluster:
            bundles = placement_group_table(pg)["bundles_to_node_id"]
            assert [u["node"] for u in cluster.units] == [bundles[0], bundles[1]]
            with tqueue.Client(cluster.address) as c:
                assert len({u.unit_id for u in c.status().units}) == 2
    finally:
        remove_placement_group(pg)


def test_every_process_of_the_job_finds_the_cluster_by_name(ray_nodes):
    """A task of the job connects with no address (it may start before the cluster: it waits);
    a second cluster of the same name is refused; once stopped, a look-up says where it looked."""
    import ray

    @ray.remote(num_cpus=0)
    def put_from_a_task(name: str) -> list[int]:
        import torch

        import tqueue.ray as tr

        with tr.connect(name=name, timeout=60) as c:
            c.put("by-name", {"x": torch.arange(3)})
            return c.get_data("by-name", ["x"], 3, task="t", timeout=30)["x"].tolist()

    early = put_from_a_task.remote("found")  # asks before the cluster is there
    with tqueue.ray.start(1, bind_host="127.0.0.1", name="found") as cluster:
        assert ray.get(early, timeout=120) == [0, 1, 2]
        assert tqueue.ray.address(name="found") == cluster.address
        with pytest.raises(ValueError, match="a tqueue cluster named 'found' is registered for this Ray job already"):
            tqueue.ray.start(1, bind_host="127.0.0.1", name="found")
    with pytest.raises(tqueue.DiscoveryError, match=r"looked for the Ray actor 'found\.[0-9a-f]+' in namespace 'tqueue' for 0\.2 s"):
        tqueue.ray.address(name="found", timeout=0.2)
