"""The one service lifecycle (common/serving/service.py): start, stop, failures, async with."""

from __future__ import annotations

import asyncio

import pytest

from revenant.common.serving.service import Service, ServiceStatus

pytestmark = pytest.mark.unit


class Probe(Service):
    def __init__(self, *, fail_start: bool = False, fail_background: bool = False, slow_start_s: float = 0.0):
        super().__init__()
        self.log: list[str] = []
        self.fail_start, self.fail_background, self.slow_start_s = fail_start, fail_background, slow_start_s

    async def _start(self) -> None:
        self.log.append("start")
        await asyncio.sleep(self.slow_start_s)
        if self.fail_start:
            raise ValueError("cannot start")

        async def background() -> None:
            if self.fail_background:
                await asyncio.sleep(0.01)
                raise KeyError("background failed")
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.log.append("background cancelled")
                raise

        self.spawn(background(), "background")

    async def _shutdown(self) -> None:
        self.log.append(f"shutdown ({self.status.value})")


async def test_stop_before_run_is_harmless_and_run_returns_at_once():
    s = Probe()
    s.stop()
    s.stop()
    await asyncio.wait_for(s.run(), 1)
    assert s.status is ServiceStatus.STOPPED and s.log == []


async def test_async_with_runs_until_the_block_ends_then_shuts_down_after_background_tasks():
    async with Probe() as s:
        assert s.status is ServiceStatus.RUNNING and s.ready.is_set()
    assert s.log == ["start", "background cancelled", "shutdown (stopping)"]
    assert s.status is ServiceStatus.STOPPED and not s.ready.is_set()
    s.stop()  # after the end: harmless


async def test_a_failed_start_shuts_down_what_it_started_and_raises_its_error():
    s = Probe(fail_start=True)
    with pytest.raises(ValueError, match="cannot start"):
        async with s:
            pass
    assert s.log == ["start", "shutdown (stopping)"] and s.status is ServiceStatus.STOPPED


async def test_a_failed_background_task_stops_the_service_with_its_own_error():
    s = Probe(fail_background=True)
    with pytest.raises(KeyError, match="background failed"):
        await asyncio.wait_for(s.run(), 2)
    assert s.log[-1] == "shutdown (stopping)" and s.status is ServiceStatus.STOPPED


async def test_a_service_runs_once():
    s = Probe()
    s.stop()
    await s.run()
    with pytest.raises(RuntimeError, match="runs once"):
        await s.run()


async def test_stop_during_start_takes_effect_once_started():
    s = Probe(slow_start_s=0.05)
    task = asyncio.create_task(s.run())
    await asyncio.sleep(0.01)
    assert s.status is ServiceStatus.STARTING
    s.stop()
    await asyncio.wait_for(task, 2)
    assert s.log[0] == "start" and s.log[-1] == "shutdown (stopping)" and s.status is ServiceStatus.STOPPED


async def test_cancelling_async_with_while_starting_leaves_nothing_running():
    s = Probe(slow_start_s=0.2)

    async def enter() -> None:
        async with s:
            await asyncio.sleep(3600)

    task = asyncio.create_task(enter())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.status is ServiceStatus.STOPPED and s.log[-1] == "shutdown (stopping)"


async def test_spawn_outside_a_run_is_refused():
    s = Probe()

    async def nothing() -> None:
        pass

    with pytest.raises(RuntimeError, match="not running"):
        s.spawn(nothing(), "late")


async def test_a_background_task_that_loses_its_cancellation_is_cancelled_again(caplog):
    """Python 3.11's wait_for returns what it awaited when that finished as the cancellation came:
    a loop around it carries on. The stop cancels it again rather than waiting for ever."""

    class Swallower(Service):
        def __init__(self) -> None:
            super().__init__()
            self.lost = 0

        async def _start(self) -> None:
            async def loop() -> None:
                while True:
                    try:
                        await asyncio.sleep(3600)
                    except asyncio.CancelledError:
                        if self.lost:
                            raise
                        self.lost += 1  # the first one lost, as that wait_for would lose it

            self.spawn(loop(), "swallower")

    s = Swallower()
    async with s:
        pass
    assert s.status is ServiceStatus.STOPPED and s.lost == 1
    assert "task swallower still running after its cancellation" in caplog.text
