"""What checksums cost: a same-host put + get_data of the standard batch (benchmarks/workload.py,
133 KB a sample) with CRC-32C on and off, over the sockets (shm off) and over the arena.

    python -m benchmarks.integrity --sizes 1024 --repeats 7

Prints, per route and size, the median milliseconds of one put + get_data with checksums off
and on, and the cost in percent of the round trip without them. Medians: two noisy cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import tqueue

from .workload import fields, make_batch, nbytes

ROUTES = {
    "sockets": dict(shm=False),
    "arena": dict(shm=True),
}


def round_trip(client: tqueue.Client, partition: str, batch: dict, want: list[str]) -> float:
    t = time.perf_counter()
    meta = client.put(partition, batch)
    got = client.get_data(meta, fields=want)
    elapsed = time.perf_counter() - t
    assert len(got[want[0]]) == len(meta.indexes)
    client.clear(partition)
    return elapsed


def measure(address: str, route: str, on: bool, batch: dict, repeats: int) -> float:
    extra = {"arena_checksums": on} if route == "arena" else {}
    config = tqueue.ClientConfig(checksums=on, **ROUTES[route], **extra)
    want = fields()
    with tqueue.Client(address, config=config) as c:
        round_trip(c, f"warm-{route}-{on}", batch, want)
        times = [round_trip(c, f"bench-{route}-{on}-{i}", batch, want) for i in range(repeats)]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024", help="samples per put, comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--routes", default="sockets,arena")
    args = p.parse_args(argv)
    print("| route | samples | MB | off ms | on ms | cost |")
    print("|---|---|---|---|---|---|")
    with tqueue.LocalCluster(num_storage_units=1) as cluster:
        for size in [int(s) for s in args.sizes.split(",")]:
            batch = make_batch(size)
            mb = nbytes(batch) / 1e6
            for route in args.routes.split(","):
                # off and on interleaved, twice, so that drift on a noisy machine hits both
                offs, ons = [], []
                for _ in range(2):
                    offs.append(measure(cluster.address, route, False, batch, args.repeats))
                    ons.append(measure(cluster.address, route, True, batch, args.repeats))
                off, on = statistics.median(offs), statistics.median(ons)
                print(f"| {route} | {size} | {mb:.0f} | {off * 1e3:.1f} | {on * 1e3:.1f} | {100 * (on - off) / off:+.0f}% |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
