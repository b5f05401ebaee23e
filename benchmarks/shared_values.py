"""Values shared by a GRPO group (``create_partition(dedup=[...])``): what a unit holds and
what crosses, against the same partition without it (every sample holding its own copy).

    python benchmarks/shared_values.py [--groups 8] [--group 16] [--image-mib 1] [--prompt 4096]
                                       [--response 1024] [--shm] [--heartbeat 1] [--out DIR]

Each group's samples share one float32 image of ``--image-mib`` MiB and one int64 prompt of
``--prompt`` tokens; each has its own response (int64, a seeded length around ``--response``).
A producer puts ``--groups`` groups, one put a group, to a LocalCluster of one storage unit
(real processes); then the same images come back in a second round of groups, so the unit's
growth for a group whose image it holds is measured too. A reader reads one group. The whole
run is made twice, with ``dedup=["image", "prompt_ids"]`` and without it (the naive layout).

Reported: the logical bytes (every sample's values), the bytes the unit stores (``status().units``) and
their ratio to one image, one prompt and the responses of each group; ``status().bytes_shared``;
the bytes sent to the unit (``ClientStats.wire_bytes``) and to the reader for one group; the
unit's growth for a group whose image it already holds; put and read wall time (medians).
``--shm`` puts through the same-host arena instead of sockets. The unit's bytes are read from
``status()`` once two of its heartbeats came after the puts: ``--heartbeat`` (the cluster's
interval, s; tqueue's default 1) shortens that wait, as the smoke tests do.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import tqueue
from tqueue.config import HEARTBEAT_INTERVAL

SHARED = ["image", "prompt_ids"]


def group_of(g: int, args: argparse.Namespace, image: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(g)
    prompt = torch.randint(0, 150_000, (args.prompt,), generator=gen)
    sizes = torch.randint(args.response // 2, args.response * 3 // 2 + 1, (args.group,), generator=gen).tolist()
    return {
        "image": [image] * args.group,
        "prompt_ids": [prompt] * args.group,
        "response_ids": [torch.randint(0, 150_000, (n,), generator=gen) for n in sizes],
    }


def _nbytes(values: list[torch.Tensor]) -> int:
    return sum(v.nbytes for v in values)


def _settled(client: tqueue.Client, within: float = 20.0) -> Any:
    """``status()`` once two heartbeats of every unit (one an interval, the cluster's
    ``heartbeat_interval``) came after this call: a unit drops a value it finds it holds already
    after its commit reported its bytes, and the controller hears from a unit by other messages
    too."""
    deadline = time.monotonic() + within
    for _ in range(2):
        t0 = time.monotonic()
        while True:
            st = client.status()
            if all(u.silent < time.monotonic() - t0 for u in st.units) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    return st


def _unit_bytes(st: Any) -> int:
    return sum(u.nbytes for u in st.units)


def one(args: argparse.Namespace, dedup: bool) -> dict[str, Any]:
    config = tqueue.ClientConfig(shm=True, shm_min_bytes=0) if args.shm else tqueue.ClientConfig(shm=False)
    side = int((args.image_mib * (1 << 20) / 12) ** 0.5)  # float32 [3, side, side]
    images = [torch.rand(3, side, side, generator=torch.Generator().manual_seed(100 + g)) for g in range(args.groups)]
    out: dict[str, Any] = {"dedup": dedup}
    with (
        tqueue.LocalCluster(num_storage_units=1, controller={"heartbeat_interval": args.heartbeat}) as cluster,
        tqueue.Client(cluster.address, config=config) as producer,
    ):
        producer.create_partition("step", dedup=SHARED if dedup else ())
        logical = distinct = 0
        puts, sent = [], 0
        for g in range(args.groups):
            data = group_of(g, args, images[g])
            logical += sum(_nbytes(v) for v in data.values())
            distinct += images[g].nbytes + data["prompt_ids"][0].nbytes + _nbytes(data["response_ids"])
            t0 = time.perf_counter()
            producer.put("step", data, groups=[f"g{g}"] * args.group)
            puts.append(time.perf_counter() - t0)
        sent = producer.stats.wire_bytes
        st = _settled(producer)
        held, shared = _unit_bytes(st), st.bytes_shared
        # a group of a new round whose image (and prompt) the unit already holds
        again = group_of(0, args, images[0])
        again["response_ids"] = [torch.randint(0, 150_000, (len(r),)) for r in again["response_ids"]]
        producer.put("step", again, groups=["again"] * args.group)
        grown = _unit_bytes(_settled(producer)) - held
        with tqueue.Client(cluster.address, config=config) as reader:
            t0 = time.perf_counter()
            batch = reader.get_data("step", ["image", "prompt_ids", "response_ids"], args.group, task="train",
                                    timeout=60, policy="first_ready")
            out["read_s"] = time.perf_counter() - t0
            assert all(torch.equal(x, images[0]) for x in batch["image"]), "the reader got another image"
            out["get_wire_bytes"] = reader.stats.wire_bytes
            out["get_logical_bytes"] = sum(_nbytes(list(batch[f])) for f in ("image", "prompt_ids", "response_ids"))
    out.update(
        logical_bytes=logical, distinct_bytes=distinct, unit_bytes=held, bytes_shared=shared,
        put_wire_bytes=sent, put_s=statistics.median(puts), again_growth=grown,
        again_responses=_nbytes(again["response_ids"]), held_over_distinct=held / distinct,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "route": "arena" if args.shm else "sockets", "groups": args.groups, "group": args.group,
        "shared": one(args, True), "naive": one(args, False),
    }


def table(r: dict[str, Any]) -> str:
    mb = 1e6
    s, n = r["shared"], r["naive"]
    rows = [
        ("logical bytes (every sample's values)", s["logical_bytes"], n["logical_bytes"]),
        ("held by the unit", s["unit_bytes"], n["unit_bytes"]),
        ("status().bytes_shared", s["bytes_shared"], n["bytes_shared"]),
        ("sent to the unit", s["put_wire_bytes"], n["put_wire_bytes"]),
        ("a group read: sent to the reader", s["get_wire_bytes"], n["get_wire_bytes"]),
        ("a group read: handed over", s["get_logical_bytes"], n["get_logical_bytes"]),
        ("a group whose image is held: the unit's growth", s["again_growth"], n["again_growth"]),
    ]
    lines = [
        f"{r['groups']} groups of {r['group']} samples; route: {r['route']}",
        "",
        "| | dedup | naive (no dedup) |",
        "|---|---:|---:|",
        *(f"| {name} | {a / mb:.1f} MB | {b / mb:.1f} MB |" for name, a, b in rows),
        f"| held / (one image + one prompt + responses, per group) | {s['held_over_distinct']:.3f} | {n['held_over_distinct']:.3f} |",
        f"| put a group (median) | {s['put_s'] * 1e3:.1f} ms | {n['put_s'] * 1e3:.1f} ms |",
        f"| read a group | {s['read_s'] * 1e3:.1f} ms | {n['read_s'] * 1e3:.1f} ms |",
        "",
        f"the responses of the group whose image is held: {s['again_responses'] / mb:.2f} MB",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group", type=int, default=16, help="samples a group")
    p.add_argument("--image-mib", type=float, default=1.0)
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--response", type=int, default=1024, help="response tokens (about)")
    p.add_argument("--shm", action="store_true", help="put through the same-host arena")
    p.add_argument("--heartbeat", type=float, default=HEARTBEAT_INTERVAL,
                   help="the cluster's heartbeat interval, s (tqueue's default: 1); status() is read after two")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write shared_values.json there")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "shared_values.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
