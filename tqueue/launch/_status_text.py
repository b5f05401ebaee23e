"""``tqueue status ADDR`` and ``tqueue top ADDR``: what the controller reports, as text.

``status`` prints it once (or as JSON with ``--json``); ``top`` redraws it every interval in
the terminal, with rates of consumption since the last frame, until interrupted (or for
``--iterations`` frames).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import msgspec

from ..wire import StatusReply


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [head] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def render(st: StatusReply, *, address: str, previous: StatusReply | None = None, elapsed: float = 0.0) -> str:
    """The status as text: partitions (and their tasks), units, waiting calls."""
    lines = [f"tqueue at {address}: trainer version {st.version}"
             + (f", admitted {st.admitted} of {st.admission_limit} samples" if st.admission_limit >= 0 else "")
             + (f"; metrics {st.metrics}" if st.metrics else "")]
    before: dict[tuple[str, str], int] = {}
    if previous is not None:
        before = {(p.name, t): s.consumed for p in previous.partitions for t, s in p.tasks.items()}
    rows = []
    for p in sorted(st.partitions, key=lambda p: p.name):
        flags = ("sealed" if p.sealed else "open") + (f", recycles to {p.recycle_to}" if p.recycle_to else "")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(p.reasons.items())) or "-"
        rows.append([p.name, p.samples, p.ready, p.in_flight, p.excluded, reasons, _size(p.nbytes), flags])
        for task, t in sorted(p.tasks.items()):
            rate = ""
            if previous is not None and elapsed > 0:
                rate = f", {(t.consumed - before.get((p.name, task), 0)) / elapsed:.1f}/s"
            rows.append([f"  task {task}", "", "", "", "", f"leased {t.leased}, consumed {t.consumed}{rate}, refused "
                         f"{t.refused}, expired {t.expired}, lost {t.lost}", "", ""])
    lines += ["", f"partitions ({len(st.partitions)})"]
    lines += _table(["name", "samples", "ready", "in flight", "excluded", "why excluded / tasks", "bytes", "state"], rows)
    units = [[u.unit_id, u.name or "-", u.host, u.address, "alive" if u.alive else f"dead (silent {u.silent:.1f} s)",
              _size(u.nbytes) + (f" of {_size(u.capacity)}" if u.capacity else ""), _size(u.arena_used), u.metrics or "-"]
             for u in sorted(st.units, key=lambda u: u.unit_id)]
    lines += ["", f"storage units ({len(st.units)})"]
    lines += _table(["id", "name", "host", "address", "state", "stored", "arena", "metrics"], units)
    waits = [[w.kind, w.partition, w.task or "-", w.reason] for w in st.waiting]
    lines += ["", f"waiting calls ({len(st.waiting)})"]
    lines += _table(["kind", "partition", "task", "waits for"], waits) if waits else ["  none"]
    return "\n".join(lines) + "\n"


def status(address: str, *, as_json: bool = False, out: TextIO = sys.stdout, timeout: float = 10.0) -> int:
    from ..client import Client
    from ..config import ClientConfig

    with Client(address, config=ClientConfig(request_timeout=timeout)) as client:
        st = client.status()
    out.write(msgspec.json.encode(st).decode() + "\n" if as_json else render(st, address=address))
    return 0


def top(address: str, *, interval: float = 1.0, iterations: int = 0, out: TextIO = sys.stdout) -> int:
    """Redraw the status every ``interval`` seconds; ``iterations`` frames (0: until Ctrl-C)."""
    from ..client import Client

    previous: StatusReply | None = None
    last = time.monotonic()
    frame = 0
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    try:
        with Client(address) as client:
            while True:
                st = client.status()
                now = time.monotonic()
                text = render(st, address=address, previous=previous, elapsed=now - last)
                out.write(f"{clear}{text}" if clear else f"--- {time.strftime('%H:%M:%S')}\n{text}")
                out.flush()
                previous, last, frame = st, now, frame + 1
                if iterations and frame >= iterations:
                    return 0
                time.sleep(interval)  # the view's refresh period
    except KeyboardInterrupt:
        return 0
