"""Fencing by freezing on real job processes: the agent's self-fence stops a job (SIGSTOP) and
only the leader's word thaws it, with the same pid and nothing lost; a frozen job is never
checkpointed; one frozen past max_frozen_s is killed and reported evicted."""

from __future__ import annotations

import asyncio
import sys
import time

import psutil
import pytest

from conftest import COUNTER, running
from revenant.agent.processes import procs
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu  # real job processes in their own PID namespaces


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job_states(sup: Supervisor, job: str) -> set[str]:
    """The states of the job's own processes (not its init's, nor the init's passing children)."""
    return {status for _, status in running(sup.jobs[job].pid, str(COUNTER))}


async def lines(sup: Supervisor, job: str) -> list[str]:
    return JobFiles(sup.storage, job).output.read_text().splitlines()


async def started(tmp_path, clock=None):
    procs.become_subreaper()
    events: list = []
    sup = Supervisor("n1", tmp_path / "storage", None, lambda subject, msg: events.append(msg),
                     switch_timeout_s=3600, max_frozen_s=600, clock=clock or time.monotonic)
    await sup.start(JobSpec(id="1", argv=[sys.executable, str(COUNTER), "100000", "0.02"], workdir="/"), 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(await lines(sup, "1")) < 5:
        await asyncio.sleep(0.05)
    return sup, events


async def test_a_frozen_job_does_nothing_and_thaws_with_its_pid_and_nothing_lost(tmp_path):
    sup, events = await started(tmp_path)
    try:
        pid = sup.jobs["1"].pid
        assert sup.freeze_all("self-fenced: test") == ["1"]
        await asyncio.sleep(0.3)
        assert job_states(sup, "1") == {psutil.STATUS_STOPPED}
        before = await lines(sup, "1")
        await asyncio.sleep(1.0)
        assert await lines(sup, "1") == before  # frozen: not a line written
        with pytest.raises(RevenantError, match="frozen") as refused:
            await sup.checkpoint("1", 1, stop=False)
        assert refused.value.code == "frozen"
        assert not sup.thaw("1", 2)  # another generation: no
        assert sup.thaw("1", 1)
        await asyncio.sleep(0.5)
        after = await lines(sup, "1")
        assert sup.jobs["1"].pid == pid and len(after) > len(before)
        # The counter goes on where it stopped: consecutive, no line lost or repeated.
        numbers = [int(line.split()[1]) for line in after]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert not [e for e in events if e.kind in ("exited", "killed", "evicted")]
    finally:
        await sup.shutdown()


async def test_a_thaw_asked_for_before_a_later_fence_does_nothing(tmp_path):
    sup, _ = await started(tmp_path)
    try:
        sup.freeze_all("self-fenced: test")
        asked = sup.fences
        sup.freeze_all("self-fenced again")  # while the leader's answer was on its way
        assert not sup.thaw("1", 1, asked)
        await asyncio.sleep(0.3)
        assert job_states(sup, "1") == {psutil.STATUS_STOPPED} and sup.jobs["1"].frozen_at is not None
        assert sup.thaw("1", 1, sup.fences)  # an answer to the fence in force
        await asyncio.sleep(0.3)
        assert psutil.STATUS_STOPPED not in job_states(sup, "1")
    finally:
        await sup.shutdown()


async def test_a_job_frozen_past_max_frozen_is_killed_and_reported_evicted(tmp_path):
    clock = Clock()
    sup, events = await started(tmp_path, clock)
    try:
        sup.freeze_all("self-fenced: test")
        await sup.expire_frozen(600)
        assert "1" in sup.jobs  # not yet
        clock.now += 601
        await sup.expire_frozen(600)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "1" in sup.jobs:
            await asyncio.sleep(0.05)
        evicted = [e for e in events if e.kind == "evicted"]
        assert [e.job for e in evicted] == ["1"] and "max_frozen_s" in evicted[0].reason
    finally:
        await sup.shutdown()
