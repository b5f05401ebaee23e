"""A checkpoint killed halfway: the whole cluster SIGKILLed (by pid) while the units write
their payload files. The manifest still names the previous checkpoint, whose files are
untouched, and it restores exactly."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading

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
