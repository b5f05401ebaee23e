"""Chaos: a streaming RL job whose processes are SIGKILLed and restarted, every sample ledgered.

    python benchmarks/chaos.py [--seconds 120] [--units 3] [--producers 3] [--kill-every 3]
                               [--seed 1] [--rows 256] [--copies 1]

The job, on a local cluster (heartbeats every 0.5 s): producer processes put groups of
``GROUP`` samples (``x``: float32 rows drawn from a generator seeded by the sample's id; ``id``;
``crc``: CRC-32 of ``x``'s bytes) into one partition that two tasks read. ``reward`` leases
samples, checks each CRC, writes a ``reward`` field (a function of the id) with ``update`` and
acks; ``train`` leases samples that have their reward, checks bytes, CRC and reward, and acks.
Leases lapse after ``LEASE`` s, so what a killed consumer held is served again. Every worker
appends one JSON line to a ledger file of its own for each put acknowledged to it (ids and
indexes) and each ack it made (ids), and counts the errors it met.

Meanwhile the driver SIGKILLs a random process every ``--kill-every`` s: a producer or a
consumer of either task (restarted at once, as a new incarnation), or a storage unit (a
replacement is started; the dead one's samples are lost, and the controller counts them per
task). With ``--copies 2`` units die one at a time: a unit is a candidate only once the
controller has declared the one killed before dead and no sample is held once any more (its
copies made again); then no sample may be lost at all. Then the producers stop, the consumers drain, and the ledger is checked against what
the controller reports (``select(consumed_by=task)`` lists the live samples a task consumed):

* no task consumed a sample twice (two recorded acks), and none that was never put;
* every sample acknowledged to a producer was, for each task, consumed and recorded; or
  consumed by a consumer killed between its ack and its ledger line (the controller says
  consumed); or lost with its unit (no longer live, and the task's ``lost`` count covers it);
  or, at most a batch per consumer killed, gone in a kill window: a consumer wrote that it was
  acking them and was killed before it wrote that it had, and then their unit died, so that
  neither the ledger nor the controller can tell consumed from lost (a consumer whose update or
  ack fails writes so, ``not_acked``: those samples count as lost, not as in a kill window);
* every byte read matched its CRC and its generator, every reward its id;
* the controller's own counts agree: for each task, consumed + lost == samples; no sample is
  held once at the end (after up to ``SETTLE`` s for its copy to be made again), and none was
  found corrupt (``status().corrupt``);
* the controller, never killed, ends with its fds and threads where they started and its
  resident memory within ``RSS_SLACK`` of the start.

Prints the ledger's totals as JSON (with the fds, threads and RSS of the controller and of the units alive at the end, at their start and at the end); exits non-zero on any breach. ``run()`` is what
tests/faults/test_chaos.py calls (a short run); docs/reliability.md keeps a long run's totals.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``tqueue`` of this tree importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import tqueue
from tqueue import errors

PARTITION = "chaos"
TASKS = ("reward", "train")
GROUP = 8  # samples per put, and per read
LEASE = 3.0  # seconds a killed consumer's lease lasts
INTERVAL = 0.5  # the cluster's heartbeat interval
BACKLOG = 2048  # producers pause while the trainer has this many samples left to read
RSS_SLACK = 64 << 20  # the controller's resident memory may end this much above its start
SETTLE = 30.0  # seconds the end waits for samples held once to be copied again (copies=2)
# the errors a worker meets when a process it talks to is killed: counted, then it goes on
EXPECTED = (errors.DataLostError, errors.StorageUnitUnavailableError, errors.WaitTimeoutError, errors.UnavailableError)


def payload(ident: int, rows: int) -> torch.Tensor:
    return torch.rand(rows, generator=torch.Generator().manual_seed(ident))


def reward_of(ident: int) -> float:
    return float(ident % 1009) / 7.0


class Ledger:
    """One worker's ledger: JSON lines appended with one write each (a SIGKILL loses at most
    the line being built, never half of one already written)."""

    def __init__(self, path: pathlib.Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def _backlog(client: tqueue.Client) -> int:
    """Samples the trainer has yet to read (or to learn lost)."""
    part = next((p for p in client.status().partitions if p.name == PARTITION), None)
    if part is None or "train" not in part.tasks:
        return 0
    train = part.tasks["train"]
    return part.samples - train.consumed - train.lost


def produce(address: str, incarnation: int, rows: int, ledger: Ledger, stop: pathlib.Path) -> None:
    """Put groups until told to stop, pausing while the trainer is ``BACKLOG`` samples behind
    (rollouts wait for the trainer in a real job too; without it the consumers never catch up)."""
    seq = 0
    pace = threading.Event()  # never set: a pause that ends by its timeout
    with tqueue.Client(address, config=tqueue.ClientConfig(request_timeout=10.0)) as client:
        while not stop.exists():
            try:
                if seq % 16 == 0 and _backlog(client) > BACKLOG:
                    pace.wait(0.05)
                    continue
            except EXPECTED as exc:
                ledger.write(error=type(exc).__name__)
                continue
            ids = [(incarnation << 32) | (seq * GROUP + k) for k in range(GROUP)]
            xs = torch.stack([payload(i, rows) for i in ids])
            crcs = [zlib.crc32(x.numpy().tobytes()) for x in xs]
            seq += 1
            try:
                meta = client.put(PARTITION, {"x": xs, "id": torch.tensor(ids), "crc": torch.tensor(crcs)}, timeout=10.0)
            except EXPECTED as exc:
                ledger.write(error=type(exc).__name__)
                continue
            ledger.write(put=ids, idx=meta.indexes)


def consume(address: str, task: str, rows: int, ledger: Ledger, stop: pathlib.Path) -> None:
    """Read, check, (reward: update,) ack. Once the producers stopped, a batch of one, so that
    the last samples (fewer than a batch, where some were lost) are read too."""
    fields = ["x", "id", "crc"] + (["reward"] if task == "train" else [])
    draining = stop.with_name("draining")
    with tqueue.Client(address, config=tqueue.ClientConfig(request_timeout=10.0)) as client:
        size = GROUP
        while not stop.exists():
            try:
                batch = client.get_data(PARTITION, fields, size, task=task, timeout=1.0, lease_timeout=LEASE)
            except EXPECTED as exc:
                ledger.write(error=type(exc).__name__)
                # the tail (fewer than a batch, where some were lost) is read one by one
                size = 1 if isinstance(exc, errors.WaitTimeoutError) and draining.exists() else GROUP
                continue
            ids = batch["id"].tolist()
            for k, (ident, crc) in enumerate(zip(ids, batch["crc"].tolist())):
                data = batch["x"][k].numpy().tobytes()
                if zlib.crc32(data) != crc or not torch.equal(batch["x"][k], payload(ident, rows)):
                    ledger.write(corrupt=ident, task=task)
                if task == "train" and float(batch["reward"][k]) != reward_of(ident):
                    ledger.write(bad_reward=ident)
            ledger.write(acking=ids, task=task)  # killed from here to "acked": acked or not, unknown
            try:
                if task == "reward":
                    client.update(batch.meta, {"reward": torch.tensor([reward_of(i) for i in ids], dtype=torch.float64)})
                client.ack(batch.meta)
            except EXPECTED as exc:  # not acked: the samples are served again, or lost with their unit
                ledger.write(error=type(exc).__name__, not_acked=ids, task=task)
                continue
            ledger.write(acked=ids, task=task)


def worker(argv: list[str]) -> int:
    role, address, incarnation, rows, ledger_path, stop = argv
    ledger = Ledger(pathlib.Path(ledger_path))
    if role == "producer":
        produce(address, int(incarnation), int(rows), ledger, pathlib.Path(stop))
    else:
        consume(address, role, int(rows), ledger, pathlib.Path(stop))
    return 0


class Job:
    """The worker processes and the units: started, killed and restarted by pid."""

    def __init__(
        self, cluster: tqueue.LocalCluster, tmp: pathlib.Path, rows: int, rng: random.Random, copies: int = 1
    ) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.rows = rows
        self.rng = rng
        self.stop = {"producer": tmp / "stop-producers", "consumer": tmp / "stop-consumers"}
        self.workers: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}  # incarnation -> (role, proc)
        self.killed: dict[str, int] = {}
        self.crashed: list[str] = []
        self.units = list(cluster.pids[1:])  # live unit pids
        self.unit_addresses = list(cluster.unit_addresses)  # theirs, in the same order
        self.dying: list[str] = []  # addresses of units killed, until the controller knows
        self.copies = copies
        self.unit_baseline = {pid: _server_use(pid) for pid in self.units}  # fds, threads, RSS at its start
        self._next = 1
        script = pathlib.Path(__file__).resolve()
        self._cmd = [sys.executable, str(script), "--worker"]
        self._env = {**os.environ, "PYTHONPATH": str(script.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start(self, role: str) -> None:
        n, self._next = self._next, self._next + 1
        stop = self.stop["producer" if role == "producer" else "consumer"]
        args = [role, self.cluster.address, str(n), str(self.rows), str(self.tmp / f"ledger-{n}.jsonl"), str(stop)]
        with open(self.tmp / f"stderr-{n}.log", "wb") as err:  # a file: a pipe nobody reads would fill up
            proc = subprocess.Popen([*self._cmd, *args], env=self._env, stderr=err)
        self.workers[n] = (role, proc)

    def _stderr(self, n: int) -> str:
        return (self.tmp / f"stderr-{n}.log").read_text(errors="replace")[-2000:]

    def units_may_die(self, client: tqueue.Client) -> bool:
        """With copies (``copies`` > 1), one unit killed at a time: the next only once the
        controller has declared every unit killed before dead and has copied again every
        sample they held (no sample of the partition is held once)."""
        if self.copies < 2:
            return True
        status = client.status()
        alive = {u.address for u in status.units if u.alive}
        if any(address in alive for address in self.dying):
            return False
        self.dying.clear()
        return all(p.single == 0 for p in status.partitions if p.name == PARTITION)

    def kill_one(self, client: tqueue.Client) -> str:
        """SIGKILL a random worker or unit (never the last live unit) and start its successor."""
        live = [n for n, (_, p) in self.workers.items() if p.poll() is None]
        units = len(self.units) > 1 and self.units_may_die(client)
        choices = [("worker", n) for n in live] + ([("unit", pid) for pid in self.units] if units else [])
        kind, which = self.rng.choice(choices)
        if kind == "unit":
            os.kill(which, signal.SIGKILL)
            i = self.units.index(which)
            self.dying.append(self.unit_addresses.pop(i))
            self.units.remove(which)
            self.units.append(self.cluster.start_unit())
            self.unit_baseline[self.units[-1]] = _server_use(self.units[-1])
            self.unit_addresses.append(self.cluster.unit_addresses[-1])
            victim = "unit"
        else:
            victim, proc = self.workers[which]
            proc.kill()
            proc.wait()
            del self.workers[which]
            self.start(victim)
        self.killed[victim] = self.killed.get(victim, 0) + 1
        return victim

    def check_alive(self) -> None:
        """A worker that exited by itself before it was told to stop crashed: that is a finding."""
        for n, (role, proc) in list(self.workers.items()):
            if proc.poll() is not None and not self.stop["producer" if role == "producer" else "consumer"].exists():
                self.crashed.append(f"{role} #{n} exited {proc.returncode}: {self._stderr(n)}")
                del self.workers[n]
                self.start(role)

    def finish(self, role: str, timeout: float) -> None:
        self.stop["producer" if role == "producer" else "consumer"].touch()
        for n, (r, proc) in list(self.workers.items()):
            if (r == "producer") == (role == "producer"):
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    self.crashed.append(f"{r} #{n} did not stop within {timeout} s: {self._stderr(n)}")
                    continue
                if proc.returncode:
                    self.crashed.append(f"{r} #{n} exited {proc.returncode}: {self._stderr(n)}")


def _server_use(pid: int) -> dict[str, int]:
    """A server's open fds, threads and resident bytes, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task")), "rss": rss}


def _drained(client: tqueue.Client) -> bool:
    part = next((p for p in client.status().partitions if p.name == PARTITION), None)
    return part is not None and all(
        part.tasks.get(t) is not None and part.tasks[t].consumed + part.tasks[t].lost >= part.samples for t in TASKS
    )


def _held_once(client: tqueue.Client) -> int:
    part = next((p for p in client.status().partitions if p.name == PARTITION), None)
    return part.single if part is not None else 0


def run(
    *, seconds: float = 120.0, units: int = 3, producers: int = 3, kill_every: float = 3.0, seed: int = 1,
    rows: int = 256, drain_timeout: float = 120.0, copies: int = 1,
) -> dict[str, Any]:
    """Run the job with its kills; the ledger's totals, checked (AssertionError on a breach)."""
    rng = random.Random(seed)
    pause = threading.Event()
    with (
        tempfile.TemporaryDirectory(prefix="tqueue-chaos-") as tmp,
        tqueue.LocalCluster(num_storage_units=units, controller={"heartbeat_interval": INTERVAL}) as cluster,
    ):
        tmpdir = pathlib.Path(tmp)
        with tqueue.Client(cluster.address) as client:
            client.create_partition(PARTITION, tasks=list(TASKS), copies=copies)
            baseline = _server_use(cluster.pids[0])
            job = Job(cluster, tmpdir, rows, rng, copies)
            for _ in range(producers):
                job.start("producer")
            for task in TASKS:
                job.start(task)
            t0 = time.monotonic()
            kills: list[str] = []
            while time.monotonic() - t0 < seconds:
                pause.wait(min(kill_every, max(0.0, seconds - (time.monotonic() - t0))))
                job.check_alive()
                if time.monotonic() - t0 < seconds:
                    kills.append(job.kill_one(client))
            job.finish("producer", timeout=60.0)
            (tmpdir / "draining").touch()
            deadline = time.monotonic() + drain_timeout
            while not _drained(client) and time.monotonic() < deadline:
                job.check_alive()
                pause.wait(0.5)
            drained = _drained(client)
            job.finish("consumer", timeout=60.0)
            # copying again goes on in the background: held once at the end is a finding
            # only once it had time to settle (a bounded wait on the controller's own state)
            settle = time.monotonic() + SETTLE
            while _held_once(client) and time.monotonic() < settle:
                pause.wait(0.2)
            status = next(p for p in client.status().partitions if p.name == PARTITION)
            live = client.select(PARTITION, ["x"])
            consumed = {t: client.select(PARTITION, ["x"], consumed_by=t) for t in TASKS}
            client.clear(PARTITION)
        wall = time.monotonic() - t0
        end = _server_use(cluster.pids[0])
        # the units alive at the end, their partition cleared: (start, end) of each
        unit_use = {pid: (job.unit_baseline[pid], _server_use(pid)) for pid in job.units}
        result = _check(tmpdir, status, live, consumed, drained, job.killed)
        if copies > 1 and status.lost:
            result["breaches"].append(f"{status.lost} samples lost with copies={copies}, one unit killed at a time")
    result.update({
        "seconds": seconds, "wall_s": round(wall, 1), "units": units, "producers": producers, "copies": copies,
        "kills": job.killed,
        "crashed": job.crashed, "controller_fds": [baseline["fds"], end["fds"]],
        "controller_threads": [baseline["threads"], end["threads"]],
        "controller_rss_mb": [round(baseline["rss"] / 2**20, 1), round(end["rss"] / 2**20, 1)],
        "unit_fds": [[a["fds"], b["fds"]] for a, b in unit_use.values()],
        "unit_threads": [[a["threads"], b["threads"]] for a, b in unit_use.values()],
        "unit_rss_mb": [[round(a["rss"] / 2**20, 1), round(b["rss"] / 2**20, 1)] for a, b in unit_use.values()],
    })
    breaches = result["breaches"]
    if job.crashed:
        breaches.append(f"{len(job.crashed)} workers crashed: {job.crashed[:3]}")
    if end["fds"] > baseline["fds"] or end["threads"] > baseline["threads"]:
        breaches.append(f"controller fds/threads {baseline} -> {end}")
    if end["rss"] > baseline["rss"] + RSS_SLACK:
        breaches.append(f"controller RSS {baseline['rss']} -> {end['rss']}")
    if breaches:
        raise AssertionError(f"chaos: {breaches}; totals {json.dumps(result)}")
    return result


def _check(
    tmp: pathlib.Path, status: Any, live_meta: Any, consumed_meta: dict[str, Any], drained: bool, killed: dict[str, int]
) -> dict[str, Any]:
    put: dict[int, int] = {}  # id -> index, for puts acknowledged to a producer
    acked: dict[str, list[int]] = {t: [] for t in TASKS}
    # ids a consumer was acking, less those whose ack it saw fail: left over, a kill came between
    acking: dict[str, collections.Counter[int]] = {t: collections.Counter() for t in TASKS}
    errors_seen: dict[str, int] = {}
    corrupt, bad_reward = 0, 0
    for path in sorted(tmp.glob("ledger-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "put" in rec:
                put.update(zip(rec["put"], rec["idx"]))
            elif "acked" in rec:
                acked[rec["task"]].extend(rec["acked"])
            elif "acking" in rec:
                acking[rec["task"]].update(rec["acking"])
            if "error" in rec:
                errors_seen[rec["error"]] = errors_seen.get(rec["error"], 0) + 1
                if "not_acked" in rec:
                    acking[rec["task"]].subtract(rec["not_acked"])
            corrupt += "corrupt" in rec
            bad_reward += "bad_reward" in rec
    live = set(live_meta.indexes) if live_meta is not None else set()
    breaches = [] if drained else ["the consumers did not drain the partition in time"]
    if not put:
        breaches.append("no put was acknowledged: the job did not run")
    totals: dict[str, Any] = {"acknowledged_puts": len(put), "errors_met": errors_seen}
    for task in TASKS:
        ids = acked[task]
        twice = len(ids) - len(set(ids))
        unacked = len(set(ids) - set(put))  # stored, but the producer was killed before its ack: consumed too
        server = set(consumed_meta[task].indexes) if consumed_meta[task] is not None else set()
        recorded = set(ids) & set(put)
        unrecorded = [i for i, idx in put.items() if i not in recorded and idx in server]
        gone = [i for i, idx in put.items() if i not in recorded and idx not in live]
        # a consumer killed between its ack and its ledger line, whose samples' unit then died:
        # consumed, but neither the ledger nor the controller can say so any more
        window = [i for i in gone if acking[task][i] > 0]
        lost = [i for i in gone if acking[task][i] <= 0]
        missing = [i for i, idx in put.items() if i not in recorded and idx in live and idx not in server]
        task_lost = status.tasks[task].lost
        counted = status.tasks[task].consumed
        totals[task] = {"consumed": len(recorded), "consumed_unrecorded": len(unrecorded), "lost": len(lost),
                        "gone_in_a_kill_window": len(window),
                        "lost_counted": task_lost, "consumed_counted": counted, "twice": twice, "missing": len(missing),
                        "consumed_unacknowledged_puts": unacked}
        if drained and counted + task_lost != status.samples:
            breaches.append(f"{task}: consumed {counted} + lost {task_lost} != {status.samples} samples (status)")
        if twice:
            breaches.append(f"{task}: {twice} samples consumed twice")
        if missing:
            breaches.append(f"{task}: {len(missing)} acknowledged samples neither consumed nor lost, e.g. {missing[:5]}")
        if len(lost) > task_lost:
            breaches.append(f"{task}: {len(lost)} acknowledged samples gone, only {task_lost} counted lost")
        if len(window) > GROUP * killed.get(task, 0):  # a batch at most per consumer killed
            breaches.append(f"{task}: {len(window)} samples gone in kill windows, more than {killed.get(task, 0)} kills explain")
    if corrupt or bad_reward:
        breaches.append(f"{corrupt} samples with bad bytes, {bad_reward} with a wrong reward")
    totals["samples"] = status.samples
    totals["partition_lost"] = status.lost
    totals["held_once"] = status.single
    if status.single:
        breaches.append(f"{status.single} samples still held once at the end (one more death would lose them)")
    corrupt_counted = getattr(status, "corrupt", None)  # copies the controller dropped for bad bytes
    if corrupt_counted is not None:
        totals["corrupt"] = corrupt_counted
        if corrupt_counted:
            breaches.append(f"{corrupt_counted} copies found corrupt")
    totals["breaches"] = breaches
    return totals


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--units", type=int, default=3)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--copies", type=int, default=1, help="copies of each put (2: a unit's death alone loses nothing)")
    args = p.parse_args(argv)
    try:
        result = run(seconds=args.seconds, units=args.units, producers=args.producers, kill_every=args.kill_every,
                     seed=args.seed, rows=args.rows, copies=args.copies)
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
