"""An embedded cluster on one machine: a controller and N storage units as child processes."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import ClientConfig, ControllerConfig, StorageConfig
from ._serve import READY

log = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0
_UNIT_OPTIONS = {f.name for f in dataclasses.fields(StorageConfig)} - {"controller", "bind", "host"}
_CONTROLLER_OPTIONS = {f.name for f in dataclasses.fields(ControllerConfig)} - {"bind"}


def unit_flags(storage: Mapping[str, Any] | None) -> list[str]:
    """``tqueue storage-unit`` flags for :class:`~tqueue.config.StorageConfig` options."""
    out: list[str] = []
    for key, value in (storage or {}).items():
        if key not in _UNIT_OPTIONS:
            raise ValueError(f"unknown storage option {key!r}; known: {sorted(_UNIT_OPTIONS)}")
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def controller_flags(controller: Mapping[str, Any] | None) -> list[str]:
    """``tqueue controller`` flags for :class:`~tqueue.config.ControllerConfig` options."""
    out: list[str] = []
    for key, value in (controller or {}).items():
        if key == "policies":
            for spec in value:
                out += ["--policy", spec]
        elif key in _CONTROLLER_OPTIONS:
            out += ["--" + key.replace("_", "-"), str(value)]
        else:
            raise ValueError(f"unknown controller option {key!r}; known: {sorted(_CONTROLLER_OPTIONS)}")
    return out


class LocalCluster:
    """Start a controller and ``num_storage_units`` units on ``host`` with OS-chosen ports.

    ``unit_hosts`` gives each unit the host name it reports for placement (default: this
    machine's), to simulate several hosts on one machine. ``storage`` sets
    :class:`~tqueue.config.StorageConfig` options of every unit, e.g. ``{"shm_bytes": 0}``;
    ``controller`` the controller's :class:`~tqueue.config.ControllerConfig` options, e.g.
    ``{"capacity_bytes": 1 << 30, "heartbeat_interval": 0.5}``.

    Use as a context manager; everything is stopped on exit, also after an exception, and
    the children also stop by themselves if this process dies (their stdin closes).
    ``auth=True`` turns on CurveZMQ with keys made for this cluster (removed with it), and
    ``auth="DIR"`` with the keys in DIR (see tqueue/transport/_auth.py); :meth:`client` and
    :meth:`client_config` carry the client's keys. With auth on, checkpoints go under
    ``checkpoint_root`` (given in ``controller``; by default a private folder removed with the
    cluster, its path in :attr:`checkpoint_root`)::

        with tqueue.LocalCluster(num_storage_units=2) as cluster:
            client = tqueue.Client(cluster.address)
    """

    def __init__(
        self,
        num_storage_units: int = 2,
        *,
        host: str = "127.0.0.1",
        start_timeout: float = 60.0,
        env: dict[str, str] | None = None,
        unit_hosts: Sequence[str] | None = None,
        storage: Mapping[str, Any] | None = None,
        controller: Mapping[str, Any] | None = None,
        auth: bool | str = False,
    ) -> None:
        if num_storage_units < 1:
            raise ValueError(f"num_storage_units must be at least 1, got {num_storage_units}")
        if unit_hosts is not None and len(unit_hosts) != num_storage_units:
            raise ValueError(f"unit_hosts names {len(unit_hosts)} hosts for {num_storage_units} units")
        self.unit_hosts = list(unit_hosts) if unit_hosts is not None else None
        self.unit_args = unit_flags(storage)
        self.controller_args = controller_flags(controller)
        self.num_storage_units = num_storage_units
        self.host = host
        self.start_timeout = start_timeout
        self.env = env
        self.address = ""
        self.unit_addresses: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        # auth: fresh CurveZMQ keys in a private directory, removed with the cluster
        self.auth_dir = auth if isinstance(auth, str) else ""
        made = ""
        if auth is True:
            from ..transport import _auth

            self.auth_dir = made = str(_auth.generate(tempfile.mkdtemp(prefix="tqueue-auth-")))
        if self.auth_dir:
            self.unit_args += ["--auth-dir", self.auth_dir]
            self.controller_args += ["--auth-dir", self.auth_dir]
        # checkpoints: under the root given in controller= (and storage=, else the same); with
        # auth on and none given, under a private one, removed with the cluster
        self.checkpoint_root = str((controller or {}).get("checkpoint_root", ""))
        root_made = ""
        if self.auth_dir and not self.checkpoint_root:
            self.checkpoint_root = root_made = tempfile.mkdtemp(prefix="tqueue-checkpoints-")
            self.controller_args += ["--checkpoint-root", root_made]
        if self.checkpoint_root and "checkpoint_root" not in (storage or {}):
            self.unit_args += ["--checkpoint-root", self.checkpoint_root]
        self._finalizer = weakref.finalize(self, _stop_all, self._procs, made, root_made)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> LocalCluster:
        try:
            ctl = self._spawn(["controller", "--bind", f"tcp://{self.host}:0", *self.controller_args])
            self.address = self._ready(ctl)["address"]
            units = [self._spawn_unit(self.unit_hosts[i] if self.unit_hosts else "") for i in range(self.num_storage_units)]
            self.unit_addresses = [self._ready(u)["address"] for u in units]
        except BaseException:
            self.close()
            raise
        log.info("local cluster up: controller %s, %d units", self.address, len(self.unit_addresses))
        return self

    def start_unit(self, host: str = "") -> int:
        """Start one more storage unit for this cluster (a replacement for one that died, say:
        it registers under a new id, empty); its pid, once it is ready. Its address is
        appended to ``unit_addresses``, and it is stopped with the cluster."""
        proc = self._spawn_unit(host)
        self.unit_addresses.append(self._ready(proc)["address"])
        return proc.pid

    def restart_controller(self, *, restore: str = "", kill: bool = True) -> int:
        """Stop the controller (SIGKILL, or SIGTERM with ``kill=False``) and start a new one at
        the same address; with ``restore``, it resumes from that checkpoint
        (``ControllerConfig.restore``). The units and clients stay and rejoin it by
        themselves. Returns the new controller's pid, once it is ready."""
        old = self._procs[0]  # the controller is started first
        old.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        old.wait()
        if old.stdin is not None and not old.stdin.closed:
            old.stdin.close()
        args = ["controller", "--bind", self.address, *self.controller_args]
        if restore:
            args += ["--restore", restore]
        proc = self._spawn(args)
        self._procs.remove(proc)
        self._procs[0] = proc
        self._ready(proc)
        return proc.pid

    def restart_unit(self, i: int, *, restore: str = "", kill: bool = True) -> int:
        """Stop storage unit ``i`` (in start order; SIGKILL, or SIGTERM with ``kill=False``) and
        start a new one at its address, hence under its name; with ``restore``, it loads its
        payload from that checkpoint first (``StorageConfig.restore``). Returns the new
        unit's pid, once it is ready."""
        old = self._procs[1 + i]
        old.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        old.wait()
        if old.stdin is not None and not old.stdin.closed:
            old.stdin.close()
        args = ["storage-unit", "--controller", self.address, "--bind", self.unit_addresses[i], *self.unit_args]
        if restore:
            args += ["--restore", restore]
        proc = self._spawn(args)
        self._procs.remove(proc)
        self._procs[1 + i] = proc
        self._ready(proc)
        return proc.pid

    def _spawn_unit(self, host: str) -> subprocess.Popen[bytes]:
        return self._spawn(
            ["storage-unit", "--controller", self.address, "--bind", f"tcp://{self.host}:0"]
            + (["--host", host] if host else [])
            + self.unit_args
        )

    def _spawn(self, args: Sequence[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ if self.env is None else self.env)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tqueue", *args, "--watch-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._procs.append(proc)
        return proc

    def _ready(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        assert proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tqueue server (pid {proc.pid}) did not start within {self.start_timeout} s")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(
                        f"tqueue server (pid {proc.pid}) exited with {proc.wait()} before it was ready"
                    )
                line += chunk
        proc.stdout.close()
        text = line.decode().strip()
        if not text.startswith(READY):
            raise RuntimeError(f"unexpected start-up line from tqueue server: {text!r}")
        return json.loads(text[len(READY) :])

    def client_config(self, **options: Any) -> ClientConfig:
        """A :class:`~tqueue.config.ClientConfig` for this cluster (its client keys, with
        ``auth``), with ``options``."""
        return ClientConfig(auth_dir=self.auth_dir, **options)

    def client(self, **kwargs: Any) -> Any:
        """A :class:`tqueue.Client` connected to this cluster (with its client keys, with
        ``auth``: a ``config`` given is completed with them)."""
        from ..client import Client

        config = kwargs.pop("config", None) or ClientConfig()
        if self.auth_dir and not config.auth_dir:
            config = dataclasses.replace(config, auth_dir=self.auth_dir)
        return Client(self.address, config=config, **kwargs)

    def close(self) -> None:
        """Stop every process (units first). Idempotent."""
        self._finalizer()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stop_all(procs: list[subprocess.Popen[bytes]], auth_dir: str = "", checkpoint_root: str = "") -> None:
    for proc in reversed(procs):
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()  # the child sees EOF and stops cleanly
            except OSError:
                pass
    for proc in reversed(procs):
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("tqueue server pid %d did not stop; terminating it", proc.pid)
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
    for made in (auth_dir, checkpoint_root):
        if made:
            shutil.rmtree(made, ignore_errors=True)
