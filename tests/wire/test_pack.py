"""Integer fields packed into narrower types on the wire (tqueue/wire/_pack.py).

Readers must get exactly the values and the dtype that were put, on every path: socket and
bulk stream, same-host readers of socket-written data, several writes of different widths in
one read, and fields whose reads come back jagged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import tqueue
import tqueue.transport._bulk
import tqueue.wire._layout
from tqueue.client import _puts as client_mod
from tqueue.errors import ProtocolError
from tqueue.wire import FieldBlock, FieldSpec, _pack
from tqueue.wire._layout import frame_layout, sample_sizes

from ..servers import LoopCluster

SOCKET = tqueue.ClientConfig(shm=False, request_timeout=10)
SHM = tqueue.ClientConfig(shm=True, shm_min_bytes=0, request_timeout=10)


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each narrowing test on the C pass and on the numpy fallback."""
    if request.param == "native":
        if _pack._native_pack is None:
            pytest.skip("tqueue._native_pack is not built")
    else:
        monkeypatch.setattr(_pack, "_native_pack", None)
    return request.param


# --- narrowing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lo, hi, want",
    [
        (0, 1, "int8"),
        (-128, 127, "int8"),
        (0, 128, "uint8"),  # expert ids under 256
        (0, 255, "uint8"),
        (0, 256, "int16"),
        (-1, 128, "int16"),
        (-129, 0, "int16"),
        (-(2**15), 2**15 - 1, "int16"),
        (0, 2**15, "int32"),
        (-(2**31), 2**31 - 1, "int32"),
        (0, 2**31, None),
        (-(2**31) - 1, 0, None),
    ],
)
def test_narrowest_type_that_holds_every_value(impl, lo, hi, want):
    a = np.full(5000, lo, dtype=np.int64)
    a[1234] = hi
    got = _pack.narrow(a)
    if want is None:
        assert got is None
        return
    values, name = got
    assert name == want and values.dtype == np.dtype(want)
    assert np.array_equal(values.astype(np.int64), a)


@pytest.mark.parametrize("size", [3 * (1 << 16), 3 << 20])  # one thread; two halves
def test_a_value_past_the_probe_still_decides_the_type(impl, size):
    a = np.zeros(size, dtype=np.int64)
    a[-1] = 40_000  # the first values fit int8; the last one needs int32
    values, name = _pack.narrow(a)
    assert name == "int32" and np.array_equal(values, a)
    a[-1] = 2**40
    assert _pack.narrow(a) is None


def test_int32_and_int16_sources_narrow_too(impl):
    values, name = _pack.narrow(np.arange(-100, 20_000, dtype=np.int32))
    assert name == "int16" and values.tolist() == list(range(-100, 20_000))
    values, name = _pack.narrow(np.arange(-100, 27, dtype=np.int16).repeat(40))
    assert name == "int8" and values.tolist() == np.arange(-100, 27).repeat(40).tolist()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.uint64, np.int8, np.bool_, np.dtype(">i8")])
def test_other_dtypes_are_never_packed(dtype):
    assert _pack.narrow(np.zeros(10_000, dtype=dtype)) is None


def test_small_fields_are_left_alone():
    assert _pack.narrow(np.zeros(_pack.MIN_BYTES // 8 - 1, dtype=np.int64)) is None


def test_native_pass_refuses_buffers_that_do_not_match():
    native = _pack._native_pack
    if native is None:
        pytest.skip("tqueue._native_pack is not built")
    a = np.zeros(16, dtype=np.int64)
    with pytest.raises(ValueError, match="cannot narrow 8-byte integers to 8 bytes"):
        native.narrow_into(a, 8, np.zeros(16, dtype=np.int64), 8)
    with pytest.raises(ValueError, match="128 bytes of 8-byte integers do not fill 12 bytes of 4-byte ones"):
        native.narrow_into(a, 8, np.zeros(3, dtype=np.int32), 4)
    with pytest.raises(TypeError):
        native.narrow_into(a, 8, b"read-only", 1)
    with pytest.raises(ValueError, match="cannot narrow 8-byte integers to 2 unsigned bytes"):
        native.narrow_into(a, 8, np.zeros(16, dtype=np.uint16), 2, True)
    # unsigned: 0 to 255 fit a byte, -1 and 256 do not
    out = np.zeros(3, dtype=np.uint8)
    assert native.narrow_into(np.array([0, 128, 255]), 8, out, 1, True) and out.tolist() == [0, 128, 255]
    assert not native.narrow_into(np.array([0, -1, 5]), 8, out, 1, True)
    assert not native.narrow_into(np.array([256, 0, 5], dtype=np.int16), 2, out, 1, True)


def test_widening_many_frames_on_two_threads_is_exact():
    g = np.random.default_rng(3)
    srcs = [g.integers(-(2**31), 2**31, size=n, dtype=np.int64).astype(np.int32) for n in (1 << 18, 3, 1 << 20, 12345, 1 << 19)]
    dst = np.full(sum(len(s) for s in srcs) + 2, -7, dtype=np.int64)
    jobs, at = [], 1
    for s in srcs:
        jobs.append((dst[at : at + len(s)], s))
        at += len(s)
    _pack.widen_all(jobs)
    assert dst[0] == -7 and dst[-1] == -7  # nothing outside the frames' rows
    assert np.array_equal(dst[1:-1], np.concatenate(srcs).astype(np.int64))


# --- the header -----------------------------------------------------------------------


INT64 = FieldSpec(kind="tensor", dtype="int64", shape=(4,))


def test_packed_frames_declare_their_narrow_sizes():
    block = FieldBlock(name="ids", spec=INT64, counts=[2, 3], packed=["int8", ""])
    assert sample_sizes(block).tolist() == [4, 4, 32, 32, 32]
    frame_of, offsets, sizes = frame_layout(block, [b"\x00" * 8, b"\x00" * 96])
    assert frame_of.tolist() == [0, 0, 1, 1, 1] and offsets.tolist() == [0, 4, 0, 32, 64]
    with pytest.raises(ProtocolError, match="field 'ids': frame 0 has 64 bytes, the header declares 8"):
        frame_layout(block, [b"\x00" * 64, b"\x00" * 96])


@pytest.mark.parametrize(
    "spec, packed, match",
    [
        (FieldSpec(kind="tensor", dtype="float32", shape=(4,)), ["int8"], r"field 'f': tensor fields of dtype 'float32' cannot be packed"),
        (FieldSpec(kind="tensor", dtype="uint64", shape=(4,)), ["int8"], r"dtype 'uint64' cannot be packed"),
        (FieldSpec(kind="ndarray", dtype=">i8", shape=(4,)), ["int8"], r"dtype '>i8' cannot be packed"),
        (INT64, ["int64"], r"frame 0 is packed as 'int64', which is not a narrower integer type than 'int64'"),
        (INT64, ["uint16"], r"packed as 'uint16', which is not a narrower"),
        (FieldSpec(kind="tensor", dtype="int16", shape=(4,)), ["int32"], r"packed as 'int32', which is not a narrower"),
        (INT64, ["int8", "int8"], r"field 'f': 2 packed types for 1 frame"),
        (FieldSpec(kind="object", layout="jagged"), ["int8"], r"object fields of dtype '' cannot be packed"),
    ],
)
def test_bad_packed_headers_are_protocol_errors(spec, packed, match):
    block = FieldBlock(name="f", spec=spec, counts=[2], packed=packed, sizes=[1, 1] if spec.kind == "object" else None)
    with pytest.raises(ProtocolError, match=match):
        sample_sizes(block)


# --- through a cluster ----------------------------------------------------------------


def batch_of(n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 151_936, (n, 512), generator=g),  # int32
        "mask": torch.randint(0, 2, (n, 512), generator=g),  # int8
        "pos": torch.arange(512).repeat(n, 1),  # int16
        "hashes": torch.randint(-(2**62), 2**62, (n, 64), generator=g),  # stays int64
        "small16": torch.randint(-100, 100, (n, 256), generator=g, dtype=torch.int16),  # int8
        "np32": np.arange(n * 300, dtype=np.int32).reshape(n, 300) - 7,  # int16 (n <= 100)
        "logp": torch.randn(n, 128, generator=g),
        "text": [f"sample {seed}-{i}" for i in range(n)],
    }


def assert_same(batch: Any, data: dict[str, Any], rows: list[int] | None = None) -> None:
    rows = list(range(len(data["text"]))) if rows is None else rows
    for name, want in data.items():
        got = batch[name]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want[rows]), name
        elif isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want[rows]), name
        else:
            assert list(got) == [want[r] for r in rows], name


@pytest.fixture(scope="module")
def cluster() -> Any:
    with LoopCluster(num_storage_units=1) as c:
        yield c


def client(cluster: Any, config: tqueue.ClientConfig) -> tqueue.Client:
    return tqueue.Client(cluster.address, config=config)


@pytest.mark.parametrize("reader", ["socket", "shm"])
def test_packed_fields_come_back_exact_to_socket_and_same_host_readers(cluster, partition, reader):
    data = batch_of(96, seed=1)
    with client(cluster, SOCKET) as producer, client(cluster, SOCKET if reader == "socket" else SHM) as consumer:
        producer.put(partition, data)
        wide, sent = producer.stats.put_bytes, producer.stats.wire_bytes
        assert sent < wide / 2  # ids halve, masks and positions shrink more
        batch = consumer.get_data(partition, list(data), 96, task="t", timeout=10)
        assert_same(batch, data)
        assert consumer.stats.get_bytes == wide and consumer.stats.wire_bytes == sent
        assert stored(consumer, partition) == sent  # the unit keeps the narrow bytes


def test_pack_ints_off_sends_each_field_in_its_own_dtype(cluster, partition):
    data = batch_of(32, seed=2)
    with client(cluster, dataclasses.replace(SOCKET, pack_ints=False)) as c:
        c.put(partition, data)
        assert c.stats.wire_bytes == c.stats.put_bytes
        assert_same(c.get_data(partition, list(data), 32, task="t", timeout=10), data)


def test_same_host_writes_stay_wide_in_the_arena(cluster, partition):
    """Dense fields: the arena copy costs the same narrowed or not, and wide arena bytes are
    read in place (narrow, a batch of them read 3-4x slower)."""
    data = batch_of(32, seed=3)
    with client(cluster, SHM) as c:
        c.put(partition, data)
        assert c.stats.wire_bytes == c.stats.put_bytes
        assert_same(c.get_data(partition, list(data), 32, task="t", timeout=10), data)


def test_big_put_over_bulk_lanes_and_bulk_fetch_are_exact(cluster, partition, monkeypatch):
    data = batch_of(100, seed=4)  # with a threshold of 256 KiB, this put takes the streams
    with client(cluster, dataclasses.replace(SOCKET, bulk_lanes=2, bulk_put_min_bytes=1 << 18)) as producer, client(cluster, SOCKET) as consumer:
        producer.put(partition, data)
        batch = consumer.get_data(partition, list(data), 100, task="t", timeout=10)
        assert_same(batch, data)
        assert any(getattr(r, "idle", None) for r in consumer._inner._conns.routes.values())  # over a bulk stream


def test_one_read_of_writes_packed_to_different_widths(cluster, partition):
    """Rows of 128 bytes: the unit joins small runs into one frame, never across widths."""
    rows = torch.arange(64 * 16).reshape(64, 16)
    writes = [rows % 100, rows * 30, rows * 100_000, rows * 2**40, rows % 100 - 50, rows % 256]  # int8, 16, 32, 64, 8, uint8
    with client(cluster, SOCKET) as c:
        metas = [c.put(partition, {"x": w}) for w in writes]
        assert c.stats.wire_bytes == rows.numel() * (1 + 2 + 4 + 8 + 1 + 1)
        meta = c.get_meta(partition, ["x"], 384, task="t", timeout=10)
        got = c.get_data(meta)["x"]
        want = torch.cat(writes)
        assert got.dtype == torch.int64 and torch.equal(got, want[meta.indexes])
        # the same samples in a scattered order, from another client
        order = [i for m in reversed(metas) for i in m.indexes[::2]] + [i for m in metas for i in m.indexes[1::2]]
        with client(cluster, SOCKET) as other:
            scattered = msgspec.structs.replace(meta, indexes=order, units=[meta.units[0]] * len(order), versions=None, groups=None)
            assert torch.equal(other.get_data(scattered, fields=["x"])["x"], want[order])


def test_a_packed_write_to_a_jagged_field_reads_back_exact(cluster, partition):
    with client(cluster, SOCKET) as c:
        c.put(partition, {"x": [torch.arange(5), torch.arange(7) - 1000]})
        dense = torch.arange(8 * 1024).reshape(8, 1024) - 5
        c.put(partition, {"x": dense})  # int16, stored as a dense piece of a jagged field
        got = c.get_data(partition, ["x"], 10, task="t", timeout=10)["x"]
        assert isinstance(got, list) and [t.dtype for t in got] == [torch.int64] * 10
        assert torch.equal(got[0], torch.arange(5)) and torch.equal(got[1], torch.arange(7) - 1000)
        assert all(torch.equal(got[2 + i], dense[i]) for i in range(8))


@pytest.mark.parametrize(("writer", "reader"), [("socket", "zmq"), ("socket", "bulk"), ("socket", "shm"), ("shm", "shm"), ("shm", "zmq")])
def test_jagged_integer_samples_travel_and_are_stored_narrow(cluster, partition, writer, reader):
    """Routed experts as the rollout bridges put them: one int32 [length, 48, 8] tensor a
    sample, expert ids under 256 (uint8): one byte an id on the socket and in the unit, read back
    exact in int32 by ZeroMQ, bulk-stream and same-host readers; written through a socket or
    the same-host arena (which holds jagged integer fields narrow too, readers copying them
    to pad or pack anyway; one range, one width). A frame holds whole samples
    at one width: the big sample whose values need int16 travels at int16, small samples
    joined in one frame at their common width."""
    g = torch.Generator().manual_seed(5)
    lengths = (300, 17, 1200, 5, 3)
    experts = [torch.randint(0, 256, (n, 48, 8), generator=g, dtype=torch.int32) for n in lengths]
    experts[2][7, 3, 1] = 1000  # its own frame (over 64 KiB), at int16
    ids = sum(e.numel() for e in experts)
    consumer_config = {"zmq": dataclasses.replace(SOCKET, bulk=False), "bulk": SOCKET, "shm": SHM}[reader]
    with client(cluster, SOCKET if writer == "socket" else SHM) as producer, client(cluster, consumer_config) as consumer:
        producer.put(partition, {"routed_experts": experts})
        assert producer.stats.put_bytes == ids * 4
        if writer == "socket":
            assert producer.stats.wire_bytes == ids + experts[2].numel()  # 1 byte an id, 2 for the int16 sample
        else:  # an arena range holds the field as one frame: at the width of its widest values
            assert producer.stats.wire_bytes == ids * 2
        assert stored(consumer, partition) == producer.stats.wire_bytes  # the unit keeps the narrow bytes
        got = consumer.get_data(partition, ["routed_experts"], len(lengths), task="t", timeout=10)["routed_experts"]
        assert [t.dtype for t in got] == [torch.int32] * len(lengths)
        assert all(torch.equal(a, b) for a, b in zip(got, experts))
        # what the reader received is counted narrow, what it got wide
        assert (consumer.stats.wire_bytes, consumer.stats.get_bytes) == (producer.stats.wire_bytes, ids * 4)


def test_an_update_of_an_integer_field_is_packed_and_exact(cluster, partition):
    with client(cluster, SOCKET) as c:
        meta = c.put(partition, {"ids": torch.zeros(16, 1024, dtype=torch.int64)})
        sent = c.stats.wire_bytes
        rewards = torch.arange(16 * 1024).reshape(16, 1024) % 7
        c.update(meta, {"scores": rewards})
        assert c.stats.wire_bytes - sent == rewards.numel()  # int8 on the wire
        got = c.get_data(partition, ["ids", "scores"], 16, task="t", timeout=10)
        assert torch.equal(got["scores"], rewards) and got["scores"].dtype == torch.int64


# --- narrowed as sent, widened as received (bulk streams) -------------------------------


def big_batch(n: int, seed: int) -> dict[str, Any]:
    """Fields of more than ``PROBE`` values: over bulk streams they are narrowed as sent."""
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 151_936, (n, 4096), generator=g),  # int32
        "mask": torch.randint(0, 2, (n, 4096), generator=g),  # int8
        "hashes": torch.randint(-(2**62), 2**62, (n, 1024), generator=g),  # stays int64
        "text": [f"sample {seed}-{i}" for i in range(n)],
    }


def stored(c: tqueue.Client, partition: str) -> int:
    return next(p.nbytes for p in c.status().partitions if p.name == partition)


def counting_packs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record each ``pack`` the client makes: True where narrowing is deferred to the send."""
    calls: list[bool] = []
    real = client_mod.pack

    def spy(enc: Any, chunk: int, take: Any = None, *, defer: bool = False) -> Any:
        calls.append(defer)
        return real(enc, chunk, take, defer=defer)

    monkeypatch.setattr(client_mod, "pack", spy)
    return calls


def test_big_fields_are_narrowed_as_sent_and_widened_as_received(cluster, partition, impl, monkeypatch):
    calls = counting_packs(monkeypatch)
    data = big_batch(64, seed=5)
    with client(cluster, dataclasses.replace(SOCKET, bulk_put_min_bytes=1 << 18)) as producer, client(cluster, SOCKET) as consumer:
        producer.put(partition, data)
        assert calls == [True]  # one pack, deferred, and no second one: the guesses held
        ids, mask, hashes = (data[f].numel() for f in ("ids", "mask", "hashes"))
        sent = producer.stats.wire_bytes
        assert sent == ids * 4 + mask + hashes * 8 + producer.stats.put_bytes - (ids + mask + hashes) * 8
        batch = consumer.get_data(partition, list(data), 64, task="t", timeout=10)
        assert_same(batch, data)
        assert any(getattr(r, "idle", None) for r in consumer._inner._conns.routes.values())  # over bulk streams
        assert consumer.stats.wire_bytes == sent and consumer.stats.get_bytes == producer.stats.put_bytes
        assert stored(consumer, partition) == sent


def test_a_value_past_the_first_ones_sends_the_put_again_at_its_width(cluster, partition, impl, monkeypatch):
    """The width is guessed from a field's first values before the Store goes; a later value
    that does not fit stops the streams mid-write, and the put is sent again knowing every
    value. The unit keeps only the second write; the client and unit go on working."""
    calls = counting_packs(monkeypatch)
    data = big_batch(64, seed=6)
    data["mask"][-1, -1] = 40_000  # int8 for the first 64Ki values, int32 for the whole field
    with client(cluster, dataclasses.replace(SOCKET, bulk_lanes=2, bulk_put_min_bytes=1 << 18)) as producer, client(cluster, SOCKET) as consumer:
        producer.put(partition, data)
        assert calls == [True, False]  # deferred, then again with every value known
        ids, mask, hashes = (data[f].numel() for f in ("ids", "mask", "hashes"))
        sent = producer.stats.wire_bytes
        assert sent == ids * 4 + mask * 4 + hashes * 8 + producer.stats.put_bytes - (ids + mask + hashes) * 8
        assert stored(consumer, partition) == sent  # the broken first write left nothing
        batch = consumer.get_data(partition, list(data), 64, task="t", timeout=10)
        assert_same(batch, data)
        # the samples in a scattered order: packed frames staged, then widened
        meta = batch.meta
        order = meta.indexes[1::2] + meta.indexes[::2]
        scattered = msgspec.structs.replace(meta, indexes=order, units=[meta.units[0]] * 64, versions=None, groups=None)
        assert_same(consumer.get_data(scattered), data, rows=order)
        more = big_batch(64, seed=7)
        producer.put(partition, more)  # the streams that were stopped are replaced
        assert_same(consumer.get_data(partition, list(more), 64, task="t", timeout=10), more)


def test_lanes_are_balanced_by_what_their_frames_cost_to_send(cluster, partition, monkeypatch):
    """A narrowed frame costs its narrow bytes plus half its wide ones: a lane of int64
    values sent as int32 carries half the bytes of a lane of float32 sent as they are."""
    config = dataclasses.replace(SOCKET, bulk_put_min_bytes=1 << 18, bulk_lane_min_bytes=1 << 20)
    lanes: list[int] = []
    real = tqueue.transport._bulk.BulkStream.write

    def spy(self: Any, frames: Any, timeout: float) -> None:
        lanes.append(sum(tqueue.wire._layout.nbytes(f) for f in frames))
        real(self, frames, timeout)

    monkeypatch.setattr(tqueue.transport._bulk.BulkStream, "write", spy)
    data = {
        "ids": torch.arange(64 * 8192).reshape(64, 8192),  # 4 MiB wide, 2 MiB as int32
        "logp": torch.randn(64, 16384),  # 4 MiB
    }
    with client(cluster, dataclasses.replace(config, bulk_lanes=2)) as c:
        c.put(partition, data)
        assert sorted(lanes) == [2 << 20, 4 << 20]  # by bytes alone: 3 MiB each
        got = c.get_data(partition, ["ids", "logp"], 64, task="t", timeout=10)
        assert torch.equal(got["ids"], data["ids"]) and torch.equal(got["logp"], data["logp"])


def test_a_put_too_small_for_the_streams_is_narrowed_before_it_is_sent(cluster, partition, monkeypatch):
    """Deferred frames are only for the streams: a put below ``bulk_put_min_bytes`` (as the
    caller's values hold it) goes inline on ZeroMQ, packed once, knowing every value, before
    it is sent, and reads back exact."""
    calls = counting_packs(monkeypatch)
    data = big_batch(24, seed=8)  # ids and mask of 96 Ki values: big enough to defer
    with client(cluster, SOCKET) as c:
        c.put(partition, data)
        assert calls == [False]  # never deferred, never packed twice
        ids, mask = data["ids"].numel(), data["mask"].numel()
        assert c.stats.wire_bytes == c.stats.put_bytes - ids * 4 - mask * 7
        assert_same(c.get_data(partition, list(data), 24, task="t", timeout=10), data)
