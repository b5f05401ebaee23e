"""The transfer_queue shim over a real tqueue cluster (processes and sockets on 127.0.0.1).
Needs the shim installed (pip install -e compat/transferqueue), hence the integration tier."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tqueue

pytestmark = pytest.mark.integration

tq = pytest.importorskip("transfer_queue")
TensorDict = pytest.importorskip("tensordict").TensorDict


@pytest.fixture(scope="module")
def shim() -> Iterator[Any]:
    conf = tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    assert conf.controller.zmq_info.startswith("tcp://127.0.0.1:")
    yield tq
    tq.close()


def test_put_fetch_get_clear_round_trip(shim: Any) -> None:
    client = shim.get_client()
    td = TensorDict(
        {
            "ids": torch.arange(6).reshape(3, 2),
            "reward": torch.tensor([0.5, 1.0, 1.5]),
            "resp": torch.nested.as_nested_tensor([torch.ones(1), torch.ones(3), torch.ones(2)], layout=torch.jagged),
        },
        batch_size=[3],
    )
    put = client.put(td, partition_id="rt")
    assert put.size == 3 and put.is_ready and put.field_names == ["ids", "resp", "reward"]
    meta = client.get_meta(["ids", "resp", "reward"], 3, "rt", task_name="train")
    assert meta.global_indexes == put.global_indexes
    data = client.get_data(meta)
    assert data["ids"].is_nested and torch.equal(data["ids"].to_padded_tensor(0), td["ids"])
    assert torch.equal(data["reward"], td["reward"])
    assert [t.shape[0] for t in data["resp"].unbind()] == [1, 3, 2]
    # fetch consumes at once, as TransferQueue's does
    assert client.check_consumption_status("train", "rt")
    back = client.put(TensorDict({"adv": torch.zeros(3)}, batch_size=[3]), metadata=meta)
    assert back.field_names == ["adv", "ids", "resp", "reward"]
    assert torch.equal(client.get_data(back.select_fields(["adv"]))["adv"], torch.zeros(3))
    assert "rt" in client.get_partition_list()
    client.clear_partition("rt")
    assert "rt" not in client.get_partition_list()


def test_non_tensor_fields_come_back_as_non_tensor_stack(shim: Any) -> None:
    from tensordict import NonTensorStack

    client = shim.get_client()
    td = TensorDict({"x": torch.zeros(2), "prompt": NonTensorStack("a", "bc")}, batch_size=[2])
    meta = client.get_meta(["prompt"], 2, client.put(td, partition_id="nt").partition_ids[0], task_name="t")
    got = client.get_data(meta).get("prompt")
    assert isinstance(got, NonTensorStack) and got.tolist() == ["a", "bc"]


def test_arbitrary_objects_are_refused_at_put(shim: Any) -> None:
    from tensordict import NonTensorStack

    td = TensorDict({"obj": NonTensorStack(object(), object())}, batch_size=[2])
    with pytest.raises(tqueue.FieldTypeError, match="obj"):
        shim.get_client().put(td, partition_id="objs")


def test_data_parser_is_refused_by_design(shim: Any) -> None:
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(NotImplementedError, match="data_parser .* refused .* apply it to the data before the put"):
        shim.get_client().put(td, partition_id="p", data_parser=lambda d: d)


def test_missing_features_name_what_they_wait_for(shim: Any) -> None:
    from transfer_queue._errors import NotYetSupportedError

    with pytest.raises(NotYetSupportedError, match="kv_batch_put .* key index"):
        shim.kv_batch_put(keys=["a"], partition_id="p", tags=[{}])
    with pytest.raises(NotYetSupportedError, match="force_fetch"):
        shim.get_client().get_meta(["x"], 1, "p", mode="force_fetch", task_name="t")


def test_init_refuses_sampler_objects_and_other_backends() -> None:
    code = (
        "import transfer_queue as tq\n"
        "class Mine(tq.BaseSampler):\n"
        "    def sample(self, ready, n, *a, **k): return ready[:n], ready[:n]\n"
        "for conf in ({'controller': {'sampler': Mine()}}, {'backend': {'storage_backend': 'MooncakeStore'}}):\n"
        "    try:\n"
        "        tq.init(conf)\n"
        "    except NotImplementedError as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "NotSupportedError a sampler object (Mine) pickled into the controller" in done.stdout, done.stdout + done.stderr
    assert "NotSupportedError storage backend 'MooncakeStore'" in done.stdout, done.stdout + done.stderr


def test_a_child_process_attaches_with_init(shim: Any) -> None:
    code = (
        "import torch, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "tq.init()\n"
        "tq.get_client().put(TensorDict({'v': torch.ones(4)}, batch_size=[4]), partition_id='child')\n"
        "tq.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    meta = shim.get_client().get_meta(["v"], 4, "child", task_name="t")
    assert torch.equal(shim.get_client().get_data(meta)["v"], torch.ones(4))


def test_polling_mode_returns_an_empty_meta(monkeypatch: pytest.MonkeyPatch, shim: Any) -> None:
    from transfer_queue.client import POLLING_ENV

    monkeypatch.setenv(POLLING_ENV, "1")
    meta = shim.get_client().get_meta(["never"], 2, "empty-partition", task_name="t")
    assert meta.size == 0 and meta.global_indexes == [] and not meta.is_ready


def test_checkpoint_round_trip_with_user_metadata(tmp_path: Any) -> None:
    code = (
        "import json, sys, torch, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "tq.init()\n"
        "tq.get_client().put(TensorDict({'v': torch.arange(3.0)}, batch_size=[3]), partition_id='ck')\n"
        "tq.save_checkpoint(sys.argv[1], metadata={'global_steps': 7})\n"
        "tq.close()\n"
        "tq.init()\n"
        "tq.load_checkpoint(sys.argv[1])\n"
        "c = tq.get_client()\n"
        "print(c.get_data(c.get_meta(['v'], 3, 'ck', task_name='t'))['v'].tolist())\n"
        "print(json.load(open(sys.argv[1] + '/metadata.json')))\n"
        "tq.close()\n"
    )
    # a cluster of its own: not the one the module's fixture exported to child processes
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[0.0, 1.0, 2.0]" in done.stdout
    assert "'storage_saved': True, 'user_metadata': {'global_steps': 7}" in done.stdout, done.stdout
    assert not (tmp_path / "metadata.json.tmp").exists()


def test_transfer_queue_checkpoints_are_refused(shim: Any, tmp_path: Any) -> None:
    (tmp_path / "controller_state.pkl").write_bytes(b"")
    with pytest.raises(NotImplementedError, match="TransferQueue checkpoint .pickle.* refused"):
        shim.load_checkpoint(tmp_path)
