"""Malformed traffic at a unit's ZeroMQ port and its bulk port, fast, from threads, while a
correct client puts and gets beside it: the client is served throughout, bytes intact, and
the unit's memory stays bounded. ``TQUEUE_FUZZ_MESSAGES`` (default 100,000) and
``TQUEUE_FUZZ_STREAMS`` (default 300) scale it."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

import tqueue
from tqueue.wire import _messages as _wire

from . import _fuzz
from ._proc import fds, peak_rss, reset_peak, rss, threads

MESSAGES = int(os.environ.get("TQUEUE_FUZZ_MESSAGES", 100_000))
STREAMS = int(os.environ.get("TQUEUE_FUZZ_STREAMS", 300))
MiB = 1 << 20
RSS_BOUND = 64 * MiB
SEED = 14


@pytest.fixture(scope="module")
def target() -> Iterator[tqueue.LocalCluster]:
    # retain_bytes=0: freed memory goes back to the OS, so RSS shows what the unit holds
    # (by default it keeps up to 4 GiB of freed payload mapped for the next writes)
    with tqueue.LocalCluster(num_storage_units=1, storage={"retain_bytes": 0}) as c:
        yield c


class ZmqFuzzer(threading.Thread):
    """Sends MESSAGES malformed messages as fast as it can, reading what comes back, then a
    Hello whose answer says the unit has handled every one before it (same connection)."""

    def __init__(self, address: str) -> None:
        super().__init__(name="fuzz-zmq", daemon=True)
        self.address = address
        self.sent_frames = 0
        self.replies = 0
        self.seconds = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(SEED)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            start = time.perf_counter()
            for i in range(MESSAGES):
                frames = _fuzz.message(rng)
                sock.send_multipart(frames)
                self.sent_frames += len(frames)
                if i % 256 == 0:
                    self._drain(sock, 0)
            last = _wire.Hello(rid=2**40, protocol=_wire.PROTOCOL_VERSION)
            sock.send_multipart(_wire.encode(last))
            while not self._drain(sock, 60_000, until=last.rid):
                pass
            self.seconds = time.perf_counter() - start
        except BaseException as exc:  # the test thread re-raises it
            self.error = exc
        finally:
            sock.close()
            ctx.term()

    def _drain(self, sock: zmq.Socket, timeout_ms: int, until: int = -1) -> bool:
        """Read what has arrived; True once the reply to ``until`` did."""
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            self.replies += 1
            if until >= 0 and _wire.salvage_rid(frames[1:2] and frames) == until:
                return True
            timeout_ms = 0
        if timeout_ms:
            raise TimeoutError("the unit stopped answering the fuzzer")
        return False


class BulkFuzzer(threading.Thread):
    """Opens STREAMS bulk connections, writes junk or half a hello on each, and closes."""

    def __init__(self, address: str) -> None:
        super().__init__(name="fuzz-bulk", daemon=True)
        host, _, port = address.rpartition(":")
        self.where = (host, int(port))
        self.sent_frames = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(SEED + 1)
        try:
            for _ in range(STREAMS):
                with socket.create_connection(self.where, timeout=30) as s:
                    for chunk in _fuzz.bulk_opening(rng):
                        try:
                            s.sendall(chunk)
                        except OSError:
                            break  # the unit closed it already: it refused the opening
                        self.sent_frames += 1
        except BaseException as exc:
            self.error = exc


def test_fuzzed_unit_serves_a_correct_client_and_stays_bounded(target, partition):
    from .conftest import bulk_address_of

    pid = target.pids[1]
    bulk = bulk_address_of(target)
    config = tqueue.ClientConfig(shm=False, host="elsewhere")  # its fetches go over the bulk port
    with tqueue.Client(target.address, config=config) as c:
        rng = torch.Generator().manual_seed(SEED)
        c.get_data(c.put("warm-up", {"x": torch.rand(4, 1 << 16, generator=rng)}))
        reset_peak(pid)
        rss0, fd0, th0 = rss(pid), fds(pid), threads(pid)
        fuzzers = [ZmqFuzzer(target.unit_addresses[0]), BulkFuzzer(bulk)]
        for f in fuzzers:
            f.start()
        rounds = 0
        while rounds < 5 or any(f.is_alive() for f in fuzzers):
            data = {"x": torch.rand(8, 1 << 15, generator=rng), "s": [f"r{rounds}-{i}" for i in range(8)]}
            meta = c.put(partition, data)
            got = c.get_data(meta)
            assert torch.equal(got["x"], data["x"]) and got["s"] == data["s"]
            c.clear(partition)
            rounds += 1
        for f in fuzzers:
            f.join()
            if f.error is not None:
                raise f.error
        zmq_fuzz, bulk_fuzz = fuzzers
        grew = peak_rss(pid) - rss0
        rate = MESSAGES / zmq_fuzz.seconds
        print(
            f"\nfuzz: {MESSAGES} messages ({zmq_fuzz.sent_frames} frames) at the ZeroMQ port in "
            f"{zmq_fuzz.seconds:.1f} s ({rate:,.0f} messages/s handled), {bulk_fuzz.sent_frames} writes on "
            f"{STREAMS} bulk connections; {rounds} correct put/get rounds meanwhile; unit peak RSS "
            f"+{grew / MiB:.1f} MiB, fds {fd0}->{fds(pid)}, threads {th0}->{threads(pid)}"
        )
        assert zmq_fuzz.replies > MESSAGES // 2  # the unit answered what it could
        assert grew < RSS_BOUND, grew / MiB
        assert c.status().units  # the unit is still registered and answering
