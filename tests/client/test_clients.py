"""The sync and async clients are twins; the sync one drives one loop thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import tqueue
from tqueue.errors import ControllerUnavailableError, ProtocolVersionError
from tqueue.wire import _messages as _wire


def test_sync_client_never_calls_asyncio_run(client, partition, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("asyncio.run called")

    monkeypatch.setattr(asyncio, "run", forbidden)
    monkeypatch.setattr(asyncio, "new_event_loop", forbidden)
    # loop threads only: pools start workers lazily, and a client another test dropped ends
    # whenever the collector gets to it
    loops = [t for t in threading.enumerate() if t.name == "tqueue-client"]
    for i in range(5):
        client.put(partition, {"x": torch.tensor([i])})
    assert client.get_data(partition, ["x"], 5, task="t", timeout=5)["x"].tolist() == [0, 1, 2, 3, 4]
    assert [t for t in threading.enumerate() if t.name == "tqueue-client"] == loops


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


def test_a_same_host_batch_that_outlives_its_client_in_a_running_loop_logs_nothing(cluster, partition, caplog):
    """Its arena views let go after the client closed: the hold is left to lapse at the unit
    (its hold_timeout), and no callback of the loop fails ("client is closed")."""
    import gc
    import logging

    async def main():
        async with tqueue.AsyncClient(cluster.address, config=tqueue.ClientConfig(shm=True, shm_min_bytes=0)) as c:
            meta = await c.put(partition, {"x": torch.arange(1 << 16, dtype=torch.int64).reshape(4, -1)})
            batch = await c.get_data(meta)
        assert batch["x"].sum().item() == sum(range(1 << 16))  # still readable: it holds its pages
        del batch
        gc.collect()
        for _ in range(3):  # the release's callback, and anything it would start, run here
            await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_protocol_version_mismatch_names_both_versions(cluster, monkeypatch):
    import tqueue.client._connections as mod

    monkeypatch.setattr(mod, "PROTOCOL_VERSION", _wire.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolVersionError, match=rf"peer speaks tqueue protocol {_wire.PROTOCOL_VERSION + 1}, the controller speaks protocol {_wire.PROTOCOL_VERSION}"):
        with tqueue.Client(cluster.address):
            pass


def test_no_controller_is_a_typed_unavailable_error():
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = tqueue.ClientConfig(request_timeout=0.3)
        client = tqueue.Client(f"tcp://127.0.0.1:{port}", config=config)
        try:
            with pytest.raises(ControllerUnavailableError, match=rf"controller at tcp://127.0.0.1:{port} did not answer Hello within 0.3 s"):
                client.connect()
        finally:
            client.close()  # now: left to the collector, its loop thread would end during a later test
    finally:
        silent.close(0)
        ctx.term()


def test_a_refused_put_sends_nothing(client, partition):
    with pytest.raises(tqueue.FieldTypeError, match=r"sample 1 of field 'bad'"):
        client.put(partition, {"x": torch.zeros(2), "bad": ["ok", {1, 2}]})
    assert partition not in {p.name for p in client.status().partitions}
    assert client.stats.puts == 0 and client.stats.put_bytes == 0


def test_sync_get_meta_from_many_threads_on_their_own_connections(client, partition):
    """The blocking client's get_meta goes out on a connection per calling thread: four
    threads at once each get a disjoint lease, and an empty wait is a typed timeout."""
    client.put(partition, {"x": torch.arange(64)})
    metas: list[list[int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4, timeout=10)

    def take() -> None:
        try:
            start.wait()
            metas.append(client.get_meta(partition, ["x"], 16, task="t", timeout=10).indexes)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert sorted(i for m in metas for i in m) == list(range(64))
    assert len(client._direct_routes) == 4
    with pytest.raises(tqueue.WaitTimeoutError, match=partition):
        client.get_meta(partition, ["x"], 1, task="t", timeout=0.05)


def test_blocking_peer_skips_the_late_answer_to_a_request_it_gave_up_on():
    """A server that answers request 1 only after request 2 arrived: request 1 times out
    (typed), request 2 gets its own answer, not the late one."""
    import zmq

    from tqueue.transport import _zmq as _transport

    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        pending = [server.recv_multipart() for _ in range(3)]  # request 1, its Cancel, request 2
        for ident, *frames in pending:
            msg, _ = _wire.decode(frames)
            if not isinstance(msg, _wire.Cancel):
                server.send_multipart([ident, *_wire.encode(_wire.Registered(rid=msg.rid, unit_id=msg.rid * 10))])

    thread = threading.Thread(target=serve)
    thread.start()
    peer = _transport.BlockingPeer(f"tcp://127.0.0.1:{port}", name="controller", unavailable=ControllerUnavailableError)
    try:
        with pytest.raises(ControllerUnavailableError, match=r"did not answer Hello within 0.2 s"):
            peer.request(_wire.Hello(protocol=1), expect=_wire.HelloReply, timeout=0.2)
        reply = peer.request(_wire.Hello(protocol=1), expect=_wire.Registered, timeout=10)
        assert reply.unit_id == 20
    finally:
        thread.join(timeout=10)
        peer.close()
        server.close(0)
        ctx.term()


def test_a_nixl_mode_that_is_none_of_the_three_is_a_typed_error_before_connecting(monkeypatch):
    with pytest.raises(tqueue.InvalidArgumentError, match=r"ClientConfig.nixl is one of 'auto', 'on', 'off'; got True"):
        tqueue.Client("tcp://127.0.0.1:1", config=tqueue.ClientConfig(nixl=True))  # type: ignore[arg-type]
    monkeypatch.setenv("TQUEUE_NIXL", "yes")
    with pytest.raises(tqueue.InvalidArgumentError, match=r"got 'yes'"):
        tqueue.Client("tcp://127.0.0.1:1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no CUDA device")
def test_pin_memory_without_cuda_is_a_typed_error_before_connecting():
    config = tqueue.ClientConfig(pin_memory=True)
    with pytest.raises(tqueue.InvalidArgumentError, match=r"pin_memory needs a CUDA device, and torch sees none"):
        tqueue.Client("tcp://127.0.0.1:1", config=config)
