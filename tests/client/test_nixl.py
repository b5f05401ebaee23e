"""The NIXL route (the ``nixl`` extra) against real units and real NIXL agents: UCX over TCP and
same-host memory reads, here; RDMA needs NICs these machines lack. Each test's client reaches
the units by NIXL only (``shm=False``: no arena maps, ``nixl=True``).

Runs in .ci/run's integration tier, which installs the extra."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
import torch

import tqueue
from tqueue.transport import _nixl

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not _nixl.available(), reason="the nixl extra is not installed (pip install -e '.[nixl]')"),
]

WAIT = 60.0
NIXL = tqueue.ClientConfig(shm=False, nixl="on")


@pytest.fixture
def spy(monkeypatch):
    """Every NIXL transfer this process makes: (op, pieces, bytes)."""
    seen: list[tuple[str, int, int]] = []
    real = _nixl.Agent._transfer

    def transfer(self, op, peer, pieces, local, timeout):
        seen.append((op, len(pieces), sum(n for _, _, n in pieces)))
        return real(self, op, peer, pieces, local, timeout)

    monkeypatch.setattr(_nixl.Agent, "_transfer", transfer)
    return seen


def on_first_post(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> threading.Event:
    """Run ``action`` once, on the agent's thread, as the next transfer is posted and in
    flight; the event says it ran."""
    fired = threading.Event()

    def hook() -> None:
        if not fired.is_set():
            action()
            fired.set()

    monkeypatch.setattr(_nixl, "posted_hook", hook)
    return fired


def batch(n: int, width: int) -> dict:
    return {
        "x": torch.arange(n * width, dtype=torch.float32).reshape(n, width),
        "ids": [torch.arange(i % 7 + 1, dtype=torch.int64) * (i + 1) for i in range(n)],
        "tag": [{"i": i, "s": "r" * (i % 3)} for i in range(n)],
    }


def same(got: tqueue.Batch, want: dict) -> None:
    order = got.meta.indexes
    assert torch.equal(got["x"], want["x"][order])
    assert all(torch.equal(got["ids"][k], want["ids"][i]) for k, i in enumerate(order))
    assert list(got["tag"]) == [want["tag"][i] for i in order]


def test_puts_and_gets_cross_by_nixl_with_exact_bytes_and_small_puts_inline(spy):
    """A put of at least shm_min_bytes is WRITten into the unit's arena, one piece per field; a
    smaller one goes inline. One get of both reads the arena's ranges by one READ and takes
    the inline samples' frames from the reply, every byte exact."""
    with tqueue.LocalCluster(1, storage={"nixl": True}) as cluster, tqueue.Client(cluster.address, config=NIXL) as c:
        big, small = batch(32, 16384), batch(4, 16384)  # 2 MiB, then 256 KiB (under shm_min_bytes)
        c.put("p", big)
        assert [(op, pieces) for op, pieces, _ in spy] == [("WRITE", 3)]
        assert spy[0][2] >= 32 * 16384 * 4
        c.put("p", small)
        assert len(spy) == 1  # inline
        want = {k: big[k] + small[k] if isinstance(big[k], list) else torch.cat([big[k], small[k]]) for k in big}
        same(c.get_data("p", ["x", "ids", "tag"], 36, task="t", timeout=WAIT), want)
        assert [op for op, _, _ in spy] == ["WRITE", "READ"]
        assert spy[1][2] == spy[0][2]  # the arena's samples alone were read


def test_a_round_trip_over_ucx_tcp_alone(spy, monkeypatch):
    """UCX_TLS=tcp: the route's transfers go over TCP sockets (as between hosts without RDMA),
    the bytes exact both ways."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with tqueue.LocalCluster(2, storage={"nixl": True}, env={"UCX_TLS": "tcp"}) as cluster:
        with tqueue.Client(cluster.address, config=NIXL) as c:
            want = batch(64, 8192)
            c.put("p", want)
            same(c.get_data("p", ["x", "ids", "tag"], 64, task="t", timeout=WAIT), want)
            assert {op for op, _, _ in spy} == {"WRITE", "READ"}


def test_a_unit_killed_mid_read_fails_the_get_with_a_typed_error_and_the_client_goes_on(spy, monkeypatch):
    """SIGKILL the unit while a 256 MiB READ of its arena is in flight over TCP: the get fails
    with StorageUnitUnavailableError naming the unit (not a hang), and the same client then
    puts and reads through the other unit, exact."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with tqueue.LocalCluster(2, storage={"nixl": True}, env={"UCX_TLS": "tcp"}) as cluster:
        with tqueue.Client(cluster.address, config=NIXL) as c:
            want = {"x": torch.randn(64, 1 << 20)}  # 256 MiB
            meta = c.put("victim", want)
            (victim,) = set(meta.units)
            address = next(u.address for u in c.status().units if u.unit_id == victim)
            pid = cluster.pids[1 + cluster.unit_addresses.index(address)]
            killed = on_first_post(monkeypatch, lambda: os.kill(pid, signal.SIGKILL))
            with pytest.raises(tqueue.StorageUnitUnavailableError, match=rf"storage unit {victim}\b"):
                c.get_data("victim", ["x"], 64, task="t", timeout=WAIT)
            assert killed.is_set() and spy[-1][0] == "READ"
            monkeypatch.setattr(_nixl, "posted_hook", None)
            again = batch(16, 65536)
            c.put("after", again)  # the dead unit is refused or forgotten: the put lands on the other
            same(c.get_data("after", ["x", "ids", "tag"], 16, task="t", timeout=WAIT), again)


def test_a_unit_killed_mid_write_costs_the_put_nothing_it_lands_on_the_other_unit(spy, monkeypatch):
    """SIGKILL the unit a 256 MiB put is being written to by NIXL over TCP, once its WRITE is
    posted: the put is placed again on the other unit and acknowledged there, exact; nothing
    of it is on the dead one."""
    from tqueue.client._routes.nixl import NixlRoute

    monkeypatch.setenv("UCX_TLS", "tcp")
    with tqueue.LocalCluster(2, storage={"nixl": True}, env={"UCX_TLS": "tcp"}) as cluster:
        with tqueue.Client(cluster.address, config=NIXL) as c:
            c.put("warm", batch(16, 65536))  # both routes made, agents connected
            pids = {u.unit_id: cluster.pids[1 + cluster.unit_addresses.index(u.address)] for u in c.status().units}
            target: list[int] = []
            real = NixlRoute._transfer

            async def transfer(self: NixlRoute, op: str, *args: object) -> object:
                if op == "WRITE" and not target:
                    target.append(self.info.unit_id)
                return await real(self, op, *args)

            monkeypatch.setattr(NixlRoute, "_transfer", transfer)
            killed = on_first_post(monkeypatch, lambda: os.kill(pids[target[0]], signal.SIGKILL))  # the victim's WRITE
            want = {"x": torch.randn(64, 1 << 20)}  # 256 MiB
            meta = c.put("victim", want, timeout=WAIT)
            assert killed.is_set()
            assert set(meta.units) == set(pids) - {target[0]}
            got = c.get_data(meta)  # in the put's order (the dropped grant's indexes are not reused)
            assert list(got.meta.indexes) == list(meta.indexes) and torch.equal(got["x"], want["x"])


def test_a_unit_stopped_mid_read_fails_the_get_at_the_transfers_deadline_and_serves_once_it_runs(spy, monkeypatch):
    """SIGSTOP the unit once a 256 MiB READ of its arena is posted (UCX over TCP): the transfer
    stalls, nothing says the unit died, and the get fails at the transfer's deadline (the
    request timeout, 2 s here, plus its bytes at 200 MB/s) with a typed error naming the unit,
    not a hang. The abandoned transfer is released (nixl aborts it: its buffer is free to go).
    SIGCONT: the next get of the same samples is exact."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with tqueue.LocalCluster(1, storage={"nixl": True}, env={"UCX_TLS": "tcp"}) as cluster:
        with tqueue.Client(cluster.address, config=dataclasses.replace(NIXL, request_timeout=2.0)) as c:
            want = {"x": torch.randn(64, 1 << 20)}  # 256 MiB
            c.put("stalled", want)
            pid = cluster.pids[1]
            stopped = on_first_post(monkeypatch, lambda: os.kill(pid, signal.SIGSTOP))
            t0 = time.monotonic()
            try:
                with pytest.raises(tqueue.StorageUnitUnavailableError, match=r"storage unit 0\b.*a NIXL READ of 268435456 bytes did not end within 3\.3 s"):
                    c.get_data("stalled", ["x"], 64, task="t", timeout=WAIT)
                took = time.monotonic() - t0
            finally:
                os.kill(pid, signal.SIGCONT)
            assert stopped.is_set() and 3.3 <= took < 30, took
            monkeypatch.setattr(_nixl, "posted_hook", None)
            got = c.get_data("stalled", ["x"], 64, task="again", timeout=WAIT)
            assert torch.equal(got["x"], want["x"][got.meta.indexes])


def test_auto_takes_nixl_only_where_both_hosts_have_rdma_devices(spy, monkeypatch):
    """The default, ``nixl="auto"``: these hosts have no RDMA device, so a unit that offers NIXL
    is reached by sockets (no transfer through NIXL, bytes exact). Where this host and the
    unit's list RDMA devices, the same choice takes NIXL; where only one does, it does not."""
    from tqueue.client._connections import Connections
    from tqueue.wire import UnitInfo

    with tqueue.LocalCluster(1, storage={"nixl": True}) as cluster:
        with tqueue.Client(cluster.address, config=tqueue.ClientConfig(shm=False)) as c:
            want = batch(32, 16384)
            c.put("p", want)
            same(c.get_data("p", ["x", "ids", "tag"], 32, task="t", timeout=WAIT), want)
            assert spy == [] and _nixl.rdma_devices() == []  # no RDMA device here: sockets
    conns = Connections("tcp://127.0.0.1:9", tqueue.ClientConfig())
    offers = dict(unit_id=0, address="tcp://127.0.0.1:9", host="elsewhere", nixl=b"metadata", nixl_base=4096)
    monkeypatch.setattr(_nixl, "rdma_devices", lambda: ["mlx5_0"])
    assert conns._use_nixl(UnitInfo(**offers, rdma=True))
    assert not conns._use_nixl(UnitInfo(**offers, rdma=False))
    monkeypatch.setattr(_nixl, "rdma_devices", lambda: [])
    assert not conns._use_nixl(UnitInfo(**offers, rdma=True))
    assert not Connections("tcp://127.0.0.1:9", tqueue.ClientConfig(nixl="off"))._use_nixl(UnitInfo(**offers, rdma=True))
    asyncio.run(conns.close())


def test_a_unit_with_nixl_needs_an_arena():
    from tqueue.storage._server import StorageUnit

    async def main():
        StorageUnit(tqueue.StorageConfig(controller="tcp://127.0.0.1:9", nixl=True, shm_bytes=0))

    with pytest.raises(tqueue.InvalidArgumentError, match=r"StorageConfig.nixl needs an arena: set shm_bytes above 0"):
        asyncio.run(main())


SCRIPT = textwrap.dedent(
    """
    import torch, tqueue
    with tqueue.LocalCluster(1, storage={"nixl": True}) as cluster:
        with tqueue.Client(cluster.address, config=tqueue.ClientConfig(shm=False, nixl="on")) as c:
            want = torch.arange(1 << 22, dtype=torch.int32).reshape(16, -1)
            c.put("p", {"x": want})
            got = c.get_data("p", ["x"], 16, task="t", timeout=60)
            assert torch.equal(got["x"], want[got.meta.indexes])
            print("exact", got["x"].numel() * 4)
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="network namespaces need root and unshare")
def test_the_route_works_in_a_network_namespace_with_loopback_alone():
    """A namespace with no device but ``lo``: UCX finds its TCP transport there, the cluster
    and client run inside it, and the bytes come back exact."""
    out = subprocess.run(
        ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"$0\"", SCRIPT],
        capture_output=True, text=True, timeout=180, env={**os.environ, "UCX_TLS": "tcp"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"exact {1 << 24}" in out.stdout


def test_a_restarted_unit_is_reached_through_its_new_agent(spy):
    """SIGKILL the unit and start it again at its address: its new agent has new metadata and
    a new arena. The same client's next put and get reach it through the new agent (the route
    of the old one is forgotten with the old connection, or when a transfer to it fails), and
    every byte is exact."""
    with tqueue.LocalCluster(1, storage={"nixl": True}) as cluster, tqueue.Client(cluster.address, config=NIXL) as c:
        first = batch(32, 16384)
        c.put("before", first)
        same(c.get_data("before", ["x", "ids", "tag"], 32, task="t", timeout=WAIT), first)
        cluster.restart_unit(0)
        after = batch(48, 16384)
        c.put("after", after, timeout=WAIT)
        same(c.get_data("after", ["x", "ids", "tag"], 48, task="t", timeout=WAIT), after)
        assert [op for op, _, _ in spy][-2:] == ["WRITE", "READ"]


def test_a_get_cancelled_mid_read_returns_only_once_the_read_has_ended(spy, monkeypatch):
    """Cancel a get while its 256 MiB READ is in flight over TCP (as Ctrl-C or a timeout
    does): a posted transfer cannot be withdrawn, so the cancellation waits for it to end
    before the batch's buffers go back to the pool; the next get of the same samples is exact."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    ended: list[bool] = []
    real = _nixl.Agent._transfer

    def transfer(self, *args):
        try:
            return real(self, *args)
        finally:
            ended.append(True)

    monkeypatch.setattr(_nixl.Agent, "_transfer", transfer)
    with tqueue.LocalCluster(1, storage={"nixl": True}, env={"UCX_TLS": "tcp"}) as cluster:

        async def main():
            async with tqueue.AsyncClient(cluster.address, config=NIXL) as c:
                want = {"x": torch.randn(64, 1 << 20)}
                meta = await c.put("p", want)
                posted = asyncio.Event()
                loop = asyncio.get_running_loop()
                monkeypatch.setattr(_nixl, "posted_hook", lambda: loop.call_soon_threadsafe(posted.set))
                ended.clear()
                task = asyncio.ensure_future(c.get_data(meta))
                await asyncio.wait_for(posted.wait(), WAIT)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert ended == [True]  # the READ had ended when the cancellation came back
                monkeypatch.setattr(_nixl, "posted_hook", None)
                got = await c.get_data(meta)
                assert torch.equal(got["x"], want["x"])  # rows in the meta's order: the put's

        asyncio.run(main())
