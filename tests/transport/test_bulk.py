"""The bulk stream (``tqueue.transport._bulk``): payload over plain TCP streams, fetched straight into
the batch's rows and put into the unit's memory. Real controller and unit processes, real
sockets on 127.0.0.1; every client is ``shm=False`` (the bulk path is only for clients that
do not map the unit's arena).

``streams`` wraps ``tqueue.transport._bulk.BulkStream`` (the client looks it up at call time) to
count, per unit bulk address, the streams that carried fetches, the bytes read on them and
the bytes of puts written, so that a test knows which path its payload really took."""

from __future__ import annotations

import asyncio
import collections
import math
import os
import select
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import tqueue
from tqueue.client._routes import BulkRoute
from tqueue.transport import _bulk
from tqueue.wire._layout import split_lanes

from ..servers import LoopCluster

HOSTS = ("bulk-a", "bulk-b")  # the units' host names: a producer on one puts to its unit

# Units without the bulk listener (test_local_cluster_storage_bulk_false_turns_the_listener_off
# checks that the option reaches the unit's command line as a word and is read right).
UNITS_WITHOUT_BULK = {"bulk": False}


# --- helpers --------------------------------------------------------------------------


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bytes read as ``dtype``: every bit pattern, NaNs included."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def payload(n: int, seed: int, ids: int = 4096, logp: int = 2048) -> dict[str, Any]:
    """Two dense fields (int64 ``[n, ids]``, float32 ``[n, logp]``), a jagged one and an
    object one; different for every seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (n,), generator=g).tolist()
    lengths[0] = 0  # an empty sample too
    return {
        "ids": torch.randint(-(2**62), 2**62, (n, ids), dtype=torch.int64, generator=g),
        "logp": random_bits((n, logp), torch.float32, g),
        "tokens": [torch.randint(-(2**40), 2**40, (k,), dtype=torch.int64, generator=g) for k in lengths],
        "text": [f"seed {seed}, sample {i}: " + "é✓" * (i % 7) for i in range(n)],
    }


DENSE = ("ids", "logp")
ALL = ("ids", "logp", "tokens", "text")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that NaNs compare by their bits."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def dense_nbytes(data: dict[str, Any]) -> int:
    return sum(data[f].numel() * data[f].element_size() for f in DENSE)


def assert_rows(batch: Any, rows: list[tuple[dict[str, Any], int]], fields: tuple[str, ...] = ALL) -> None:
    """Batch position ``i`` holds row ``rows[i][1]`` of the put data ``rows[i][0]``."""
    assert batch.size == len(rows)
    for f in fields:
        got = batch[f]
        if f in DENSE:
            want = torch.stack([data[f][r] for data, r in rows])
            assert got.dtype == want.dtype and got.shape == want.shape, f
            assert torch.equal(bits(got), bits(want)), f"field {f} differs"
        elif f == "tokens":
            assert isinstance(got, list) and len(got) == len(rows)
            for i, (data, r) in enumerate(rows):
                want = data[f][r]
                assert got[i].dtype == want.dtype and got[i].shape == want.shape, (f, i)
                assert torch.equal(got[i], want), (f, i)
        else:
            assert got == [data[f][r] for data, r in rows]


def same(batch: Any, data: dict[str, Any], fields: tuple[str, ...] = ALL) -> None:
    assert_rows(batch, [(data, r) for r in range(len(data["text"]))], fields)


def closed_by_peer(sock: socket.socket) -> bool:
    """Wait (the socket's timeout) until the other side closes: EOF or a reset."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_exit(pid: int, timeout: float = 10.0) -> None:
    """Block on a pidfd (no polling) until ``pid`` has exited."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"process {pid} still alive after {timeout} s"
    finally:
        os.close(fd)


def unit_pid(cluster: tqueue.LocalCluster, address: str) -> int:
    """The process of the unit serving at ``address`` (pids: controller first, units in order)."""
    return cluster.pids[1 + cluster.unit_addresses.index(address)]


class StreamLog:
    """What the wrapped ``BulkStream`` saw, per unit bulk address (threads write it).

    ``opened`` counts the streams that carried fetches (their first read); ``wrote`` the
    bytes of puts sent over streams."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened: collections.Counter[str] = collections.Counter()
        self.read: collections.Counter[str] = collections.Counter()
        self.wrote: collections.Counter[str] = collections.Counter()
        self.readers: set[int] = set()
        # hooks, run in the client's worker thread that opens or reads the stream
        self.after_open: Callable[[Any], None] | None = None
        self.before_read: Callable[[Any], None] | None = None
        self.after_read: Callable[[Any], None] | None = None


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> StreamLog:
    log = StreamLog()

    class Counting(_bulk.BulkStream):
        def __init__(self, address: str, timeout: float) -> None:
            super().__init__(address, timeout)
            if log.after_open is not None:
                log.after_open(self)

        def read(self, targets: Any, timeout: float) -> None:
            if log.before_read is not None:
                log.before_read(self)
            super().read(targets, timeout)
            with log.lock:
                if id(self) not in log.readers:
                    log.readers.add(id(self))
                    log.opened[self.address] += 1
                log.read[self.address] += sum(t.nbytes for t in targets)
            if log.after_read is not None:
                log.after_read(self)

        def write(self, frames: Any, timeout: float) -> None:
            super().write(frames, timeout)
            with log.lock:
                log.wrote[self.address] += sum(memoryview(f).nbytes for f in frames)

    monkeypatch.setattr(_bulk, "BulkStream", Counting)
    return log


@pytest.fixture(scope="module")
def bulk_cluster() -> Iterator[tqueue.LocalCluster]:
    with LoopCluster(num_storage_units=2, unit_hosts=HOSTS) as c:
        yield c


@pytest.fixture
def connect(bulk_cluster: tqueue.LocalCluster) -> Iterator[Callable[..., tqueue.Client]]:
    """Connected ``shm=False`` clients of the module's cluster, closed after the test."""
    clients: list[tqueue.Client] = []

    def make(host: str = HOSTS[0], address: str | None = None, **opts: Any) -> tqueue.Client:
        opts.setdefault("bulk_lanes", 1)  # one stream per fetch: the counts below rely on it
        config = tqueue.ClientConfig(shm=False, host=host, request_timeout=10, **opts)
        c = tqueue.Client(address or bulk_cluster.address, config=config)
        clients.append(c)
        c.connect()
        return c

    yield make
    for c in clients:
        c.close()


def bulk_address(client: tqueue.Client, unit_id: int) -> str:
    address = client._inner._conns.units[unit_id].bulk
    assert address.startswith("127.0.0.1:"), address
    return address


def idle_streams(client: tqueue.Client, unit_id: int) -> int:
    route = client._inner._conns.routes.get(unit_id)
    return len(route.idle) if isinstance(route, BulkRoute) else 0


# --- tests ----------------------------------------------------------------------------


def test_round_trip_over_the_bulk_stream_is_bit_exact_and_copies_nothing(connect, streams, partition):
    producer, consumer = connect(), connect()
    data = payload(256, seed=1)  # 8 MiB + 2 MiB dense: far above _bulk.MIN_BYTES
    meta = producer.put(partition, data)
    unit = meta.units[0]
    address = bulk_address(consumer, unit)

    copied = consumer.stats.copied_bytes
    same(consumer.get_data(meta), data)
    assert streams.opened[address] == 1
    assert streams.read[address] > dense_nbytes(data)  # every field came over the stream
    assert idle_streams(consumer, unit) == 1  # back in the pool after the fetch

    # dense fields only: every byte lands in the batch tensors' rows, nothing is copied
    copied, read = consumer.stats.copied_bytes, streams.read[address]
    batch = consumer.get_data(meta, fields=list(DENSE))
    same(batch, data, DENSE)
    assert consumer.stats.copied_bytes == copied
    assert streams.read[address] - read == dense_nbytes(data)
    assert streams.opened[address] == 1  # the same stream, reused
    assert idle_streams(consumer, unit) == 1


def test_bulk_off_on_the_client_or_on_the_unit_gives_the_same_bytes(connect, streams, partition):
    data = payload(256, seed=2)
    producer = connect()
    meta = producer.put(partition, data)
    address = bulk_address(producer, meta.units[0])

    on = connect()
    via_bulk = on.get_data(meta)
    assert streams.opened[address] == 1 and streams.read[address] > dense_nbytes(data)

    off = connect(bulk=False)
    copied = off.stats.copied_bytes
    via_frames = off.get_data(meta)
    assert streams.opened[address] == 1  # the client without bulk opened no stream
    assert off.stats.copied_bytes > copied  # ZeroMQ frames assembled by copying

    with LoopCluster(num_storage_units=1, storage=UNITS_WITHOUT_BULK) as plain:
        p = connect(address=plain.address)
        plain_meta = p.put(partition, data)
        c = connect(address=plain.address)
        assert c._inner._conns.units[plain_meta.units[0]].bulk == ""  # the unit offers none
        via_plain_unit = c.get_data(plain_meta)
    assert sum(streams.opened.values()) == 1

    for batch in (via_bulk, via_frames, via_plain_unit):
        same(batch, data)
    for f in DENSE:
        assert torch.equal(bits(via_bulk[f]), bits(via_frames[f]))
        assert torch.equal(bits(via_bulk[f]), bits(via_plain_unit[f]))
    for a, b, c in zip(via_bulk["tokens"], via_frames["tokens"], via_plain_unit["tokens"]):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert via_bulk["text"] == via_frames["text"] == via_plain_unit["text"]


def test_scattered_samples_on_two_units_come_back_exact(connect, streams, partition):
    on_a, on_b = connect(HOSTS[0]), connect(HOSTS[1])
    source: dict[int, tuple[dict[str, Any], int]] = {}  # sample index -> (data, row)
    units = set()
    for k, producer in enumerate((on_a, on_b, on_a, on_b)):  # interleaved puts
        data = payload(48, seed=10 + k, ids=512, logp=256)  # 5 KiB dense per sample
        meta = producer.put(partition, data)
        units.add(meta.units[0])
        assert len(set(meta.units)) == 1
        source.update({idx: (data, row) for row, idx in enumerate(meta.indexes)})
    assert len(units) == 2  # both units hold samples
    unit_a, unit_b = sorted(units, key=lambda u: on_a._inner._conns.units[u].host)

    consumer = connect()
    addr_a, addr_b = bulk_address(consumer, unit_a), bulk_address(consumer, unit_b)
    whole = consumer.get_meta(partition, list(ALL), 192, task="scatter", timeout=10)
    order = torch.randperm(len(whole), generator=torch.Generator().manual_seed(3)).tolist()
    for positions in (order, list(reversed(range(len(whole))))):
        meta = whole.select(positions)
        assert set(meta.units) == units
        read = streams.read.copy()
        batch = consumer.get_data(meta)
        assert_rows(batch, [source[i] for i in meta.indexes])
        assert streams.read[addr_a] > read[addr_a] and streams.read[addr_b] > read[addr_b]
        padded = consumer.get_data(meta, fields=["tokens"], jagged="padded", pad_value=-1)
        lengths = padded.lengths("tokens")
        for i, idx in enumerate(meta.indexes):
            data, row = source[idx]
            n = int(lengths[i])
            assert torch.equal(padded["tokens"][i, :n], data["tokens"][row])
            assert bool((padded["tokens"][i, n:] == -1).all())

    # one batch, two paths: unit A's part over its stream, unit B's two samples (far under
    # MIN_BYTES) inline on ZeroMQ; A's rows interleaved with B's
    a_pos = [p for p in order if whole.units[p] == unit_a][:60]
    b_pos = [p for p in order if whole.units[p] == unit_b][:2]
    meta = whole.select(a_pos[:20] + b_pos[:1] + a_pos[20:] + b_pos[1:])
    read = streams.read.copy()
    batch = consumer.get_data(meta)
    assert_rows(batch, [source[i] for i in meta.indexes])
    assert streams.read[addr_a] > read[addr_a]
    assert streams.read[addr_b] == read[addr_b]


def test_garbage_on_the_bulk_port_is_dropped_and_the_unit_still_serves(connect, streams, partition):
    producer = connect()
    data = payload(64, seed=4)
    meta = producer.put(partition, data)
    consumer = connect()
    address = bulk_address(consumer, meta.units[0])
    host, _, port = address.rpartition(":")

    silent = socket.create_connection((host, int(port)), timeout=10)  # says nothing at all
    try:
        junk = os.urandom(12)
        while junk.startswith(b"TQB1"):
            junk = os.urandom(12)
        with socket.create_connection((host, int(port)), timeout=10) as garbage:
            garbage.sendall(junk)
            assert closed_by_peer(garbage)  # no "K": the unit hung up
        with socket.create_connection((host, int(port)), timeout=10) as short:
            short.sendall(b"TQB1")  # the right magic, then no more before the token
            short.shutdown(socket.SHUT_WR)
            assert closed_by_peer(short)
        socket.create_connection((host, int(port)), timeout=10).close()  # connect, close

        # a real client still gets a stream (the silent one blocks no handshake) and exact data
        same(consumer.get_data(meta), data)
        assert streams.opened[address] == 1
        assert streams.read[address] > dense_nbytes(data)
        same(connect().get_data(meta, fields=list(DENSE)), data, DENSE)
        assert streams.opened[address] == 2
    finally:
        silent.close()


def test_unit_killed_under_an_idle_stream_fails_typed_within_the_request_timeout(streams, partition):
    """The typed error names what ended the wait: the unit's refused reconnect (the client's
    connection watch, usually first), or the request's or the heartbeats' timeout (both 3 s
    here): no wall clock is raced against it (the producer, whose put must not time out
    under load, has the default timeout)."""
    timeout = 3.0
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        config = tqueue.ClientConfig(shm=False, request_timeout=timeout)
        with tqueue.Client(cluster.address, config=config) as client, \
                tqueue.Client(cluster.address, config=tqueue.ClientConfig(shm=False)) as producer:
            data = payload(64, seed=5)
            meta = producer.put(partition, data)
            unit = meta.units[0]
            same(client.get_data(meta), data)
            assert idle_streams(client, unit) == 1  # an open stream, waiting for the next fetch

            pid = unit_pid(cluster, client._inner._conns.units[unit].address)
            os.kill(pid, signal.SIGKILL)
            wait_exit(pid)
            with pytest.raises(
                tqueue.StorageUnitUnavailableError,
                match=rf"storage unit {unit} at tcp://127\.0\.0\.1:\d+ (did not answer Fetch within {timeout}"
                r"|has not been heard from for|no longer answers \(connection refused\)|closed the connection)",
            ):
                client.get_data(meta)
            assert idle_streams(client, unit) == 0  # the stream was closed, not put back


def test_unit_killed_mid_stream_fails_typed_at_once(streams, partition):
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        config = tqueue.ClientConfig(shm=False, request_timeout=30)
        with tqueue.Client(cluster.address, config=config) as client:
            data = payload(512, seed=6)  # 20 MiB dense
            meta = client.put(partition, data)
            unit = meta.units[0]
            pid = unit_pid(cluster, client._inner._conns.units[unit].address)

            def small_window(stream: Any) -> None:
                # a fixed small receive buffer (no autotuning), so that the dead unit's socket
                # buffers cannot hold the whole reply whatever this host's tcp_rmem says
                stream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)

            def kill_unit(stream: Any) -> None:  # the Fetched reply is in, the bytes are not
                os.kill(pid, signal.SIGKILL)
                wait_exit(pid)

            streams.after_open = small_window
            streams.before_read = kill_unit
            # the stream's end (EOF or reset), or the unit's ZeroMQ connection closing (the
            # client's connection watch; whichever the client sees first), not the stream's
            # 30 s stall limit (TimeoutError): no wall clock raced against a timeout
            with pytest.raises(
                tqueue.StorageUnitUnavailableError,
                match=r"bulk stream from 127\.0\.0\.1:\d+ broke mid-fetch: (?!TimeoutError)\w+"
                r"|storage unit \d+ at tcp://\S+ (closed the connection|no longer answers)",
            ) as info:
                client.get_data(meta, fields=list(DENSE))
            if "bulk stream" in str(info.value):
                assert isinstance(info.value.__cause__, OSError)
            assert idle_streams(client, unit) == 0


def test_concurrent_fetches_from_one_unit_open_and_reuse_several_streams(bulk_cluster, streams, partition):
    async def main() -> None:
        config = tqueue.ClientConfig(shm=False, host=HOSTS[0], request_timeout=10, bulk_lanes=1)
        async with tqueue.AsyncClient(bulk_cluster.address, config=config) as producer, \
                tqueue.AsyncClient(bulk_cluster.address, config=config) as consumer:
            datas = [payload(16 + 8 * k, seed=20 + k) for k in range(4)]  # 0.6 to 1.6 MiB each
            metas = [await producer.put(partition, d) for d in datas]
            unit = metas[0].units[0]
            assert all(m.units == [unit] * len(m) for m in metas)
            address = consumer._conns.units[unit].bulk
            for round_ in range(2):
                batches = await asyncio.gather(*(consumer.get_data(m) for m in metas))
                for batch, data in zip(batches, datas):
                    same(batch, data)
                assert streams.opened[address] == 4, round_  # 4 at once; the second round reuses them
                assert len(consumer._conns.routes[unit].idle) == 4
                assert streams.read[address] >= (round_ + 1) * sum(dense_nbytes(d) for d in datas)
            # and out of step: a dense-only fetch beside a full one, both exact
            a, b = await asyncio.gather(
                consumer.get_data(metas[3], fields=list(DENSE)), consumer.get_data(metas[0])
            )
            same(a, datas[3], DENSE)
            same(b, datas[0])
            assert streams.opened[address] == 4

    asyncio.run(main())


def test_local_cluster_storage_bulk_false_turns_the_listener_off():
    """Boolean unit options reach the unit's command line as words ('--bulk False')."""
    with tqueue.LocalCluster(num_storage_units=1, storage={"bulk": False}) as cluster:
        config = tqueue.ClientConfig(shm=False)
        with tqueue.Client(cluster.address, config=config) as client:
            client.connect()
            [info] = client._inner._conns.units.values()
            assert info.bulk == "", f"the unit still listens for bulk streams at {info.bulk}"


# --- a pooled buffer received into stays out of the pool while any slice of it is alive --


@pytest.mark.parametrize(
    "shape_of",
    [
        # a dense field of exactly chunk_bytes (1 MiB): one frame, received in place into
        # the batch buffer, returned as a tensor over that frame
        pytest.param(lambda v: {"x": torch.full((256, 1024), float(v))}, id="dense-one-frame"),
        # a jagged field of 4 MiB: received into one staging buffer, returned as views of it
        pytest.param(lambda v: {"x": [torch.full((4096,), float(v)) for _ in range(256)]}, id="jagged-staged"),
    ],
)
def test_a_batch_is_not_overwritten_by_the_next_fetch(connect, streams, partition, shape_of):
    producer, consumer = connect(), connect()
    first = producer.put(partition, shape_of(1))
    second = producer.put(partition, shape_of(2))
    address = bulk_address(consumer, first.units[0])
    kept = consumer.get_data(first)
    value = kept["x"] if isinstance(kept["x"], torch.Tensor) else torch.stack(kept["x"])
    assert bool((value == 1).all())
    consumer.get_data(second)
    assert streams.read[address] >= 2 << 20  # both came over the bulk stream
    value = kept["x"] if isinstance(kept["x"], torch.Tensor) else torch.stack(kept["x"])
    assert bool((value == 1).all()), f"the kept batch now holds {value.unique().tolist()}"


def test_staged_parts_of_two_units_do_not_share_a_buffer(connect, streams, partition):
    """Unit A's staged frames wait in a pooled buffer for assembly; unit B's part, read
    after A's is done, must not be received into that same buffer. The hooks only fix the
    order (B's stream opens once A's read is over); without them it happens by chance
    (about half of such fetches here)."""
    on_a, on_b = connect(HOSTS[0]), connect(HOSTS[1])
    meta_a = on_a.put(partition, {"x": torch.full((256, 2048), 1.0)})
    meta_b = on_b.put(partition, {"x": torch.full((256, 2048), 2.0)})
    assert meta_a.units[0] != meta_b.units[0]
    consumer = connect()
    addr_a, addr_b = bulk_address(consumer, meta_a.units[0]), bulk_address(consumer, meta_b.units[0])
    whole = consumer.get_meta(partition, ["x"], 512, task="t", timeout=10)
    a_pos = [i for i, u in enumerate(whole.units) if u == meta_a.units[0]]
    b_pos = [i for i, u in enumerate(whole.units) if u == meta_b.units[0]]
    meta = whole.select([p for pair in zip(a_pos, b_pos) for p in pair])  # 2 MiB staged per unit

    a_done = threading.Event()
    streams.after_read = lambda s: a_done.set() if s.address == addr_a else None
    streams.after_open = lambda s: a_done.wait(10) if s.address == addr_b else None
    batch = consumer.get_data(meta)
    assert a_done.is_set() and streams.read[addr_a] and streams.read[addr_b]
    want = torch.tensor([1.0 if u == meta_a.units[0] else 2.0 for u in meta.units])
    got = batch["x"]
    wrong = (got != want[:, None]).any(dim=1)
    assert not bool(wrong.any()), f"{int(wrong.sum())} of {len(meta)} rows hold another unit's data"


PUT_BULK_MIN_BYTES = tqueue.ClientConfig().bulk_put_min_bytes
LANE_MIN_BYTES = tqueue.ClientConfig().bulk_lane_min_bytes


def test_a_big_fetch_runs_over_parallel_lanes(connect, streams, partition):
    """With ``bulk_lanes=2`` a fetch of one unit's samples above the lane threshold is split
    over two streams read at once (each half lands in place: no copy); a small one is not."""
    producer = connect()
    consumer = connect(bulk_lanes=2)
    rows = 512
    data = {"x": torch.randn(rows, 2 * LANE_MIN_BYTES // (4 * rows) + 8), "s": [f"s{i}" for i in range(rows)]}
    meta = producer.put(partition, data)
    address = bulk_address(consumer, meta.units[0])
    before = consumer.stats.copied_bytes
    got = consumer.get_data(meta)
    assert torch.equal(got["x"], data["x"]) and got["s"] == data["s"]
    assert consumer.stats.copied_bytes == before
    assert streams.opened[address] == 2
    assert streams.read[address] >= data["x"].nbytes
    small = consumer.get_data(meta.select(range(8)))
    assert torch.equal(small["x"], data["x"][:8])
    assert streams.opened[address] == 2  # no new stream: below the threshold, one lane



# --- puts over the bulk stream -------------------------------------------------------------


def test_a_put_over_bulk_lanes_is_exact_and_visible_once_acknowledged(connect, streams, partition, monkeypatch):
    """A big put goes over two lanes into the unit; a small one over one; both read back
    exact (inline and over the bulk stream)."""
    producer = connect(bulk_lanes=2, bulk_put_min_bytes=_bulk.MIN_BYTES)  # the small one too
    width = LANE_MIN_BYTES // (8 * 256) + 16
    big = payload(512, seed=11, ids=width)
    small = payload(64, seed=12, ids=width)
    meta_big = producer.put(partition, big)
    address = bulk_address(producer, meta_big.units[0])
    assert streams.wrote[address] >= dense_nbytes(big)
    assert idle_streams(producer, meta_big.units[0]) == 2  # two lanes, back in the pool
    meta_small = producer.put(partition, small)
    assert idle_streams(producer, meta_small.units[0]) == 2  # one of them reused
    consumer = connect()
    same(consumer.get_data(meta_big), big)
    same(consumer.get_data(meta_small), small)
    same(connect(bulk=False).get_data(meta_small), small)


def test_a_put_whose_stream_breaks_midway_is_refused_and_leaves_nothing(connect, streams, partition, monkeypatch):
    """A writer that stops halfway through a lane (as a producer that dies would): the unit
    refuses the put without storing a byte, says why (the typed error the put raises), and
    keeps serving."""
    producer = connect(bulk_lanes=1, bulk_put_min_bytes=_bulk.MIN_BYTES)
    data = payload(128, seed=21)
    real_write = _bulk.BulkStream.write

    def half_then_close(self: Any, frames: Any, timeout: float) -> None:
        half = frames[: max(1, len(frames) // 2)]
        real_write(self, half, timeout)
        self.close()
        raise tqueue.StorageUnitUnavailableError("the test's writer stopped halfway")

    monkeypatch.setattr(_bulk.BulkStream, "write", half_then_close)
    with pytest.raises(tqueue.ProtocolError, match=r"bulk stream \d+ broke while a put was read"):
        producer.put(partition, data)
    monkeypatch.undo()
    good = payload(16, seed=22)
    meta = connect().put(partition, good)
    consumer = connect()
    got = consumer.get_meta(partition, list(ALL), 16, task="t", timeout=10)
    assert sorted(got.indexes) == sorted(meta.indexes)
    same(consumer.get_data(got), good)
    with pytest.raises(tqueue.WaitTimeoutError):
        consumer.get_meta(partition, list(ALL), 1, task="t", timeout=0.2)


def test_a_refused_bulk_put_closes_its_streams_and_the_next_put_works(connect, partition, monkeypatch):
    """The unit refuses a Store whose lanes do not add up (typed ProtocolError, named); the
    client drops those streams, whose bytes are out of step, and the next put is exact."""
    import tqueue.client._puts as client_mod

    producer = connect(bulk_lanes=1, bulk_put_min_bytes=_bulk.MIN_BYTES)
    data = payload(64, seed=31)
    monkeypatch.setattr(client_mod, "split_lanes", lambda sizes, lanes: [len(sizes) - 1])
    with pytest.raises(tqueue.ProtocolError, match="lanes carry"):
        producer.put(partition, data)
    monkeypatch.setattr(client_mod, "split_lanes", split_lanes)
    meta = producer.put(partition, data)
    same(connect().get_data(meta), data)


def test_a_put_below_the_bulk_threshold_goes_inline_and_one_above_over_a_stream(connect, streams, partition):
    """Small puts (a rollout's group) skip the streams, whose hand-offs would cost more than
    they save; a put from ``ClientConfig.bulk_put_min_bytes`` up takes one. Both read back exact."""
    producer = connect()
    small = payload(64, seed=41)  # 2.5 MiB
    meta = producer.put(partition, small)
    address = bulk_address(producer, meta.units[0])
    assert streams.wrote[address] == 0
    big = payload(PUT_BULK_MIN_BYTES // (8 * 4096) + 8, seed=42)
    meta_big = producer.put(partition, big)
    assert streams.wrote[bulk_address(producer, meta_big.units[0])] >= dense_nbytes(big)
    consumer = connect()
    same(consumer.get_data(meta), small)
    same(consumer.get_data(meta_big), big)


def test_bulk_streams_know_frames_by_protocol_not_by_the_codec():
    """``_bulk`` imports nothing of the wire's codec: packed frames reach it as ``Produced``
    and ``Consumed`` (which ``Narrowing`` and ``Widening`` satisfy), and a frame that cannot be
    produced is a transport error the client catches, ``FrameRefused``."""
    import ast
    import inspect

    import numpy as np

    from tqueue.wire._pack import Narrowing, Widening

    tree = ast.parse(inspect.getsource(_bulk))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("wire" in m for m in imported), imported
    a, b = socket.socketpair()
    try:
        ok = Narrowing(np.arange(8, dtype=np.int64), np.dtype(np.int8))
        wide = np.zeros(8, dtype=np.int64)
        _bulk.send_frames(a, [ok])
        _bulk.read_into(b, [Widening(wide, np.dtype(np.int8))], 10)
        assert wide.tolist() == list(range(8))
        with pytest.raises(_bulk.FrameRefused, match="could not be produced"):
            _bulk.send_frames(a, [Narrowing(np.array([1, 300] * 4, dtype=np.int64), np.dtype(np.int8))])
    finally:
        a.close()
        b.close()


def test_stream_failures_are_typed_at_the_transport_boundary():
    """A listener that cannot bind and a stream that cannot connect fail as tqueue errors
    naming the operation, raised from the OS error."""
    with pytest.raises(tqueue.UnavailableError, match=r"cannot listen for bulk streams on 203\.0\.113\.1: \w+") as info:
        _bulk.BulkServer("203.0.113.1")  # TEST-NET-3: never an address of this host
    assert isinstance(info.value.__cause__, OSError)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # a port that was just free and is closed again below
    with pytest.raises(tqueue.StorageUnitUnavailableError, match=rf"cannot open a bulk stream to 127\.0\.0\.1:{port}: ConnectionRefusedError"):
        _bulk.BulkStream(f"127.0.0.1:{port}", timeout=10)


def test_a_unit_send_is_counted_until_let_go_and_cut_off_at_its_pace():
    """A unit's stream counts the bytes it has to send (``held_bytes``) until its writer lets
    go of them; a reader that stops is cut off at the stall timeout and the stream closed; a
    send that would queue past ``max_queued`` behind one under way is refused, nothing queued."""
    import time

    import numpy as np

    let_go = threading.Semaphore(0)
    server = _bulk.BulkServer("127.0.0.1", stall=0.5, min_rate=1 << 30, max_queued=8 << 20, on_sent=let_go.release)
    reader = _bulk.BulkStream(server.address, 10)
    stopped = _bulk.BulkStream(server.address, 10)
    stopped.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    try:
        reply = np.random.default_rng(7).integers(0, 256, 32 << 20, dtype=np.uint8)
        got = np.empty_like(reply)
        assert server.send(reader.token, [reply])
        reader.read([memoryview(got)], 10)
        assert let_go.acquire(timeout=10) and server.held_bytes == 0 and np.array_equal(got, reply)

        assert server.send(stopped.token, [reply])
        assert server.held_bytes == reply.nbytes
        assert not server.send(stopped.token, [reply[: 1 << 20]])  # 33 MiB past 8 MiB behind it
        assert server.held_bytes == reply.nbytes
        t0 = time.monotonic()
        assert let_go.acquire(timeout=10), "the stopped reader was never cut off"
        took = time.monotonic() - t0
        assert server.held_bytes == 0 and took <= 0.5 * 1.25 + 2  # two busy cores
        left = 0
        stopped.sock.settimeout(10)
        while chunk := stopped.sock.recv(1 << 20):  # what was in flight, then the unit's hang-up
            left += len(chunk)
        assert left < reply.nbytes
        assert not server.send(stopped.token, [reply])  # that stream is gone
    finally:
        reader.close()
        stopped.close()
        server.close()
