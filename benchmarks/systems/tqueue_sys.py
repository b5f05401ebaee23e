"""tqueue in the benchmark suite: a local cluster, producer and consumer processes."""

from __future__ import annotations

import itertools
from multiprocessing.connection import Connection
from typing import Any

from ..harness import Result, Scenario, Worker, cpu_seconds, now, serve, settle
from ..workload import fields, make_batch, nbytes, verify


def _client(address: str, transport: str, pack: bool, coalesce: bool = False) -> Any:
    import dataclasses

    import tqueue

    config = tqueue.ClientConfig.from_env()
    config = dataclasses.replace(
        config, shm=transport == "shm", pack_ints=pack, coalesce_puts=coalesce, nixl="on" if transport == "nixl" else "off"
    )
    client = tqueue.Client(address, config=config)
    client.connect()
    return client


def _prepare(state: dict[str, Any], msg: dict[str, Any]) -> dict[str, Any]:
    """A producer's share of the batch, one part per group when streaming (made untimed);
    the last run's batch is freed here, untimed too (harness.py)."""
    state.pop("spent", None)
    group, mm = msg["group"], msg["multimodal"]
    start, stop = msg["start"], msg["stop"]
    step = group or (stop - start)
    state["grouped"] = bool(group)
    state["parts"] = [
        (make_batch(min(step, stop - a), multimodal=mm, start=a), f"g{a // 8}") for a in range(start, stop, step)
    ]
    return {"nbytes": sum(nbytes(b) for b, _ in state["parts"])}


def _producer(conn: Connection, address: str, rank: int, transport: str, pack: bool, inflight: int = 1) -> None:
    """Puts its share of the batch, one put per group when streaming; with ``inflight`` > 1,
    an ``AsyncClient`` keeps that many puts going at once (as an async rollout worker's
    finished requests put concurrently), and coalesces those that wait in one turn of its loop."""
    if inflight > 1:
        _async_producer(conn, address, transport, pack, inflight)
        return
    client = _client(address, transport, pack)
    state: dict[str, Any] = {}

    def prepare(msg: dict[str, Any]) -> dict[str, Any]:
        return _prepare(state, msg)

    def go(msg: dict[str, Any]) -> dict[str, Any]:
        t0 = now()
        for batch, group in state["parts"]:
            client.put(msg["partition"], batch, groups=group if state["grouped"] else None)
        t1 = now()
        state["spent"] = state.pop("parts")
        return {"t0": t0, "t1": t1}

    try:
        serve(conn, {"prepare": prepare, "go": go})
    finally:
        client.close()


def _async_producer(conn: Connection, address: str, transport: str, pack: bool, inflight: int) -> None:
    import asyncio
    import dataclasses

    import tqueue

    loop = asyncio.new_event_loop()
    config = tqueue.ClientConfig.from_env()
    config = dataclasses.replace(
        config, shm=transport == "shm", pack_ints=pack, coalesce_puts=True, nixl="on" if transport == "nixl" else "off"
    )
    client = tqueue.AsyncClient(address, config=config)
    loop.run_until_complete(client.connect())
    state: dict[str, Any] = {}

    def prepare(msg: dict[str, Any]) -> dict[str, Any]:
        return _prepare(state, msg)

    async def put_all(partition: str) -> None:
        slots = asyncio.Semaphore(inflight)

        async def one(batch: Any, group: str) -> None:
            async with slots:
                await client.put(partition, batch, groups=group if state["grouped"] else None)

        await asyncio.gather(*(one(b, g) for b, g in state["parts"]))

    def go(msg: dict[str, Any]) -> dict[str, Any]:
        t0 = now()
        loop.run_until_complete(put_all(msg["partition"]))
        t1 = now()
        state["spent"] = state.pop("parts")
        return {"t0": t0, "t1": t1}

    try:
        serve(conn, {"prepare": prepare, "go": go})
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def _consumer(conn: Connection, address: str, rank: int, transport: str, pack: bool) -> None:
    client = _client(address, transport, pack)

    def get(msg: dict[str, Any]) -> dict[str, Any]:
        t0 = now()
        meta = client.get_meta(msg["partition"], msg["fields"], msg["count"], task="train", timeout=600)
        t1 = now()
        batch = client.get_data(meta)
        t2 = now()
        if msg["ordered"]:
            verify(batch, meta.indexes[0], meta.indexes[0] + len(meta), multimodal=msg["multimodal"])
        client.ack(meta)
        del batch
        settle()
        return {"t0": t0, "t1": t1, "t2": t2, "indexes": meta.indexes}

    try:
        serve(conn, {"get": get})
    finally:
        client.close()


class TQueueSystem:
    """``transport``: ``tcp`` (sockets only) or ``shm`` (the same-host path, chosen
    automatically because producers, units and consumers share this host). ``pack``: integer
    fields travel narrowed (the default; socket writes only); off for ``tqueue-wide``."""

    def __init__(self, transport: str = "tcp", units: int = 2, pack: bool = True, inflight: int = 1) -> None:
        self.name = {"shm": "tqueue-shm", "nixl": "tqueue-nixl"}.get(transport, "tqueue" if pack else "tqueue-wide")
        if inflight > 1:
            self.name = f"{self.name}-inflight"
        self.inflight = inflight
        self.transport = transport
        self.units = units
        self.pack = pack
        self.copies = (
            "put: integer fields narrowed frame by frame into a cache-sized buffer the bulk "
            "stream sends from (1 pass; the narrow bytes are not written to memory and read "
            "back), other dense tensors 0 user-space copies (frames are views of the tensor), "
            "small jagged samples and objects joined once; kernel: 1 copy each way; unit: 0 "
            "(receives into buffers it keeps, answers with slices); get: packed frames received "
            "into a cache-sized buffer and widened from it into the batch's rows (1 pass), "
            "other dense fields 0 (received into the batch's rows), objects decoded from staging"
            if transport == "tcp" and pack
            else "put: dense tensors 0 user-space copies (frames are views of the tensor, sent on "
            "bulk streams), small jagged samples and objects joined once; kernel: 1 copy each "
            "way; unit: 0 (receives into buffers it keeps, answers with slices); get: 0 for "
            "dense fields (received into the batch's rows), objects decoded from staging"
            if transport == "tcp"
            else "put: 1 copy into a registered staging buffer, then a NIXL WRITE into the unit's arena; get: "
            "one NIXL READ of the arena's ranges straight into the batch's rows (dense fields), objects decoded"
            if transport == "nixl"
            else "put: 1 copy into the unit's shared-memory arena; no socket; get: 0 copies "
            "when a field's samples lie in one range in order (views under a hold), else 1 "
            "copy into a pooled batch buffer"
        )
        self._cluster: Any = None
        self._producers: list[Worker] = []
        self._consumers: list[Worker] = []
        self._runs = itertools.count()
        self._client: Any = None

    def unavailable(self) -> str | None:
        if self.transport == "nixl":
            from tqueue.transport import _nixl

            if not _nixl.available():
                return "the nixl extra is not installed (pip install -e '.[nixl]')"
        return None

    def start(self) -> None:
        import tqueue

        storage = {"nixl": True} if self.transport == "nixl" else None
        self._cluster = tqueue.LocalCluster(num_storage_units=self.units, storage=storage).start()
        self._client = tqueue.Client(self._cluster.address)

    def _workers(self, scenario: Scenario) -> None:
        addr = self._cluster.address
        while len(self._producers) < scenario.producers:
            self._producers.append(Worker(_producer, addr, len(self._producers), self.transport, self.pack, self.inflight, name=f"tq-producer-{len(self._producers)}").ready())
        while len(self._consumers) < scenario.consumers:
            self._consumers.append(Worker(_consumer, addr, len(self._consumers), self.transport, self.pack, name=f"tq-consumer-{len(self._consumers)}").ready())

    def run(self, scenario: Scenario, size: int) -> Result:
        self._workers(scenario)
        partition = f"bench-{next(self._runs)}"
        producers = self._producers[: scenario.producers]
        consumers = self._consumers[: scenario.consumers]
        total = 0
        for w, (a, b) in zip(producers, scenario.shares(size, scenario.producers)):
            w.send({"cmd": "prepare", "start": a, "stop": b, "group": scenario.group, "multimodal": scenario.multimodal})
        for w in producers:
            total += w.recv()["nbytes"]
        want = fields(scenario.multimodal)
        get_msgs = [
            {"cmd": "get", "partition": partition, "fields": want, "count": b - a, "ordered": scenario.group == 0, "multimodal": scenario.multimodal}
            for a, b in scenario.shares(size, scenario.consumers)
        ]
        streaming = scenario.group > 0
        if streaming:  # consumers wait (parked) while producers stream
            for w, m in zip(consumers, get_msgs):
                w.send(m)
        for w in producers:
            w.send({"cmd": "go", "partition": partition})
        puts = [w.recv() for w in producers]
        if not streaming:
            for w, m in zip(consumers, get_msgs):
                w.send(m)
        gets = [w.recv() for w in consumers]
        seen = sorted(i for g in gets for i in g["indexes"])
        if seen != list(range(size)):
            raise AssertionError(f"consumers got {len(seen)} samples, not each of {size} once")
        self._client.clear(partition)
        start = min(p["t0"] for p in puts)
        return Result(
            system=self.name,
            scenario=scenario.name,
            size=size,
            transport=self.transport,
            nbytes=total,
            put_s=max(p["t1"] - p["t0"] for p in puts),
            get_meta_s=max(g["t1"] - g["t0"] for g in gets),
            get_s=max(g["t2"] - g["t1"] for g in gets),
            e2e_s=max(g["t2"] for g in gets) - start,
        )

    def put_cost(self, group: int, puts: int) -> dict[str, float]:
        """CPU time a streaming put of ``group`` samples costs, in µs per put, by process:
        one producer puts ``puts`` groups of the workload's samples one after another (no
        reader), twice: the first warms the unit's pages and pools and is not counted."""
        producer = Worker(_producer, self._cluster.address, 99, self.transport, self.pack, self.inflight, name="tq-put-cost").ready()
        try:
            out: dict[str, float] = {}
            for attempt in range(2):
                producer.send({"cmd": "prepare", "start": 0, "stop": group * puts, "group": group, "multimodal": False})
                producer.recv()
                pids = {"client": producer.proc.pid, "controller": self._cluster.pids[0]}
                pids |= {f"unit{i}": pid for i, pid in enumerate(self._cluster.pids[1:])}
                before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                producer.send({"cmd": "go", "partition": f"put-cost-{attempt}"})
                done = producer.recv()
                after = {k: cpu_seconds(pid) for k, pid in pids.items()}
                self._client.clear(f"put-cost-{attempt}")
                units = sum(after[k] - before[k] for k in pids if k.startswith("unit"))
                out = {
                    "client": (after["client"] - before["client"]) / puts * 1e6,
                    "controller": (after["controller"] - before["controller"]) / puts * 1e6,
                    "units": units / puts * 1e6,
                    "wall": (done["t1"] - done["t0"]) / puts * 1e6,
                }
            out["total"] = out["client"] + out["controller"] + out["units"]
            return out
        finally:
            producer.stop()

    def stop(self) -> None:
        for w in self._producers + self._consumers:
            w.stop()
        self._producers, self._consumers = [], []
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
