"""Checkpoints of jobs that share a working directory, dumped at once, with real criu through the
supervisor and its engine: they never collide on criu's parasite proc mountpoint.

criu's parasite, in each job's namespace init, mounts a proc of its own at ``proc.crtools``
relative to the init's working directory (the host's /proc is not its PID namespace's).  With the
init working in the job's workdir, two jobs from one directory dumped at once failed now and then
with "Can't create a directory (-17)"; the init now works in the job's own directory."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER
from revenant.agent.pipeline.criu import PARASITE_PROC_DIR
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import CriuError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

JOBS = 4


@pytest.fixture
def sup(supervisors):
    """Jobs without a mount namespace of their own (no private scratch): they see the host's /proc,
    the case where criu's parasite mounts a proc of its own at ``proc.crtools`` (a job with a mount
    namespace gets a /proc of its own, agent/running/launcher.py)."""
    return supervisors("n1", concurrency=JOBS, scratch={})  # every dump of a round at once


async def start(sup: Supervisor, workdir: Path, n: int = JOBS) -> list[JobSpec]:
    """``n`` counter jobs, all in ``workdir`` (what a user submitting from one directory gets)."""
    specs = [JobSpec(id=str(i + 1), argv=[sys.executable, str(COUNTER), "1000000", "0.02"], workdir=str(workdir))
             for i in range(n)]
    for spec in specs:
        await sup.start(spec, 1)
    for spec in specs:
        await until(lambda: JobFiles(sup.storage, spec.id).output.stat().st_size > 60)
    return specs


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def chain_ok(output: bytes) -> bool:
    """The counter's lines 0, 1, 2, ... each hashed over all before it: none lost or doubled."""
    h = hashlib.sha256()
    for i, line in enumerate(output.decode().splitlines()):
        h.update(str(i).encode())
        if line != f"line {i} {h.hexdigest()[:16]}":
            return False
    return True


def the_job(init_pid: int) -> psutil.Process:
    """The job itself, among the namespace init's children (its switch also runs sleep, stat...)."""
    return next(p for p in psutil.Process(init_pid).children() if str(COUNTER) in _cmdline(p))


def _cmdline(proc: psutil.Process) -> list[str]:
    """The command line, or nothing for a child that ended meanwhile (a switch's sleep, a zombie)."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


async def test_four_jobs_in_one_workdir_survive_20_rounds_of_concurrent_dumps_and_restore(tmp_path, sup):
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    specs = await start(sup, workdir)
    for spec in specs:
        rt = sup.jobs[spec.id]
        # The init works in the job's own directory; the job in its workdir.
        assert psutil.Process(rt.pid).cwd() == str(rt.files.dir) and the_job(rt.pid).cwd() == str(workdir)
    failures = []
    for _ in range(20):
        results = await asyncio.gather(*(sup.checkpoint(s.id, 1, stop=False) for s in specs), return_exceptions=True)
        failures += [str(r) for r in results if isinstance(r, BaseException)]
    assert failures == []
    assert not (workdir / PARASITE_PROC_DIR).exists() and os.listdir(workdir) == []
    assert [len(JobFiles(sup.storage, s.id).committed()) for s in specs] == [1] * JOBS  # retention: max_epochs 1

    # Vacated and restored all at once: our own children again, in the same directories.
    await asyncio.gather(*(sup.checkpoint(s.id, 1, stop=True) for s in specs))
    await asyncio.gather(*(sup.restore(s, 2) for s in specs))
    for spec in specs:
        rt = sup.jobs[spec.id]
        assert psutil.Process(rt.pid).ppid() == os.getpid()
        assert psutil.Process(rt.pid).cwd() == str(rt.files.dir) and the_job(rt.pid).cwd() == str(workdir)
        size = rt.files.output.stat().st_size
        await until(lambda: rt.files.output.stat().st_size > size + 60)
        assert chain_ok(rt.files.output.read_bytes())
    results = await asyncio.gather(*(sup.checkpoint(s.id, 2, stop=False) for s in specs), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []


async def test_what_another_job_s_dump_holds_in_the_shared_workdir_does_not_fail_a_dump(tmp_path, sup):
    """Deterministically what a concurrent dump of another job in the same workdir did: hold
    ``proc.crtools`` there for a moment.  Before, this failed the dump with EEXIST every time."""
    workdir = tmp_path / "workdir"
    (workdir / PARASITE_PROC_DIR).mkdir(parents=True)
    [spec] = await start(sup, workdir, 1)
    reply = await sup.checkpoint(spec.id, 1, stop=False)
    assert reply.epoch is not None and reply.epoch.n == 1


async def test_a_leftover_proc_mountpoint_in_the_job_s_dir_is_removed_mounted_or_not(tmp_path, sup):
    """A criu killed mid-dump leaves the parasite's mountpoint (maybe still mounted) in the job's
    directory, which would fail every later dump of the job."""
    [spec] = await start(sup, tmp_path, 1)
    stale = JobFiles(sup.storage, spec.id).dir / PARASITE_PROC_DIR
    stale.mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(stale)], check=True)
    assert os.path.ismount(stale)
    assert (await sup.checkpoint(spec.id, 1, stop=False)).epoch.n == 1
    assert not stale.exists()
    stale.mkdir()
    assert (await sup.checkpoint(spec.id, 1, stop=False)).epoch.n == 2
    assert not stale.exists()


async def test_a_failed_dump_shows_the_parasite_s_error_and_keeps_criu_s_log(tmp_path, sup):
    """A ``proc.crtools`` the agent cannot remove (a file) makes the parasite fail for real: the user
    sees its specific error, not criu's closing "Dumping FAILED.", and the log is kept."""
    [spec] = await start(sup, tmp_path, 1)
    files = JobFiles(sup.storage, spec.id)
    (files.dir / PARASITE_PROC_DIR).write_text("in the way")
    with pytest.raises(CriuError) as info:
        await sup.checkpoint(spec.id, 1, stop=False)
    error, kept = str(info.value).split(" (criu log: ")
    assert error.startswith("criu dump failed: pie: ") and error.endswith(
        "Error (criu/pie/parasite.c:634): Can't create a directory (-17)")
    log = Path(kept.rstrip(")"))
    assert log.parent == files.dir / "criu-logs" and log.name.endswith("-dump-g1-n1.log")
    assert "Dumping FAILED." in log.read_text()
    size = files.output.stat().st_size
    await until(lambda: files.output.stat().st_size > size)  # the job runs on
    assert files.committed() == []
