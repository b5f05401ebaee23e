"""Optional CurveZMQ on every ZeroMQ socket, with an allow-list of client keys.

CURVE alone only proves the server to the client; the allow-list, checked by a ZAP handler
in each server process, is what keeps strangers out: a peer whose key is not on it never
completes its handshake, so it can send nothing at all. Each admitted connection carries a
*principal* (ZeroMQ's ``User-Id``): ``cluster`` for the controller and the storage units,
which share the cluster's key pair, and ``client:<key>`` for a client. Servers check it
where it matters (see ``Server.route(..., role=...)`` and the lease and hold owners).

Keys live in one directory, ``auth_dir`` of each config (or ``TQUEUE_AUTH_DIR``), as
ZeroMQ certificate files (``zmq.auth.create_certificates``)::

    cluster.key, cluster.key_secret   the cluster's key pair (servers need the secret;
                                      clients only the public half, to verify servers)
    clients/*.key                     public keys of the clients servers admit
    client.key_secret                 this client's own key pair (on client machines)

:func:`generate` writes such a directory (``LocalCluster(auth=True)`` uses it).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
from typing import Any

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from ..errors import InvalidArgumentError
from ._sockets import context  # the one context the sockets are made in

ZAP_DOMAIN = b"tqueue"
CLUSTER = "cluster"  # the principal of the controller and the units


@dataclasses.dataclass(frozen=True)
class Curve:
    """One process's CurveZMQ keys: its own pair and the cluster's public key (the key
    servers present, which a connecting side verifies)."""

    public: bytes
    secret: bytes
    server: bytes

    def connect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the cluster (before it connects)."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server whose peers the ZAP handler admits (before it binds)."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = ZAP_DOMAIN


def _load(path: pathlib.Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise InvalidArgumentError(f"auth: no key file {str(path)!r}")
    public, private = zmq.auth.load_certificate(str(path))
    if secret and not private:
        raise InvalidArgumentError(f"auth: {str(path)!r} holds no secret key")
    return public, private


def client_keys(auth_dir: str) -> Curve | None:
    """A client's keys from ``auth_dir`` (None: auth off)."""
    if not auth_dir:
        return None
    root = pathlib.Path(auth_dir)
    public, secret = _load(root / "client.key_secret", secret=True)
    server, _ = _load(root / "cluster.key", secret=False)
    assert secret is not None
    return Curve(public, secret, server)


def server_keys(auth_dir: str) -> Curve | None:
    """A server's keys from ``auth_dir`` (None: auth off); starts this process's ZAP handler,
    which admits the cluster's key and the client keys in ``auth_dir/clients``."""
    if not auth_dir:
        return None
    root = pathlib.Path(auth_dir)
    public, secret = _load(root / "cluster.key_secret", secret=True)
    assert secret is not None
    allowed = {public: CLUSTER}  # certificate files hold z85 keys
    clients = root / "clients"
    if clients.is_dir():
        for key in zmq.auth.load_certificates(str(clients)):
            allowed.setdefault(key, f"client:{key[:16].decode()}")
    _admit(allowed)
    return Curve(public, secret, public)


class _Allowed:
    """The ZAP handler's allow-list (z85 public key -> principal); shared by every server of
    the process, and read from the handler's thread."""

    def __init__(self) -> None:
        self.keys: dict[bytes, str] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class _Authenticator(ThreadAuthenticator):
    def __init__(self, allowed: _Allowed, context: zmq.Context) -> None:
        super().__init__(context)
        self._tqueue_keys = allowed

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._tqueue_keys.keys.get(zmq.utils.z85.encode(client_public_key), "")


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "allowed": _Allowed, "auth": _Authenticator (once per process)


def _admit(keys: dict[bytes, str]) -> None:
    """Start the process's ZAP handler if it is not running; add ``keys`` to what it admits.
    Each call is matched by one :func:`release` (a server's close)."""
    with _lock:
        allowed: _Allowed | None = _state.get("allowed")
        if allowed is None:
            allowed = _Allowed()
            auth = _Authenticator(allowed, context())
            auth.start()
            auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=allowed)
            _state.update(allowed=allowed, auth=auth, users=0)
        allowed.keys.update(keys)
        _state["users"] += 1


def release() -> None:
    """A server that called :func:`server_keys` closed: the last one stops the ZAP handler."""
    with _lock:
        if not _state:
            return
        _state["users"] -= 1
        if _state["users"] <= 0:
            _state.pop("auth").stop()
            _state.clear()


def generate(auth_dir: str | os.PathLike[str], clients: int = 1) -> pathlib.Path:
    """Write a cluster key pair and ``clients`` client key pairs (the first also as this
    directory's ``client.key_secret``) into ``auth_dir``, private to this user."""
    root = pathlib.Path(auth_dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    zmq.auth.create_certificates(str(root), "cluster")
    allowed = root / "clients"
    allowed.mkdir(mode=0o700, exist_ok=True)
    private = root / "private"
    private.mkdir(mode=0o700, exist_ok=True)
    for i in range(clients):
        public_file, secret_file = zmq.auth.create_certificates(str(private), f"client{i}")
        pathlib.Path(public_file).replace(allowed / f"client{i}.key")
        if i == 0:
            pathlib.Path(secret_file).replace(root / "client.key_secret")
    for path in root.rglob("*"):
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    return root
