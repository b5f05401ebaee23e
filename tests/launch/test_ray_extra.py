"""Without the ``ray`` extra, launching on Ray says how to install it (importing tqueue.ray
does not need Ray)."""

from __future__ import annotations

import sys

import pytest

import tqueue.ray


def test_starting_without_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"tqueue\.ray needs ray \(the 'ray' extra\): from a checkout of tqueue, pip install -e '\.\[ray\]'"):
        tqueue.ray.start(1)
