"""Cancel and signal on the node, with real job processes in their PID namespaces: a signal
reaches the job's own program (its pid is the one a start reports, not the init's) or every
process of it; a cancel's signal lets the job end cleanly within its grace, and SIGKILL ends one
that will not; a start or restore that arrives after its kill never runs."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from revenant.agent.processes import procs
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import JobNotRunning, RevenantError, StaleGeneration
from revenant.messages import JobEvent, JobSpec

pytestmark = pytest.mark.criu  # real job processes in their own PID namespaces

SIGNALLED = Path(__file__).resolve().parent / "jobs" / "signalled.py"


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def output(sup: Supervisor, job: str) -> str:
    return JobFiles(sup.storage, job).output.read_text()


@pytest.fixture
async def sup(tmp_path):
    procs.become_subreaper()
    events: list = []
    s = Supervisor("n1", tmp_path / "storage", None, lambda subject, msg: events.append(msg), switch_timeout_s=3600)
    s.events = events
    yield s
    await s.shutdown()


async def start(sup: Supervisor, job: str, *args: str, generation: int = 1):
    reply = await sup.start(JobSpec(id=job, argv=[sys.executable, str(SIGNALLED), *args], workdir="/"), generation)
    await until(lambda: "program: started" in output(sup, job))
    return reply


async def test_a_signal_reaches_the_program_whose_pid_the_start_reports_or_every_process(sup):
    reply = await start(sup, "1")
    program = psutil.Process(reply.program_pid)
    assert reply.program_pid != reply.pid and program.ppid() == reply.pid
    assert str(SIGNALLED) in program.cmdline()
    assert procs.program_pid(reply.pid) == reply.program_pid  # the init's helpers come and go: never them
    sent = sup.signal("1", 1, signal.SIGUSR1)
    assert sent.signalled == [reply.program_pid]
    await until(lambda: "program: saved at step" in output(sup, "1"))
    assert "worker: USR1" not in output(sup, "1")
    every = sup.signal("1", 1, signal.SIGUSR1, every=True)
    assert reply.program_pid in every.signalled and len(every.signalled) >= 2 and reply.pid not in every.signalled
    await until(lambda: "worker: USR1" in output(sup, "1"))
    with pytest.raises(StaleGeneration):
        sup.signal("1", 2, signal.SIGUSR1)
    with pytest.raises(JobNotRunning):
        sup.signal("2", 1, signal.SIGUSR1)


async def test_a_cancels_signal_lets_the_job_end_cleanly_within_its_grace(sup):
    reply = await start(sup, "1")
    began = time.monotonic()
    await sup.kill("1", 1, "cancelled by admin", signal.SIGTERM, 30.0)
    assert time.monotonic() - began < 10  # it ended on TERM, long before the grace ran out
    assert "program: bye" in output(sup, "1") and not psutil.pid_exists(reply.program_pid)
    ended = [e for e in sup.events if isinstance(e, JobEvent) and e.kind in ("killed", "exited")]
    assert [(e.kind, e.reason) for e in ended] == [("killed", "cancelled by admin")]


async def test_a_job_that_ignores_the_cancels_signal_is_killed_after_its_grace(sup):
    reply = await start(sup, "1", "ignore-term")
    began = time.monotonic()
    await sup.kill("1", 1, "cancelled by admin", signal.SIGTERM, 0.5)
    assert time.monotonic() - began >= 0.5
    assert "program: TERM ignored" in output(sup, "1") and "worker: TERM" in output(sup, "1")
    assert "1" not in sup.jobs and not psutil.pid_exists(reply.program_pid)


async def test_a_start_that_arrives_after_its_kill_never_runs(sup):
    with pytest.raises(JobNotRunning):
        await sup.kill("1", 2, "cancelled by admin")
    for generation in (1, 2):
        with pytest.raises(StaleGeneration, match="was killed on n1 before it started"):
            await sup.start(JobSpec(id="1", argv=["sleep", "100"], workdir="/"), generation)
    assert "1" not in sup.jobs
    await start(sup, "1", generation=3)  # a newer generation (a restart) runs


async def test_a_job_being_checkpointed_is_not_signalled_and_a_cancel_kills_it_at_once(sup):
    reply = await start(sup, "1")
    rt = sup.jobs["1"]
    async with rt.lock:  # as a checkpoint holds it: a signal now would be saved in the epoch
        with pytest.raises(RevenantError, match="job 1 is being checkpointed on n1; signal it once that ends") as busy:
            sup.signal("1", 1, signal.SIGUSR1)
        assert busy.value.code == "busy" and busy.value.retriable
        began = time.monotonic()
        await sup.kill("1", 1, "cancelled by admin", signal.SIGTERM, 30.0)
        assert time.monotonic() - began < 10  # no grace: killed at once
    assert "program: bye" not in output(sup, "1") and not psutil.pid_exists(reply.program_pid)


async def test_a_launch_waiting_behind_another_is_refused_once_its_generation_is_killed(sup):
    from revenant.agent.running.runtime import Launch

    earlier = Launch(1)
    sup.launching["1"] = earlier  # a restore of generation 1 still in flight
    later = asyncio.create_task(sup.start(JobSpec(id="1", argv=["sleep", "100"], workdir="/"), 2))
    await asyncio.sleep(0.05)  # generation 2 waits for it
    killing = asyncio.create_task(sup.kill("1", 2, "cancelled by admin"))
    await asyncio.sleep(0.05)
    del sup.launching["1"]
    earlier.done.set()
    await killing
    with pytest.raises(StaleGeneration, match="generation 2 was killed on n1 before it started"):
        await later
    assert "1" not in sup.jobs
