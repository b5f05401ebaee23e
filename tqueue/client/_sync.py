"""The blocking client: the async client driven by one background event-loop thread.

Its methods are made from :class:`~tqueue.client.AsyncClient`'s (:func:`_twin`): the same
name, signature and docstring, and a body that runs the async method on the loop thread and
waits. Its namespaces (``keys``, ``samples``, ``rollouts``, ``checkpoints``) are made the same
way from the async client's (:func:`_twin_in`), and the deprecated old names hand the call to
them (:func:`_moved`). A caller interrupted while it waits (``KeyboardInterrupt``, or any exception raised
in its thread) cancels the call: what the call had parked at a server is withdrawn there
before the exception goes on.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

from .._api import deprecated
from ..config import ClientConfig
from ..errors import ForkedClientError, InvalidArgumentError
from ._ask import quiet_flat, warn_flat
from ._async import AsyncClient, ClientStats
from ._gets import ThreadRoute
from ._spaces import MOVED, AsyncCheckpoints, AsyncKeys, AsyncRollouts, AsyncSamples

T = TypeVar("T")
P = ParamSpec("P")
A = TypeVar("A")
# seconds an interrupted caller waits for its cancelled call to withdraw what it had parked
# (the Cancel is sent from the loop thread); the loop never blocks, so this is a bound only
CANCEL_GRACE: Final = 5.0
# the calls whose flat data-parallel and micro-batch keywords are deprecated (client/_ask.py)
LEASES: Final = frozenset({"get_meta", "get_data"})


def _loop_thread(loop: asyncio.AbstractEventLoop) -> None:
    quiet_flat()  # the calls it runs were warned about in their callers' threads
    loop.run_forever()


def _shutdown(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, inner: AsyncClient, direct: list[Any], pid: int
) -> None:
    if os.getpid() != pid:  # a forked child: the sockets and the thread are the parent's to close
        return
    for route in direct:
        route.close()
    direct.clear()
    if loop.is_closed():
        return
    if thread.is_alive():
        try:
            asyncio.run_coroutine_threadsafe(inner.close(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
    if not thread.is_alive():
        loop.close()


# keywords of a method with a new name (old -> new): the old one works for one release, and warns
RENAMED_KEYWORDS: dict[str, dict[str, str]] = {"create_partition": {"replicas": "copies"}}


def _rename(method: str, renamed: dict[str, str], kwargs: dict[str, Any]) -> None:
    """Warn, at the caller of the blocking twin, of each old keyword of ``method`` in
    ``kwargs``, and give its value the new name (the async method would warn in the loop
    thread)."""
    for old, new in renamed.items():
        if old in kwargs:
            deprecated(f"Client.{method}({old}=)", f"Client.{method}({new}=)", stacklevel=4)
            if kwargs.get(new):
                raise InvalidArgumentError(f"{method}: give {new}= or {old}=, not both")
            kwargs[new] = kwargs.pop(old)


def _twin(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
    *,
    from_thread: Callable[..., T] | None = None,
) -> Callable[Concatenate[Client, P], T]:
    """The blocking twin of an :class:`AsyncClient` method: its name, signature and docstring,
    run on the client's loop thread while the caller waits (cancelled if the wait is
    interrupted). ``from_thread(route, *args, **kwargs)``: a method of
    :class:`~tqueue.client._gets.ThreadRoute` that the calling thread runs itself, on its own
    route, instead."""
    name = method.__name__
    leases = name in LEASES
    renamed = RENAMED_KEYWORDS.get(name, {})
    if from_thread is None:

        def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
            if leases:
                warn_flat(name, kwargs)  # in the caller's thread; the loop thread is quiet
            if renamed:
                _rename(name, renamed, kwargs)  # likewise
            return self._run(method(self._inner, *args, **kwargs))

    else:
        on_route = from_thread

        def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
            if leases:
                warn_flat(name, kwargs)
            return on_route(self._thread_route(), *args, **kwargs)

    return functools.wraps(method)(twin)


class _Space:
    """A namespace of the blocking client: each method runs its twin of the async client's
    namespace (``inner``) on the client's loop thread (``run``: the client's ``_run``). Made
    at each access, so that it keeps its client alive but the client does not keep it."""

    def __init__(self, run: Callable[[Coroutine[Any, Any, Any]], Any], inner: Any) -> None:
        self._run = run
        self._inner = inner


def _twin_in(method: Callable[Concatenate[A, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[_Space, P], T]:
    """The blocking twin of a method of one of :class:`AsyncClient`'s namespaces."""

    def twin(self: _Space, /, *args: P.args, **kwargs: P.kwargs) -> T:
        result: T = self._run(method(self._inner, *args, **kwargs))
        return result

    return functools.wraps(method)(twin)


def _moved(method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[Client, P], T]:
    """The blocking twin of a deprecated method of :class:`AsyncClient`: it warns in the
    calling thread and calls the namespace method that replaces it."""
    old = method.__name__
    space, name = MOVED[old]

    def alias(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        deprecated(f"Client.{old}()", f"client.{space}.{name}()")
        result: T = getattr(getattr(self, space), name)(*args, **kwargs)
        return result

    return functools.wraps(method)(alias)


class Keys(_Space):
    __doc__ = AsyncKeys.__doc__
    bind = _twin_in(AsyncKeys.bind)
    tag = _twin_in(AsyncKeys.tag)
    set_tags = _twin_in(AsyncKeys.set_tags)
    lookup = _twin_in(AsyncKeys.lookup)
    of = _twin_in(AsyncKeys.of)
    all = _twin_in(AsyncKeys.all)
    drop = _twin_in(AsyncKeys.drop)


class Samples(_Space):
    __doc__ = AsyncSamples.__doc__
    select = _twin_in(AsyncSamples.select)
    allocate = _twin_in(AsyncSamples.allocate)
    reset = _twin_in(AsyncSamples.reset)
    stats = _twin_in(AsyncSamples.stats)


class Rollouts(_Space):
    __doc__ = AsyncRollouts.__doc__
    complete = _twin_in(AsyncRollouts.complete)
    postpone = _twin_in(AsyncRollouts.postpone)
    fail = _twin_in(AsyncRollouts.fail)
    reserve = _twin_in(AsyncRollouts.reserve)
    wait_sealed = _twin_in(AsyncRollouts.wait_sealed)
    wait_version = _twin_in(AsyncRollouts.wait_version)
    set_staleness = _twin_in(AsyncRollouts.set_staleness)


class Checkpoints(_Space):
    __doc__ = AsyncCheckpoints.__doc__
    save = _twin_in(AsyncCheckpoints.save)
    load = _twin_in(AsyncCheckpoints.load)


class Client:
    """Talks to a tqueue cluster from ordinary (blocking) code.

    The twin of :class:`AsyncClient`: the same methods (made from its methods), arguments,
    docstrings and errors. It owns one daemon thread running an event loop; each call hands
    its coroutine to that loop and blocks until it is done. A call interrupted while it waits
    (``KeyboardInterrupt``, or any exception raised in the calling thread) is cancelled: what
    it had parked at the controller is withdrawn before the exception goes on. Use it as a
    context manager or call :meth:`close`.
    """

    def __init__(self, address: str, *, config: ClientConfig | None = None) -> None:
        self._pid = os.getpid()  # a forked child has none of this client's threads or sockets
        self._inner = AsyncClient(address, config=config)  # first: a bad argument starts no thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=_loop_thread, args=(self._loop,), name="tqueue-client", daemon=True
        )
        self._thread.start()
        self._local = threading.local()
        self._direct_lock = threading.Lock()
        self._direct_routes: list[ThreadRoute] = []  # one per calling thread
        self._finalizer = weakref.finalize(
            self, _shutdown, self._loop, self._thread, self._inner, self._direct_routes, self._pid
        )

    @property
    def address(self) -> str:
        return self._inner.address

    @property
    def config(self) -> ClientConfig:
        return self._inner.config

    @property
    def stats(self) -> ClientStats:
        return self._inner.stats

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if os.getpid() != self._pid:
            coro.close()
            raise _forked(self._pid)
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a tqueue Client cannot be called from its own loop thread")
        if not self._finalizer.alive:
            coro.close()
            raise RuntimeError("the client is closed")
        done = threading.Event()
        held: list[asyncio.Task[T]] = []

        def start() -> None:  # on the loop thread
            task = self._loop.create_task(coro)
            task.add_done_callback(lambda _: done.set())
            held.append(task)

        self._loop.call_soon_threadsafe(start)
        try:
            done.wait()
        except BaseException:  # KeyboardInterrupt, or any exception raised in this thread
            # cancel the call (queued after start, so the task exists): its requests are
            # withdrawn at the servers; wait for that before the exception goes on
            self._loop.call_soon_threadsafe(lambda: held[0].cancel())
            done.wait(CANCEL_GRACE)
            raise
        return held[0].result()

    connect = _twin(AsyncClient.connect)

    def close(self) -> None:
        """Close connections and stop the loop thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Client:
        try:
            self.connect()
        except BaseException:
            self.close()  # the with block never runs, so its exit never would
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _thread_route(self) -> ThreadRoute:
        """This thread's own route to the controller (after the client's handshake)."""
        if os.getpid() != self._pid:
            raise _forked(self._pid)
        route = getattr(self._local, "route", None)
        if route is None or route.closed:
            if not self._finalizer.alive:
                raise RuntimeError("the client is closed")
            self.connect()
            route = self._inner.thread_route()
            self._local.route = route
            with self._direct_lock:
                self._direct_routes.append(route)
        return route

    @property
    def keys(self) -> Keys:
        return Keys(self._run, self._inner.keys)

    @property
    def samples(self) -> Samples:
        return Samples(self._run, self._inner.samples)

    @property
    def rollouts(self) -> Rollouts:
        return Rollouts(self._run, self._inner.rollouts)

    @property
    def checkpoints(self) -> Checkpoints:
        return Checkpoints(self._run, self._inner.checkpoints)

    create_partition = _twin(AsyncClient.create_partition)
    clear = _twin(AsyncClient.clear)
    status = _twin(AsyncClient.status)
    put = _twin(AsyncClient.put)
    update = _twin(AsyncClient.update)
    # sent from the calling thread on its own connection to the controller, not through the
    # loop thread: the answer comes about twice as fast
    get_meta = _twin(AsyncClient.get_meta, from_thread=ThreadRoute.get_meta)
    renew = _twin(AsyncClient.renew)
    get_data = _twin(AsyncClient.get_data)
    ack = _twin(AsyncClient.ack)
    seal = _twin(AsyncClient.seal)
    set_version = _twin(AsyncClient.set_version)

    # the old names of what the namespaces hold: deprecated, for one more release
    bind_keys = _moved(AsyncClient.bind_keys)
    tag_keys = _moved(AsyncClient.tag_keys)
    set_tags = _moved(AsyncClient.set_tags)
    lookup_keys = _moved(AsyncClient.lookup_keys)
    keys_of = _moved(AsyncClient.keys_of)
    list_keys = _moved(AsyncClient.list_keys)
    drop_keys = _moved(AsyncClient.drop_keys)
    select = _moved(AsyncClient.select)
    allocate = _moved(AsyncClient.allocate)
    reset_consumption = _moved(AsyncClient.reset_consumption)
    field_stats = _moved(AsyncClient.field_stats)
    complete = _moved(AsyncClient.complete)
    postpone = _moved(AsyncClient.postpone)
    fail = _moved(AsyncClient.fail)
    reserve = _moved(AsyncClient.reserve)
    sealed = _moved(AsyncClient.sealed)
    wait_version = _moved(AsyncClient.wait_version)
    set_staleness = _moved(AsyncClient.set_staleness)
    save_checkpoint = _moved(AsyncClient.save_checkpoint)
    load_checkpoint = _moved(AsyncClient.load_checkpoint)


def _forked(parent: int) -> ForkedClientError:
    return ForkedClientError(
        f"this client was made in process {parent} and used in process {os.getpid()}, forked from it: "
        "make a new client in the child (in a DataLoader, inside the worker: tqueue.bridges.loader does)"
    )
