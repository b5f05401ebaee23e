"""zmq-raw: the same bytes over bare ZeroMQ sockets between processes, the floor to compare to.

Each consumer process binds one ROUTER socket (``tcp://127.0.0.1`` or an ``ipc://`` path in a
temporary directory); each producer process connects one DEALER socket per consumer it feeds.
A producer sends every put as messages of frames of at most ``frame_bytes`` (1 MiB unless
told, 4 MiB at most): tensors' raw bytes straight from the batch (``memoryview``,
``copy=False``), prompt strings and meta dicts msgpack-encoded with msgspec, images one frame
each. The consumer receives with ``copy=False``, copies each tensor frame into its place in
the batch tensors it allocates, decodes the lists, keeps the images as tensors over the
received frames, and acknowledges each producer once that producer's last byte is in.
``put_s`` runs from a producer's first send to the acknowledgements; ``get_s`` is a
consumer's receive time (first message to holding its share); ``e2e_s`` from the first
producer's first send to the last consumer holding its share.

Wire, one message per line (after the ROUTER's identity frame)::

    B  [run, start, n, [[field, dtype, row_shape], ...], [object field, ...], has_images]
    T  (run, start, field index, byte offset) | one frame of the field's rows from ``start``
    O  (run, start, object field index)       | msgpack of the list, in frames
    I  (run, start)                           | msgpack of shapes | one frame per image
    E  (run,)                                   end of this producer's stream to this consumer
    A  (run,)                                   consumer -> producer: all received
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import struct
import tempfile
from typing import Any

from benchmarks import workload
from benchmarks.harness import Result, Scenario, Worker, now, serve, settle
from benchmarks.systems import Plan, make_plan, make_puts, missing

FRAME = 1 << 20  # default frame size; the brief's ceiling is 4 MiB
TIMEOUT_S = 600.0  # longest wait for any one message, ack or reply

_T = struct.Struct("<qqqq")  # run, start, field index, byte offset
_O = struct.Struct("<qqq")  # run, start, object field index
_I = struct.Struct("<qq")  # run, start
_E = struct.Struct("<q")  # run


def _plan(msg: dict[str, Any]) -> Plan:
    return make_plan(Scenario(**msg["scenario"]), msg["size"], split_per_consumer=True)


# ---------------------------------------------------------------- producer process


def _producer_main(conn: Any, index: int) -> None:
    import msgspec
    import numpy as np
    import torch
    import zmq

    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}  # endpoint -> DEALER, kept across runs
    state: dict[str, Any] = {}

    def sock_for(endpoint: str) -> zmq.Socket:
        if endpoint not in socks:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"p{index}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            socks[endpoint] = s
        return socks[endpoint]

    def prepare(msg: dict[str, Any]) -> dict[str, Any]:
        state.pop("parts", None)  # the last run's batch, freed here, untimed (harness.py)
        plan = _plan(msg)
        parts = make_puts(plan, index)
        # sends[i]: (consumer, lo, hi) row ranges of put i, one per consumer that takes some
        sends: list[list[tuple[int, int, int]]] = [[] for _ in parts]
        for c, pieces in enumerate(plan.pieces):
            for pc in pieces:
                if pc.producer == index:
                    sends[pc.put].append((c, pc.lo, pc.hi))
        dests = plan.consumers_of(index)
        state.update(run=msg["run"], plan=plan, parts=parts, sends=sends, frame=msg["frame"],
                     socks={c: sock_for(msg["endpoints"][c]) for c in dests})
        return {"nbytes": sum(workload.nbytes(p) for p in parts)}

    def send_rows(sock: zmq.Socket, run: int, start: int, batch: dict[str, Any], lo: int, hi: int,
                  frame: int) -> None:
        tensors = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
        objects = [k for k in workload.OBJECT_FIELDS if k in batch]
        images = batch.get(workload.IMAGE_FIELD)
        head = [run, start, hi - lo, [[k, str(v.dtype).removeprefix("torch."), list(v.shape[1:])] for k, v in tensors],
                objects, images is not None]
        sock.send_multipart([b"B", msgspec.msgpack.encode(head)])
        for f, (_, t) in enumerate(tensors):
            rows = t[lo:hi]
            if not rows.is_contiguous():  # row slices of the workload's tensors always are
                rows = rows.contiguous()
            raw = memoryview(rows.numpy().reshape(-1).view(np.uint8))
            for off in range(0, len(raw), frame):
                sock.send_multipart([b"T", _T.pack(run, start, f, off), raw[off : off + frame]], copy=False)
        for f, k in enumerate(workload.OBJECT_FIELDS):
            if k not in batch:
                continue
            blob = msgspec.msgpack.encode(batch[k][lo:hi])
            view = memoryview(blob)
            sock.send_multipart([b"O", _O.pack(run, start, f)] + [view[o : o + frame] for o in range(0, len(blob), frame)],
                                copy=False)
        if images is not None:
            at, i = lo, lo
            while at < hi:  # messages of whole images, about a frame's worth each
                size = 0
                while i < hi and (i == at or size + images[i].nbytes <= frame):
                    size += images[i].nbytes
                    i += 1
                imgs = [images[j].contiguous() for j in range(at, i)]
                shapes = msgspec.msgpack.encode([list(x.shape) for x in imgs])
                sock.send_multipart([b"I", _I.pack(run, start + at - lo), shapes]
                                    + [memoryview(x.numpy().reshape(-1)) for x in imgs], copy=False)
                at = i

    def go(msg: dict[str, Any]) -> dict[str, Any]:
        run, plan, parts, socks_c = state["run"], state["plan"], state["parts"], state["socks"]
        puts = plan.puts[index]
        t0 = now()
        for i, batch in enumerate(parts):
            for c, lo, hi in state["sends"][i]:
                send_rows(socks_c[c], run, puts[i][0] + lo, batch, lo, hi, state["frame"])
        for s in socks_c.values():
            s.send_multipart([b"E", _E.pack(run)])
        poller = zmq.Poller()
        for s in socks_c.values():
            poller.register(s, zmq.POLLIN)
        waiting = set(socks_c.values())
        while waiting:
            ready = dict(poller.poll(TIMEOUT_S * 1000))
            if not ready:
                raise TimeoutError(f"producer {index}: no acknowledgement in {TIMEOUT_S} s")
            for s in ready:
                kind, body = s.recv_multipart()
                if kind == b"A" and _E.unpack(body)[0] == run:
                    waiting.discard(s)
                    poller.unregister(s)
        t1 = now()
        state.clear()  # frees the batch
        return {"t0": t0, "t1": t1}

    try:
        serve(conn, {"prepare": prepare, "go": go})
    finally:
        state.clear()
        for s in socks.values():
            s.close(0)
        ctx.term()


# ---------------------------------------------------------------- consumer process


def _consumer_main(conn: Any, index: int, endpoint: str) -> None:
    import msgspec
    import numpy as np
    import torch
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(msg: dict[str, Any]) -> dict[str, Any]:
        plan = _plan(msg)
        run, mm = msg["run"], plan.scenario.multimodal
        q0, q1 = plan.shares[index]
        n = q1 - q0
        expect = len(plan.producers_of(index))
        tensors: dict[str, tuple[torch.Tensor, Any, int]] = {}  # field -> (batch tensor, its bytes, row bytes)
        names: dict[tuple[bytes, int], list[str]] = {}  # (producer, start) -> tensor fields of that put
        objects: dict[str, list[Any]] = {k: [None] * n for k in workload.OBJECT_FIELDS}
        images: list[Any] = [None] * n
        peers: list[bytes] = []
        got = 0  # tensor bytes received
        t_first = None
        while len(peers) < expect:
            if not sock.poll(TIMEOUT_S * 1000):
                raise TimeoutError(f"consumer {index}: nothing received for {TIMEOUT_S} s")
            frames = sock.recv_multipart(copy=False)
            if t_first is None:
                t_first = now()
            peer, kind = frames[0].bytes, frames[1].bytes
            if kind == b"T":
                _, start, f, off = _T.unpack(frames[2].buffer)
                dest, raw, row = tensors[names[peer, start][f]]
                at = (start - q0) * row + off
                payload = frames[3].buffer
                raw[at : at + len(payload)] = np.frombuffer(payload, np.uint8)
                got += len(payload)
            elif kind == b"B":
                r, start, _, specs, _, _ = msgspec.msgpack.decode(frames[2].buffer)
                if r != run:
                    raise RuntimeError(f"consumer {index}: message of run {r} during run {run}")
                names[peer, start] = [k for k, _, _ in specs]
                for k, dtype, shape in specs:
                    if k not in tensors:
                        t = torch.empty((n, *shape), dtype=getattr(torch, dtype))
                        tensors[k] = (t, t.view(-1).view(torch.uint8).numpy(), t[0].numel() * t.element_size())
            elif kind == b"O":
                _, start, f = _O.unpack(frames[2].buffer)
                parts = frames[3:]
                blob = parts[0].buffer if len(parts) == 1 else b"".join(p.buffer for p in parts)
                values = msgspec.msgpack.decode(blob)
                objects[workload.OBJECT_FIELDS[f]][start - q0 : start - q0 + len(values)] = values
            elif kind == b"I":
                _, start = _I.unpack(frames[2].buffer)
                for j, (shape, fr) in enumerate(zip(msgspec.msgpack.decode(frames[3].buffer), frames[4:])):
                    images[start - q0 + j] = torch.frombuffer(fr.buffer, dtype=torch.uint8).view(shape)
            elif kind == b"E":
                peers.append(peer)
        batch: dict[str, Any] = {k: v[0] for k, v in tensors.items()}
        batch.update(objects)
        if mm:
            batch[workload.IMAGE_FIELD] = images
        t_done = now()
        for peer in peers:
            sock.send_multipart([peer, b"A", _E.pack(run)])
        workload.verify(batch, q0, q1, multimodal=mm)
        if got != sum(t.nbytes for t, _, _ in tensors.values()):
            raise AssertionError(f"consumer {index}: {got} tensor bytes received, batch holds a different count")
        if mm and any(x is None for x in images):
            raise AssertionError("images missing")
        del batch, objects, images
        settle()
        return {"t_first": t_first, "t_done": t_done}

    try:
        serve(conn, {"endpoint": lambda msg: {"endpoint": bound}, "recv": recv})
    finally:
        sock.close(0)
        ctx.term()


# ---------------------------------------------------------------- driver


class ZmqRawSystem:
    """Raw ZeroMQ between producer and consumer processes.

    ``transport``: "tcp" (127.0.0.1) or "ipc" (a socket file in a temporary directory).
    ``frame_bytes``: the largest frame sent (at most 4 MiB).
    ``warm_memory``: the worker processes keep the memory they free (glibc: no mmap'd
    allocations, no trimming), so from the second run on a consumer's batch lands in pages it
    has touched before, as a store that reuses its memory would. Off, every run pays the
    kernel for fresh zeroed pages, which on a small VM costs more than the copy itself.
    """

    name = "zmq-raw"

    def __init__(self, transport: str = "tcp", frame_bytes: int = FRAME, warm_memory: bool = True) -> None:
        if transport not in ("tcp", "ipc"):
            raise ValueError(f"transport must be tcp or ipc, not {transport!r}")
        if not 0 < frame_bytes <= 4 << 20:
            raise ValueError("frame_bytes must be in (0, 4 MiB]")
        self.transport = transport
        self.frame_bytes = frame_bytes
        self.warm_memory = warm_memory
        self.copies = ("producer: 0 of tensor and image bytes (frames point into the batch), 1 of prompt/meta "
                       "(msgpack); the kernel's socket copies; consumer: 1 of tensor bytes (frame -> batch "
                       "tensor), 0 of images (tensors over the received frames), prompt/meta decoded"
                       + ("; batch memory reused across runs" if warm_memory else ""))
        self._producers: list[Worker] = []
        self._consumers: list[Worker] = []
        self._endpoints: list[str] = []
        self._tmp: str | None = None
        self._run = 0

    def unavailable(self) -> str | None:
        absent = missing("zmq", "msgspec", "numpy")
        return f"{', '.join(absent)} not installed" if absent else None

    def start(self) -> None:
        if self.transport == "ipc":
            self._tmp = tempfile.mkdtemp(prefix="zmq-raw-")

    @contextlib.contextmanager
    def _child_env(self) -> Any:
        """The environment spawned workers start with (glibc reads its tunables at startup)."""
        if not self.warm_memory:
            yield
            return
        saved = os.environ.get("GLIBC_TUNABLES")
        ours = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
        os.environ["GLIBC_TUNABLES"] = f"{saved}:{ours}" if saved else ours
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("GLIBC_TUNABLES", None)
            else:
                os.environ["GLIBC_TUNABLES"] = saved

    def _grow(self, producers: int, consumers: int) -> None:
        with self._child_env():
            self._spawn(producers, consumers)

    def _spawn(self, producers: int, consumers: int) -> None:
        while len(self._consumers) < consumers:
            i = len(self._consumers)
            ep = "tcp://127.0.0.1:*" if self.transport == "tcp" else f"ipc://{self._tmp}/c{i}"
            w = Worker(_consumer_main, i, ep, name=f"zmq-raw-consumer-{i}")
            self._consumers.append(w)
            w.send({"cmd": "endpoint"})
            self._endpoints.append(w.recv(120)["endpoint"])
        while len(self._producers) < producers:
            i = len(self._producers)
            self._producers.append(Worker(_producer_main, i, name=f"zmq-raw-producer-{i}"))

    def run(self, scenario: Scenario, size: int) -> Result:
        plan = make_plan(scenario, size, split_per_consumer=True)
        self._grow(scenario.producers, scenario.consumers)
        self._run += 1
        msg = {"run": self._run, "scenario": dataclasses.asdict(scenario), "size": size, "frame": self.frame_bytes,
               "endpoints": self._endpoints[: scenario.consumers]}
        prods, cons = self._producers[: scenario.producers], self._consumers[: scenario.consumers]
        for w in prods:
            w.send({"cmd": "prepare", **msg})
        nbytes = sum(w.recv(TIMEOUT_S)["nbytes"] for w in prods)
        for w in cons:
            w.send({"cmd": "recv", **msg})
        for w in prods:
            w.send({"cmd": "go"})
        sent = [w.recv(TIMEOUT_S) for w in prods]
        got = [w.recv(TIMEOUT_S) for w in cons]
        del plan
        return Result(
            system=self.name, scenario=scenario.name, size=size, transport=self.transport, nbytes=nbytes,
            put_s=max(s["t1"] - s["t0"] for s in sent),
            get_meta_s=None,
            get_s=max(g["t_done"] - g["t_first"] for g in got),
            e2e_s=max(g["t_done"] for g in got) - min(s["t0"] for s in sent),
        )

    def stop(self) -> None:
        workers = self._producers + self._consumers
        for w in workers:  # all at once: each takes a while to exit
            try:
                w.send({"cmd": "stop"})
            except OSError:
                pass
        for w in workers:
            w.stop()
        self._producers, self._consumers, self._endpoints = [], [], []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
