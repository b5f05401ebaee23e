"""Flow control: the staleness bound and the memory budget make puts wait (parked, no
polling) and then either proceed or fail with a typed error that says why."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading

import pytest
import torch

import tqueue
from tqueue.errors import StorageFullError, WaitTimeoutError
from tqueue.wire import Cancel, Reserve, StatusRequest
from tqueue.wire import _messages as wire

from .parking import park


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def cluster():
    """Units of 4 MiB each; a cluster of its own, for the budget and the staleness bound."""
    with tqueue.LocalCluster(num_storage_units=2, storage={"capacity_bytes": 4 << 20}) as c:
        yield c


def mib(n: int) -> dict:
    return {"x": torch.zeros(4 * n, 1 << 16)}  # samples of 256 KiB (float32)


async def parked(coro):
    """Start ``coro``; one loop turn sends its request, and it must still be pending."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    assert not task.done()
    return task


def test_producer_blocks_at_the_staleness_bound_until_the_trainer_advances(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as producer, tqueue.AsyncClient(cluster.address) as trainer:
            await trainer.set_staleness(max_staleness=1, batch_size=4)  # (v + 2) * 4 samples
            try:
                await producer.put(partition, {"x": torch.arange(8)}, version=0)
                blocked = await parked(producer.put(partition, {"x": torch.arange(2)}, version=0, timeout=60))
                status = await producer.status()  # same connection as the put: ordered after it
                assert [w.kind for w in status.waiting] == ["put"]
                assert "8 samples admitted of 8 allowed (trainer version 0, max_staleness 1" in status.waiting[0].reason
                pid = cluster.pids[0]
                before = cpu_seconds(pid)
                with pytest.raises(asyncio.TimeoutError):  # still blocked a second later...
                    await asyncio.wait_for(asyncio.shield(blocked), 1.0)
                assert cpu_seconds(pid) - before < 0.1  # ...and the controller idles meanwhile
                await trainer.set_version(1)
                meta = await asyncio.wait_for(blocked, 10)
                assert meta.indexes == [8, 9] and meta.versions == [0, 0]
                with pytest.raises(WaitTimeoutError, match=r"for the trainer: 10 samples admitted of 12 allowed"):
                    await producer.reserve(3, timeout=0.1)
                await producer.reserve(2, timeout=1)
                await producer.put(partition, {"x": torch.arange(2)}, version=1, timeout=0)  # reserved
            finally:
                await trainer.set_staleness(None)

    asyncio.run(main())


def test_consumers_refuse_stale_samples_and_count_them(cluster, client, partition):
    client.set_version(5)
    client.put(partition, {"x": torch.arange(4)}, version=[2, 4, 5, 3])
    meta = client.get_meta(partition, ["x"], 2, task="t", max_staleness=1, timeout=5)
    assert meta.indexes == [1, 2] and meta.versions == [4, 5]
    with pytest.raises(WaitTimeoutError):
        client.get_meta(partition, ["x"], 1, task="t", max_staleness=1, timeout=0)
    status = {p.name: p for p in client.status().partitions}[partition]
    assert status.tasks["t"].refused == 2  # counted, not silently lost
    assert client.get_meta(partition, ["x"], 4, task="other", timeout=5).indexes == [0, 1, 2, 3]


def test_put_over_budget_waits_then_succeeds_when_memory_is_freed(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as c:
            await c.put(f"{partition}-a", mib(3))
            await c.put(f"{partition}-b", mib(3))  # one per unit: both nearly full
            blocked = await parked(c.put(partition, mib(2), timeout=60))
            status = await c.status()
            assert [w.kind for w in status.waiting] == ["put"]
            assert "fits on no storage unit" in status.waiting[0].reason
            await c.clear(f"{partition}-a")
            meta = await asyncio.wait_for(blocked, 10)
            assert len(meta) == 8
            await c.clear(partition)
            await c.clear(f"{partition}-b")

    asyncio.run(main())


def test_put_over_budget_raises_after_its_timeout(cluster, client, partition):
    client.put(f"{partition}-a", mib(3))
    client.put(f"{partition}-b", mib(3))
    try:
        with pytest.raises(StorageFullError, match=r"put timed out after 0.2 s: a write of 2097152 bytes .* fits on no storage unit \(unit 0: \d+ of 4194304"):
            client.put(partition, mib(2), timeout=0.2)
        with pytest.raises(StorageFullError, match=r"a write of 8388608 bytes"):
            client.put(partition, mib(8), timeout=60)  # can never fit: no wait
    finally:
        client.clear(f"{partition}-a")
        client.clear(f"{partition}-b")
    assert partition not in {p.name for p in client.status().partitions}  # nothing half-made


def test_a_put_that_would_wait_for_memory_is_checked_first(cluster, client, partition):
    """The controller checks a put once it has room, but one that would wait for memory is
    checked before it waits: a put against the partition's schema fails at once, and one to a
    sealed partition is answered at once, neither parked for the whole timeout."""
    client.put(partition, {"x": torch.zeros(1, 1 << 16)})
    client.put(f"{partition}-a", mib(3))
    client.put(f"{partition}-b", mib(3))  # one per unit: both nearly full
    try:
        with pytest.raises(tqueue.SchemaError, match=rf"field 'x' of partition '{partition}'"):
            client.put(partition, {"x": torch.zeros(4 * 2, 1 << 16, dtype=torch.float64)}, timeout=60)
        client.seal(partition)
        with pytest.raises(tqueue.PartitionSealedError, match=rf"to partition '{partition}' stored nothing"):
            client.put(partition, mib(2), timeout=60)
        assert client.put(partition, mib(2), timeout=60, if_sealed="discard").status == "aborted"
        assert client.status().waiting == []
    finally:
        client.clear(f"{partition}-a")
        client.clear(f"{partition}-b")


def test_a_cancelled_write_waiting_for_the_trainer_is_withdrawn(cluster, client, raw):
    peer = raw(cluster.address)
    client.set_staleness(max_staleness=0, batch_size=2)
    try:
        before = client.status()
        if before.admission_limit > before.admitted:  # fill the window
            client.reserve(before.admission_limit - before.admitted, timeout=0)
        admitted = client.status().admitted
        status = park(peer, Reserve(rid=1, count=2, timeout=math.inf))
        assert [w.kind for w in status.waiting] == ["reserve"]
        assert park(peer, Cancel(rid=2, of=1)).waiting == []
        client.set_version(client.status().version + 1)  # would have admitted the withdrawn one
        assert client.status().admitted == admitted  # ...which took no share of the window
        assert peer.ask(wire.encode(StatusRequest(rid=3))).rid == 3  # and got no reply
    finally:
        client.set_staleness(None)


def test_a_put_larger_than_the_staleness_window_waits_for_the_trainer(cluster, partition):
    async def main():
        async with tqueue.AsyncClient(cluster.address) as producer, tqueue.AsyncClient(cluster.address) as trainer:
            await trainer.set_staleness(max_staleness=0, batch_size=2)  # a window of 2 samples
            try:
                status = await trainer.status()
                count = max(0, status.admission_limit - status.admitted) + 3
                blocked = await parked(producer.put(partition, {"x": torch.arange(count)}, timeout=60))
                status = await producer.status()  # same connection as the put: ordered after it
                assert [w.kind for w in status.waiting] == ["put"]
                await trainer.set_version(status.version + 2)  # the limit grows by 4 >= 3
                meta = await asyncio.wait_for(blocked, 10)
                assert len(meta) == count
            finally:
                await trainer.set_staleness(None)

    asyncio.run(main())


def test_puts_of_later_steps_never_hold_back_the_step_the_trainer_reads(cluster, client, partition):
    """The four-put repro of the demo's deadlock: with the bound counted across steps, puts
    to steps 1 and 2 spent the window and the trainer's own step 0 could not fill. Per step,
    step v + k + 1 waits for the trainer and step v is never held back."""
    before = client.status()
    v = before.version
    step = [f"{partition}/step-{v + i}" for i in range(3)]
    client.set_staleness(max_staleness=1, batch_size=4)
    try:
        for name in (step[0], step[1], step[1]):
            client.put(name, {"x": torch.arange(2)}, version=v, timeout=0)
        with pytest.raises(WaitTimeoutError, match=rf"partition '{step[2]}' \(step {v + 2}\) wait for the trainer.*admitted at version {v + 1}"):
            client.put(step[2], {"x": torch.arange(2)}, version=v, timeout=0)
        client.put(step[0], {"x": torch.arange(2)}, version=v, timeout=0)  # the trainer's step: at once
        meta = client.get_meta(step[0], ["x"], 4, task="actor", timeout=5)
        assert sorted(meta.indexes) == [0, 1, 2, 3]
        client.ack(meta)
        client.set_version(v + 1)
        client.put(step[2], {"x": torch.arange(2)}, version=v + 1, timeout=0)  # admitted now
        assert client.status().admitted == before.admitted  # steps take no share of the running total
    finally:
        client.set_staleness(None)


def test_a_partition_named_freely_takes_its_step_from_create_partition(cluster, client, partition):
    v = client.status().version
    client.create_partition(partition, step=v + 2)
    client.set_staleness(max_staleness=0, batch_size=1)
    try:
        with pytest.raises(WaitTimeoutError, match=rf"'{partition}' \(step {v + 2}\).*admitted at version {v + 2}"):
            client.put(partition, {"x": torch.arange(3)}, timeout=0)
        client.set_version(v + 2)
        client.put(partition, {"x": torch.arange(3)}, timeout=0)
    finally:
        client.set_staleness(None)
    with pytest.raises(tqueue.errors.InvalidArgumentError, match="step must be >= 0"):
        client.create_partition(partition + "-bad", step=-3)


def test_a_put_a_parked_consumer_needs_is_admitted_past_the_running_total(cluster, partition):
    """Partitions without a step share AReaL's running total; a consumer parked on one of
    them still gets the puts it waits for, whatever other partitions spent."""

    async def main():
        async with tqueue.AsyncClient(cluster.address) as producer, tqueue.AsyncClient(cluster.address) as trainer:
            await trainer.set_staleness(max_staleness=0, batch_size=2)
            try:
                status = await trainer.status()
                room = status.admission_limit - status.admitted
                if room > 0:
                    await producer.put(partition + "-other", {"x": torch.arange(room)}, timeout=0)
                blocked = await parked(producer.put(partition, {"x": torch.arange(2)}, timeout=60))
                status = await producer.status()  # same connection as the put: ordered after it
                assert [w.kind for w in status.waiting] == ["put"]
                meta = await trainer.get_meta(partition, ["x"], 2, task="actor", timeout=10)
                assert sorted(meta.indexes) == [0, 1]
                assert len(await asyncio.wait_for(blocked, 10)) == 2
            finally:
                await trainer.set_staleness(None)

    asyncio.run(main())


class _Warnings(logging.Handler):
    """Collects the client's warnings of a wait that may never end; ``event`` is set once
    ``want`` of them arrived."""

    def __init__(self, want: int) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []
        self.want = want
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "may never end" not in record.getMessage():
            return
        self.texts.append(record.getMessage())
        if len(self.texts) >= self.want:
            self.event.set()


def test_a_put_waiting_for_memory_and_a_read_waiting_for_it_are_both_warned(partition):
    """The put waits for memory, the read waits for the put: each caller is told (a Notice
    on its parked request, logged as a warning by the async and the blocking client alike),
    and both go on when memory is freed."""
    warnings = _Warnings(want=2)
    logger = logging.getLogger("tqueue")
    logger.addHandler(warnings)
    storage = {"capacity_bytes": 4 << 20}
    try:
        with tqueue.LocalCluster(num_storage_units=1, storage=storage, controller={"cycle_notice": 0.3}) as cluster:
            with tqueue.Client(cluster.address) as trainer:
                got: list = []
                reader = threading.Thread(
                    target=lambda: got.append(trainer.get_meta(partition, ["x"], 8, task="actor", timeout=60))
                )

                async def main():
                    async with tqueue.AsyncClient(cluster.address) as producer:
                        await producer.put(f"{partition}-held", mib(3))
                        blocked = await parked(producer.put(partition, mib(2), timeout=60))
                        assert [w.kind for w in (await producer.status()).waiting] == ["put"]
                        reader.start()
                        assert await asyncio.to_thread(warnings.event.wait, 20)
                        await producer.clear(f"{partition}-held")
                        return await asyncio.wait_for(blocked, 10)

                meta = asyncio.run(main())
                reader.join(10)
                assert len(meta) == 8 and len(got) == 1 and sorted(got[0].indexes) == list(range(8))
    finally:
        logger.removeHandler(warnings)
    assert len(warnings.texts) == 2
    for text in warnings.texts:
        assert f"a wait that may never end: get_meta of task(s) ['actor'] on partition '{partition}'" in text
        assert "fits on no storage unit" in text
