"""The job supervisor and its checkpoint engine in-process, on real job processes with real
CRIU: failures (criu failing or missing, a full disk) that must leave the job unharmed, the dead
man's switch, restores that are killed or superseded, and drains."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER, running
from revenant.agent.checkpointing.engine import Engine, NoSpace
from revenant.agent.pipeline.criu import locate_criu
from revenant.agent.pipeline.steps import BaseStep
from revenant.agent.processes import procs
from revenant.agent.processes.exits import SWITCH_EXIT
from revenant.agent.running.jobs import JobNotRunning, Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import CriuError, RevenantError, StaleGeneration
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu


@pytest.fixture
async def supervisor_factory(tmp_path):
    procs.become_subreaper()
    made: list[Supervisor] = []

    def make(storage: Path, criu: str | None = None, staging: Path | None = None) -> tuple[Supervisor, list]:
        events: list = []
        engine = None
        if criu is not None:
            engine = Engine(criu_path=criu, criu_version="4.1.1", node="n1", storage=storage,
                            work_roots=[tmp_path / "work"], staging=staging)
        # No agent renews a lease here: a long switch timeout keeps the dead man's switch quiet.
        sup = Supervisor("n1", storage, engine, lambda subject, msg: events.append(msg),
                         criu_error="criu not found: set criu_path, REVENANT_CRIU, or put criu on PATH",
                         switch_timeout_s=3600)
        made.append(sup)
        return sup, events

    yield make
    for sup in made:
        await sup.shutdown()  # kills any job a failed test left running


async def start_counter(sup: Supervisor, job: str = "1") -> JobSpec:
    spec = JobSpec(id=job, argv=[sys.executable, str(COUNTER), "100000", "0.02"], workdir="/")
    await sup.start(spec, 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and JobFiles(sup.storage, job).output.stat().st_size < 30:
        await asyncio.sleep(0.05)
    return spec


async def growing(sup: Supervisor, job: str) -> bool:
    out = JobFiles(sup.storage, job).output
    before = out.stat().st_size
    await asyncio.sleep(0.3)
    return out.stat().st_size > before


async def test_failing_criu_reports_its_error_keeps_its_log_and_the_job_runs_on(tmp_path, supervisor_factory):
    fake = tmp_path / "criu"
    fake.write_text('#!/bin/sh\necho "(00.01) Error (criu/util.c:1): rlimit: Can\'t setup RLIMIT_NOFILE"\n'
                    'echo "(00.02) Error (criu/cr-dump.c:2120): Dumping FAILED."\n'
                    'echo "(00.03) Error (criu/util.c:1): rlimit: Can\'t setup RLIMIT_NOFILE"\nexit 1\n')
    fake.chmod(0o755)
    sup, events = supervisor_factory(tmp_path / "storage", str(fake))
    await start_counter(sup)
    for stop in (False, True):
        with pytest.raises(CriuError) as info:
            await sup.checkpoint("1", 1, stop=stop)
        # Nothing more specific was said: the closing line, and where the run's log is kept.
        error, kept = str(info.value).split(" (criu log: ")
        assert error == "criu dump failed: (00.02) Error (criu/cr-dump.c:2120): Dumping FAILED."
        assert Path(kept.rstrip(")")).parent == JobFiles(sup.storage, "1").dir / "criu-logs"
        assert "Dumping FAILED." in Path(kept.rstrip(")")).read_text()
        assert await growing(sup, "1")
    assert JobFiles(sup.storage, "1").committed() == []
    assert [e.kind for e in events if e.__class__.__name__ == "EpochEvent"] == ["failed", "failed"]
    assert sup.checkpoint_failures == 2


class FenceDuringTheDump(BaseStep):
    """The node self-fences while criu holds the job (after the dump, before the commit)."""

    name = "fence"

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    async def after_dump(self, ctx) -> None:
        self.sup.freeze_all("self-fenced: test")


def states(sup: Supervisor, job: str) -> set[str]:
    """The states of the job's own processes (below its init)."""
    return {status for _, status in running(sup.jobs[job].pid, str(COUNTER))}


async def test_an_image_dumped_while_the_job_froze_is_discarded_and_the_job_stays_frozen(tmp_path, supervisor_factory):
    criu = locate_criu()
    sup, events = supervisor_factory(tmp_path / "storage", criu)
    await start_counter(sup)
    first = await sup.checkpoint("1", 1, stop=False)
    assert sup.engine is not None
    sup.engine.steps.append(FenceDuringTheDump(sup))
    for stop in (False, True):  # a checkpoint, then a vacate (criu leaves that one stopped)
        with pytest.raises(RevenantError, match="discarded: job 1 was frozen during the dump") as info:
            await sup.checkpoint("1", 1, stop=stop)
        assert info.value.code == "frozen" and info.value.retriable
        # Not committed (it would restore the job stopped), the older epoch kept, and the
        # failed vacate does not resume a job its node froze: only the leader's word thaws it.
        assert JobFiles(sup.storage, "1").committed() == [first.epoch.n]
        await asyncio.sleep(0.3)
        assert states(sup, "1") == {psutil.STATUS_STOPPED} and not await growing(sup, "1")
        assert sup.thaw("1", 1) and await growing(sup, "1")
    assert [e.kind for e in events if e.__class__.__name__ == "EpochEvent"] == ["created", "failed", "failed"]


async def test_missing_criu_is_one_clear_error(tmp_path, supervisor_factory):
    sup, _ = supervisor_factory(tmp_path / "storage", None)
    await start_counter(sup)
    with pytest.raises(CriuError, match="cannot checkpoint on n1: criu not found"):
        await sup.checkpoint("1", 1, stop=False)
    assert await growing(sup, "1")
    with pytest.raises(JobNotRunning, match="job 9 is not running on n1"):
        await sup.checkpoint("9", 1, stop=False)


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
async def test_full_disk_fails_the_checkpoint_cleanly(tmp_path, supervisor_factory, small_disk, staged):
    sup, events = supervisor_factory(small_disk, locate_criu(), staging=tmp_path / "staging" if staged else None)
    await start_counter(sup)
    first = await sup.checkpoint("1", 1, stop=False)
    files = JobFiles(small_disk, "1")
    assert files.committed() == [1]
    # Fill the disk, leaving less than one checkpoint's worth.
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - first.epoch.bytes // 4))
    for stop in (False, True):
        with pytest.raises(NoSpace, match="no space left writing the checkpoint of 1"):
            await sup.checkpoint("1", 1, stop=stop)
        assert "1" in sup.jobs and await growing(sup, "1")
    # The older epoch is untouched and still verifies; nothing half-written is listed or left.
    assert files.committed() == [1]
    files.verify(1)
    assert sorted(p.name for p in files.epochs_dir.iterdir()) == [".lock", "1"]  # nothing half-written left
    pid = sup.jobs["1"].pid
    assert psutil.Process(pid).status() != psutil.STATUS_STOPPED


async def test_dead_mans_switch_freezes_then_kills_a_job_nobody_resets(tmp_path):
    procs.become_subreaper()
    events: list = []
    sup = Supervisor("n1", tmp_path / "storage", None, lambda subject, msg: events.append(msg), switch_timeout_s=0.8,
                     max_frozen_s=2.0)
    try:
        spec = JobSpec(id="1", argv=[sys.executable, str(COUNTER), "100000", "0.02"], workdir="/")
        spec2 = JobSpec(id="2", argv=[sys.executable, str(COUNTER), "100000", "0.02"], workdir="/")
        await sup.start(spec, 1)
        await sup.start(spec2, 1)
        rt1 = sup.jobs["1"]
        # Job 2's stamp is kept fresh, as a live agent holding its lease does; job 1's is not:
        # its switch freezes it first (its output stops), and kills it max_frozen_s later.
        output = JobFiles(sup.storage, "1").output
        frozen_size = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not rt1.exited.is_set():
            os.utime(JobFiles(sup.storage, "2").stamp)
            job = {status for _, status in running(rt1.pid, str(COUNTER))}
            if frozen_size is None and job == {psutil.STATUS_STOPPED}:
                frozen_size = output.stat().st_size
            await asyncio.sleep(0.1)
        assert frozen_size is not None, "the switch never froze the job"
        assert rt1.exited.is_set() and rt1.exit_code == SWITCH_EXIT
        assert output.stat().st_size == frozen_size  # not one byte while frozen
        # Nobody reset job 1's switch (no agent holds a lease here): its node stopped it, so it is
        # reported evicted, for the coordinator to restore it from its last epoch.
        evicted = [e for e in events if getattr(e, "kind", "") == "evicted"]
        assert [e.job for e in evicted] == ["1"] and "dead man's switch fired" in evicted[0].reason
        assert "2" in sup.jobs and await growing(sup, "2")
    finally:
        await sup.shutdown()


def slow_criu(tmp_path: Path, delay_s: float, verb: str = "restore") -> str:
    """Real criu, with every ``verb`` (restore or dump) held back ``delay_s`` (a large image, a busy node)."""
    wrapper = tmp_path / f"slow-criu-{verb}"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = {verb} ] && sleep {delay_s}\nexec {locate_criu()} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


async def vacated_counter(sup: Supervisor) -> JobSpec:
    spec = await start_counter(sup)
    await sup.checkpoint("1", 1, stop=True)
    assert "1" not in sup.jobs
    return spec


def copies_running(storage: Path, job: str) -> int:
    """Processes of the job's command line (a restored job is its own namespace's init + the job)."""
    count = 0
    for p in psutil.Process().children(recursive=True):  # this test's jobs, not another run's on the machine
        try:
            line = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and str(COUNTER) in line and "revenant-init" not in line:
                count += 1
        except psutil.Error:
            pass  # gone meanwhile
    return count


async def test_a_kill_during_a_restore_kills_what_the_restore_brings_up(tmp_path, supervisor_factory):
    sup, events = supervisor_factory(tmp_path / "storage", slow_criu(tmp_path, 1.0))
    spec = await vacated_counter(sup)
    restore = asyncio.create_task(sup.restore(spec, 2))
    await asyncio.sleep(0.3)
    assert "1" not in sup.jobs and sup.launching["1"].generation == 2
    reply = await sup.kill("1", 2, "the coordinator gave up on it")
    assert reply.generation == 2
    with pytest.raises(StaleGeneration, match="was the coordinator gave up on it while it started"):
        await restore
    assert "1" not in sup.jobs and not sup.launching
    assert copies_running(sup.storage, "1") == 0


async def test_a_newer_generation_supersedes_a_restore_still_in_flight(tmp_path, supervisor_factory):
    sup, events = supervisor_factory(tmp_path / "storage", slow_criu(tmp_path, 1.0))
    spec = await vacated_counter(sup)
    older = asyncio.create_task(sup.restore(spec, 2))
    await asyncio.sleep(0.3)
    with pytest.raises(RevenantError, match="generation 2 is already starting"):
        await sup.restore(spec, 2)  # the same generation twice: refused, the first goes on
    newer = await sup.restore(spec, 3)
    with pytest.raises(StaleGeneration, match="superseded by generation 3"):
        await older
    assert newer.generation == 3 and sup.jobs["1"].generation == 3
    assert psutil.pid_exists(newer.pid) and copies_running(sup.storage, "1") == 1
    # An older generation never replaces a newer one, running or starting.
    with pytest.raises(RevenantError, match="generation 3 already runs"):
        await sup.start(spec, 2)


async def test_a_drain_past_its_budget_still_reports_the_job_evicted(tmp_path, supervisor_factory):
    sup, events = supervisor_factory(tmp_path / "storage", slow_criu(tmp_path, 5.0, verb="dump"))
    await start_counter(sup)
    rt = sup.jobs["1"]
    await sup.drain(0.5, "node n1 is shutting down")  # the dump cannot finish in time
    assert not rt.vacating and "1" in sup.jobs and await growing(sup, "1")  # resumed, unharmed
    await sup.shutdown("node n1 is shutting down")
    evicted = [e for e in events if getattr(e, "kind", "") == "evicted"]
    assert [(e.job, e.epoch) for e in evicted] == [("1", None)] and "shutting down" in evicted[0].reason
    assert [e.kind for e in events if e.__class__.__name__ == "JobEvent"] == ["started", "evicted"]


async def test_a_drain_reports_the_epoch_it_stopped_the_job_at(tmp_path, supervisor_factory):
    sup, events = supervisor_factory(tmp_path / "storage", locate_criu())
    await start_counter(sup)
    await sup.drain(30, "node n1 is shutting down")
    assert "1" not in sup.jobs
    evicted = [e for e in events if getattr(e, "kind", "") == "evicted"]
    assert [(e.job, e.epoch) for e in evicted] == [("1", 1)]
    assert "checkpointed" in evicted[0].reason
    assert [e.kind for e in events if e.__class__.__name__ == "JobEvent"] == ["started", "evicted"]
