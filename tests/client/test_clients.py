"""The sync and async clients are twins; the sync one drives one loop thread."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest
import torch

import tqueue
from tqueue import _wire
from tqueue.errors import ControllerUnavailableError, ProtocolVersionError


def public_methods(cls):
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}


def test_sync_and_async_have_the_same_methods_and_signatures():
    sync, asyn = tqueue.Client, tqueue.AsyncClient
    assert public_methods(sync) == public_methods(asyn)
    for name in public_methods(sync):
        s = inspect.signature(getattr(sync, name))
        a = inspect.signature(getattr(asyn, name))
        assert list(s.parameters) == list(a.parameters), name
        assert inspect.iscoroutinefunction(getattr(asyn, name)), name


def test_sync_client_never_calls_asyncio_run(client, partition, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("asyncio.run called")

    monkeypatch.setattr(asyncio, "run", forbidden)
    threads = threading.active_count()
    for i in range(5):
        client.put(partition, {"x": torch.tensor([i])})
    assert client.get_data(partition, ["x"], 5, task="t", timeout=5)["x"].tolist() == [0, 1, 2, 3, 4]
    assert threading.active_count() == threads


def test_context_manager_stops_the_loop_thread(cluster):
    with tqueue.Client(cluster.address) as c:
        thread = c._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        c.status()
    c.close()  # idempotent


def test_async_client_in_a_users_loop(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            metas = await asyncio.gather(*(c.put(partition, {"x": torch.tensor([i])}) for i in range(8)))
            assert sorted(m.indexes[0] for m in metas) == list(range(8))
            batch = await c.get_data(partition, ["x"], 8, task="t", timeout=5)
            await c.ack(batch.meta)
            return sorted(batch["x"].tolist())

    assert asyncio.run(main()) == list(range(8))


def test_protocol_version_mismatch_names_both_versions(cluster, monkeypatch):
    import tqueue.client._async as mod

    monkeypatch.setattr(mod, "PROTOCOL_VERSION", _wire.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolVersionError, match=r"peer speaks tqueue protocol 2, the controller speaks protocol 1"):
        with tqueue.Client(cluster.address):
            pass


def test_no_controller_is_a_typed_unavailable_error():
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = tqueue.ClientConfig(request_timeout=0.3)
        with pytest.raises(ControllerUnavailableError, match=rf"controller at tcp://127.0.0.1:{port} did not answer Hello within 0.3 s"):
            tqueue.Client(f"tcp://127.0.0.1:{port}", config=config).connect()
    finally:
        silent.close(0)
        ctx.term()


def test_a_refused_put_sends_nothing(client, partition):
    with pytest.raises(tqueue.FieldTypeError, match=r"sample 1 of field 'bad'"):
        client.put(partition, {"x": torch.zeros(2), "bad": ["ok", {1, 2}]})
    assert partition not in {p.name for p in client.status().partitions}
    assert client.stats.puts == 0 and client.stats.put_bytes == 0
