"""Background tasks with an owner (tqueue/_tasks.py): held until they end, a failure logged
once with the task's name, cancelled and awaited at close; a fan-out that fails whole."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tqueue._tasks import Tasks, all_or_none


def test_a_failed_background_task_is_logged_with_its_name_and_forgotten(caplog):
    async def main() -> int:
        tasks = Tasks("unit 3")

        async def fail() -> None:
            raise ValueError("disk on fire")

        task = tasks.start(fail(), "flush the log")
        with caplog.at_level(logging.ERROR, logger="tqueue._tasks"):
            await asyncio.wait([task])
            await asyncio.sleep(0)  # done callbacks run on the next loop turn
        return len(tasks)

    assert asyncio.run(main()) == 0
    (record,) = caplog.records
    assert record.getMessage() == "unit 3: flush the log failed"
    assert isinstance(record.exc_info[1], ValueError)


def test_close_cancels_what_is_left_and_waits_for_it():
    async def main() -> list[str]:
        tasks = Tasks("controller")
        events: list[str] = []
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                events.append("cleaned up")

        tasks.start(forever(), "wait")
        await started.wait()
        await tasks.close()
        events.append(f"closed with {len(tasks)} left")
        with pytest.raises(RuntimeError, match="controller is closed"):
            tasks.start(forever())
        return events

    assert asyncio.run(main()) == ["cleaned up", "closed with 0 left"]


def test_a_fan_out_that_fails_cancels_the_rest_before_raising():
    async def main() -> list[str]:
        events: list[str] = []
        started = asyncio.Event()

        async def slow() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                events.append("sibling cancelled")
                raise

        async def failing() -> None:
            await started.wait()
            raise KeyError("unit 1")

        with pytest.raises(KeyError, match="unit 1"):
            await all_or_none(slow(), failing())
        events.append("raised")
        return events

    assert asyncio.run(main()) == ["sibling cancelled", "raised"]


def test_a_fan_out_returns_results_in_order():
    async def value(v: int) -> int:
        await asyncio.sleep(0)
        return v

    assert asyncio.run(all_or_none(value(1), value(2), value(3))) == [1, 2, 3]
