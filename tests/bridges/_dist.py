"""A job of ``world`` real processes on gloo (127.0.0.1) reading training steps through
:class:`tqueue.bridges.megatron.StepReader`, for tests/bridges/test_megatron*.py.

Each rank reads ``steps`` steps (partitions ``{prefix}-{k}``) and reports, per step, its meta,
a digest of every byte it got, the fields' tokens, and for the last step the CPU time it spent
waiting (the launcher holds that step back until every rank waits for it)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import torch

FIELDS = ["ids", "n", "tag", "flag"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(values: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(values):
        v = values[name]
        for t in v if isinstance(v, list) else [v]:
            if isinstance(t, torch.Tensor):
                h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.cpu().contiguous().numpy().tobytes())
            else:
                h.update(repr(t).encode())
    return h.hexdigest()


def rank_main(rank: int, world: int, port: int, address: str, prefix: str, steps: int, batch: int, mode: str,
              layout: dict[str, int], out: Any) -> None:
    import torch.distributed as dist

    import tqueue
    from tqueue.bridges.megatron import StepReader

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        kwargs: dict[str, Any] = {}
        if layout.get("megatron"):
            from megatron.core import parallel_state as ps

            ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"])
        else:
            kwargs = {"dp_rank": rank // layout["tp"], "dp_size": world // layout["tp"]}
        with tqueue.Client(address) as client:
            reader = StepReader(client, mode=mode, lease_timeout=300.0, **kwargs)
            out.put(("ready", rank, reader.layout.dp_rank, reader.layout.replica))
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
                # write-back: the replica's first rank updates a computed field (read back by the test)
                reader.update(step, {"value": torch.arange(len(step.meta), dtype=torch.float32) + 100 * k + step.meta.dp_rank})
                reader.done(step)
                out.put(("step", rank, report))
        if layout.get("megatron"):
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_job(address: str, prefix: str, *, world: int, steps: int, batch: int, mode: str, layout: dict[str, int],
            produce: Any) -> dict[str, Any]:
    """Start the ranks; ``produce(step)`` puts (and seals) step ``step``'s samples, called for
    the last step only once every rank is parked on it. Returns the ranks' reports."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, address, prefix, steps, batch, mode, layout, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for k in range(steps - 1):
            produce(k)
        ready = {}
        reports: dict[tuple[int, int], dict[str, Any]] = {}
        while len(reports) < world * (steps - 1) or len(ready) < world:
            kind, rank, *rest = out.get(timeout=120)
            if kind == "ready":
                ready[rank] = rest
            else:
                reports[(rank, rest[0]["step"])] = rest[0]
        # handshake: the controller reports every reader parked on the last step (in broadcast
        # mode the replicas' first ranks; the others wait in the broadcast)
        import tqueue
        from tests.faults._proc import until

        readers = world if mode == "each" else len({tuple(r[1]) for r in ready.values()})
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
        return {"ready": ready, "reports": reports, "held": held}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
