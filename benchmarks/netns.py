"""Simulated hosts on one machine: a network namespace per host, joined by veth pairs to a
bridge that lives in a namespace of its own, each link shaped by ``tc``.

Used by ``benchmarks/multihost.py`` and ``tests/launch/test_multihost.py``. Needs root and
iproute2 (``ip``, ``tc``); :func:`unavailable` says why not where either is missing.

Each host gets ``eth0`` with ``10.77.0.<n>/24`` and its own loopback; the bridge end of its link
is ``h<n>`` in the bridge's namespace. A link is shaped in both directions (the host's ``eth0``
shapes what the host sends, the bridge end what it receives): ``netem`` with a rate and a delay
where the kernel has it, else ``tbf`` with the rate alone (no delay: the kernel lacks
``sch_netem``), and :attr:`Hosts.shaper` says which.

Processes are started with ``ip netns exec`` (which execs, so the pid is the program's own) and
stopped by pid: SIGTERM, then SIGKILL after a timeout. Leaving the ``with`` block, even on an
exception, stops every process started here and deletes the namespaces, which deletes their
veth ends and the bridge.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

SUBNET = "10.77.0"


def unavailable() -> str:
    """Why namespaces cannot be made here ("" where they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    probe = f"tqprobe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def reap_stale() -> list[str]:
    """Delete namespaces this module made for a process that is gone (one killed before its
    ``finally`` ran); those of live processes are left alone. Returns what was deleted."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(r"tq(\d+)-[a-z0-9]+", name)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        gone.append(name)
    return gone


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class Hosts:
    """Simulated hosts ``names``, each a namespace with one link to a shared bridge.

    ``rate`` is each link's rate in bits per second (0: unshaped); ``delay_ms`` the one-way
    delay netem adds on each side of a link (ignored where only tbf exists).
    """

    def __init__(self, names: Sequence[str], *, rate: float = 0.0, delay_ms: float = 0.0) -> None:
        self.tag = f"tq{os.getpid()}"
        self.names = list(names)
        self.ip = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.names)}
        self.rate = {name: rate for name in self.names}
        self.delay_ms = delay_ms
        self.shaper = ""  # "netem" or "tbf" once a link is shaped
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    # --- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        reap_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        self._made.append(br)
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self.ns(name)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            peer = f"h{i + 1}"
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", peer, "netns", br)
            _run("ip", "-n", br, "link", "set", peer, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip[name]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate[name]:
                self.shape(name, self.rate[name])

    def close(self) -> None:
        """Stop every process started here (by pid, the last started first: units before
        their controller), then delete the namespaces."""
        for proc in reversed(self.procs):
            stop(proc)
        self.procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    # --- links ----------------------------------------------------------------------

    def shape(self, name: str, rate: float) -> None:
        """Give ``name``'s link ``rate`` bit/s in both directions (replacing what it had)."""
        self.rate[name] = rate
        i = self.names.index(name) + 1
        for ns, dev in ((self.ns(name), "eth0"), (self.bridge_ns, f"h{i}")):
            self._shape_dev(ns, dev, rate)

    def _shape_dev(self, ns: str, dev: str, rate: float) -> None:
        bits = f"{int(rate)}bit"
        if self.shaper in ("", "netem"):
            netem = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "rate", bits, "limit", "100000"]
            if self.delay_ms:
                netem[8:8] = ["delay", f"{self.delay_ms}ms"]
            if subprocess.run(netem, capture_output=True).returncode == 0:
                self.shaper = "netem"
                return
        # tbf: the bucket holds at least one timer tick's worth of bytes (HZ >= 100)
        burst = max(256 * 1024, int(rate / 8 / 100))
        _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", bits,
             "burst", str(burst), "latency", "50ms")
        self.shaper = "tbf"

    # --- processes ------------------------------------------------------------------

    def popen(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: bool = False
    ) -> subprocess.Popen[bytes]:
        """``argv`` in host ``name``'s namespace, stdout piped; ``TQUEUE_HOST`` set to ``name``.
        ``stdin``: a pipe the process may watch (it stops when the pipe closes)."""
        full_env = dict(os.environ, TQUEUE_HOST=name, **(env or {}))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(name), *argv],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env=full_env,
        )
        self.procs.append(proc)
        return proc

    def tqueue(self, name: str, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
        """``tqueue ARGS`` (a server, with ``--watch-stdin``) in host ``name``; its process and
        the ready line's JSON."""
        proc = self.popen(name, [sys.executable, "-m", "tqueue", *args, "--watch-stdin"], stdin=True)
        assert proc.stdout is not None
        line = read_line(proc.stdout, timeout, what=f"{args[0]} on {name}")
        if not line.startswith("TQUEUE-READY "):
            raise RuntimeError(f"{args[0]} on {name} printed {line!r} instead of its ready line")
        return proc, line[len("TQUEUE-READY ") :]


def read_line(stream: IO[bytes], timeout: float, *, what: str) -> str:
    """One line from a child's stdout within ``timeout`` seconds (TimeoutError else)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise TimeoutError(f"{what}: no line within {timeout} s")
    line = stream.readline().decode()
    if not line:
        raise RuntimeError(f"{what}: exited without a line")
    return line.strip()


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop ``proc`` by its pid: close its stdin, SIGTERM, SIGKILL after ``timeout``."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    for stream in (proc.stdout, proc.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@contextlib.contextmanager
def elapsed() -> Iterator[list[float]]:
    """``with elapsed() as t:`` ... ``t[0]`` is the block's seconds afterwards."""
    out = [0.0]
    start = time.perf_counter()
    try:
        yield out
    finally:
        out[0] = time.perf_counter() - start
