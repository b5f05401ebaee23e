"""The public surface is small, sorted, held here name by name with its stability tiers, and
importable without torch for servers; the old spellings warn and still work."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import pathlib
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tqueue
import tqueue.errors
from tqueue import _api
from tqueue.client import AsyncClient, Client
from tqueue.client import _sync as sync_spaces
from tqueue.client._ask import MetaAsk
from tqueue.client._spaces import MOVED, AsyncCheckpoints, AsyncKeys, AsyncRollouts, AsyncSamples


def test_all_is_sorted_and_complete():
    assert tqueue.__all__ == sorted(tqueue.__all__)
    for name in tqueue.__all__:
        assert getattr(tqueue, name) is not None
    assert tqueue.errors.__all__ == sorted(tqueue.errors.__all__)


def test_every_error_is_a_tqueue_error_and_timeouts_are_timeouts():
    for name in tqueue.errors.__all__:
        obj = getattr(tqueue.errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, tqueue.TQueueError)
    assert issubclass(tqueue.WaitTimeoutError, TimeoutError)
    assert issubclass(tqueue.UnavailableError, ConnectionError)
    assert issubclass(tqueue.FieldTypeError, TypeError)
    assert issubclass(tqueue.SchemaError, ValueError)


def test_servers_do_not_import_torch():
    code = "import sys, tqueue.controller, tqueue.storage, tqueue.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# --- the surface, held: a change here is an API change (docs/api.md) ---------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]

PACKAGE = [
    "AsyncClient", "AuthenticationError", "Batch", "Client", "ClientConfig", "ClientStats", "ControllerConfig",
    "ControllerUnavailableError", "DataCorruptionError", "DataLostError", "DataParallel", "DiscoveryError",
    "EngineError", "FieldSpec", "FieldStats", "FieldTypeError", "ForkedClientError", "Grouping", "InvalidArgumentError",
    "LocalCluster", "Meta", "MicroBatch", "MicroBatches", "OverSampling", "PartitionClearedError", "PartitionSealedError", "PermissionDeniedError",
    "ProtocolError", "ProtocolVersionError", "RemoteError", "SchemaError", "StorageConfig", "StorageFullError",
    "StorageUnitUnavailableError", "TQueueDeprecationWarning", "TQueueError", "Timeouts", "UnavailableError",
    "UnknownFieldError", "WaitTimeoutError",
]
# the verbs a user learns first, and the namespaces that hold the rest
CORE = {"connect", "close", "create_partition", "put", "update", "get_meta", "get_data", "renew", "ack", "seal",
        "clear", "status", "set_version"}
ATTRIBUTES = {"address", "config", "stats"}
SPACES = {
    "keys": (AsyncKeys, sync_spaces.Keys, {"bind", "tag", "set_tags", "lookup", "of", "all", "drop"}),
    "samples": (AsyncSamples, sync_spaces.Samples, {"select", "allocate", "reset", "stats"}),
    "rollouts": (AsyncRollouts, sync_spaces.Rollouts,
                 {"complete", "postpone", "fail", "reserve", "wait_sealed", "wait_version", "set_staleness"}),
    "checkpoints": (AsyncCheckpoints, sync_spaces.Checkpoints, {"save", "load"}),
}


def _methods(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(getattr(cls, n))}


def test_the_package_surface_is_held():
    assert tqueue.__all__ == PACKAGE
    assert "BatchMeta" not in tqueue.__all__ and "PROTOCOL_VERSION" not in tqueue.__all__


def test_every_public_name_carries_a_tier():
    for name in tqueue.__all__:
        assert _api.tier(f"tqueue.{name}") in ("public", "developer"), name
    client_names = CORE | ATTRIBUTES | set(SPACES)
    assert {n for n in _api.PUBLIC if n.startswith("Client.")} == {f"Client.{n}" for n in client_names}
    assert _api.tier("AsyncClient.thread_route") == "developer"
    assert not _api.PUBLIC & _api.DEVELOPER


def test_the_clients_show_the_core_and_the_old_names_only():
    """Methods: the core verbs, and for one release the deprecated names (MOVED) that the
    namespaces replace; AsyncClient has thread_route besides (developer)."""
    assert _methods(Client) == CORE | set(MOVED)
    assert _methods(AsyncClient) == CORE | set(MOVED) | {"thread_route"}
    for name in ("keys", "samples", "rollouts", "checkpoints"):
        assert isinstance(getattr(Client, name), property), name


@pytest.mark.parametrize("space", sorted(SPACES), ids=sorted(SPACES))
def test_namespaces_are_twins_made_from_the_async_ones(space):
    async_cls, sync_cls, names = SPACES[space]
    assert _methods(async_cls) == names and _methods(sync_cls) == names
    for name in names:
        a, s = getattr(async_cls, name), getattr(sync_cls, name)
        assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s), name
        assert s.__wrapped__ is a and s.__doc__ == a.__doc__ and a.__doc__, name
        assert inspect.signature(s) == inspect.signature(a), name
    for old, (where, new) in MOVED.items():
        if where == space:
            assert inspect.signature(getattr(Client, old)) == inspect.signature(getattr(sync_cls, new)), old


def test_an_old_method_name_warns_and_calls_its_namespace():
    calls: list[tuple[str, tuple[Any, ...]]] = []
    stub = SimpleNamespace(keys=SimpleNamespace(bind=lambda *a, **k: calls.append(("bind", a)) or "bound"))
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"Client\.bind_keys\(\) .* use client\.keys\.bind\(\)") as got:
        assert Client.bind_keys(stub, "meta", ["k"]) == "bound"  # type: ignore[arg-type]
    assert calls == [("bind", ("meta", ["k"]))]
    assert got[0].filename == __file__  # at the caller's line

    async def listed() -> str:
        return "listed"

    async def awaited(call: Any) -> Any:  # a user's coroutine: the warning names its line
        return await call

    astub = SimpleNamespace(keys=SimpleNamespace(all=lambda *a: listed()))
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"AsyncClient\.list_keys\(\) .* client\.keys\.all\(\)") as got:
        assert asyncio.run(awaited(AsyncClient.list_keys(astub))) == "listed"  # type: ignore[arg-type]
    assert got[0].filename == __file__


def test_flat_lease_keywords_warn_and_the_option_objects_are_spread():
    seen: list[MetaAsk] = []

    async def get_meta(ask: MetaAsk) -> MetaAsk:
        seen.append(ask)
        return ask

    stub = SimpleNamespace(_gets=SimpleNamespace(get_meta=get_meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ask = asyncio.run(AsyncClient.get_meta(
            stub, "p", ["x"], 8, task="t",  # type: ignore[arg-type]
            data_parallel=tqueue.DataParallel(1, 4, replica_group="g"), micro_batches=tqueue.MicroBatches(size=2)))
    assert (ask.dp_rank, ask.dp_size, ask.replica_group, ask.micro_batch_size) == (1, 4, "g", 2)
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"get_meta\(dp_rank=, dp_size=\) is deprecated.*DataParallel"):
        flat = asyncio.run(AsyncClient.get_meta(stub, "p", ["x"], 8, task="t", dp_rank=1, dp_size=4))  # type: ignore[arg-type]
    assert (flat.dp_rank, flat.dp_size) == (1, 4)
    with pytest.raises(tqueue.InvalidArgumentError, match="give data_parallel or dp_rank, not both"):
        MetaAsk("p", ["x"], 8, task="t", data_parallel=tqueue.DataParallel(0, 2), dp_rank=1)
    with pytest.raises(tqueue.InvalidArgumentError, match="0 <= rank < size"):
        tqueue.DataParallel(2, 2)


def test_the_wire_struct_and_version_left_the_package_and_still_work_for_a_release():
    from tqueue import wire

    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"tqueue\.BatchMeta .* tqueue\.wire\.BatchMeta"):
        assert tqueue.BatchMeta is wire.BatchMeta
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"tqueue\.PROTOCOL_VERSION"):
        assert tqueue.PROTOCOL_VERSION == wire.PROTOCOL_VERSION
    meta = wire.BatchMeta(partition="p", partition_uid=1, indexes=[0, 1], units=[0, 0], fields=["x"], schema={})
    assert isinstance(meta, tqueue.Meta)  # the struct is a Meta as it is


def _partition_stub(sent: list[Any]) -> SimpleNamespace:
    """An AsyncClient's stand-in whose controller records each request it is sent."""

    async def request(msg: Any, expect: Any = None) -> tuple[Any, list[Any]]:
        sent.append(msg)
        return None, []

    async def ctl() -> SimpleNamespace:
        return SimpleNamespace(request=request)

    return SimpleNamespace(_conns=SimpleNamespace(ctl=ctl), _puts=SimpleNamespace(shared={}))


def test_create_partition_replicas_is_the_old_spelling_of_copies():
    sent: list[Any] = []
    astub = _partition_stub(sent)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        asyncio.run(AsyncClient.create_partition(astub, "p", copies=2))  # type: ignore[arg-type]
    with pytest.warns(tqueue.TQueueDeprecationWarning,
                      match=r"AsyncClient\.create_partition\(replicas=\) .* use AsyncClient\.create_partition\(copies=\)"):
        asyncio.run(AsyncClient.create_partition(astub, "p", replicas=2))  # type: ignore[arg-type]
    stub = SimpleNamespace(_run=asyncio.run, _inner=astub)
    with pytest.warns(tqueue.TQueueDeprecationWarning,
                      match=r"Client\.create_partition\(replicas=\) .* use Client\.create_partition\(copies=\)") as got:
        Client.create_partition(stub, "p", replicas=2)  # type: ignore[arg-type]
    assert got[0].filename == __file__  # at the caller's line, not in the client's loop thread
    assert [m.copies for m in sent] == [2, 2, 2]
    with pytest.raises(tqueue.InvalidArgumentError, match="give copies= or replicas=, not both"):
        asyncio.run(AsyncClient.create_partition(astub, "p", copies=2, replicas=2))  # type: ignore[arg-type]
    with pytest.raises(tqueue.InvalidArgumentError, match="give copies= or replicas=, not both"):
        Client.create_partition(stub, "p", copies=2, replicas=2)  # type: ignore[arg-type]


def test_controller_config_replicas_is_the_old_spelling_of_copies():
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"ControllerConfig\(replicas=\) .* use ControllerConfig\(copies=\)"):
        config = tqueue.ControllerConfig(replicas=2)  # type: ignore[call-arg]
    assert config.copies == 2 and config == tqueue.ControllerConfig(copies=2)
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"ControllerConfig\.replicas .* use ControllerConfig\.copies"):
        assert config.replicas == 2
    with pytest.raises(TypeError, match="give copies= or replicas=, not both"):
        tqueue.ControllerConfig(copies=2, replicas=2)  # type: ignore[call-arg]
    assert "copies" in {f.name for f in dataclasses.fields(tqueue.ControllerConfig)}
    assert "replicas" not in {f.name for f in dataclasses.fields(tqueue.ControllerConfig)}


def test_the_replicas_flag_is_the_old_spelling_of_copies(capsys):
    from tqueue import cli

    parser = cli._parser()
    assert parser.parse_args(["controller", "--copies", "2"]).copies == 2
    assert parser.parse_args(["controller"]).copies == 1
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"--replicas is deprecated .* use --copies"):
        assert parser.parse_args(["controller", "--replicas", "2"]).copies == 2
    assert "tqueue: warning: --replicas is deprecated" in capsys.readouterr().err  # a shell shows no DeprecationWarning
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["controller"]
    assert "--copies" in sub.format_help() and "--replicas" not in sub.format_help()


def test_partition_status_replicas_is_the_old_spelling_of_copies():
    from tqueue.wire import PartitionStatus

    status = PartitionStatus(name="p", uid=1, samples=0, fields={}, tasks={}, nbytes=0, copies=2)
    with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"PartitionStatus\.replicas .* use PartitionStatus\.copies"):
        assert status.replicas == 2


def test_config_groups_name_every_field_once_and_timeouts_travel_together():
    from tqueue.config import grouped

    for cls in (tqueue.ClientConfig, tqueue.ControllerConfig, tqueue.StorageConfig):
        names = [n for group in cls.GROUPS.values() for n in group]
        fields = {f.name for f in dataclasses.fields(cls)}
        assert len(names) == len(set(names)) and set(names) <= fields, cls.__name__
    config = tqueue.ClientConfig(shm=False).replace(timeouts=tqueue.Timeouts(get=5.0))
    assert config.timeouts == tqueue.Timeouts(get=5.0) and config.get_timeout == 5.0 and not config.shm
    assert grouped(config)["timeouts"] == {"request_timeout": 30.0, "get_timeout": 5.0, "put_timeout": 60.0,
                                           "lease_timeout": 600.0}


FLAT = re.compile(r"\b(dp_rank|dp_size|max_tokens_per_micro_batch|micro_batch_size|num_microbatches_multiple_of"
                  r"|min_num_microbatches)=")


def test_the_shim_bridges_and_demos_use_the_new_spellings():
    """No client call under an old name, and no flat lease keyword passed to the client, in
    the TransferQueue shim, the bridges, the demos and the command line."""
    files = [*(ROOT / "compat/transferqueue/transfer_queue").rglob("*.py"), *(ROOT / "tqueue/bridges").glob("*.py"),
             *(ROOT / "tqueue/demos").glob("*.py"), ROOT / "tqueue/cli.py"]
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"client\w*\)?\.(%s)\(" % "|".join(sorted(MOVED)), code) or (
                    "get_meta(" in code and FLAT.search(code)):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_shim_in_use_raises_no_deprecation_warning():
    tq = pytest.importorskip("transfer_queue")
    TensorDict = pytest.importorskip("tensordict").TensorDict
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
        try:
            client = tq.get_client()
            client.put(TensorDict({"ids": torch.arange(6).reshape(3, 2)}, batch_size=[3]), partition_id="dep")
            meta = client.get_meta(["ids"], 3, "dep", task_name="train")
            assert torch.equal(client.get_data(meta)["ids"].to_padded_tensor(0), torch.arange(6).reshape(3, 2))
            tq.kv_put("k", "kv", fields={"x": torch.ones(2)}, tag={"n": 1})
            assert "k" in tq.kv_list("kv")["kv"]
            tq.kv_clear("k", "kv")
        finally:
            tq.close()


def test_create_partition_takes_grouping_and_over_sampling_and_the_flat_spellings_warn(cluster, partition):
    """Options that travel together are one object each; the flat keywords still work for one
    release, warning with the replacement, and mixing the two forms is refused."""
    with tqueue.Client(cluster.address) as c:
        c.create_partition(f"{partition}-g-new", grouping=tqueue.Grouping(2, on_member_failure="mask_member"),
                           over_sampling=tqueue.OverSampling(groups=1))
        with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"create_partition\(group_size=, on_member_failure=\) is deprecated.*Grouping"):
            c.create_partition(f"{partition}-g-old", group_size=2, on_member_failure="mask_member")
        with pytest.warns(tqueue.TQueueDeprecationWarning, match=r"create_partition\(target=, recycle_to=\) is deprecated.*OverSampling"):
            c.create_partition(f"{partition}-t-old", target=3, recycle_to=f"{partition}-t-next")
        with pytest.raises(tqueue.InvalidArgumentError, match="give over_sampling= or target=, not both"), pytest.warns(tqueue.TQueueDeprecationWarning):
            c.create_partition(f"{partition}-t-both", target=3, over_sampling=tqueue.OverSampling(samples=3))
        c.put(f"{partition}-g-new", {"x": torch.arange(2)}, groups="a")  # one whole group: the target, sealed
        c.put(f"{partition}-g-old", {"x": torch.arange(1)}, groups="b")  # one member of two
        with pytest.raises(tqueue.WaitTimeoutError, match="0 groups complete"):
            c.get_meta(f"{partition}-g-old", ["x"], 2, task="t", timeout=0.1)  # whole groups by default
        parts = {p.name: p for p in c.status().partitions}
        assert (parts[f"{partition}-g-new"].sealed, parts[f"{partition}-g-new"].groups_complete, parts[f"{partition}-t-old"].recycle_to) == (True, 1, f"{partition}-t-next")
        for name in (f"{partition}-g-new", f"{partition}-g-old", f"{partition}-t-old"):
            c.clear(name)
    with pytest.raises(tqueue.InvalidArgumentError, match="OverSampling needs one target"):
        tqueue.OverSampling(samples=2, groups=1)
    with pytest.raises(tqueue.InvalidArgumentError, match="Grouping's on_member_failure is 'drop_group' or 'mask_member'"):
        tqueue.Grouping(2, on_member_failure="retry")  # type: ignore[arg-type]
