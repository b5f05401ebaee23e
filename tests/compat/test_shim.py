"""The transfer_queue shim over a real tqueue cluster (processes and sockets on 127.0.0.1).
Needs the shim installed (pip install -e compat/transferqueue), hence the integration tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
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


def test_vlm_values_with_tensors_inside_travel_without_pickle(shim: Any) -> None:
    """vime's multimodal_train_inputs (a dict of tensors, None for a text-only sample) and its
    ragged micro_batch_indices, in one put, come back exactly."""
    from tensordict import NonTensorStack

    image = {"pixel_values": torch.randn(4, 3, dtype=torch.bfloat16), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    grid = np.arange(6, dtype=np.int32).reshape(2, 3)
    td = TensorDict({
        "multimodal_train_inputs": NonTensorStack(image, None, {"grid": grid}),
        "micro_batch_indices": NonTensorStack([[0, 1], [2]], [[0]], []),
        "x": torch.arange(3),
    }, batch_size=[3])
    meta = shim.get_client().put(td, partition_id="vlm")
    back = shim.get_client().get_data(meta)
    mm = back["multimodal_train_inputs"].tolist()
    assert mm[1] is None and set(mm[0]) == {"pixel_values", "image_grid_thw"}
    assert mm[0]["pixel_values"].dtype == torch.bfloat16 and torch.equal(mm[0]["pixel_values"], image["pixel_values"])
    assert torch.equal(mm[0]["image_grid_thw"], image["image_grid_thw"])
    assert isinstance(mm[2]["grid"], np.ndarray) and mm[2]["grid"].dtype == np.int32 and (mm[2]["grid"] == grid).all()
    assert back["micro_batch_indices"].tolist() == [[[0, 1], [2]], [[0]], []]
    with pytest.raises(tqueue.FieldTypeError, match=r"multimodal_train_inputs.*\['pixel_values'\]"):
        shim.get_client().put(TensorDict({"multimodal_train_inputs": NonTensorStack({"pixel_values": {1, 2}})},
                                         batch_size=[1]), partition_id="vlm")
    shim.get_client().clear_partition("vlm")


def test_data_parser_is_refused_by_design(shim: Any) -> None:
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(NotImplementedError, match="data_parser .* refused .* apply it to the data before the put"):
        shim.get_client().put(td, partition_id="p", data_parser=lambda d: d)


def test_insert_allocates_rows_that_puts_fill_field_by_field(shim: Any) -> None:
    """``get_meta(mode="insert")`` over tqueue's ``allocate``: rows with no data, production
    status 0, filled by ``put(metadata=)`` in two rounds; readers see them once complete; and
    ``kv_retrieve_meta(create=True)`` allocates rows for new keys."""
    client = shim.get_client()
    rows = client.get_meta(["x", "y"], 3, "ins", mode="insert")
    assert rows.size == 3 and rows.production_status.tolist() == [0, 0, 0] and set(rows.field_schema) == {"x", "y"}
    client.put(TensorDict({"x": torch.arange(3.0)}, batch_size=[3]), metadata=rows)
    assert client.check_production_status(data_fields=["x"], partition_id="ins")
    assert not client.check_production_status(data_fields=["x", "y"], partition_id="ins")
    client.put(TensorDict({"y": torch.arange(3) * 2}, batch_size=[3]), metadata=rows)
    got = client.get_data(client.get_meta(["x", "y"], 3, "ins", task_name="t"))
    assert got["x"].tolist() == [0.0, 1.0, 2.0] and got["y"].tolist() == [0, 2, 4]
    made = client.kv_retrieve_meta(["k1", "k2"], "kv-ins", create=True)
    client.put(TensorDict({"x": torch.tensor([7.0, 8.0])}, batch_size=[2]), metadata=made)
    assert client.get_data(client.kv_retrieve_meta(["k2", "k1"], "kv-ins"))["x"].tolist() == [8.0, 7.0]


def test_force_fetch_neither_leases_nor_consumes(shim: Any) -> None:
    client = shim.get_client()
    client.put(TensorDict({"x": torch.arange(3.0)}, batch_size=[3]), partition_id="ff")
    client.get_meta(["x"], 2, "ff", task_name="t")  # fetch: consumed at once
    peek = client.get_meta(["x"], 3, "ff", mode="force_fetch")
    assert client.get_data(peek)["x"].tolist() == [0.0, 1.0, 2.0]
    assert client.get_meta(["x"], 1, "ff", task_name="t").size == 1  # the third is still there for t
    with pytest.raises(tqueue.WaitTimeoutError, match="force_fetch.* has 3 samples .* 4 were asked for"):
        client.get_meta(["x"], 4, "ff", mode="force_fetch")
    indexes, status = client.get_production_status(["x"], "ff")
    assert indexes.tolist() == peek.global_indexes and status.tolist() == [1, 1, 1]
    indexes, consumed = client.get_consumption_status("t", "ff")
    assert indexes.tolist() == peek.global_indexes and consumed.tolist() == [1, 1, 1]
    assert client.get_consumption_status("t", "no-such-partition") == (None, None)
    assert client.reset_consumption("ff", "t") and not client.check_consumption_status("t", "ff")
    assert client.get_consumption_status("t", "ff")[1].tolist() == [0, 0, 0]


def test_init_refuses_sampler_objects_and_other_backends() -> None:
    code = (
        "import transfer_queue as tq\n"
        "class Mine(tq.BaseSampler):\n"
        "    def sample(self, ready, n, *a, **k): return ready[:n], ready[:n]\n"
        "for conf in ({'controller': {'sampler': Mine()}}, {'backend': {'storage_backend': 'MooncakeStore'}}):\n"
        "    try:\n"
        "        tq.init(conf)\n"
        "    except (NotImplementedError, TypeError) as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # a class with no file to import it from cannot reach the controller
    assert "TypeError sampler Mine is defined in an interactive session" in done.stdout, done.stdout + done.stderr
    assert "NotSupportedError storage backend 'MooncakeStore'" in done.stdout, done.stdout + done.stderr


USER_SAMPLER = """
import sys
import numpy as np
import torch
from tensordict import TensorDict
import transfer_queue as tq


class HighestScore(tq.BaseSampler):
    def __init__(self, keep=0):
        super().__init__()
        self.keep = keep

    def sample(self, ready_indexes, batch_size, *args, scores=None, **kwargs):
        order = np.argsort(-np.asarray(scores)[ready_indexes], kind="stable")[:batch_size]
        chosen = sorted(ready_indexes[i] for i in order)
        return chosen, chosen


if __name__ == "__main__":
    sampler = HighestScore()
    sampler.keep = 3  # attributes travel as JSON
    tq.init({"controller": {"sampler": sampler}, "backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    client = tq.get_client()
    client.put(TensorDict({"x": torch.arange(6).view(6, 1)}, batch_size=[6]), partition_id="p")
    meta = client.get_meta(["x", "x"], 2, "p", task_name="t", sampling_config={"scores": np.array([0, 9, 1, 8, 2, 3])})
    print("chosen", meta.global_indexes, meta.field_names)
    try:
        tq.close()
        tq.init({"controller": {"zmq_info": sys.argv[1]}, "backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    except Exception as e:
        print("unexpected", e)
    tq.close()
    import os
    os.environ.pop("TQUEUE_ADDRESS", None)
    try:
        tq.init({"controller": {"sampler": sampler, "zmq_info": sys.argv[1]}})
    except NotImplementedError as e:
        print(type(e).__name__, e)
"""


def test_a_sampler_of_ones_own_runs_in_the_controller_init_starts(shim: Any, tmp_path: Any) -> None:
    """A BaseSampler subclass defined in a script: the controller imports the script's class,
    gets its attributes as JSON and calls sample() with sampling_config; a cluster that is
    running already cannot be given one."""
    script = tmp_path / "mine.py"
    script.write_text(USER_SAMPLER)
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    address = shim.get_client()._client.address
    done = subprocess.run([sys.executable, str(script), address], capture_output=True, text=True, timeout=120, env=env)
    assert "chosen [1, 3] ['x']" in done.stdout, done.stdout + done.stderr  # the highest scores; a field named twice read once
    assert "unexpected" not in done.stdout, done.stdout
    assert f"NotSupportedError a sampler of your own (transfer_queue_sampler) for the cluster at {address}" in done.stdout, (
        done.stdout + done.stderr
    )


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


def test_polling_mode_is_the_jobs_in_every_process(tmp_path: Any) -> None:
    """An under-supplied get_meta returns an empty meta in polling mode, also in a process
    that attached without a config: the mode is kept in the cluster."""
    child = (
        "import transfer_queue as tq\n"
        "conf = tq.init()\n"
        "meta = tq.get_client().get_meta(['never'], 2, 'empty-partition', task_name='t')\n"
        "print(conf.controller.polling_mode, meta.size, meta.global_indexes, meta.is_ready)\n"
    )
    parent = (
        "import subprocess, sys, transfer_queue as tq\n"
        "tq.init({'controller': {'polling_mode': True}})\n"
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, timeout=60).stdout)\n"
        "tq.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120, env=env)
    assert "True 0 [] False" in done.stdout, done.stdout + done.stderr


def test_kv_round_trip(shim: Any) -> None:
    shim.kv_batch_put(keys=["u1", "u2"], partition_id="kv", tags=[{"status": "running"}, {"status": "running"}])
    assert shim.kv_list("kv") == {"kv": {"u1": {"status": "running"}, "u2": {"status": "running"}}}
    meta = shim.kv_batch_put(
        keys=["u2", "u1"],
        partition_id="kv",
        fields=TensorDict({"ids": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(5)], layout=torch.jagged)}, batch_size=[2]),
    )
    assert meta.fields == ["ids"] and meta.tags == [{"status": "running"}, {"status": "running"}]
    shim.kv_put(key="u1", partition_id="kv", fields={"reward": torch.tensor(1.5)}, tag={"status": "finished"})
    got = shim.kv_batch_get(keys=["u1", "u2"], partition_id="kv", select_fields="ids")
    assert [t.shape[0] for t in got["ids"].unbind()] == [5, 2]
    with pytest.raises(ValueError, match="Some fields are not ready .*reward"):
        shim.kv_batch_get(keys=["u1", "u2"], partition_id="kv", select_fields=["reward"])
    assert shim.kv_batch_get(keys="u1", partition_id="kv", select_fields=["reward"])["reward"].tolist() == [1.5]
    with pytest.raises(ValueError, match="keys or partition were not found"):
        shim.kv_batch_get(keys=["u1", "nope"], partition_id="kv")
    client = shim.get_client()
    bm = client.kv_retrieve_meta(["u2"], "kv")
    assert client.kv_retrieve_keys(bm.global_indexes, "kv") == ["u2"]
    shim.kv_clear(keys=["u1", "missing"], partition_id="kv")
    assert list(shim.kv_list()["kv"]) == ["u2"]


def test_custom_meta_is_kept_in_the_cluster(shim: Any) -> None:
    client = shim.get_client()
    meta = client.put(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), partition_id="cm")
    meta.update_custom_meta([{"total_lengths": 3}, {"total_lengths": 9}])
    client.set_custom_meta(meta)
    fetched = client.get_meta(["x"], 2, "cm", task_name="t")
    assert fetched.get_all_custom_meta() == [{"total_lengths": 3}, {"total_lengths": 9}]


def test_async_twins(shim: Any) -> None:
    import asyncio

    async def run() -> Any:
        await shim.async_kv_put(key="a", partition_id="tw", fields={"v": torch.tensor([1, 2])}, tag={"n": 1})
        got = await shim.async_kv_batch_get(keys="a", partition_id="tw")
        listed = await shim.get_client().async_kv_list("tw")
        return got, listed

    got, listed = asyncio.run(run())
    assert got["v"].unbind()[0].tolist() == [1, 2] and listed == {"tw": {"a": {"n": 1}}}


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


def test_a_checkpoint_loads_into_the_running_queue(shim: Any, tmp_path: Any) -> None:
    """verl's resume (test_reissue_inflight_on_cpu): keys saved, cleared, loaded back into the
    running cluster, while another partition lives on; a partition in both is replaced."""
    shim.kv_batch_put(["p0", "p1"], "prompts", TensorDict({"x": torch.tensor([[1], [2]])}, batch_size=[2]),
                      tags=[{"status": "pending"}, {"status": "running"}])
    shim.kv_batch_put(["other"], "live", TensorDict({"x": torch.tensor([[9]])}, batch_size=[1]))
    shim.save_checkpoint(tmp_path / "ck", metadata={"global_steps": 3})
    shim.kv_clear(["p0", "p1"], "prompts")
    shim.kv_batch_put(["p2"], "prompts", TensorDict({"x": torch.tensor([[7]])}, batch_size=[1]))  # replaced by the load
    shim.kv_batch_put(["late"], "after", TensorDict({"x": torch.tensor([[5]])}, batch_size=[1]))  # not in the checkpoint
    shim.load_checkpoint(tmp_path / "ck")
    listing = shim.kv_list()
    assert listing["prompts"] == {"p0": {"status": "pending"}, "p1": {"status": "running"}}
    assert shim.kv_batch_get(["p0", "p1"], "prompts", "x")["x"].values().tolist() == [1, 2]
    assert shim.kv_batch_get(["late"], "after", "x")["x"].values().tolist() == [5]
    assert shim.kv_batch_get(["other"], "live", "x")["x"].values().tolist() == [9]
    for partition in ("prompts", "live", "after"):
        shim.get_client().clear_partition(partition)


def test_transfer_queue_checkpoints_are_refused(shim: Any, tmp_path: Any) -> None:
    (tmp_path / "controller_state.pkl").write_bytes(b"")
    with pytest.raises(NotImplementedError, match="TransferQueue checkpoint .pickle.* refused"):
        shim.load_checkpoint(tmp_path)


def test_a_dtype_that_converts_exactly_is_tolerated(shim: Any, caplog: pytest.LogCaptureFixture) -> None:
    shim.kv_put(key="a", partition_id="drift", fields={"mask": torch.ones(3)})
    with caplog.at_level("WARNING", logger="transfer_queue"):
        shim.kv_put(key="b", partition_id="drift", fields={"mask": torch.ones(2, dtype=torch.int64)})
    assert "convert exactly" in caplog.text
    got = shim.kv_batch_get(keys=["a", "b"], partition_id="drift")["mask"]
    assert got.dtype == torch.float32 and [t.tolist() for t in got.unbind()] == [[1.0] * 3, [1.0] * 2]
    with pytest.raises(tqueue.SchemaError, match="dtype"):
        shim.kv_put(key="c", partition_id="drift", fields={"mask": torch.tensor([2**40 + 1])})


def test_load_names_what_is_missing(shim: Any, tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        shim.load_checkpoint(tmp_path / "nonexistent")
    with pytest.raises(FileNotFoundError, match="holds no metadata.json"):
        shim.load_checkpoint(tmp_path)


def test_non_tensor_data_of_one_value_per_row_is_per_sample(shim: Any) -> None:
    import numpy as np
    from tensordict import NonTensorData

    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td["raw"] = NonTensorData(data=np.array([b"a", b"bc"], dtype="|S4"), batch_size=[2])
    td["same"] = NonTensorData(data="all", batch_size=[2])
    client = shim.get_client()
    meta = client.get_meta(["raw", "same"], 2, client.put(td, partition_id="ntd").partition_ids[0], task_name="t")
    got = client.get_data(meta)
    assert got.get("raw").tolist() == [b"a", b"bc"] and got.get("same").tolist() == ["all", "all"]


def test_grpo_sampler_releases_whole_groups_of_each_put() -> None:
    code = (
        "import torch, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "tq.init({'controller': {'sampler': tq.GRPOGroupNSampler(n_samples_per_prompt=2)}})\n"
        "c = tq.get_client()\n"
        "c.put(TensorDict({'r': torch.arange(4.0)}, batch_size=[4]), partition_id='g')\n"
        "print(sorted(c.get_meta(['r'], 2, 'g', task_name='t').global_indexes))\n"
        "print(sorted(c.get_meta(['r'], 2, 'g', task_name='t').global_indexes))\n"
        "try:\n"
        "    c.put(TensorDict({'r': torch.arange(3.0)}, batch_size=[3]), partition_id='g')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "tq.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = done.stdout.splitlines()
    assert sorted(lines[:2]) == ["[0, 1]", "[2, 3]"], done.stdout + done.stderr
    assert "refused: put of 3 rows under GRPOGroupNSampler(n_samples_per_prompt=2): whole groups only" in done.stdout


def test_a_key_named_meanwhile_is_written_in_place(shim: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes putting the same new key: the one whose bind is refused drops its sample
    and writes into the one the key names."""
    import msgspec

    client = shim.get_client()._client
    shim.kv_put(key="k", partition_id="race", fields={"v": torch.tensor([1])})
    real = client.keys.lookup
    stale: list[int] = []

    def as_before_the_other_put(self: Any, partition: str, keys: Any = None, **kw: Any) -> Any:
        found = real(partition, keys, **kw)
        if not stale:  # the first lookup sees the partition as it was before the other put
            stale.append(1)
            return msgspec.structs.replace(found, indexes=[-1] * len(found.indexes), meta=None)
        return found

    monkeypatch.setattr(type(client.keys), "lookup", as_before_the_other_put)  # made at each access
    shim.kv_put(key="k", partition_id="race", fields={"v": torch.tensor([2])})
    monkeypatch.undo()
    assert stale == [1]
    assert shim.kv_batch_get(keys="k", partition_id="race")["v"].unbind()[0].tolist() == [2]
    assert len(client.select("race", ["v"])) == 1


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "two-workers"])
def test_streaming_dataloader_reads_a_partition_once(shim: Any, workers: int) -> None:
    client = shim.get_client()
    partition = f"stream-{workers}"
    client.put(TensorDict({"x": torch.arange(8.0)}, batch_size=[8]), partition_id=partition)
    dataset = shim.StreamingDataset(
        shim.init(), batch_size=2, micro_batch_size=1, data_fields=["x"], partition_id=partition,
        task_name="train", dp_rank=0, should_check_consumption_status=True,
    )
    loader = shim.StreamingDataLoader(dataset, num_workers=workers)
    if workers:  # spawned, not forked from this process and its client's threads
        assert loader.multiprocessing_context.get_start_method() == "spawn"
    seen = [float(td["x"][0]) for td, meta in loader]
    assert sorted(seen) == [float(i) for i in range(8)]


def test_metrics_endpoint_is_the_controllers() -> None:
    code = (
        "import urllib.request, transfer_queue as tq\n"
        "tq.init()\n"
        "print(tq.get_metrics_endpoint())\n"
        "tq.close()\n"
        "tq.init({'metrics': {'enabled': True, 'port': 0}})\n"
        "url = tq.get_metrics_endpoint()\n"
        "print(url.startswith('http://127.0.0.1:'), b'tqueue' in urllib.request.urlopen(url, timeout=10).read())\n"
        "tq.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.splitlines() == ["None", "True True"], done.stdout + done.stderr


def test_an_init_that_fails_leaves_no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer_queue.interface as iface

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise tqueue.ControllerUnavailableError("simulated: the controller went away")

    monkeypatch.delenv("TQUEUE_ADDRESS", raising=False)
    monkeypatch.setattr(iface, "_state", {"config": None, "cluster": None, "client": None, "registry": []})  # not the module's shim
    started: list[tqueue.LocalCluster] = []
    real_start = tqueue.LocalCluster.start

    def start(self: tqueue.LocalCluster) -> tqueue.LocalCluster:
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(tqueue.LocalCluster, "start", start)
    monkeypatch.setattr(iface.TransferQueueClient, "__init__", refuse)
    with pytest.raises(tqueue.ControllerUnavailableError, match="simulated"):
        iface.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    assert len(started) == 1 and all(p.poll() is not None for p in started[0]._procs)
    assert iface._state["cluster"] is None and "TQUEUE_ADDRESS" not in os.environ


def _child_json(code: str) -> Any:
    """Run ``code`` in a child whose init starts a cluster of its own (the module's address
    left out of its environment); the JSON of its last line of output, with its tq.close()."""
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code + "print(json.dumps(out))\ntq.close()\n"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rank_aware_sampler_gives_one_dp_rank_the_same_samples_and_others_their_own() -> None:
    """``controller.sampler: RankAwareSampler`` over tqueue's rounds of a replica group: two
    ranks of dp_rank 0 (two clients, as two processes would be) read identical samples batch
    after batch, whichever asks first; dp_rank 1 reads others."""
    code = (
        "import os, torch, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "from transfer_queue.client import TransferQueueClient\n"
        "tq.init({'controller': {'sampler': 'RankAwareSampler', 'polling_mode': True}})\n"
        "address = os.environ['TQUEUE_ADDRESS']\n"
        "tq.get_client().put(TensorDict({'x': torch.arange(16)}, batch_size=[16]), partition_id='train')\n"
        "ranks = {(g, r): TransferQueueClient(f'rank{g}{r}', address) for g in (0, 1) for r in (0, 1)}\n"
        "out = []\n"
        "for step in range(3):\n"
        "    for (g, r) in sorted(ranks, key=lambda k: (k[1] + step) % 2):\n"
        "        m = ranks[(g, r)].get_meta(['x'], 2, 'train', task_name='t', sampling_config={'dp_rank': g, 'batch_index': step})\n"
        "        out.append((step, g, r, m.global_indexes))\n"
        "import json\n"
    )
    by = {(s, g, r): idx for s, g, r, idx in _child_json(code)}
    for step in range(3):
        assert by[(step, 0, 0)] == by[(step, 0, 1)] and by[(step, 1, 0)] == by[(step, 1, 1)]
        assert not set(by[(step, 0, 0)]) & set(by[(step, 1, 0)])
    assert len({i for idx in by.values() for i in idx}) == 12  # 3 steps x 2 groups x 2 samples


def test_seqlen_balanced_sampler_is_a_token_balanced_round_over_its_dp_size() -> None:
    """``controller.sampler: SeqlenBalancedSampler(dp_size=2)`` over tqueue's rounds: the two
    dp ranks split each batch by tokens (lengths 100 .. 10 into two halves of 220), and the
    tensor-parallel peers of a rank get its identical meta."""
    code = (
        "import os, json, torch, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "from transfer_queue import SeqlenBalancedSampler\n"
        "from transfer_queue.client import TransferQueueClient\n"
        "tq.init({'controller': {'sampler': SeqlenBalancedSampler(dp_size=2), 'polling_mode': True}})\n"
        "lengths = [100, 10, 90, 20, 80, 30, 70, 40]\n"
        "ids = torch.nested.nested_tensor([torch.ones(n, dtype=torch.int64) for n in lengths], layout=torch.jagged)\n"
        "tq.get_client().put(TensorDict({'input_ids': ids, 'n': torch.tensor(lengths)}, batch_size=[8]), partition_id='train')\n"
        "ranks = {(dp, tp): TransferQueueClient(f'r{dp}{tp}', os.environ['TQUEUE_ADDRESS']) for dp in (0, 1) for tp in (0, 1)}\n"
        "out = []\n"
        "for (dp, tp), c in ranks.items():\n"
        "    m = c.get_meta(['input_ids', 'n'], 4, 'train', task_name='t', sampling_config={'dp_rank': dp, 'batch_index': 0})\n"
        "    out.append([dp, tp, m.global_indexes, c.get_data(m)['n'].tolist()])\n"
    )
    reads = {(dp, tp): (idx, n) for dp, tp, idx, n in _child_json(code)}
    assert reads[(0, 0)] == reads[(0, 1)] and reads[(1, 0)] == reads[(1, 1)]
    assert sorted(reads[(0, 0)][0] + reads[(1, 0)][0]) == list(range(8))
    assert sum(reads[(0, 0)][1]) == sum(reads[(1, 0)][1]) == 220


def test_a_meta_of_several_partitions_is_read_and_written_in_its_order(shim: Any) -> None:
    """BatchMeta.concat of two partitions' metas, reordered: get_data returns its rows in the
    meta's order, and put(metadata=) writes each row to its own partition."""
    client = shim.get_client()
    a = client.put(TensorDict({"r": torch.tensor([1.0, 2.0]), "ids": torch.ones(2, 3)}, batch_size=[2]), partition_id="mp-a")
    b = client.put(
        TensorDict({"r": torch.tensor([3.0]), "ids": torch.nested.as_nested_tensor([torch.zeros(5)], layout=torch.jagged)}, batch_size=[1]),
        partition_id="mp-b",
    )
    both = tq.BatchMeta.concat([a, b])
    both.reorder([2, 0, 1])  # b's sample first, then a's
    assert both.partition_ids == ["mp-b", "mp-a", "mp-a"]
    got = client.get_data(both)
    assert got["r"].tolist() == [3.0, 1.0, 2.0]
    assert got["ids"].is_nested and [tuple(t.shape) for t in got["ids"].unbind()] == [(5,), (3,), (3,)]
    written = client.put(TensorDict({"adv": torch.tensor([30.0, 10.0, 20.0])}, batch_size=[3]), metadata=both)
    assert written.partition_ids == both.partition_ids and written.global_indexes == both.global_indexes
    assert "adv" in written.field_names
    assert client.get_data(written.select_fields(["adv"]))["adv"].tolist() == [30.0, 10.0, 20.0]
    assert client.get_data(a.select_fields(["r"]))["r"].tolist() == [1.0, 2.0]
    assert torch.equal(
        client.get_data(client.get_meta(["adv"], 2, "mp-a", task_name="t"))["adv"], torch.tensor([10.0, 20.0])
    )
    assert client.get_data(client.get_meta(["adv"], 1, "mp-b", task_name="t"))["adv"].tolist() == [30.0]
    client.clear_partition("mp-a")
    client.clear_partition("mp-b")


def test_sampling_config_reaches_a_tqueue_policy_named_as_the_sampler() -> None:
    """controller.sampler 'tqueue:NAME' reads with that policy (controller.policies loads it
    into the cluster init starts); every sampling_config key reaches it as candidates.args."""
    code = (
        "import torch, numpy as np, transfer_queue as tq\n"
        "from tensordict import TensorDict\n"
        "tq.init({'controller': {'sampler': 'tqueue:skip', 'policies': ['skip=tests.controller.custom_policy:Skip']}})\n"
        "c = tq.get_client()\n"
        "c.put(TensorDict({'r': torch.arange(8.0)}, batch_size=[8]), partition_id='p')\n"
        "print(c.get_meta(['r'], 2, 'p', task_name='t', sampling_config={'skip': np.int64(3), 'dp_rank': 0}).global_indexes)\n"
        "print(c.get_meta(['r'], 2, 'p', task_name='t').global_indexes)\n"
        "tq.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQUEUE_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.splitlines() == ["[3, 4]", "[0, 1]"], done.stdout + done.stderr
