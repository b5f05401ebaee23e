"""Client and AsyncClient are twins: the same public methods, with the same parameters,
and each parameter list is written once."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest

import tqueue.client
from tqueue.client import AsyncClient, Client
from tqueue.client._ask import Completion, DataAsk, MetaAsk, Options, PutAsk

CLIENT = pathlib.Path(tqueue.client.__file__).parent

# Deliberate differences, each with why:
ONLY_ASYNC = {
    "__aenter__": "async context manager; Client has __enter__",
    "__aexit__": "async context manager; Client has __exit__",
    "thread_route": "a blocking caller's own route; Client's get_meta takes it",
}
ONLY_SYNC = {
    "__enter__": "context manager; AsyncClient has __aenter__",
    "__exit__": "context manager; AsyncClient has __aexit__",
}
ONLY_SYNC_WRITTEN = {"close": "stops the loop thread too, not only the connections"}


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


@pytest.mark.parametrize("name", twin_names(), ids=twin_names())
def test_each_blocking_method_is_made_from_its_async_twin(name):
    """Not written again: Client's method wraps AsyncClient's (signature and docstring)."""
    s = getattr(Client, name)
    if name in ONLY_SYNC_WRITTEN:
        return
    assert s.__wrapped__ is getattr(AsyncClient, name)
    assert s.__doc__ == getattr(AsyncClient, name).__doc__


def parameter_lists(source: str) -> list[set[str]]:
    """The names of each run of lines ``name: annotation[ = default][,]``: the parameter
    lists of multi-line signatures, and the fields of dataclasses."""
    runs: list[set[str]] = [set()]
    for line in source.splitlines():
        match = re.match(r"^\s+(\w+): [^=]+( = .*)?,?$", line)
        if match and not line.lstrip().startswith(("return", "#")):
            runs[-1].add(match.group(1))
        elif runs[-1]:
            runs.append(set())
    return [r for r in runs if r]


@pytest.mark.parametrize("ask", [PutAsk, MetaAsk, DataAsk, Completion], ids=lambda a: a.__name__)
def test_the_arguments_of_a_many_option_call_are_written_once(ask):
    """The call's signature is its dataclass's, and each of its parameters is in one list
    of the client's source that holds several of them (or in none: a list of its own)."""
    method = {PutAsk: "put", MetaAsk: "get_meta", DataAsk: "get_data", Completion: "complete"}[ask]
    signature = inspect.signature(getattr(AsyncClient, method))
    assert list(signature.parameters.values())[1:] == list(inspect.signature(ask).parameters.values())
    names = set(signature.parameters) - {"self"}
    source = "".join(p.read_text() for p in sorted(CLIENT.rglob("*.py")))
    lists = [r for r in parameter_lists(source) if len(r & names) >= 4]
    for name in names:
        times = sum(name in r for r in lists)
        assert times <= 1, f"{method}'s parameter {name!r} is written in {times} lists: {lists}"


def test_the_blocking_client_uses_only_the_public_methods_of_the_async_one():
    """No ``_inner._name``: what Client needs of AsyncClient is public (thread_route included)."""
    source = (CLIENT / "_sync.py").read_text()
    assert re.findall(r"_inner\._\w+", source) == []
    assert re.findall(r"AsyncClient\._\w+", source) == []


def test_how_a_read_presents_jagged_fields_is_written_once():
    """``jagged``, ``pad_value``, ``padding_side``, ``device`` and ``dtype`` of get_data are Options'
    fields, which DataAsk inherits: no other list of the client's source holds ``jagged``."""
    source = "".join(p.read_text() for p in sorted(CLIENT.rglob("*.py")))
    holding = [r for r in parameter_lists(source) if "jagged" in r]
    assert holding == [{"jagged", "pad_value", "padding_side", "device", "dtype"}]
    assert issubclass(DataAsk, Options)
