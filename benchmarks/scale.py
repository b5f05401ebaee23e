"""One controller under many clients, measured (issue 28, point 3).

    .venv/bin/python -m benchmarks.scale [--clients 100,400,1000] [--seconds 8] [--fill 1e6,1e7]
                                         [--profile-s 6] [--json out.json]

A controller and one storage unit as processes on 127.0.0.1, then two kinds of load, each at
every count of ``--clients`` concurrent connections, each connection looping on its own
partition: put one small sample (one float32 field of 16 values), get_meta of 1, ack.

* ``real``: ``tqueue.AsyncClient`` objects spread over ``--procs`` processes, one controller
  connection each (the load a user's code makes; the clients' CPU caps it on 2 cores).
* ``raw``: a light load generator: DEALER sockets, one per connection, over ``--gen-procs``
  processes, driven by one ``zmq.Poller`` loop each. Grant and GetMeta are encoded once per
  connection; Store and Ack (which carry the grant's and the lease's ids) are encoded per
  cycle. The Stores of one process share one connection to the unit (matched by request id):
  only the controller sees every connection.

The controller's CPU time comes from ``/proc/<pid>/stat`` between the start signal and the
last worker's report. Per metadata operation counts put, get_meta and ack as one each (as issue
28 did); the controller also handles each put's commit from the unit, one ``Commit`` for
the stores a unit handled in one turn of its loop: three to four messages a cycle, counted
from the controller's own metrics (``msgs/cycle``; µs/msg is per message it answered).
The partitions are never sealed, so they do not free themselves: each grows by one sample a
cycle (created in the warm-up cycle, before the clock starts). ``--profile-s`` samples the controller with py-spy
(where installed: ``pip install py-spy``) during one more raw run at the largest count, with
the controller launched through ``gc-controller`` here, which times its cyclic collector.

Then ``--fill``: a fresh controller and unit, one partition filled to each size (puts of up to
10^6 one-byte samples), the controller's RSS per sample, and the p50 of get_meta (1 and 256
samples, each acked) from a blocking ``Client``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
KINDS = ("put", "get_meta", "ack")


def py_spy() -> str | None:
    """py-spy's path: beside this Python (a venv), or on PATH."""
    beside = pathlib.Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid``."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    return int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


# --- workers ----------------------------------------------------------------------------


def _wait_go() -> float:
    """Say ready, then wait for the driver's ``GO seconds`` line; the deadline."""
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    if line[:1] != ["GO"]:
        raise SystemExit(f"expected GO, got {line!r}")
    return time.perf_counter() + float(line[1])


async def _real(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tqueue

    x = torch.zeros(1, 16)
    clients = [tqueue.AsyncClient(cfg["address"]) for _ in range(cfg["n"])]
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    deadline = [float("inf")]

    async def cycle(c: Any, name: str, record: bool) -> None:
        t0 = time.perf_counter()
        await c.put(name, {"x": x})
        t1 = time.perf_counter()
        meta = await c.get_meta(name, ["x"], 1, task="t", timeout=60)
        t2 = time.perf_counter()
        await c.ack(meta)
        t3 = time.perf_counter()
        if record:
            lat["put"].append(t1 - t0)
            lat["get_meta"].append(t2 - t1)
            lat["ack"].append(t3 - t2)

    async def loop(i: int, c: Any) -> None:
        name = f"r{cfg['tag']}-{i}"
        while time.perf_counter() < deadline[0]:
            await cycle(c, name, True)

    # one cycle each first: every connection made, every client's schema cache warm
    await asyncio.gather(*(cycle(c, f"r{cfg['tag']}-{i}", False) for i, c in enumerate(clients)))
    deadline[0] = await asyncio.get_running_loop().run_in_executor(None, _wait_go)
    cpu0 = [time.process_time()]
    await asyncio.gather(*(loop(i, c) for i, c in enumerate(clients)))
    cpu = time.process_time() - cpu0[0]
    for c in clients:
        await c.close()
    return {"cpu": cpu, **{k: [round(v * 1e6) for v in vals] for k, vals in lat.items()}}


class _Conn:
    __slots__ = ("sock", "name", "grant", "get", "state", "t0", "index")

    def __init__(self, sock: Any, name: str, grant: list[bytes], get: list[bytes], index: int) -> None:
        self.sock, self.name, self.grant, self.get, self.index = sock, name, grant, get, index
        self.state = ""
        self.t0 = 0.0


def _raw(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import zmq

    from tqueue.client._encode import encode as encode_fields
    from tqueue.wire import PROTOCOL_VERSION, Ack, GetMeta, Grant, Hello, Store, decode, encode

    ctx = zmq.Context()
    enc = encode_fields({"x": torch.zeros(1, 16)}, partition="x", chunk_bytes=1 << 20)
    grant_blocks = enc.grant_blocks()
    bufs = [bytes(b) for b in enc.buffers]

    def dealer(address: str) -> Any:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        return s

    first = dealer(cfg["address"])
    first.send_multipart(encode(Hello(protocol=PROTOCOL_VERSION, host="gen", rid=1)))
    hello, _ = decode(first.recv_multipart())
    unit = dealer(hello.units[0].address)  # type: ignore[attr-defined]
    conns = []
    for i in range(cfg["n"]):
        name = f"g{cfg['tag']}-{i}"
        grant = encode(Grant(partition=name, count=1, blocks=grant_blocks, host="gen", nbytes=enc.nbytes, rid=1))
        get = encode(GetMeta(partition=name, fields=["x"], batch_size=1, task="t", timeout=60.0, rid=2))
        conns.append(_Conn(first if i == 0 else dealer(cfg["address"]), name, grant, get, i))
    by_sock = {c.sock: c for c in conns}
    poller = zmq.Poller()
    for c in conns:
        poller.register(c.sock, zmq.POLLIN)
    poller.register(unit, zmq.POLLIN)
    lat: dict[str, list[float]] = {k: [] for k in KINDS}

    def start(c: _Conn) -> None:
        c.state, c.t0 = "put", time.perf_counter()
        c.sock.send_multipart(c.grant)

    def on_reply(c: _Conn, frames: list[Any], deadline: float, record: bool) -> bool:
        msg, _ = decode(frames)
        now = time.perf_counter()
        kind = type(msg).__name__
        if kind == "Error":
            raise RuntimeError(f"{c.name}: {msg}")
        if kind == "Granted":
            store = Store(rid=c.index + 1, grant_id=msg.grant_id, partition=c.name,  # type: ignore[attr-defined]
                          partition_uid=msg.partition_uid, start=msg.start, count=1,  # type: ignore[attr-defined]
                          blocks=enc.blocks, timeout=30.0)
            unit.send_multipart(encode(store, bufs))
            return False
        if record:
            lat[c.state].append(now - c.t0)
        if kind == "Stored":
            c.state, c.t0 = "get_meta", now
            c.sock.send_multipart(c.get)
        elif kind == "MetaReply":
            meta = msg.meta  # type: ignore[attr-defined]
            c.state, c.t0 = "ack", now
            c.sock.send_multipart(encode(Ack(partition=c.name, partition_uid=meta.partition_uid, task="t",
                                             indexes=meta.indexes, lease=meta.lease, rid=3)))
        elif now < deadline:
            start(c)
        else:
            return True
        return False

    def run(deadline: float, record: bool) -> None:
        for c in conns:
            start(c)
        left = len(conns)
        while left:
            for sock, _ in poller.poll(30_000):
                if sock is unit:
                    while True:
                        try:
                            frames = unit.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg, _ = decode(frames)
                        left -= on_reply(conns[msg.rid - 1], frames, deadline, record)
                else:
                    left -= on_reply(by_sock[sock], sock.recv_multipart(zmq.NOBLOCK), deadline, record)

    run(0.0, False)  # one cycle each: connected, partitions known
    deadline = _wait_go()
    cpu0 = time.process_time()
    run(deadline, True)
    cpu = time.process_time() - cpu0
    for s in [*by_sock, unit]:
        s.close()
    ctx.term()
    return {"cpu": cpu, **{k: [round(v * 1e6) for v in vals] for k, vals in lat.items()}}


def _echo_server(cfg: dict[str, Any]) -> None:
    """The floor: one Python loop that receives, decodes and answers each message on a
    ROUTER (Ping -> Pong), nothing else; stopped by SIGTERM."""
    import zmq

    from tqueue.wire import Pong, decode, encode

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    print("TQUEUE-READY " + json.dumps({"address": sock.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    while True:
        ident, *frames = sock.recv_multipart()
        msg, _ = decode(frames)
        sock.send_multipart([ident, *encode(Pong(rid=msg.rid))])


def _ping(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ping -> Pong on each of ``n`` connections, as fast as answered."""
    import zmq

    from tqueue.wire import Ping, encode

    ctx = zmq.Context()
    ping = encode(Ping(rid=1))
    socks = []
    poller = zmq.Poller()
    for _ in range(cfg["n"]):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(cfg["address"])
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    sent = dict.fromkeys(socks, 0.0)
    lat: list[float] = []

    def run(deadline: float, record: bool) -> None:
        for s in socks:
            sent[s] = time.perf_counter()
            s.send_multipart(ping)
        left = len(socks)
        while left:
            for s, _ in poller.poll(30_000):
                s.recv_multipart(zmq.NOBLOCK)
                now = time.perf_counter()
                if record:
                    lat.append(now - sent[s])
                if now < deadline:
                    sent[s] = now
                    s.send_multipart(ping)
                else:
                    left -= 1

    run(0.0, False)
    deadline = _wait_go()
    cpu0 = time.process_time()
    run(deadline, True)
    cpu = time.process_time() - cpu0
    for s in socks:
        s.close()
    ctx.term()
    return {"cpu": cpu, "ping": [round(v * 1e6) for v in lat]}


def worker(role: str, cfg: dict[str, Any]) -> None:
    if role == "echo-server":
        _echo_server(cfg)
        return
    out = {"real": lambda: asyncio.run(_real(cfg)), "raw": lambda: _raw(cfg), "ping": lambda: _ping(cfg)}[role]()
    print(json.dumps(out), flush=True)


def gc_controller(path: str, args: list[str]) -> int:
    """``tqueue controller ARGS`` in this process, with the cyclic collector's CPU time (and
    the process's) written to ``path`` as JSON at exit: the benchmark's own launch, tqueue
    unchanged."""
    import atexit
    import gc

    from tqueue.cli import main as tqueue_main

    state = {"start": 0.0, "wall": 0.0, "gc_cpu_s": 0.0, "collections": [0, 0, 0], "longest_ms": [0.0, 0.0, 0.0]}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            state["start"], state["wall"] = time.thread_time(), time.perf_counter()
        else:
            gen = info["generation"]
            state["gc_cpu_s"] += time.thread_time() - state["start"]
            state["collections"][gen] += 1
            state["longest_ms"][gen] = max(state["longest_ms"][gen], (time.perf_counter() - state["wall"]) * 1e3)

    def write() -> None:
        pathlib.Path(path).write_text(json.dumps({**state, "cpu_s": time.process_time()}))

    gc.callbacks.append(timed)
    atexit.register(write)
    return tqueue_main(["controller", *args])


# --- the driver -------------------------------------------------------------------------


class Servers:
    """A controller and one unit on 127.0.0.1, stopped by pid on leaving."""

    def __init__(self, *controller_args: str, echo: bool = False, gc_file: str = "") -> None:
        from benchmarks.netns import read_line

        self.procs: list[subprocess.Popen[bytes]] = []
        self.unit_pid = 0
        self.metrics = ""  # the controller's Prometheus endpoint: the requests it handled, by kind
        self.log = tempfile.TemporaryFile()  # the servers' stderr, shown when a run fails
        try:
            if echo:  # the floor in place of a controller, no unit
                ctl = subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "worker", "echo-server", "{}"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
                self.procs.append(ctl)
                self.ctl_pid = ctl.pid
                self.address = json.loads(read_line(ctl.stdout, 60, what="echo")[len("TQUEUE-READY "):])["address"]  # type: ignore[arg-type]
                return
            if gc_file:  # the controller through gc_controller
                ctl = self._start("controller", *controller_args, "--metrics-port", "0",
                                  prefix=["-m", "benchmarks.scale", "gc-controller", gc_file])
            else:
                ctl = self._start("controller", *controller_args, "--metrics-port", "0")
            self.ctl_pid = ctl.pid
            self.address = json.loads(read_line(ctl.stdout, 60, what="controller")[len("TQUEUE-READY "):])["address"]  # type: ignore[arg-type]
            self.metrics = _metrics_url(self.address)
            unit = self._start("storage-unit", "--controller", self.address, "--host", "unit-host")
            read_line(unit.stdout, 60, what="unit")  # type: ignore[arg-type]
            self.unit_pid = unit.pid
        except BaseException:
            self.close()
            raise

    def _start(self, *args: str, prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        if prefix is not None:  # gc-controller takes the arguments after "controller"
            args = args[1:]
        proc = subprocess.Popen([sys.executable, *(prefix or ["-m", "tqueue"]), *args, "--watch-stdin"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=REPO)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        from benchmarks.netns import stop

        for proc in reversed(self.procs):  # the unit first: it would miss its controller
            stop(proc)
        self.log.close()

    def tail(self, lines: int = 3) -> str:
        """The last lines the servers wrote to stderr."""
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _metrics_url(address: str) -> str:
    from tqueue import Client

    with Client(address) as client:
        return client.status().metrics


def requests_handled(url: str) -> dict[str, int]:
    """The controller's count of requests it answered, by message kind (its latency
    histogram's counts; pings, answered on arrival, are not among them)."""
    import urllib.request

    if not url:
        return {}
    counts: dict[str, int] = {}
    with urllib.request.urlopen(url, timeout=30) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("tqueue_request_seconds_count{"):
                labels, _, value = line.rpartition(" ")
                kind = labels.split('kind="', 1)[1].split('"', 1)[0]
                counts[kind] = int(float(value))
    return counts


def _pct(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1e3  # ms


def load(
    role: str, clients: int, procs: int, seconds: float, profile_s: float = 0.0, heartbeat: float = 1.0,
    gc_file: str = "",
) -> dict[str, Any]:
    """One run: ``clients`` connections of kind ``role`` over ``procs`` processes; the
    cluster's heartbeat every ``heartbeat`` seconds (a client gives the controller 3 of them,
    the controller a unit 5)."""
    from benchmarks.netns import read_line, stop

    with Servers("--heartbeat-interval", str(heartbeat), echo=role == "ping", gc_file=gc_file) as servers:
        workers = []
        try:
            for p in range(procs):
                n = clients // procs + (p < clients % procs)
                cfg = {"address": servers.address, "n": n, "tag": p}
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.scale", "worker", role, json.dumps(cfg)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                ))
            for w in workers:
                if read_line(w.stdout, 300, what=f"{role} worker") != "READY":  # type: ignore[arg-type]
                    raise RuntimeError(f"{role} worker did not say READY")
            spy = None
            spy_path = py_spy()
            if profile_s and spy_path:
                spy = subprocess.Popen(
                    [spy_path, "record", "--pid", str(servers.ctl_pid), "--duration", str(int(profile_s)),
                     "--rate", "250", "--nonblocking", "--format", "raw", "--output", "/tmp/tqueue-scale-profile.txt"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            def unit_cpu_s() -> float:
                return cpu_seconds(servers.unit_pid) if servers.unit_pid else 0.0

            handled0 = requests_handled(servers.metrics)
            cpu0, unit0, t0 = cpu_seconds(servers.ctl_pid), unit_cpu_s(), time.perf_counter()
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"GO {seconds}\n".encode())
                w.stdin.flush()
            kinds = ("ping",) if role == "ping" else KINDS
            lat: dict[str, list[int]] = {k: [] for k in kinds}
            load_cpu = 0.0
            for w in workers:
                out = json.loads(read_line(w.stdout, seconds + 300, what=f"{role} worker"))  # type: ignore[arg-type]
                load_cpu += out["cpu"]
                for k in kinds:
                    lat[k] += out[k]
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(servers.ctl_pid) - cpu0
            unit_cpu = unit_cpu_s() - unit0
            handled = requests_handled(servers.metrics)
            handled = {k: n - handled0.get(k, 0) for k, n in handled.items() if n > handled0.get(k, 0)}
            if spy is not None:
                spy.wait(timeout=profile_s + 60)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; the servers said: {servers.tail()}") from exc
        finally:
            for w in workers:
                stop(w)
    ops = sum(len(v) for v in lat.values())
    if role == "ping":  # one message per op, nothing else
        return {
            "role": role, "clients": clients, "procs": procs, "seconds": seconds, "wall": wall, "ops": ops,
            "ops_per_s": ops / seconds, "ctl_cpu_s": cpu, "ctl_core": cpu / wall, "ctl_us_per_op": cpu / ops * 1e6,
            "ctl_us_per_msg": cpu / ops * 1e6, "ctl_msgs_per_cycle": 1.0, "unit_us_per_cycle": 0.0, "load_us_per_cycle": load_cpu / ops * 1e6,
            **{f"{k}_p50": _pct(lat["ping"], 0.5) for k in KINDS}, **{f"{k}_p99": _pct(lat["ping"], 0.99) for k in KINDS},
        }
    cycles = len(lat["ack"])
    return {
        "role": role, "clients": clients, "procs": procs, "seconds": seconds, "wall": wall, "ops": ops,
        "ops_per_s": ops / seconds, "ctl_cpu_s": cpu, "ctl_core": cpu / wall,
        "ctl_us_per_op": cpu / ops * 1e6, "ctl_us_per_msg": cpu / (sum(handled.values()) or 4 * cycles) * 1e6,
        "ctl_msgs_per_cycle": sum(handled.values()) / cycles if handled else 4.0, "handled": handled,
        "unit_us_per_cycle": unit_cpu / cycles * 1e6, "load_us_per_cycle": load_cpu / cycles * 1e6,
        **{f"{k}_p50": _pct(lat[k], 0.5) for k in KINDS}, **{f"{k}_p99": _pct(lat[k], 0.99) for k in KINDS},
    }


def profile_top(path: str, limit: int = 25) -> list[tuple[str, float, float]]:
    """(function, self %, total %) from py-spy's raw (collapsed) output, by self time."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    n = 0
    for line in pathlib.Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")" if " (" in f else f
                  for f in stack.split(";") if f]
        k = int(count)
        n += k
        if frames:
            own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return [(f, 100 * c / n, 100 * total[f] / n) for f, c in own.most_common(limit)]


def fill(sizes: list[int], calls: int = 300) -> list[dict[str, Any]]:
    """A partition filled to each of ``sizes``: controller RSS per sample, get_meta p50."""
    import torch

    import tqueue

    out = []
    with Servers() as servers:
        client = tqueue.Client(servers.address, config=tqueue.ClientConfig(host="bench"))
        client.put("warm", {"x": torch.zeros(4, dtype=torch.uint8)})
        client.clear("warm")
        base = rss_bytes(servers.ctl_pid)
        have = 0
        for size in sizes:
            t0 = time.perf_counter()
            while have < size:
                n = min(1_000_000, size - have)
                client.put("big", {"x": torch.zeros(n, dtype=torch.uint8)})
                have += n
            fill_s = time.perf_counter() - t0
            rss = rss_bytes(servers.ctl_pid)
            row: dict[str, Any] = {"samples": size, "ctl_rss": rss, "ctl_base": base,
                                   "bytes_per_sample": (rss - base) / size, "fill_s": fill_s,
                                   "unit_rss": rss_bytes(servers.unit_pid)}
            for batch in (1, 256):
                took = []
                for _ in range(calls):
                    t = time.perf_counter()
                    meta = client.get_meta("big", ["x"], batch, task=f"t{size}", timeout=10)
                    took.append(time.perf_counter() - t)
                    client.ack(meta)
                row[f"get_meta_{batch}_p50_ms"] = statistics.median(took) * 1e3
            out.append(row)
        client.close()
    return out


def _row(r: dict[str, Any], label: str) -> None:
    print(f"{label:9s} {r['clients']:5d} {r['ops_per_s']:7.0f} {r['ctl_us_per_op']:10.1f} {r['ctl_us_per_msg']:11.1f} "
          f"{r.get('ctl_msgs_per_cycle', 1.0):9.2f} {r['ctl_core']:8.0%} {r['unit_us_per_cycle']:14.0f} {r['load_us_per_cycle']:14.0f}  "
          f"{r['put_p50']:6.1f}/{r['put_p99']:6.1f}  {r['get_meta_p50']:6.1f}/{r['get_meta_p99']:6.1f}  "
          f"{r['ack_p50']:6.1f}/{r['ack_p99']:6.1f}", flush=True)


# Issue 28, point 3 (docs/performance-history.md, "Targets of issue 28, point 3")
US_PER_OP = 20.0  # controller CPU per metadata operation
P99_CLIENTS, P99_MS = 100, 10.0  # get_meta p99 at this many connections
FILL_SAMPLES, FILL_P50_MS = 10**6, 0.5  # get_meta p50 of one sample in a partition this full
CONNECTIONS = 1000


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, figure, met) for point 3's targets that this run measured; medians where
    the run repeated its rows."""
    rows = results.get("medians") or results["runs"]
    out: list[tuple[str, str, bool]] = []
    failed = results.get("failed", [])
    many = [r for r in results["runs"] if r["clients"] >= CONNECTIONS and r["role"] in ("raw", "real")]
    if many or [f for f in failed if f["clients"] >= CONNECTIONS]:
        lost = [f for f in failed if f["clients"] >= CONNECTIONS]
        out.append((f"{CONNECTIONS:,} concurrent connections complete their cycles",
                    f"{len(many)} runs completed, {len(lost)} failed" + (f" ({lost[0]['why'][:120]})" if lost else ""),
                    bool(many) and not lost))
    for r in rows:
        if r["role"] not in ("raw", "real"):
            continue
        out.append((f"controller CPU ≤ {US_PER_OP:g} µs an operation ({r['role']}, {r['clients']} connections)",
                    f"{r['ctl_us_per_op']:.1f} µs", r["ctl_us_per_op"] <= US_PER_OP))
        if r["clients"] == P99_CLIENTS:
            out.append((f"get_meta p99 < {P99_MS:g} ms at {P99_CLIENTS} connections ({r['role']})",
                        f"{r['get_meta_p99']:.1f} ms (p50 {r['get_meta_p50']:.1f})", r["get_meta_p99"] < P99_MS))
    fills = results.get("fill", [])
    for row in fills:
        if row["samples"] >= FILL_SAMPLES:
            out.append((f"get_meta p50 < {FILL_P50_MS:g} ms at {row['samples']:,} samples",
                        f"{row['get_meta_1_p50_ms']:.3f} ms (of 256: {row['get_meta_256_p50_ms']:.3f})",
                        row["get_meta_1_p50_ms"] < FILL_P50_MS))
    if len(fills) >= 2:
        small, big = fills[0], fills[-1]
        out.append((f"controller memory per sample bounded ({big['samples']:,} samples against {small['samples']:,}: "
                    "at most twice, the arrays' doubling)",
                    f"{big['bytes_per_sample']:.0f} against {small['bytes_per_sample']:.0f} B/sample",
                    big["bytes_per_sample"] <= 2 * small["bytes_per_sample"]))
    return out


def markdown(results: dict[str, Any], command: str) -> str:
    """The run's rows (medians where repeated) and its targets, as docs/performance.md shows them."""
    rows = results.get("medians") or results["runs"]
    med = f"medians of {results['repeat']}" if results.get("medians") else "one run each"
    out = [f"Written by `{command}` on {time.strftime('%Y-%m-%d')} ({results['cpus']} cores, {med}):", "",
           "| load | connections | ops/s | controller µs/op | µs/msg | msgs/cycle | controller core | "
           "get_meta p50 / p99 ms | put p50 / p99 ms | ack p50 / p99 ms |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lat = "- | - | -" if r["role"] == "ping" else (
            f"{r['get_meta_p50']:.1f} / {r['get_meta_p99']:.1f} | {r['put_p50']:.1f} / {r['put_p99']:.1f} | "
            f"{r['ack_p50']:.1f} / {r['ack_p99']:.1f}")
        out.append(f"| {r['role']} | {r['clients']} | {r['ops_per_s']:.0f} | {r['ctl_us_per_op']:.1f} | "
                   f"{r['ctl_us_per_msg']:.1f} | {r.get('ctl_msgs_per_cycle', 1.0):.2f} | {r['ctl_core']:.0%} | "
                   + lat + " |")
    for row in results.get("fill", []):
        out.append("")
        out.append(f"A partition of {row['samples']:,} samples: controller RSS {row['ctl_rss'] / 2**20:.0f} MiB "
                   f"({row['bytes_per_sample']:.1f} B/sample over the empty controller); get_meta p50 of 1 "
                   f"{row['get_meta_1_p50_ms']:.3f} ms, of 256 {row['get_meta_256_p50_ms']:.3f} ms.")
    found = targets(results)
    if found:
        out += ["", "| target | measured | met? |", "|---|---|---|"]
        out += [f"| {t} | {fig} | {'yes' if met else 'no'} |" for t, fig, met in found]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1], json.loads(argv[2]))
        return 0
    if argv[:1] == ["gc-controller"]:
        return gc_controller(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="100,400,1000")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--procs", type=int, default=4, help="processes of real clients")
    parser.add_argument("--gen-procs", type=int, default=2, help="processes of the raw load generator")
    parser.add_argument("--roles", default="raw,real,ping", help="raw, real, ping (an echo server: the floor)")
    parser.add_argument("--heartbeat", type=float, default=1.0,
                        help="the cluster's heartbeat interval, s (tqueue's default: 1; clients give up after 3)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row; medians printed after")
    parser.add_argument("--fill", default="1e6,1e7", help="partition sizes ('' for none)")
    parser.add_argument("--profile-s", type=float, default=6.0, help="py-spy the controller this long (0: not)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--docs", metavar="FILE", help="also write the tables into FILE, between the lines "
                        "<!-- bench:scale --> and <!-- /bench:scale --> (docs/performance.md has them)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.harness import check_docs

    check_docs(parser, args.docs, "scale")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load": os.getloadavg(), "runs": [], "repeat": args.repeat}
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    print("run       clients   ops/s  ctl µs/op  ctl µs/msg  msgs/cycle  ctl core  unit µs/cycle  load µs/cycle  put p50/p99  get_meta p50/p99  ack p50/p99 (ms)")
    for rep in range(args.repeat):
        for role in args.roles.split(","):
            procs = args.procs if role == "real" else args.gen_procs
            for clients in (int(c) for c in args.clients.split(",")):
                try:
                    r = load(role, clients, procs, args.seconds, heartbeat=args.heartbeat)
                except RuntimeError as exc:
                    results.setdefault("failed", []).append({"role": role, "clients": clients, "why": str(exc)})
                    print(f"{role} #{rep + 1} {clients:5d} failed: {str(exc)[:300]}", flush=True)
                    continue
                r["rep"] = rep
                results["runs"].append(r)
                _row(r, f"{role} #{rep + 1}")
    if args.repeat > 1:
        print(f"medians of {args.repeat}:")
        for role in args.roles.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                runs = [r for r in results["runs"] if r["role"] == role and r["clients"] == clients]
                if not runs:
                    continue
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)}
                results.setdefault("medians", []).append({"role": role, "clients": clients, **med})
                _row({"clients": clients, **med}, f"{role} m{len(runs)}")
    if args.profile_s and py_spy():
        clients = max(int(c) for c in args.clients.split(","))
        gc_file = "/tmp/tqueue-scale-gc.json"
        load("raw", clients, args.gen_procs, args.profile_s + 2, profile_s=args.profile_s, heartbeat=args.heartbeat,
             gc_file=gc_file)
        gcs = results["gc"] = json.loads(pathlib.Path(gc_file).read_text())
        print(f"controller's cyclic GC: {gcs['gc_cpu_s']:.2f} s of its {gcs['cpu_s']:.2f} s of CPU "
              f"({gcs['gc_cpu_s'] / gcs['cpu_s']:.0%}); collections by generation {gcs['collections']}, "
              f"the longest of each {', '.join(f'{ms:.1f}' for ms in gcs['longest_ms'])} ms")
        top = results["profile"] = profile_top("/tmp/tqueue-scale-profile.txt")
        print("controller profile (py-spy, raw load), by own time: own %  total %  function")
        for f, own, total in top:
            print(f"  {own:5.1f} {total:6.1f}  {f}")
    if args.fill:
        for row in fill([int(float(s)) for s in args.fill.split(",")]):
            results.setdefault("fill", []).append(row)
            print(f"partition of {row['samples']:,} samples: controller RSS {row['ctl_rss'] / 2**20:.0f} MiB "
                  f"({row['bytes_per_sample']:.1f} B/sample over the empty controller), filled in {row['fill_s']:.1f} s; "
                  f"get_meta p50 of 1: {row['get_meta_1_p50_ms']:.3f} ms, of 256: {row['get_meta_256_p50_ms']:.3f} ms",
                  flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    for target, figure, met in targets(results):
        print(f"{'met' if met else 'NOT met'}: {target}: {figure}")
    if args.docs:
        from benchmarks.harness import write_into_docs

        command = "python -m benchmarks.scale " + " ".join(a for a in argv if a)
        write_into_docs(args.docs, "scale", markdown(results, command))
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
