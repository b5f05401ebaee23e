"""Client and AsyncClient are twins: the same public methods, with the same parameters."""

from __future__ import annotations

import inspect

import pytest

from tqueue.client import AsyncClient, Client

# Deliberate differences, each with why:
ONLY_ASYNC = {
    "__aenter__": "async context manager; Client has __enter__",
    "__aexit__": "async context manager; Client has __exit__",
}
ONLY_SYNC = {
    "__enter__": "context manager; AsyncClient has __aenter__",
    "__exit__": "context manager; AsyncClient has __aexit__",
}


def public_methods(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_") or n in (*ONLY_ASYNC, *ONLY_SYNC)}
    return {n: getattr(cls, n) for n in names if inspect.isfunction(getattr(cls, n))}


def twin_names() -> list[str]:
    return sorted(set(public_methods(AsyncClient)) - set(ONLY_ASYNC))


def test_every_method_of_one_client_has_a_twin_in_the_other():
    async_names = set(public_methods(AsyncClient)) - set(ONLY_ASYNC)
    sync_names = set(public_methods(Client)) - set(ONLY_SYNC)
    assert sorted(async_names - sync_names) == []  # missing from Client
    assert sorted(sync_names - async_names) == []  # missing from AsyncClient
    for name in async_names:
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
        assert not inspect.iscoroutinefunction(getattr(Client, name)), name


@pytest.mark.parametrize("name", twin_names(), ids=twin_names())
def test_twins_take_the_same_parameters_and_return_the_same_type(name):
    a = inspect.signature(getattr(AsyncClient, name))
    s = inspect.signature(getattr(Client, name))
    described = [(p.name, p.kind, p.default, p.annotation) for p in a.parameters.values()]
    assert [(p.name, p.kind, p.default, p.annotation) for p in s.parameters.values()] == described
    # an async method's annotation names what its coroutine returns
    assert s.return_annotation == a.return_annotation


def test_the_public_attributes_are_twins_too():
    """``address``, ``config`` and ``stats``: attributes of AsyncClient, properties of Client."""
    for name in ("address", "config", "stats"):
        assert isinstance(getattr(Client, name), property), name
