"""Jobs of real processes on 127.0.0.1 reading training steps through
:class:`tqueue.bridges.megatron.StepReader`, for tests/bridges/test_megatron*.py.

Every job names its default group's backend and its device (:class:`Setup`); CPU runs use gloo,
and a default group of ``cuda:gloo`` has no CPU backend, as NCCL's has none. A CUDA setup
needs a GPU per rank: :func:`needs` skips it, with the reason, where the host has fewer.

:func:`run_job`: each rank reads ``steps`` steps (partitions ``{prefix}-{k}``) and reports, per
step, its meta, a digest of every byte it got, the fields' tokens, whether its ``update``
wrote, and for the last step the CPU time it spent waiting (the launcher holds that step back
until every reader waits for it). :func:`restart_rank` and :func:`broadcast_rank` are the
ranks of the restart and broadcast-failure tests."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import pytest
import torch

FIELDS = ["ids", "n", "tag", "flag"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a job's ranks are laid out and talk. ``megatron``: megatron-core's parallel_state
    forms the groups; ``explicit``: plain torch.distributed ranks that give the reader their
    tensor-parallel group and their replica's writer (the last stage's first TP rank).
    Ranks are numbered as Megatron numbers them: TP fastest, then DP, then PP."""

    tp: int = 1
    pp: int = 1
    megatron: bool = False
    explicit: bool = False
    backend: str = "gloo"  # the default group's
    device: str = "cpu"  # "cuda": one GPU per rank

    def dp_size(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def place(self, rank: int, world: int) -> tuple[int, int, int]:
        """(dp rank, pipeline stage, tp rank) of a global rank."""
        dp = self.dp_size(world)
        return (rank // self.tp) % dp, rank // (self.tp * dp), rank % self.tp


def needs(setup: Setup, world: int) -> None:
    """Skip, saying why, a CUDA setup on a host with fewer GPUs than ranks."""
    if setup.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world:
            pytest.skip(f"{setup.backend} on {setup.device} needs {world} GPUs, one per rank; this host has {have}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(values: Any) -> str:
    h = hashlib.sha256()
    for name in sorted(values):
        v = values[name]
        for t in v if isinstance(v, list) else [v]:
            if isinstance(t, torch.Tensor):
                h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.cpu().contiguous().numpy().tobytes())
            else:
                h.update(repr(t).encode())
    return h.hexdigest()


def init(rank: int, world: int, port: int, setup: Setup) -> str:
    """Join the job's default group; the device this rank's reader uses."""
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    device = setup.device
    extra: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        extra["device_id"] = torch.device(device)
    dist.init_process_group(setup.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra)
    return device


def reader_args(rank: int, world: int, setup: Setup) -> dict[str, Any]:
    """The StepReader arguments that place this rank (every rank calls it: it may form groups)."""
    import torch.distributed as dist

    if setup.megatron:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=setup.tp, pipeline_model_parallel_size=setup.pp)
        return {}
    dp = setup.dp_size(world)
    dp_rank, _stage, _ = setup.place(rank, world)
    args: dict[str, Any] = {"dp_rank": dp_rank, "dp_size": dp}
    if setup.explicit:
        backend = "gloo" if setup.device == "cpu" else "nccl"
        for stage in range(setup.pp):  # every rank forms every TP group, in one order
            for d in range(dp):
                members = [setup.tp * (d + dp * stage) + t for t in range(setup.tp)]
                group = dist.new_group(members, backend=backend)
                if rank in members:
                    args["group"] = group
        args["writer"] = setup.tp * (dp_rank + dp * (setup.pp - 1))
    return args


def rank_main(rank: int, world: int, port: int, address: str, prefix: str, steps: int, batch: int, mode: str,
              setup: Setup, out: Any) -> None:
    import torch.distributed as dist

    import tqueue
    from tqueue.bridges.megatron import StepReader

    device = init(rank, world, port, setup)
    try:
        kwargs = reader_args(rank, world, setup)
        with tqueue.Client(address) as client:
            reader = StepReader(client, mode=mode, device=device, lease_timeout=300.0, **kwargs)
            lay = reader.layout
            out.put(("ready", rank, lay.dp_rank, lay.replica, lay.bcast, lay.writer))
            for k in range(steps):
                wall, cpu = time.monotonic(), time.process_time()
                step = reader.read(f"{prefix}-{k}", FIELDS, batch, max_tokens_per_micro_batch=64, timeout=120)
                waited = (time.monotonic() - wall, time.process_time() - cpu)
                mbs = step.micro_batches
                report = {
                    "rank": rank, "step": k, "indexes": step.meta.indexes, "digest": digest(step.fields),
                    "mb_digest": [digest(mb) for mb in mbs], "global": step.global_batch_size,
                    "num_micro": step.num_microbatches, "micro": step.micro_batch_indices,
                    "tokens": int(step.fields["n"].sum()), "tags": list(step.fields["tag"]),
                    "mb_sizes": [len(mb["tag"]) for mb in mbs], "device": str(step.fields["ids"].device),
                    "waited": waited,
                }
                reader.renew(step)  # a long step keeps its lease
                # every rank offers a value of its own; only the replica's writer writes (read back by the test)
                value = torch.arange(len(step.meta), dtype=torch.float32) + 100 * k + lay.dp_rank + 1000 * rank
                report["wrote"] = reader.update(step, {"value": value})
                reader.done(step)
                out.put(("step", rank, report))
        if setup.megatron:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_job(address: str, prefix: str, *, world: int, steps: int, batch: int, mode: str, setup: Setup,
            produce: Any) -> dict[str, Any]:
    """Start the ranks; ``produce(step)`` puts (and seals) step ``step``'s samples, called for
    the last step only once every reader is parked on it. Returns the ranks' reports."""
    needs(setup, world)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, address, prefix, steps, batch, mode, setup, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for k in range(steps - 1):
            produce(k)
        ready: dict[int, list[Any]] = {}
        reports: dict[tuple[int, int], dict[str, Any]] = {}
        while len(reports) < world * (steps - 1) or len(ready) < world:
            kind, rank, *rest = out.get(timeout=120)
            if kind == "ready":
                ready[rank] = rest
            else:
                reports[(rank, rest[0]["step"])] = rest[0]
        # handshake: the controller reports every reader parked on the last step (in broadcast
        # mode the first rank of each broadcast group; the others wait for its header)
        import tqueue
        from tests.faults._proc import until

        readers = world if mode == "each" else len({tuple(r[2]) for r in ready.values()})
        last = f"{prefix}-{steps - 1}"
        with tqueue.Client(address) as c:
            until(lambda: sum(w.partition == last for w in c.status().waiting) >= readers, 60, "the readers parked")
        # then hold the step back for the interval whose CPU the ranks measure (not a wait for anything)
        held = 1.0
        time.sleep(held)
        produce(steps - 1)
        while len(reports) < world * steps:
            kind, rank, *rest = out.get(timeout=120)
            reports[(rank, rest[0]["step"])] = rest[0]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"rank {procs.index(p)} exited with {p.exitcode}"
        return {"ready": ready, "reports": reports, "held": held, "readers": readers}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# --- a rank SIGKILLed mid-step, and the job restarted -----------------------------------------


def restart_rank(rank: int, world: int, port: int, address: str, partition: str, batch: int, lease_timeout: float,
                 hold: int, out: Any, never: Any) -> None:
    """A data-parallel rank of its own (DP=world): reads its share of ``partition``'s round 0
    and reports it; then rank ``hold`` waits to be killed (it gives up after 120 s), the
    others call done() and report that."""
    import torch.distributed as dist

    import tqueue
    from tqueue.bridges.megatron import StepReader

    init(rank, world, port, Setup())
    try:
        with tqueue.Client(address) as client:
            reader = StepReader(client, dp_rank=rank, dp_size=world, device="cpu", lease_timeout=lease_timeout)
            step = reader.read(partition, FIELDS, batch, timeout=60)
            out.put(("read", rank, step.meta.indexes, step.meta.lease))
            if rank == hold:
                never.wait(120)
                return
            reader.done(step)
            out.put(("done", rank, None, None))
    finally:
        dist.destroy_process_group()


def start_ranks(target: Any, world: int, *args: Any) -> tuple[list[Any], Any, Any]:
    """Spawn ``world`` processes of ``target(rank, world, port, *args, out, never)``."""
    ctx = mp.get_context("spawn")
    out, never = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out, never)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, out, never


def stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


# --- broadcast mode: a read's timeout and a dead or hung rank -----------------------------------


def broadcast_rank(rank: int, world: int, port: int, address: str, partition: str, timeout: float,
                   request_timeout: float, out: Any, never: Any) -> None:
    """A rank of one broadcast group (DP=1, TP=world) that reads ``partition`` with
    ``timeout`` and reports what it raised and after how long."""
    import torch.distributed as dist

    import tqueue
    from tqueue.bridges.megatron import StepReader

    init(rank, world, port, Setup())
    try:
        config = tqueue.ClientConfig(request_timeout=request_timeout)
        with tqueue.Client(address, config=config) as client:
            reader = StepReader(client, mode="broadcast", dp_rank=0, dp_size=1, device="cpu")
            out.put(("reading", rank, None, None))
            start = time.monotonic()
            try:
                reader.read(partition, FIELDS, 4, timeout=timeout)
            except tqueue.TQueueError as exc:
                out.put(("raised", rank, type(exc).__name__, (time.monotonic() - start, str(exc))))
            else:
                out.put(("read", rank, None, time.monotonic() - start))
    finally:
        dist.destroy_process_group()
