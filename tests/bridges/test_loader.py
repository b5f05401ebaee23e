"""The streaming loader, with real DataLoader worker processes: every sample reaches the
trainer once and is acked once the trainer is done with it, in the trainer's process; a
trainer SIGKILLed leaves exactly its unacked samples to the next trainer; a worker SIGKILLed
holding a leased batch loses nothing and duplicates nothing; pad rows never reach
``transform``; the last batch of each step says so. A client used after a fork raises
ForkedClientError, and one made in the child works.

Deaths and holds are handshakes (pipes, queues, events); lease timeouts are short, so the
samples of a dead holder come back within seconds."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import pytest
import torch

import tqueue
from tqueue.bridges.loader import StepBatch, StepStream, loader

LEASE = 3.0  # seconds: what a dead holder's samples take to come back


def produce(address: str, names: list[str], per_step: int, *, auto_free: bool = True) -> list[int]:
    values = []
    with tqueue.Client(address) as c:
        for k, name in enumerate(names):
            xs = [k * 1000 + i for i in range(per_step)]
            c.create_partition(name, tasks=["train"], auto_free=auto_free)
            c.put(name, {"x": torch.tensor(xs), "ids": [torch.full((i % 7 + 1,), i) for i in range(per_step)]})
            c.seal(name)
            values += xs
    return values


def train_task(client: tqueue.Client, name: str) -> Any:
    return {p.name: p for p in client.status().partitions}[name].tasks["train"]


def what_transform_saw(batch: tqueue.Batch) -> dict[str, Any]:
    return {
        "x": batch["x"].tolist(),
        "ids": batch["ids"],
        "rows": batch.size,
        "pad_rows": batch.meta.pads + int(batch.is_pad.sum()),
    }


def test_two_workers_over_three_steps_every_sample_once_acked_once_done(cluster, partition):
    names = [f"{partition}-{k}" for k in range(3)]
    values = produce(cluster.address, names, 23)  # not a multiple of the batch: a padded last batch
    stream = StepStream(cluster.address, names, ["x", "ids"], 5, lease_timeout=120, transform=what_transform_saw)
    delivered: list[tuple[str, list[int], bool]] = []
    acked: dict[str, int] = collections.Counter()
    with tqueue.Client(cluster.address) as c:
        for batch in loader(stream, num_workers=2):
            assert isinstance(batch, StepBatch)
            assert batch["pad_rows"] == 0 and batch["rows"] == len(batch["x"]) == len(batch.meta.indexes)
            assert 0 < len(batch["x"]) <= 5 and -1 not in batch.meta.indexes
            for x, ids in zip(batch["x"], batch["ids"]):
                assert ids.tolist() == [x % 1000] * (x % 1000 % 7 + 1)  # fields of one sample together
            name = batch.meta.partition
            # acked: exactly the batches the trainer asked past, though the workers prefetch
            assert train_task(c, name).consumed == acked[name]
            delivered.append((name, batch["x"], batch.end_of_step))
            acked[name] += len(batch["x"])
        assert not [p.name for p in c.status().partitions if p.name.startswith(partition)]  # all acked: freed
    seen = [x for _, xs, _ in delivered for x in xs]
    assert sorted(seen) == values and len(seen) == len(set(seen))
    order = [name for name, _, _ in delivered]
    assert order == sorted(order)  # a step's batches all come before the next step's
    for name in names:  # one last batch per step: the last one the trainer got from it
        ends = [end for n, _, end in delivered if n == name]
        assert ends == [False] * (len(ends) - 1) + [True]


def _train_three_then_hang(address: str, name: str, out) -> None:
    stream = StepStream(address, [name], ["x"], 4, lease_timeout=LEASE)
    for n, batch in enumerate(loader(stream, num_workers=2), 1):
        out.send(batch["x"].tolist())
        if n == 3:
            out.recv()  # training the third batch until killed


def test_a_trainer_killed_leaves_exactly_its_unacked_samples_to_the_next(cluster, partition):
    values = produce(cluster.address, [partition], 40, auto_free=False)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    trainer = ctx.Process(target=_train_three_then_hang, args=(cluster.address, partition, theirs))
    trainer.start()
    workers: list[int] = []
    try:
        first = []
        for _ in range(3):
            assert mine.poll(90)
            first.append(mine.recv())
        with tqueue.Client(cluster.address) as c:
            task = train_task(c, partition)
            # the two batches it asked past are acked, and nothing else: not the one it
            # trains, not those its workers prefetched
            assert task.consumed == len(first[0]) + len(first[1]) == 8
            assert task.leased >= 4
        workers += _children(trainer.pid)  # its loader's workers: orphaned by the kill
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(30)
        # the next trainer gets every sample the dead one did not ack, once: its
        # workers' prefetched batches and the one it held return at their leases' expiry
        stream = StepStream(cluster.address, [partition], ["x"], 4, lease_timeout=LEASE)
        second = [x for batch in loader(stream, num_workers=2) for x in batch["x"].tolist()]
        with tqueue.Client(cluster.address) as c:
            task = train_task(c, partition)
            assert task.consumed == 40 and task.leased == 0
            c.clear(partition)
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join()
        for pid in workers:  # a worker blocked in a wait outlives its
            with contextlib.suppress(ProcessLookupError):  # killed parent: stopped here, by pid
                os.kill(pid, signal.SIGKILL)
    done = set(first[0] + first[1])
    assert sorted(second) == sorted(set(values) - done)  # each once, and none of the acked
    assert set(first[2]) <= set(second)  # the batch it was training when killed comes again


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (Linux: /proc)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


class HoldWorkers:
    """A transform that holds each worker at its first batch until ``go``, then worker 0 at
    its second for good, reporting its pid and that batch's samples (leased, undelivered)."""

    def __init__(self, ctx: Any) -> None:
        self.ready = ctx.Queue()
        self.go = ctx.Event()
        self.holding = ctx.Queue()
        self.calls = 0  # in each worker's own copy

    def __call__(self, batch: tqueue.Batch) -> dict[str, Any]:
        worker = torch.utils.data.get_worker_info().id
        xs = batch["x"].tolist()
        self.calls += 1
        if self.calls == 1:
            self.ready.put(worker)
            self.go.wait(60)
        elif self.calls == 2 and worker == 0:
            self.holding.put((os.getpid(), xs))
            threading.Event().wait()  # until SIGKILL
        return {"x": xs, "worker": worker}


def test_a_worker_killed_loses_nothing_and_duplicates_nothing(cluster, partition):
    values = produce(cluster.address, [partition], 40, auto_free=False)
    hold = HoldWorkers(mp.get_context("spawn"))
    stream = StepStream(cluster.address, [partition], ["x"], 4, lease_timeout=LEASE, transform=hold)
    batches = iter(loader(stream, num_workers=2))  # starts the workers
    # PyTorch's SIGCHLD handler would raise the worker's death at any line of this test; by
    # default the DataLoader finds it when it next waits for a batch (after 5 s)
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    delivered: list[tuple[int, list[int]]] = []
    undelivered = None
    try:
        assert {hold.ready.get(timeout=90) for _ in range(2)} == {0, 1}
        hold.go.set()
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for batch in batches:
                delivered.append((batch["worker"], batch["x"]))
                if batch["worker"] == 0 and undelivered is None:
                    # the trainer holds worker 0's first batch, and worker 0 a lease on its
                    # second, which it never hands over: it dies now
                    pid, undelivered = hold.holding.get(timeout=60)
                    os.kill(pid, signal.SIGKILL)
    finally:
        signal.signal(signal.SIGCHLD, handler)
        del batches
    counts = collections.Counter(x for _, xs in delivered for x in xs)
    assert sorted(counts) == values and set(counts.values()) == {1}
    # the dead worker's undelivered batch came once, from the other worker, after its lease
    # expired; the batch it had handed over was acked by the trainer and never came again
    assert {w for w, xs in delivered if set(xs) & set(undelivered)} == {1}
    with tqueue.Client(cluster.address) as c:
        task = train_task(c, partition)
        assert (task.consumed, task.leased, task.expired) == (40, 0, 4)
        c.clear(partition)


def test_manual_acks_hold_a_step_until_its_last_batch(cluster, partition):
    names = [f"{partition}-{k}" for k in range(2)]
    produce(cluster.address, names, 6, auto_free=False)
    stream = StepStream(cluster.address, names, ["x"], 4, ack="manual", lease_timeout=60)
    with tqueue.Client(cluster.address) as c:
        step: list[StepBatch] = []
        ends = []
        for batch in stream:
            step.append(batch)
            assert train_task(c, batch.meta.partition).consumed == 0  # nothing acked for the trainer
            if batch.end_of_step:  # e.g. after an optimizer step over the whole step
                ends.append([len(b.meta.indexes) for b in step])
                for b in step:
                    stream.ack(b)
                assert train_task(c, batch.meta.partition).consumed == 6
                step = []
        assert ends == [[4, 2], [4, 2]]
        # asking past a step's last batch while holding its batches would only wait for
        # their leases to lapse: it raises instead
        for name in names:
            c.clear(name)
        produce(cluster.address, names, 6, auto_free=False)
        batches = iter(stream)
        assert not next(batches).end_of_step and next(batches).end_of_step
        with pytest.raises(tqueue.InvalidArgumentError, match=f"2 batches of partition '{names[0]}' are not acked"):
            next(batches)
        for name in names:
            c.clear(name)
    stream.close()


def _take_one_and_wait(address: str, name: str, out) -> None:
    stream = StepStream(address, [name], ["x"], 4, lease_timeout=LEASE)
    batch = next(iter(stream))
    out.send(batch["x"].tolist())
    out.recv()  # blocks until killed


def test_a_reader_killed_holding_a_batch_loses_nothing(cluster, partition):
    values = produce(cluster.address, [partition], 12)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_take_one_and_wait, args=(cluster.address, partition, theirs))
    proc.start()
    try:
        assert mine.poll(60)
        taken = mine.recv()
        assert len(taken) == 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        # the survivor gets everything: the dead reader's batch once its lease expires
        seen = [x for batch in StepStream(cluster.address, [partition], ["x"], 4, lease_timeout=60) for x in batch["x"].tolist()]
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert sorted(seen) == values and set(taken) <= set(seen)


def _use_after_fork(client: tqueue.Client, address: str, name: str, out) -> None:
    try:
        client.status()
        out.send("no error")
    except tqueue.ForkedClientError as exc:
        out.send(str(exc))
    with tqueue.Client(address) as fresh:  # a client made in the child works
        fresh.put(name, {"x": torch.tensor([7])})
    out.send("put")


def test_a_client_used_after_fork_raises_and_one_made_in_the_child_works(cluster, partition):
    with tqueue.Client(cluster.address) as client:
        client.status()
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_use_after_fork, args=(client, cluster.address, partition, theirs))
        proc.start()
        assert mine.poll(60)
        message = mine.recv()
        assert mine.poll(60) and mine.recv() == "put"
        proc.join(30)
        assert proc.exitcode == 0
        assert f"this client was made in process {os.getpid()} and used in process {proc.pid}, forked from it" in message
        assert client.get_data(partition, ["x"], 1, task="t", timeout=10)["x"].tolist() == [7]
