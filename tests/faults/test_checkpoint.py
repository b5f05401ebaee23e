"""A checkpoint killed halfway: the whole cluster SIGKILLed (by pid) while the units write
their payload files. The manifest still names the previous checkpoint, whose files are
untouched, and it restores exactly."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time
import zlib

import pytest
import torch

import tqueue
from tqueue.errors import TQueueError

from ._proc import until


def test_a_checkpoint_killed_while_units_write_leaves_the_previous_one_restorable(tmp_path: pathlib.Path) -> None:
    first = {"x": torch.arange(40, dtype=torch.float32).reshape(20, 2), "tag": [f"s{i}" for i in range(20)]}
    with tqueue.LocalCluster(num_storage_units=2) as old, tqueue.Client(old.address) as c:
        c.put("kept", first)
        c.get_meta("kept", ["x"], 5, task="t")  # leased at the checkpoint
        done = c.save_checkpoint(tmp_path, metadata={"n": 1})
        before = json.loads((tmp_path / "manifest.json").read_text())
        assert before["generation"] == done.generation
        for k in range(12):  # 192 MiB more: the next checkpoint's files take a while
            c.put("more", {"y": torch.full((64, 256 << 10), k, dtype=torch.uint8)})
        outcome: list[BaseException | object] = []

        def second() -> None:
            try:
                outcome.append(c.save_checkpoint(tmp_path, metadata={"n": 2}))
            except BaseException as exc:  # the cluster is killed under it
                outcome.append(exc)

        saver = threading.Thread(target=second)
        saver.start()

        def writing() -> bool:
            gens = [p for p in tmp_path.iterdir() if p.name.startswith("gen-") and p.name != done.generation]
            return any(q.name.startswith("unit-") for g in gens for q in g.iterdir())

        until(writing, 60, "a unit starts writing the second checkpoint's payload", every=0.005)
        for pid in old.pids:
            os.kill(pid, signal.SIGKILL)
        saver.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], TQueueError), outcome
    assert json.loads((tmp_path / "manifest.json").read_text()) == before
    with tqueue.LocalCluster(num_storage_units=1) as new, tqueue.Client(new.address) as c:
        assert c.load_checkpoint(tmp_path) == {"n": 1}
        assert [p.name for p in c.status().partitions] == ["kept"]
        meta = c.get_meta("kept", ["x", "tag"], 20, task="t", timeout=10)  # the lease came back
        batch = c.get_data(meta)
        order = torch.tensor(meta.indexes)
        assert torch.equal(batch["x"], first["x"][order]) and batch["tag"] == [first["tag"][i] for i in meta.indexes]
        with pytest.raises(tqueue.errors.WaitTimeoutError):
            c.get_meta("kept", ["x"], 1, task="t", timeout=0.3)


def test_a_checkpoint_taken_under_traffic_restores_what_was_acknowledged_before_it(tmp_path: pathlib.Path) -> None:
    """A producer puts and a consumer reads and acks while the checkpoint is taken; then the
    cluster is SIGKILLed and the checkpoint loaded into 3 units. Every put acknowledged before
    the checkpoint began is back, with its CRC; nothing that was never acknowledged is; every
    ack returned before it began still counts, and what the task had not consumed it reads."""
    puts: list[tuple[float, list[int], list[int]]] = []  # (returned at, indexes, crcs)
    acks: list[tuple[float, list[int]]] = []
    stop = threading.Event()
    warm = threading.Event()
    failures: list[BaseException] = []

    def produce(address: str) -> None:
        try:
            with tqueue.Client(address) as c:
                g = torch.Generator().manual_seed(0)
                while not stop.is_set():
                    x = torch.randint(0, 256, (4, 1024), dtype=torch.uint8, generator=g)
                    crcs = [zlib.crc32(row.numpy().tobytes()) for row in x]
                    meta = c.put("stream", {"x": x, "crc": crcs})
                    puts.append((time.monotonic(), list(meta.indexes), crcs))
                    if len(puts) >= 30:
                        warm.set()
        except BaseException as exc:
            failures.append(exc)

    def consume(address: str) -> None:
        try:
            with tqueue.Client(address) as c:
                while not stop.is_set():
                    try:
                        meta = c.get_meta("stream", ["x", "crc"], 4, task="train", timeout=0.5)
                    except tqueue.errors.WaitTimeoutError:
                        continue
                    batch = c.get_data(meta)
                    assert [zlib.crc32(r.numpy().tobytes()) for r in batch["x"]] == batch["crc"]
                    c.ack(meta)
                    acks.append((time.monotonic(), list(meta.indexes)))
        except BaseException as exc:
            failures.append(exc)

    with tqueue.LocalCluster(num_storage_units=2) as old:
        workers = [threading.Thread(target=f, args=(old.address,)) for f in (produce, consume)]
        for w in workers:
            w.start()
        try:
            assert warm.wait(60), f"the producer did not get going: {failures}"
            with tqueue.Client(old.address) as c:
                begin = time.monotonic()
                info = c.save_checkpoint(tmp_path)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=60)
        assert not failures, failures
        for pid in old.pids:
            os.kill(pid, signal.SIGKILL)
    crc_of = {i: crc for _, idx, crcs in puts for i, crc in zip(idx, crcs)}
    before = {i for t, idx, _ in puts if t < begin for i in idx}
    acked = {i for t, idx in acks if t < begin for i in idx}
    with tqueue.LocalCluster(num_storage_units=3) as new, tqueue.Client(new.address) as c:
        c.load_checkpoint(tmp_path)
        part = c.status().partitions[0]
        assert part.samples == info.samples and part.ready == part.samples
        every = c.get_meta("stream", ["x", "crc"], part.samples, task="audit", timeout=10)
        batch = c.get_data(every)
        assert [zlib.crc32(r.numpy().tobytes()) for r in batch["x"]] == batch["crc"]
        assert all(crc_of[i] == crc for i, crc in zip(every.indexes, batch["crc"]))  # never an unacknowledged put
        assert before <= set(every.indexes)
        train = part.tasks["train"]
        left = c.get_meta("stream", ["x"], part.samples - train.consumed, task="train", timeout=10) if part.samples > train.consumed else None
        unread = set(left.indexes) if left is not None else set()
        assert not (unread & acked) and train.consumed >= len(acked)
        assert len(unread) + train.consumed == part.samples
        print(f"\n{len(before)} samples put before the checkpoint began, {info.samples} in it, "
              f"{len(acked)} acked before it, {train.consumed} consumed in it; pause {1e3 * info.pause:.1f} ms")
