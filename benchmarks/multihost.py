"""tqueue across simulated hosts: network namespaces joined by shaped veth links (issue 28,
point 4).

    sudo .venv/bin/python -m benchmarks.multihost [--rate 2.5e9] [--slow-rate 2.5e8] [--json out.json]

Five hosts on one bridge (benchmarks/netns.py): ``ctl`` (the controller), ``prod`` (producers),
``u0`` and ``u1`` (a storage unit each), ``cons`` (consumers). Every host's link is shaped to
``--rate`` bit/s in each direction (netem with ``--delay-ms`` where the kernel has it, else tbf
with the rate alone). It measures and prints:

1. the links: raw TCP from ``prod`` to ``u0`` (one Python socket), the rate a link really gives;
2. placement by host: small puts from a producer on ``prod`` (no unit there), on ``u0`` and on
   ``u1``, and which unit each landed on;
3. cross-host throughput: a producer on ``prod`` puts ``--puts`` puts of ``--put-mb`` MB
   (``--concurrency`` at a time); then a consumer on ``cons`` gets them all, checking every
   byte; both against the link's rate;
4. one slow link: ``u1``'s link shaped to ``--slow-rate``, and step 3 again: where puts land,
   and what the put and get rates become.

Each worker is this module run as ``worker ROLE JSON`` inside a namespace; it prints one JSON
line. Needs root and iproute2; exits with 2 and the reason where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
HOSTS = ("ctl", "prod", "u0", "u1", "cons")


# --- workers (run inside a namespace) ---------------------------------------------------


def _pattern(pid: int, row: int) -> Any:
    # numpy, not torch: torch's OpenMP threads spin after each op and take the cores the
    # client's copy threads need (docs/performance-history.md, "OpenMP spinning")
    import numpy as np

    return ((np.arange(row, dtype=np.int64) + pid * 7) & 255).astype(np.uint8)


def _sink(cfg: dict[str, Any]) -> dict[str, Any]:
    server = socket.create_server((cfg["ip"], 0))
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    conn, _ = server.accept()
    buf = bytearray(1 << 20)
    got, start = 0, time.perf_counter()
    while n := conn.recv_into(buf):
        got += n
    seconds = time.perf_counter() - start
    conn.close()
    server.close()
    return {"bytes": got, "seconds": seconds}


def _blast(cfg: dict[str, Any]) -> dict[str, Any]:
    data = memoryview(bytes(1 << 20))
    with socket.create_connection((cfg["ip"], cfg["port"])) as conn:
        for _ in range(cfg["mb"]):
            conn.sendall(data)
    return {}


async def _produce(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    import tqueue

    client = tqueue.AsyncClient(cfg["address"])
    n, row = cfg["samples"], cfg["row"]
    units: list[int] = []
    seconds: list[float] = []

    def batch(p: int) -> Any:
        first = cfg["first"] + p * n
        return first, torch.from_numpy(np.stack([_pattern(first + i, row) for i in range(n)]))

    batches = [batch(p) for p in range(cfg["puts"] + 1)]  # made before the clock starts

    async def one(p: int) -> None:
        first, x = batches[p]
        t0 = time.perf_counter()
        meta = await client.put(cfg["partition"], {"x": x, "pid": list(range(first, first + n))})
        seconds.append(time.perf_counter() - t0)
        units.append(meta.units[0])

    async def lane(k: int) -> None:
        for p in range(k, cfg["puts"], cfg["concurrency"]):
            await one(p)

    await one(cfg["puts"])  # connections made, schema known: not timed below
    units.clear()
    seconds.clear()
    start = time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(cfg["concurrency"])))
    wall = time.perf_counter() - start
    status = await client.status()
    hosts = {u.unit_id: u.host for u in status.units}
    await client.close()
    return {
        "units": [hosts[u] for u in units], "seconds": wall, "bytes": (cfg["puts"]) * n * row,
        "put_p50": statistics.median(seconds), "warm": n,
    }


def _consume(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import tqueue

    client = tqueue.Client(cfg["address"])
    want, batch = cfg["count"], cfg["batch"]
    got = checked = 0
    units: list[int] = []
    seconds = 0.0  # in get_meta, get_data and ack (checking the bytes left out)
    bad: list[int] = []
    while got < want:
        start = time.perf_counter()
        meta = client.get_meta(cfg["partition"], ["x", "pid"], min(batch, want - got), task="train", timeout=120)
        data = client.get_data(meta)
        seconds += time.perf_counter() - start
        for i, pid in enumerate(data["pid"]):
            if not np.array_equal(data["x"][i].numpy(), _pattern(pid, data["x"].shape[1])):
                bad.append(pid)
            checked += data["x"][i].numel()
        start = time.perf_counter()
        client.ack(meta)
        seconds += time.perf_counter() - start
        got += len(meta)
        units.extend(meta.units)
    hosts = {u.unit_id: u.host for u in client.status().units}
    client.close()
    return {
        "samples": got, "bytes": checked, "seconds": seconds, "bad": bad[:10],
        "from": {h: [hosts[u] for u in units].count(h) for h in sorted(set(hosts.values()))},
    }


def worker(role: str, cfg: dict[str, Any]) -> None:
    if role == "produce":
        out = asyncio.run(_produce(cfg))
    else:
        out = {"sink": _sink, "blast": _blast, "consume": _consume}[role](cfg)
    print(json.dumps(out), flush=True)


# --- the driver -------------------------------------------------------------------------


def _start(hosts: Any, name: str, role: str, cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {"PYTHONPATH": str(REPO)}
    return hosts.popen(name, [sys.executable, "-m", "benchmarks.multihost", "worker", role, json.dumps(cfg)], env=env)


def _result(proc: subprocess.Popen[bytes], what: str, timeout: float = 300.0) -> dict[str, Any]:
    from benchmarks.netns import read_line

    assert proc.stdout is not None
    line = read_line(proc.stdout, timeout, what=what)
    if proc.wait(timeout=60) != 0:
        raise RuntimeError(f"{what} exited with {proc.returncode}")
    return json.loads(line)


def run_worker(hosts: Any, name: str, role: str, cfg: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """This module's ``worker ROLE`` in host ``name``; the JSON it printed."""
    return _result(_start(hosts, name, role, cfg), f"{role} on {name}", timeout)


def raw_rate(hosts: Any, src: str, dst: str, mb: int) -> float:
    """Bytes/s of one TCP stream from ``src`` to ``dst``."""
    from benchmarks.netns import read_line

    sink = _start(hosts, dst, "sink", {"ip": hosts.ip[dst]})
    assert sink.stdout is not None
    port = json.loads(read_line(sink.stdout, 60, what="sink"))["port"]
    run_worker(hosts, src, "blast", {"ip": hosts.ip[dst], "port": port, "mb": mb})
    out = _result(sink, "sink")
    return out["bytes"] / out["seconds"]


def start_cluster(hosts: Any, ctl: str = "ctl", units: tuple[str, ...] = ("u0", "u1")) -> str:
    """A controller in host ``ctl`` and a unit in each of ``units`` (named after its host),
    each bound to its host's address; the controller's address."""
    _, ready = hosts.tqueue(ctl, "controller", "--bind", f"tcp://{hosts.ip[ctl]}:0")
    address = json.loads(ready)["address"]
    for unit in units:
        hosts.tqueue(unit, "storage-unit", "--controller", address, "--bind", f"tcp://{hosts.ip[unit]}:0",
                     "--host", unit, "--name", unit)
    return address


def placement(hosts: Any, address: str, puts: int = 12) -> dict[str, list[str]]:
    """The host of the unit each of ``puts`` small puts from each producer host landed on."""
    out: dict[str, list[str]] = {}
    for i, name in enumerate(("prod", "u0", "u1")):
        res = run_worker(hosts, name, "produce", {
            "address": address, "partition": f"place-{name}", "puts": puts, "samples": 4, "row": 4096,
            "concurrency": 1, "first": i * 10_000,
        })
        out[name] = res["units"]
    return out


def transfer(hosts: Any, address: str, partition: str, args: argparse.Namespace) -> dict[str, Any]:
    """Puts from ``prod``, then gets on ``cons`` of all of them, bytes checked."""
    row = int(args.put_mb * 1e6 / args.samples)
    put = run_worker(hosts, "prod", "produce", {
        "address": address, "partition": partition, "puts": args.puts, "samples": args.samples, "row": row,
        "concurrency": args.concurrency, "first": 0,
    })
    count = (args.puts + 1) * args.samples  # the untimed first put's too
    get = run_worker(hosts, "cons", "consume", {
        "address": address, "partition": partition, "count": count, "batch": args.samples * 2,
    })
    if get["bad"] or get["samples"] != count:
        raise RuntimeError(f"{partition}: consumer got {get['samples']} of {count}, wrong bytes in {get['bad']}")
    return {
        "put_Bps": put["bytes"] / put["seconds"], "put_p50_ms": put["put_p50"] * 1e3,
        "get_Bps": get["bytes"] / get["seconds"], "units": {h: put["units"].count(h) for h in ("u0", "u1")},
        "get_bytes": get["bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1], json.loads(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.5e9, help="each link's rate, bit/s")
    parser.add_argument("--slow-rate", type=float, default=2.5e8, help="the slow link's rate, bit/s")
    parser.add_argument("--delay-ms", type=float, default=0.1, help="one-way delay per link side (netem only)")
    parser.add_argument("--puts", type=int, default=24)
    parser.add_argument("--put-mb", type=float, default=8.0)
    parser.add_argument("--samples", type=int, default=8, help="samples per put")
    parser.add_argument("--concurrency", type=int, default=2, help="puts in flight from the producer")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--docs", metavar="FILE", help="also write the figures into FILE, between the lines "
                        "<!-- bench:multihost --> and <!-- /bench:multihost --> (docs/performance.md has them)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.harness import check_docs

    check_docs(parser, args.docs, "multihost")
    from benchmarks import netns

    why = netns.unavailable()
    if why:
        print(f"multihost: {why}", file=sys.stderr)
        return 2
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    results: dict[str, Any] = {"rate": args.rate, "slow_rate": args.slow_rate, "cpus": os.cpu_count()}
    with netns.Hosts(HOSTS, rate=args.rate, delay_ms=args.delay_ms) as hosts:
        results["shaper"] = hosts.shaper
        link = args.rate / 8 or float("inf")
        say(f"links: {args.rate / 1e9:g} Gbit/s each ({hosts.shaper}"
              f"{', %g ms delay' % args.delay_ms if hosts.shaper == 'netem' else ', no delay: no sch_netem here'})")
        raw = results["raw_Bps"] = raw_rate(hosts, "prod", "u0", 256)
        say(f"raw TCP prod -> u0: {raw / 1e9:.3f} GB/s = {raw / link:.0%} of the link")
        address = start_cluster(hosts)
        place = results["placement"] = placement(hosts, address)
        for name, landed in place.items():
            say(f"placement: 12 puts from {name:4s} -> u0 {landed.count('u0'):2d}, u1 {landed.count('u1'):2d}"
                  f" ({' '.join(landed)})")
        fast = results["fast"] = transfer(hosts, address, "fast", args)
        say(f"cross-host put  prod -> units: {fast['put_Bps'] / 1e9:.3f} GB/s = {fast['put_Bps'] / link:.0%} "
              f"of the link (p50 {fast['put_p50_ms']:.1f} ms a {args.put_mb:g} MB put; placed {fast['units']})")
        say(f"cross-host get  units -> cons: {fast['get_Bps'] / 1e9:.3f} GB/s = {fast['get_Bps'] / link:.0%} "
              f"of the link ({fast['get_bytes'] / 1e6:.0f} MB, every byte checked)")
        hosts.shape("u1", args.slow_rate)
        slow_raw = results["slow_raw_Bps"] = raw_rate(hosts, "prod", "u1", 32)
        say(f"slow link u1: {args.slow_rate / 1e9:g} Gbit/s; raw TCP prod -> u1 {slow_raw / 1e9:.3f} GB/s")
        slow = results["slow"] = transfer(hosts, address, "slow", args)
        say(f"with u1 slow, put: {slow['put_Bps'] / 1e9:.3f} GB/s (p50 {slow['put_p50_ms']:.1f} ms; "
              f"placed {slow['units']}); get: {slow['get_Bps'] / 1e9:.3f} GB/s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if args.docs:
        from benchmarks.harness import write_into_docs

        command = "python -m benchmarks.multihost " + " ".join(argv)  # as root
        text = f"Written by `{command}` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} cores):\n\n"
        write_into_docs(args.docs, "multihost", text + "".join(f"* {line}\n" for line in lines))
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
