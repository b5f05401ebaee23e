"""End-to-end benchmark: tqueue beside its peers, on the same batch, in one run.

    python benchmarks/e2e.py [--quick | --smoke] [--sizes 256,1024] [--scenarios 1to1,1to4]
                             [--systems tqueue,tqueue-wide,tqueue-shm,tqueue-shm-inflight,zmq-raw,ray,ray-zerocopy,transferqueue]
                             [--repeats 5] [--warmup 3] [--rounds 2] [--out bench-results]

(also tqueue bench from a source checkout). Peers that are not installed are skipped with a
line saying so; bash benchmarks/install_peers.sh installs them. Every figure is the median of
--repeats runs, with min and max, spread over --rounds rounds that take the systems in turn;
each round starts every system afresh and runs --warmup unrecorded first. Writes results.md,
results.json and (with matplotlib) throughput.png to --out. --smoke only proves the harness
runs end to end (32 samples, 1to1, one run, no warm-up): its figures mean nothing. To compare
two trees, run each tree's harness into its own folders, alternating, and read them with
benchmarks/compare.py (its docstring has the commands).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.harness import SCENARIOS, Result

# name -> (module, class, constructor kwargs)
SYSTEMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tqueue": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "tcp"}),
    "tqueue-wide": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "tcp", "pack": False}),
    "tqueue-shm": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "shm"}),
    # streaming producers with 4 puts in flight each (threads of one Client), coalesced
    "tqueue-inflight": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "tcp", "inflight": 4}),
    "tqueue-shm-inflight": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "shm", "inflight": 4}),
    # one-sided NIXL transfers of the units' arenas (the nixl extra; UCX_TLS=tcp: as between hosts without RDMA)
    "tqueue-nixl": ("benchmarks.systems.tqueue_sys", "TQueueSystem", {"transport": "nixl"}),
    "zmq-raw": ("benchmarks.systems.zmq_sys", "ZmqRawSystem", {"transport": "tcp"}),
    "zmq-raw-ipc": ("benchmarks.systems.zmq_sys", "ZmqRawSystem", {"transport": "ipc"}),
    "ray": ("benchmarks.systems.ray_sys", "RaySystem", {"zero_copy": False}),
    "ray-zerocopy": ("benchmarks.systems.ray_sys", "RaySystem", {"zero_copy": True}),
    "transferqueue": ("benchmarks.systems.tq_sys", "TransferQueueSystem", {}),
}
OURS = ("tqueue", "tqueue-wide", "tqueue-shm", "tqueue-inflight", "tqueue-shm-inflight", "tqueue-nixl")
# bytes per sample (the workload) and how many copies of a batch a run holds at once
# (producer, store, consumer, and the previous run's memory kept warm)
SAMPLE_BYTES = 133_000
IMAGE_BYTES = 240_000
COPIES_HELD = 4


PUT_COST_PUTS = 128  # puts in the put-cost phase (after the streaming scenarios, per round)


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def too_big(scenario: str, size: int) -> str | None:
    """Why a run would not fit in this machine's memory, or None."""
    per = SAMPLE_BYTES + (IMAGE_BYTES if SCENARIOS[scenario].multimodal else 0)
    need = COPIES_HELD * per * size
    have = available_memory()
    if need > 0.8 * have:
        return f"{scenario} at {size} samples skipped: needs about {need / 1e9:.0f} GB, {have / 1e9:.0f} GB available"
    return None
QUICK = {"sizes": [256], "scenarios": ["1to1", "1to4"], "repeats": 2, "warmup": 1, "rounds": 1}
SMOKE = {"sizes": [32], "scenarios": ["1to1"], "repeats": 1, "warmup": 0, "rounds": 1}


def make_system(name: str) -> tuple[Any | None, str | None]:
    module, cls, kwargs = SYSTEMS[name]
    try:
        system = getattr(importlib.import_module(module), cls)(**kwargs)
    except (ImportError, AttributeError) as exc:
        return None, f"{name}: not available ({exc})"
    reason = system.unavailable()
    return (None, f"{name}: skipped, {reason}") if reason else (system, None)


def run_cell(args: argparse.Namespace, system: Any, name: str, scenario: str, size: int, repeats: int,
             notes: list[str], *, first: bool) -> list[Result] | None:
    """Warm-up then ``repeats`` recorded runs of one scenario and size; None if skipped or failed
    (said once in ``notes``; a system that failed is restarted)."""
    if size > args.max_size.get(name, 1 << 30):
        if first:
            notes.append(f"{name}: {scenario} at {size} samples skipped (over --max-size)")
        return None
    reason = too_big(scenario, size)
    if reason:
        if reason not in notes:
            notes.append(reason)
            print(reason, flush=True)
        return None
    sc = SCENARIOS[scenario]
    try:
        for _ in range(args.warmup):
            system.run(sc, size)
        runs = []
        for _ in range(repeats):
            r = system.run(sc, size)
            r.system = name  # one class may serve several names
            runs.append(r)
    except Exception as exc:  # noted in the output; the system is restarted
        note = f"{name}: {scenario} at {size} samples failed: {type(exc).__name__}: {str(exc)[:200]}"
        notes.append(note)
        print(note, flush=True)
        system.stop()
        system.start()
        return None
    return runs


def round_shares(repeats: int, rounds: int) -> list[int]:
    """Recorded repeats per round: ``repeats`` spread as evenly as they go."""
    rounds = max(1, min(rounds, repeats))
    return [repeats // rounds + (1 if i < repeats % rounds else 0) for i in range(rounds)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system over every scenario and size, in rounds.

    One round starts each system in turn, runs ``--warmup`` unrecorded and its share of the
    recorded repeats per scenario and size, and stops it. Several rounds, with the systems'
    order reversed every other one, spread each system's figures over the run's whole span,
    so a slow spell of a shared machine does not land on one system alone."""
    results: list[Result] = []
    notes: list[str] = []
    copies: dict[str, str] = {}
    costs: list[dict[str, Any]] = []
    started = time.time()
    systems: dict[str, Any] = {}
    for name in args.systems:
        system, note = make_system(name)
        if system is None:
            print(note, flush=True)
            notes.append(str(note))
            continue
        systems[name] = system
        copies[name] = system.copies
    shares = round_shares(args.repeats, args.rounds)
    for rnd, share in enumerate(shares):
        order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
        for name in order:
            system = systems[name]
            print(f"{name}: starting (round {rnd + 1} of {len(shares)})", flush=True)
            system.start()
            try:
                for scenario in args.scenarios:
                    for size in args.sizes:
                        runs = run_cell(args, system, name, scenario, size, share, notes, first=rnd == 0)
                        if runs is None:
                            continue
                        results.extend(runs)
                        med = statistics.median(r.gbps for r in runs)
                        print(f"  {scenario:7s} {size:6d} samples  {med:6.2f} GB/s", flush=True)
                        if args.on_progress:
                            args.on_progress(results, notes, copies)
                streaming = [SCENARIOS[s] for s in args.scenarios if SCENARIOS[s].group]
                if streaming and hasattr(system, "put_cost"):
                    group = streaming[0].group
                    cost = system.put_cost(group, PUT_COST_PUTS)
                    costs.append({"system": name, "group": group} | cost)
                    print(f"  a streaming put of {group}: {cost['total']:.0f} us of CPU "
                          f"(client {cost['client']:.0f}, controller {cost['controller']:.0f}, units {cost['units']:.0f})", flush=True)
            finally:
                system.stop()
    return {
        "results": [dataclasses.asdict(r) | {"gbps": r.gbps} for r in results],
        "put_cost": costs,
        "notes": notes,
        "copies": copies,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "seconds": time.time() - started,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "on_progress")},
    }


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (system, scenario, size): medians, min and max over the repeats."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in data["results"]:
        groups.setdefault((r["system"], r["scenario"], r["size"]), []).append(r)
    rows = []
    for (system, scenario, size), runs in groups.items():
        def med(key: str, runs: list[dict] = runs) -> float | None:
            vals = [r[key] for r in runs if r[key] is not None]
            return statistics.median(vals) if vals else None

        gbps = [r["gbps"] for r in runs]
        rows.append(
            {
                "system": system,
                "scenario": scenario,
                "size": size,
                "mb": runs[0]["nbytes"] / 1e6,
                "gbps": statistics.median(gbps),
                "gbps_min": min(gbps),
                "gbps_max": max(gbps),
                "put_ms": 1e3 * med("put_s"),  # type: ignore[operator]
                "get_meta_ms": None if med("get_meta_s") is None else 1e3 * med("get_meta_s"),  # type: ignore[operator]
                "get_ms": 1e3 * med("get_s"),  # type: ignore[operator]
                "runs": len(runs),
            }
        )
    return rows


def main_table(rows: list[dict[str, Any]]) -> list[str]:
    """The comparison table: every system, scenario and size of the run."""
    out = [
        "| scenario | samples | MB | system | end-to-end GB/s (min-max) | put ms | get_meta ms | get ms |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["scenario"], r["size"], r["system"])):
        meta = "-" if r["get_meta_ms"] is None else f"{r['get_meta_ms']:.1f}"
        out.append(
            f"| {r['scenario']} | {r['size']} | {r['mb']:.0f} | {r['system']} | "
            f"{r['gbps']:.2f} ({r['gbps_min']:.2f}-{r['gbps_max']:.2f}) | {r['put_ms']:.1f} | "
            f"{meta} | {r['get_ms']:.1f} |"
        )
    return out


def ratio_tables(rows: list[dict[str, Any]]) -> list[str]:
    """tqueue's GB/s over each peer's, and put and get alone against raw ZeroMQ."""
    out = ["", "Ratios of tqueue's end-to-end GB/s to each peer's (medians, same batch, same run):", ""]
    out += ["| scenario | samples | ours | peer | ratio |", "|---|---:|---|---|---:|"]
    index = {(r["system"], r["scenario"], r["size"]): r for r in rows}
    for (system, scenario, size), r in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if system in OURS:
            continue
        for ours in OURS:
            mine = index.get((ours, scenario, size))
            if mine:
                out.append(f"| {scenario} | {size} | {ours} | {system} | {mine['gbps'] / r['gbps']:.2f}x |")
    out += ["", "Put and get alone against raw ZeroMQ for the same bytes (rates, medians):", ""]
    out += ["| scenario | samples | system | put GB/s | get GB/s | zmq-raw GB/s | put / raw | get / raw |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (system, scenario, size), raw in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if system != "zmq-raw":
            continue
        for ours in ("tqueue", "tqueue-wide"):
            mine = index.get((ours, scenario, size))
            if mine is None:
                continue
            nbytes = mine["mb"] * 1e6
            put, get = nbytes / mine["put_ms"] / 1e6, nbytes / mine["get_ms"] / 1e6
            out.append(
                f"| {scenario} | {size} | {ours} | {put:.2f} | {get:.2f} | {raw['gbps']:.2f} | "
                f"{put / raw['gbps']:.0%} | {get / raw['gbps']:.0%} |"
            )
    return out


def put_cost_table(data: dict[str, Any]) -> list[str]:
    """The CPU a streaming put costs per system (nothing where the run measured none)."""
    if not data.get("put_cost"):
        return []
    out = ["", f"CPU a streaming put costs, summed over its processes (µs per put of one group of the workload's "
           f"samples, {PUT_COST_PUTS} puts, one after another, or 4 at a time for the -inflight systems, which "
           f"coalesce them; medians over the rounds):", ""]
    out += ["| system | group | client | controller | units | total | wall per put |", "|---|---:|---:|---:|---:|---:|---:|"]
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in data["put_cost"]:
        by.setdefault((c["system"], c["group"]), []).append(c)
    for (system, group), cs in sorted(by.items()):
        med = {k: statistics.median(c[k] for c in cs) for k in ("client", "controller", "units", "total", "wall")}
        out.append(f"| {system} | {group} | {med['client']:.0f} | {med['controller']:.0f} | {med['units']:.0f} | "
                   f"{med['total']:.0f} | {med['wall']:.0f} |")
    return out


def notes_and_machine(data: dict[str, Any]) -> list[str]:
    out = (["", "Notes:", ""] + [f"* {n}" for n in data["notes"]]) if data["notes"] else []
    m = data["machine"]
    return out + ["", f"Machine: {m['cpus']} CPUs, Python {m['python']}, {m['platform']}; run took {data['seconds']:.0f} s."]


def markdown(data: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The run's full text (results.md): every table, the copies per system, notes, machine."""
    out = main_table(rows) + ratio_tables(rows) + put_cost_table(data) + targets_markdown(targets(data, rows))
    out += ["", "Copies of each payload byte, per system:", ""]
    out += [f"* **{k}**: {v}" for k, v in data["copies"].items()]
    out += notes_and_machine(data)
    return "\n".join(out) + "\n"


# The line that stands in docs/performance.md for the tables --docs leaves out.
FULL_TABLES = ("The ratio tables (tqueue's GB/s over each peer's, put and get against raw ZeroMQ) and the "
               "copies per system are in the run's full tables: `results.md`, which `tqueue bench` writes "
               "to its `--out` folder.")


def docs_markdown(data: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """What --docs writes into a page: the main table, the put CPU and the targets (with the
    notes and the machine), and a line saying where the rest is, so a run does not grow it."""
    out = main_table(rows) + ["", FULL_TABLES] + put_cost_table(data) + targets_markdown(targets(data, rows))
    out += notes_and_machine(data)
    return "\n".join(out) + "\n"


# Issue 28's targets that this benchmark's runs can judge (docs/performance.md): each is
# judged on the medians of one run, the only figures a run has; "in every run" is judged
# over runs, in the docs.
STREAM_SYSTEM = "tqueue-shm-inflight"  # the streaming producer as an async rollout worker writes it
STREAM_PEERS = (("ray-zerocopy", 3.0), ("ray", 4.0))
WHOLE_BATCH_PEER, WHOLE_BATCH_RATIO = "ray-zerocopy", 1.25
SAME_HOST_PAIRS = (("tqueue-shm", "tqueue"), ("tqueue-shm-inflight", "tqueue-inflight"))
PUT_COST_SHARE = 0.25  # of the same run's one-at-a-time same-host put (tqueue-shm)
PUT_COST_FILED_US = 3300  # the one-at-a-time put when issue 28 was filed (3,200-3,400 µs, another machine)


def targets(data: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, figure, met) for each of issue 28's targets whose systems ran: streaming
    (8to4) against Ray, same host against TCP, a put's CPU, whole batches against Ray."""
    index = {(r["system"], r["scenario"], r["size"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    out: list[tuple[str, str, bool]] = []

    def ratio(ours: str, peer: str, scenario: str, size: int, need: float, what: str) -> None:
        mine, theirs = index.get((ours, scenario, size)), index.get((peer, scenario, size))
        if mine and theirs:
            x = mine["gbps"] / theirs["gbps"]
            out.append((f"{scenario} at {size}: {ours} ≥ {need:g}x {peer}{what}",
                        f"{x:.2f}x ({mine['gbps']:.2f} against {theirs['gbps']:.2f} GB/s)", x >= need))

    for size in sizes:
        for peer, need in STREAM_PEERS:
            ratio(STREAM_SYSTEM, peer, "8to4", size, need, "")
        for shm, tcp in SAME_HOST_PAIRS:
            ratio(shm, tcp, "8to4", size, 1.0, " (the same-host path not slower than TCP)")
    costs: dict[str, list[float]] = {}
    for c in data.get("put_cost") or []:
        costs.setdefault(c["system"], []).append(c["total"])
    if STREAM_SYSTEM in costs and "tqueue-shm" in costs:
        ours, alone = statistics.median(costs[STREAM_SYSTEM]), statistics.median(costs["tqueue-shm"])
        out.append((f"CPU of a streaming put ({STREAM_SYSTEM}) ≤ {PUT_COST_SHARE:.0%} of one put at a time (tqueue-shm)",
                    f"{ours:.0f} against {alone:.0f} µs: {ours / alone:.0%} (the issue's figure: {PUT_COST_FILED_US:,} µs, "
                    f"{ours / PUT_COST_FILED_US:.0%} of it)", ours <= PUT_COST_SHARE * alone))
    for scenario in ("1to1", "1to4"):
        for size in sizes:
            ratio("tqueue-shm", WHOLE_BATCH_PEER, scenario, size, WHOLE_BATCH_RATIO, " (same host, whole batch)")
    return out


def targets_markdown(found: list[tuple[str, str, bool]]) -> list[str]:
    if not found:
        return []
    out = ["", "Issue 28's targets, judged on this run's medians:", "", "| target | measured | met? |", "|---|---|---|"]
    return out + [f"| {t} | {fig} | {'yes' if met else 'no'} |" for t, fig, met in found]


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    scenarios = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for system in sorted({r["system"] for r in rows}):
            pts = sorted((r["size"], r["gbps"], r["gbps_min"], r["gbps_max"]) for r in rows if r["system"] == system and r["scenario"] == scenario)
            if not pts:
                continue
            xs, ys, lo, hi = zip(*pts)
            ax.errorbar(xs, ys, yerr=[[y - low for y, low in zip(ys, lo)], [h - y for y, h in zip(ys, hi)]], marker="o", capsize=3, label=system)
        ax.set_xscale("log", base=2)
        ax.set_title(scenario)
        ax.set_xlabel("batch size (samples)")
        ax.set_ylabel("end-to-end GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=_Formatter)
    p.add_argument("--quick", action="store_true", help="256 samples, 1to1 and 1to4, 2 repeats")
    p.add_argument("--smoke", action="store_true", help="CI check that the harness runs: 32 samples, 1to1, 1 run")
    p.add_argument("--sizes", default="256,1024,4096,16384", help="samples per batch, comma-separated")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="producer-to-consumer layouts, comma-separated")
    p.add_argument("--systems", default="tqueue,tqueue-wide,tqueue-shm,tqueue-shm-inflight,zmq-raw,ray,ray-zerocopy,transferqueue",
                   help=f"systems to run, comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=5, help="recorded runs of each system, scenario and size")
    p.add_argument("--warmup", type=int, default=3, help="unrecorded rounds first (warm caches, pools and page tables for every system)")
    p.add_argument("--rounds", type=int, default=2,
                   help="spread each system's recorded repeats over this many rounds, systems in turn "
                        "(each round restarts every system and warms it up again)")
    p.add_argument("--max-size", default="", help="per-system size cap, e.g. transferqueue=4096")
    p.add_argument("--out", default="bench-results", help="folder for results.md, results.json and throughput.png")
    p.add_argument("--docs", metavar="FILE", help="also write the tables (and the plot, beside FILE) into FILE, between "
                   "the lines <!-- bench:e2e --> and <!-- /bench:e2e --> (docs/performance.md has them)")
    return p


def parse(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = make_parser(prog)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.scenarios = args.scenarios.split(",")
    args.systems = args.systems.split(",")
    args.max_size = {k: int(v) for k, v in (kv.split("=") for kv in args.max_size.split(",") if kv)}
    for preset, values in ((args.quick, QUICK), (args.smoke, SMOKE)):
        if preset:
            for key, value in values.items():
                setattr(args, key, value)
    unknown = [s for s in args.systems if s not in SYSTEMS] + [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown systems or scenarios: {unknown}")
    return args


def write(data: dict[str, Any], out: pathlib.Path, *, final: bool) -> tuple[str, list[pathlib.Path]]:
    """Write the results; returns the table's text and the files written (the plot only where
    matplotlib could draw it)."""
    rows = summarize(data)
    out.mkdir(parents=True, exist_ok=True)
    data["summary"] = rows
    written = [out / "results.md", out / "results.json"]
    note = plot(rows, out / "throughput.png") if final else None
    if note:
        data["notes"].append(note)
    elif final:
        written.append(out / "throughput.png")
    written[1].write_text(json.dumps(data, indent=1))
    text = markdown(data, rows)
    written[0].write_text(text)
    return text, written


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    out = pathlib.Path(args.out)
    from benchmarks.harness import check_docs

    check_docs(make_parser(prog), args.docs, "e2e")
    started = time.time()

    def progress(results: list[Result], notes: list[str], copies: dict[str, str]) -> None:
        partial = {
            "results": [dataclasses.asdict(r) | {"gbps": r.gbps} for r in results],
            "notes": notes + ["(partial: the run is still going)"],
            "copies": copies,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "seconds": time.time() - started,
            "args": {},
        }
        write(partial, out, final=False)

    args.on_progress = progress
    data = run(args)
    text, written = write(data, out, final=True)
    print("\n" + text)
    if args.docs:
        written.append(into_docs(pathlib.Path(args.docs), docs_markdown(data, data["summary"]), out / "throughput.png", args))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def into_docs(doc: pathlib.Path, text: str, png: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    """``text`` (:func:`docs_markdown`: the run's main tables, the full ones being in the
    --out folder's results.md) into ``doc``, between its ``bench:e2e`` lines, with the command
    that made them and the plot copied beside it where there is one; returns ``doc``."""
    import shutil

    from benchmarks.harness import write_into_docs

    command = " ".join(["tqueue bench", f"--sizes {','.join(map(str, args.sizes))}",
                        f"--scenarios {','.join(args.scenarios)}", f"--systems {','.join(args.systems)}",
                        f"--repeats {args.repeats} --warmup {args.warmup} --rounds {args.rounds}"])
    head = f"Written by `{command} --docs {args.docs}` on {time.strftime('%Y-%m-%d')}:\n\n"
    tail = ""
    if png.exists():
        shutil.copyfile(png, doc.parent / "performance-bench.png")
        tail = "\n![end-to-end GB/s of this run, by scenario](performance-bench.png)\n"
    write_into_docs(doc, "e2e", head + text + tail)
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
