"""Compare two trees (or any two labelled sets of runs) from the results.json files of e2e.py.

Run the harness of each tree into its own output folders, alternating, so a slow spell of the
machine does not land on one tree alone; then::

    python benchmarks/compare.py before=OUT_B1,OUT_B2 after=OUT_A1,OUT_A2 [--out compare.md]

Every figure is the median over all repeats of every folder of a label; the last column is the
second label's end-to-end GB/s over the first's. Only plain JSON is read: the trees' harnesses
need not be the same version, as long as they write results.json with per-run records.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any


def load(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """``label=dir1,dir2``: the label and every per-run record of those folders."""
    label, sep, dirs = spec.partition("=")
    if not sep or not label or not dirs:
        raise SystemExit(f"expected label=dir[,dir...], got {spec!r}")
    runs = []
    for d in dirs.split(","):
        path = pathlib.Path(d) / "results.json"
        runs += json.loads(path.read_text())["results"]
    return label, runs


def medians(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, float]]:
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["scenario"], r["size"], r["system"]), []).append(r)
    return {
        key: {
            "gbps": statistics.median(r["gbps"] for r in rs),
            "put_ms": 1e3 * statistics.median(r["put_s"] for r in rs),
            "get_ms": 1e3 * statistics.median(r["get_s"] for r in rs),
            "runs": len(rs),
        }
        for key, rs in cells.items()
    }


def table(first: tuple[str, list[dict[str, Any]]], second: tuple[str, list[dict[str, Any]]]) -> str:
    (a, runs_a), (b, runs_b) = first, second
    ma, mb = medians(runs_a), medians(runs_b)
    out = [
        f"| scenario | samples | system | {a} GB/s | {b} GB/s | {a} put / get ms | {b} put / get ms | runs | {b} / {a} |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(set(ma) & set(mb)):
        x, y = ma[key], mb[key]
        out.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {x['gbps']:.2f} | {y['gbps']:.2f} | "
            f"{x['put_ms']:.0f} / {x['get_ms']:.0f} | {y['put_ms']:.0f} / {y['get_ms']:.0f} | "
            f"{x['runs']:.0f} + {y['runs']:.0f} | {y['gbps'] / x['gbps']:.2f}x |"
        )
    for key in sorted(set(ma) ^ set(mb)):
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | only in {a if key in ma else b} | | | | | |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="label=dir[,dir...], e.g. before=bench/b1,bench/b2")
    p.add_argument("second", help="label=dir[,dir...], e.g. after=bench/a1,bench/a2")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    text = table(load(args.first), load(args.second))
    print(text, end="")
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
