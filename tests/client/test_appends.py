"""Appends (``complete(..., append=[...])``): a trajectory grows turn by turn, each append
sends and stores only its new rows (nothing stored is read back or copied), and reads give the
whole value exactly, on every route; what holds appended samples keeps them: a checkpoint, a
postpone, a clear, an overwrite. The servers run in this process (``LoopCluster``), so that a
test can read a unit's store directly."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tqueue

from ..servers import LoopCluster

ROUTES = {
    "inline": tqueue.ClientConfig(shm=False, bulk=False),
    "bulk": tqueue.ClientConfig(shm=False, bulk_lanes=1, bulk_put_min_bytes=1),
    "arena": tqueue.ClientConfig(shm=True, shm_min_bytes=0),
}
LAYERS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopCluster]:
    with LoopCluster(num_storage_units=1) as c:
        yield c


@pytest.fixture(params=list(ROUTES))
def client(cluster: LoopCluster, request: pytest.FixtureRequest) -> Iterator[tqueue.Client]:
    with tqueue.Client(cluster.address, config=ROUTES[request.param]) as c:
        yield c


_names = iter(range(1 << 30))


def _held(cluster: LoopCluster) -> int:
    return cluster.call(lambda: sum(u.data.nbytes for u in cluster.units))


def _turn(n: int, tokens: int, seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": [torch.randint(70_000, 1 << 40, (tokens + i,), generator=g) for i in range(n)],  # wide int64
        "experts": [torch.randint(0, 128, (tokens + i, LAYERS, TOP_K), generator=g, dtype=torch.int32) for i in range(n)],
        "loss_mask": [torch.full((tokens + i,), seed % 2, dtype=torch.int8) for i in range(n)],
    }


def _grow(client: tqueue.Client, cluster: LoopCluster, part: str, turns: int = 4, n: int = 3) -> tuple[Any, dict[str, list]]:
    """A partial put, then ``turns`` appends of one turn each; returns the meta and the whole values."""
    first = _turn(n, 40, seed=0)
    meta = client.put(part, first, version=0, partial=True)
    whole = {f: list(v) for f, v in first.items()}
    at = 40
    for t in range(1, turns + 1):
        turn = _turn(n, 20 + t, seed=t)
        held, sent = _held(cluster), client.stats.wire_bytes
        client.rollouts.complete(meta, turn, version=t, first_token=at, append=list(turn), finished=t == turns)
        new = sum(x.numel() * x.element_size() for v in turn.values() for x in v)
        assert _held(cluster) - held <= new  # the turn's rows only (routed experts packed narrower)
        assert client.stats.wire_bytes - sent <= new
        for f, v in turn.items():
            whole[f] = [torch.cat([a, b]) for a, b in zip(whole[f], v)]
        at += 20 + t
    return meta, whole


def _check(batch: Any, whole: dict[str, list], meta: Any, base: int) -> None:
    for f, values in whole.items():
        for got, i in zip(batch[f], meta.indexes):
            assert torch.equal(got, values[i - base]), (f, i)


def test_a_trajectory_grown_turn_by_turn_reads_back_whole(cluster: LoopCluster, client: tqueue.Client) -> None:
    part = f"agent-{next(_names)}"
    meta, whole = _grow(client, cluster, part)
    got = client.get_meta(part, list(whole), 3, task="t", timeout=10)
    batch = client.get_data(got)
    _check(batch, whole, got, min(meta.indexes))
    assert [len(s) for s in got.segments] == [5, 5, 5]  # one version per turn
    padded = client.get_data(got, fields=["experts"], jagged="padded", dtype={"experts": torch.uint8})
    assert padded["experts"].dtype == torch.uint8 and padded["experts"].shape[1] == len(whole["experts"][2])


def test_appended_samples_move_checkpoint_overwrite_and_clear(cluster: LoopCluster, tmp_path: pathlib.Path) -> None:
    with tqueue.Client(cluster.address) as c:
        part = f"agent-{next(_names)}"
        start = _held(cluster)
        meta, whole = _grow(c, cluster, part, turns=3)
        got = c.get_meta(part, list(whole), 3, task="t", timeout=10)
        moved = c.rollouts.postpone(got, f"{part}-later")  # the rows go with the samples
        later = c.get_meta(f"{part}-later", list(whole), 3, task="t", timeout=10)
        _check(c.get_data(later), whole, later, min(moved.indexes))
        c.clear(f"{part}-later")
        c.clear(part)
        assert _held(cluster) == start  # every appended row freed with its sample

    with LoopCluster(num_storage_units=1) as old, tqueue.Client(old.address) as c:
        meta, whole = _grow(c, old, "agent-ck", turns=2)
        c.save_checkpoint(tmp_path / "ck", metadata=None)
        before = _held(old)
        c.update(meta, {"tokens": [torch.arange(5) for _ in range(3)]})  # an overwrite replaces every row
        assert _held(old) < before
        got = c.get_meta("agent-ck", ["tokens"], 3, task="t", timeout=10)
        assert all(x.tolist() == list(range(5)) for x in c.get_data(got)["tokens"])
    with LoopCluster(num_storage_units=1) as new, tqueue.Client(new.address) as c:
        c.load_checkpoint(tmp_path / "ck")  # each appended sample joined in its file, whole again
        got = c.get_meta("agent-ck", list(whole), 3, task="t", timeout=10)
        _check(c.get_data(got), whole, got, min(got.indexes))
        c.rollouts.complete(got, _turn(3, 5, seed=9), version=9, first_token=1000, append=list(whole))  # and grows on


def test_an_append_to_a_field_shared_by_content_or_of_objects_is_refused(client: tqueue.Client) -> None:
    part = f"agent-{next(_names)}"
    client.create_partition(part, dedup=["image"])
    meta = client.put(part, {"image": [torch.zeros(4)] * 2, "obj": [{"a": 1}, {"b": 2}], "t": [torch.arange(2)] * 2},
                      partial=True)
    with pytest.raises(tqueue.errors.SchemaError, match=f"field 'image' of partition '{part}' is shared by content"):
        client.rollouts.complete(meta, {"image": [torch.zeros(1)] * 2}, version=1, first_token=0, append=["image"], finished=False)
    with pytest.raises(tqueue.errors.SchemaError, match="only jagged tensor fields the partition holds grow by appends"):
        client.rollouts.complete(meta, {"obj": [{"c": 3}] * 2}, version=1, first_token=0, append=["obj"], finished=False)


def test_appended_rows_read_narrow_over_a_socket_are_joined(client: tqueue.Client) -> None:
    """Rows of expert ids under 128 travel packed (int8); a reader widens them for their
    checksums and still joins each sample's rows (the widened block keeps its rows per sample)."""
    part = f"agent-{next(_names)}"
    g = torch.Generator().manual_seed(3)
    turns = [[torch.randint(0, 128, (400, LAYERS, TOP_K), generator=g, dtype=torch.int32) for _ in range(4)]
             for _ in range(3)]
    meta = client.put(part, {"experts": turns[0]}, version=0, partial=True)
    for t in (1, 2):
        client.rollouts.complete(meta, {"experts": turns[t]}, version=t, first_token=400 * t, append=["experts"],
                                 finished=t == 2)
    got = client.get_meta(part, ["experts"], 4, task="t", timeout=10)
    batch = client.get_data(got)
    for k, i in enumerate(got.indexes):
        s = meta.indexes.index(i)
        assert torch.equal(batch["experts"][k], torch.cat([turns[t][s] for t in range(3)]))
