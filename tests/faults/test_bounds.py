"""No single message makes a unit allocate beyond limits derived from its configuration."""

from __future__ import annotations

import re

import pytest
import torch

from tqueue.wire import _messages as _wire

from ._proc import peak_rss, reset_peak, rss

MiB = 1 << 20


def _uid(client, partition):
    return client.put(partition, {"x": torch.arange(4)}).partition_uid


@pytest.mark.parametrize(
    "indexes",
    [pytest.param([10**7], id="far"), pytest.param([-1], id="negative"), pytest.param([2, 10**9], id="mixed")],
)
def test_fetch_of_samples_not_held_is_typed_and_costs_the_message(unit_cluster, unit_pid, uclient, raw, partition, indexes):
    uid = _uid(uclient, partition)
    peer = raw(unit_cluster.unit_addresses[0])
    before = rss(unit_pid)
    for rid in range(1, 6):
        fetch = _wire.Fetch(rid=rid, partition=partition, partition_uid=uid, indexes=indexes, fields=["x"])
        reply = peer.ask(_wire.encode(fetch))
        assert isinstance(reply, _wire.Error) and reply.code == "schema", reply
        assert re.search(rf"of partition '{partition}' has no field 'x' on this unit \(samples without it: \[.*{indexes[-1]}\]", reply.message)
    assert rss(unit_pid) - before < 8 * MiB  # it was 76 MB per far index
    ok = _wire.Fetch(rid=9, partition=partition, partition_uid=uid, indexes=[3, 0], fields=["x"])
    peer.send(_wire.encode(ok))
    reply, frames = peer.recv()
    assert isinstance(reply, _wire.Fetched) and len(frames) == 1


def test_drop_and_move_of_negative_samples_touch_nothing(unit_cluster, uclient, raw, partition):
    uid = _uid(uclient, partition)
    peer = raw(unit_cluster.unit_addresses[0])
    reply = peer.ask(_wire.encode(_wire.Drop(rid=1, partition_uid=uid, indexes=[-1, -4])))
    assert isinstance(reply, _wire.Dropped) and reply.partition_bytes > 0
    bad = _wire.Move(rid=2, src_uid=uid, dst_uid=uid + 1000, dst_name="t", src_indexes=[0], dst_indexes=[10**12])
    reply = peer.ask(_wire.encode(bad))
    assert isinstance(reply, _wire.Error) and re.search(r"sample indexes \[1000000000000\].*max_index", reply.message)
    assert uclient.get_data(uclient.get_meta(partition, ["x"], 4, task="t", timeout=10))["x"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "start, count", [pytest.param(0, 10**12, id="huge-count"), pytest.param(10**15, 1, id="far-start"), pytest.param(0, -5, id="negative")]
)
def test_store_beyond_max_index_is_refused_unallocated(unit_cluster, unit_pid, raw, partition, start, count):
    spec = _wire.FieldSpec(kind="tensor", dtype="int64", layout="dense", shape=[])
    block = _wire.FieldBlock(name="x", spec=spec, counts=[1])
    store = _wire.Store(rid=4, grant_id=1, partition=partition, partition_uid=7, start=start, count=count, blocks=[block])
    before = rss(unit_pid)
    reply = raw(unit_cluster.unit_addresses[0]).ask(_wire.encode(store, [b"\0" * 8]))
    assert isinstance(reply, _wire.Error) and re.search(r"lie outside \[0, \d+\) \(StorageConfig.max_index\)", reply.message)
    assert rss(unit_pid) - before < 8 * MiB


def test_too_many_frames_refused_before_decoding(unit_cluster, raw, uclient, partition):
    peer = raw(unit_cluster.unit_addresses[0])
    frames = _wire.encode(_wire.Hello(rid=5, protocol=_wire.PROTOCOL_VERSION)) + [b""] * (1 << 16)
    reply = peer.ask(frames)
    assert isinstance(reply, _wire.Error) and re.search(r"a message of 65538 frames; at most 65536", reply.message)
    _uid(uclient, partition)


def test_a_write_at_a_high_index_costs_its_pages_not_the_range_below(unit_cluster, unit_pid, raw, partition):
    spec = _wire.FieldSpec(kind="tensor", dtype="int64", layout="dense", shape=[])
    block = _wire.FieldBlock(name="x", spec=spec, counts=[1])
    top = (1 << 26) - 1  # the highest index StorageConfig.max_index allows
    store = _wire.Store(rid=4, grant_id=1, partition=partition, partition_uid=77, start=top, count=1, blocks=[block])
    reset_peak(unit_pid)
    before = rss(unit_pid)
    reply = raw(unit_cluster.unit_addresses[0]).ask(_wire.encode(store, [b"\0" * 8]))
    # installed, then refused by the controller (no such grant) and rolled back
    assert isinstance(reply, _wire.Error) and re.search(r"grant 1 is unknown", reply.message), reply
    assert peak_rss(unit_pid) - before < 8 * MiB  # it was 512 MiB: the index arrays filled up to it


def test_a_bulk_store_declaring_a_huge_frame_is_refused_before_allocating(unit_cluster, raw, partition):
    from tqueue.transport import _bulk

    from .conftest import bulk_address_of

    stream = _bulk.BulkStream(bulk_address_of(unit_cluster), 10)
    try:
        spec = _wire.FieldSpec(kind="tensor", dtype="uint8", layout="dense", shape=[1 << 40])
        block = _wire.FieldBlock(name="x", spec=spec, counts=[1])
        store = _wire.Store(
            rid=4, grant_id=1, partition=partition, partition_uid=78, start=0, count=1, blocks=[block],
            bulk=[(stream.token, 1)],
        )
        reply = raw(unit_cluster.unit_addresses[0]).ask(_wire.encode(store))
        assert isinstance(reply, _wire.Error) and reply.code == "protocol"
        assert re.search(r"declares a frame of 1099511627776 bytes; at most \d+ \(StorageConfig.max_frame_bytes\)", reply.message)
    finally:
        stream.close()
