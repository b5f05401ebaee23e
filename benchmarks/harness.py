"""What every benchmarked system implements, what it reports, and process plumbing.

A *system* moves the workload batch from producer processes to consumer processes in a
*scenario* and reports one :class:`Result` per repeat. Timestamps come from
``time.perf_counter()``, which is CLOCK_MONOTONIC on Linux and so comparable across the
processes of one machine.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    producers: int
    consumers: int
    group: int = 0  # >0: producers stream puts of this many samples
    multimodal: bool = False

    def shares(self, size: int, parts: int) -> list[tuple[int, int]]:
        """Split ``range(size)`` into ``parts`` contiguous (start, stop) ranges."""
        step, extra = divmod(size, parts)
        out, at = [], 0
        for i in range(parts):
            n = step + (1 if i < extra else 0)
            out.append((at, at + n))
            at += n
        return out


SCENARIOS = {
    "1to1": Scenario("1to1", producers=1, consumers=1),
    "1to4": Scenario("1to4", producers=1, consumers=4),
    "8to4": Scenario("8to4", producers=8, consumers=4, group=8),
    "mm1to1": Scenario("mm1to1", producers=1, consumers=1, multimodal=True),
}


@dataclasses.dataclass
class Result:
    """One repeat of one scenario at one size. Times in seconds; None where not applicable.

    ``put_s``: producer-side time to hand the data to the system (slowest producer).
    ``get_meta_s``: consumer-side metadata step (slowest consumer), if the system has one.
    ``get_s``: consumer-side time to hold the data after metadata (slowest consumer).
    ``e2e_s``: first producer start to last consumer holding its data.

    Producers keep what they put until their next ``prepare`` and consumers drop what they
    got after their timing ends: freeing a 136 MB batch takes 5-11 ms here, the benchmark's
    own housekeeping, which would otherwise sit between a put and the get after it.
    """

    system: str
    scenario: str
    size: int
    transport: str
    nbytes: int
    put_s: float
    get_meta_s: float | None
    get_s: float
    e2e_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.e2e_s / 1e9


class System(Protocol):
    name: str
    transport: str
    copies: str  # how many copies of each payload byte each path makes, in words

    def unavailable(self) -> str | None:
        """Why this system cannot run here (not installed...), or None."""

    def start(self) -> None: ...

    def run(self, scenario: Scenario, size: int) -> Result: ...

    def stop(self) -> None: ...


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, all its threads: the scheduler's nanosecond
    count of each live thread (``/proc/PID/task/TID/schedstat``), summed. ``/proc/PID/stat``
    counts in clock ticks (10 ms here), which a phase of 128 small puts (78 µs a put a tick)
    cannot resolve; a thread that ended inside the window is not counted (the processes
    measured keep theirs). Falls back to the ticks where schedstat is missing."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended between the listing and the read
        return total / 1e9
    except FileNotFoundError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """A spawned process running ``target(conn, *args)``; talks JSON over a pipe (no pickle
    of payload: only the target and its small arguments cross at spawn)."""

    def __init__(self, target: Callable[..., None], *args: Any, name: str = "worker") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout: float = 120.0) -> Worker:
        """Wait until the worker answers (its imports and set-up are done)."""
        self.send({"cmd": "ping"})
        self.recv(timeout)
        return self

    def send(self, msg: dict[str, Any]) -> None:
        self.conn.send_bytes(json.dumps(msg).encode())

    def recv(self, timeout: float = 600.0) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name} sent nothing for {timeout} s")
        try:
            msg = json.loads(self.conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"{self.proc.name} exited with code {self.proc.join(5) or self.proc.exitcode}") from None
        if "error" in msg:
            raise RuntimeError(f"{self.proc.name}: {msg['error']}")
        return msg

    def stop(self) -> None:
        try:
            self.send({"cmd": "stop"})
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)
        self.conn.close()


def serve(conn: Connection, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Worker side: answer commands until ``stop``; exceptions go back as ``error``."""
    import traceback

    handlers = {"ping": lambda msg: {"pong": True}, **handlers}
    while True:
        msg = json.loads(conn.recv_bytes())
        if msg["cmd"] == "stop":
            return
        try:
            reply = handlers[msg["cmd"]](msg)
        except Exception:  # the driver raises it with the worker's traceback
            reply = {"error": traceback.format_exc()}
        conn.send_bytes(json.dumps(reply).encode())


def now() -> float:
    return time.perf_counter()


def settle() -> None:
    """What every consumer does after a get, outside timing: a full collection of Python's
    cyclic garbage. Ray's zero-copy tensors need it (they pin their objects until collected);
    doing it in every system's consumers keeps a full collection (80-90 ms in a process with
    torch loaded) out of all systems' timed gets alike, not only out of Ray's."""
    import gc

    gc.collect()


def docs_section(path: str | os.PathLike[str], name: str) -> tuple[list[str], int, int]:
    """The lines of markdown file ``path`` and the positions of its ``<!-- bench:NAME -->``
    and ``<!-- /bench:NAME -->`` lines. Raises ``ValueError`` naming the two lines when they
    are missing, doubled or out of order (a benchmark never guesses where its results go):
    checked before a run, so that a long run is not lost at its end."""
    import pathlib

    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    doc = pathlib.Path(path)
    lines = doc.read_text().splitlines(keepends=True)
    marks = [i for i, line in enumerate(lines) if line.strip() in (start, end)]
    if [lines[i].strip() for i in marks] != [start, end]:
        raise ValueError(f"{doc} needs one line {start!r} and, after it, one line {end!r} around the "
                         f"place where the results go (found {len(marks)} of them)")
    return lines, marks[0], marks[1]


def check_docs(parser: Any, path: str | os.PathLike[str] | None, name: str) -> None:
    """Before a run: where ``--docs`` names a file, stop with ``parser``'s usage error (exit 2)
    unless it has its ``bench:NAME`` lines (:func:`docs_section`), so a long run is not lost at
    its end."""
    if path:
        try:
            docs_section(path, name)
        except (OSError, ValueError) as exc:
            parser.error(f"--docs: {exc}")


def write_into_docs(path: str | os.PathLike[str], name: str, text: str) -> None:
    """Put ``text`` into the markdown file ``path`` between its lines ``<!-- bench:NAME -->``
    and ``<!-- /bench:NAME -->``, in place of what a run wrote there before; the rest of the
    file is left as it is (see :func:`docs_section` for the errors)."""
    import pathlib

    lines, first, last = docs_section(path, name)
    body = text if text.endswith("\n") else text + "\n"
    pathlib.Path(path).write_text("".join(lines[: first + 1]) + body + "".join(lines[last:]))
