"""Key files and the addresses servers advertise."""

from __future__ import annotations

import os
import stat

import pytest

from tqueue.errors import InvalidArgumentError
from tqueue.transport import _auth, _sockets


def test_generated_keys_are_private_and_load_for_both_sides(tmp_path):
    root = _auth.generate(tmp_path / "keys", clients=2)
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, (path, oct(mode))
    client = _auth.client_keys(str(root))
    assert client is not None and len(client.public) == 40 and client.server != client.public
    assert sorted(p.name for p in (root / "clients").iterdir()) == ["client0.key", "client1.key"]
    assert _auth.client_keys("") is None and _auth.server_keys("") is None


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"auth: no key file '.*client.key_secret'"):
        _auth.client_keys(str(tmp_path))


@pytest.mark.parametrize("bound", ["tcp://0.0.0.0:5555", "tcp://*:5555"])
def test_a_wildcard_bind_is_advertised_as_a_reachable_host(bound):
    assert _sockets.reachable(bound, "node7.example") == "tcp://node7.example:5555"
    host = _sockets.reachable(bound).removeprefix("tcp://").rpartition(":")[0]
    assert host not in _sockets.WILDCARDS
    assert _sockets.reachable("tcp://127.0.0.1:5555", "node7") == "tcp://127.0.0.1:5555"

