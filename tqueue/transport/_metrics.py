"""A Prometheus endpoint for a server (``prometheus_client``'s HTTP server, in its thread).

Metrics are read when scraped, not counted on the hot paths: the scrape asks the server's
event loop for a snapshot (so it sees one consistent state, never a structure being changed)
and turns it into metric families. A scrape that the loop does not answer within
``SCRAPE_TIMEOUT`` fails that scrape, not the server.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 10.0


#: request latency buckets (seconds, upper bounds); a parked request counts until answered
LATENCY_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


class Latency:
    """Request latency per message kind, kept by a server: counts per bucket and the sum, as
    a Prometheus histogram is read (cumulated when exported)."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, kind: str, seconds: float) -> None:
        entry = self.kinds.get(kind)
        if entry is None:
            entry = self.kinds[kind] = ([0] * (len(LATENCY_BUCKETS) + 1), [0.0])
        counts, total = entry
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        total[0] += seconds


class MetricsEndpoint:
    """Serve ``families()`` (run on ``loop``) on ``port`` of the host of ``bind`` (the
    server's ZeroMQ endpoint; port 0: the OS picks). ``url`` names the host of ``address``,
    the server's advertised address, so a wildcard bind is reached as the server is.
    ``close()`` stops the HTTP server."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, families: Callable[[], Iterable[Any]], *, bind: str, address: str, port: int
    ) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._loop = loop
        self._families = families
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._http, self._thread = start_http_server(port, addr=metrics_host(bind), registry=registry)
        bound = self._http.server_address
        self.url = f"http://{url_host(address)}:{bound[1]}/metrics"

    def collect(self) -> Iterator[Any]:
        """Called by prometheus_client in its HTTP thread, once per scrape."""

        async def snapshot() -> list[Any]:
            return list(self._families())

        future = asyncio.run_coroutine_threadsafe(snapshot(), self._loop)
        yield from future.result(SCRAPE_TIMEOUT)

    def describe(self) -> list[Any]:
        return []  # read at scrape time only

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


def metrics_host(endpoint: str) -> str:
    """The host a server's metrics bind to: its ZeroMQ endpoint's (``tcp://HOST:PORT``), or
    loopback for other transports."""
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        return "0.0.0.0" if host in ("*", "") else host.strip("[]")
    return "127.0.0.1"


def url_host(address: str) -> str:
    """The host of a metrics URL: that of the server's advertised address (``tcp://HOST:PORT``,
    a wildcard already replaced by ``advertise`` or this machine's address), or loopback for
    other transports."""
    if address.startswith("tcp://"):
        return address[len("tcp://"):].rsplit(":", 1)[0]  # an IPv6 host keeps its brackets
    return "127.0.0.1"


def latency_family(name: str, doc: str, latency: Latency) -> Any:
    """``latency`` as one histogram family, labelled by message kind."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(name, doc, labels=["kind"])
    for kind, (counts, total) in sorted(latency.kinds.items()):
        buckets, running = [], 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts):
            running += count
            buckets.append((bound, running))
        family.add_metric([kind], buckets, total[0])
    return family
