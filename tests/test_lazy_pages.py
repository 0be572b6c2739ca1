"""agent/lazyrestore/lazy.py against real criu: a job dumped, then restored lazily through a criu
lazy-pages daemon; the daemon's verdict on complete, corrupt, killed and impossible restores."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from revenant.agent.lazyrestore.lazy import LazyPages, LazyResult
from revenant.agent.pipeline import criu
from revenant.agent.processes import procs
from revenant.agent.storage.epochs import FileEntry, Manifest, checksum_file
from revenant.common.errors import CriuError

pytestmark = pytest.mark.criu

MIB = 1024 * 1024

# SIZE_MIB of 4 KiB pages, each its index then "PATTERN!" repeated; on SIGUSR1 it checks every
# page (a page that came back as zeros, or wrong, fails) and prints OK or BAD.
JOB = r"""
import hashlib, signal, sys, time
PAGE = 4096
pages = int(sys.argv[1]) * 1024 * 1024 // PAGE
buf = bytearray(b"PATTERN!" * (PAGE // 8)) * pages
for i in range(pages):
    buf[i * PAGE:i * PAGE + 8] = i.to_bytes(8, "little")
want = hashlib.sha256(buf).hexdigest()
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
print("ready", flush=True)
while True:
    if asked:
        asked.clear()
        if hashlib.sha256(buf).hexdigest() == want:
            print("OK", flush=True)
        else:
            bad = sum(1 for i in range(pages) if buf[i * PAGE:i * PAGE + 8] != i.to_bytes(8, "little"))
            print(f"BAD {bad} pages", flush=True)
    time.sleep(0.02)
"""


def wait_for(cond, timeout: float = 60, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := cond():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def lines(path: Path) -> list[str]:
    return path.read_text().split()


class Dumped:
    """A patterned job of ``size_mib`` dumped into ``images`` (and then killed)."""

    def __init__(self, tmp: Path, size_mib: int, restored: list[int]) -> None:
        self.tmp, self.size_mib, self.restored = tmp, size_mib, restored
        self.images, self.out, self.pidfile = tmp / "images", tmp / "job.out", tmp / "restored.pid"
        self.workdir = tmp / "restore-wd"
        self.criu = criu.locate_criu()

    async def dump(self) -> None:
        script = self.tmp / "job.py"
        script.write_text(JOB)
        self.images.mkdir()
        dump_wd = self.tmp / "dump-wd"
        dump_wd.mkdir()
        action = self.tmp / "action.sh"
        action.write_text(criu.action_script([]))
        action.chmod(0o755)
        # A session of its own, stdio to a file: criu needs no --shell-job.
        with open(self.out, "ab") as out:
            job = subprocess.Popen([sys.executable, str(script), str(self.size_mib)], stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=out, start_new_session=True)
        try:
            wait_for(lambda: job.poll() is not None or "ready" in lines(self.out), what="the job to fill its memory")
            assert job.poll() is None, self.out.read_text()
            argv = criu.dump_argv(self.criu, pid=job.pid, images=self.images, workdir=dump_wd,
                                  action_script=action, leave_running=False)
            done = await procs.run(argv, 120)
            assert done.returncode == 0, criu.log_error(dump_wd / criu.DUMP_LOG, done.output)
        finally:
            job.kill()
            job.wait(30)

    def manifest(self) -> Manifest:
        files = {p.name: FileEntry(size=p.stat().st_size, checksum=checksum_file(p))
                 for p in sorted(self.images.iterdir()) if p.is_file()}
        return Manifest(job="lazy", epoch=4, generation=1, node="n1", created_at=time.time(),
                        criu_version="4.1.1", kernel=os.uname().release, files=files)

    async def restore(self, lp: LazyPages) -> int:
        """``criu restore --lazy-pages`` (same -D and -W as the daemon): the restored job's pid."""
        argv = criu.restore_argv(self.criu, images=self.images, workdir=self.workdir, pidfile=self.pidfile)
        done = await procs.run(argv + lp.restore_args, 120)
        if self.pidfile.exists():
            self.restored.append(int(self.pidfile.read_text()))
        assert done.returncode == 0, criu.log_error(self.workdir / criu.RESTORE_LOG, done.output)
        procs.signal_tree(self.restored[-1], signal.SIGCONT)  # restored stopped (--leave-stopped), as the engine does
        return self.restored[-1]


def kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:  # restored with --restore-sibling: our own child
        os.waitpid(pid, 0)
    except ChildProcessError:
        wait_for(lambda: not procs.alive(pid), 30, f"pid {pid} to die")


@pytest.fixture
async def dumped(tmp_path):
    """``await dumped(size_mib)``; every restored job and daemon is killed at the end."""
    restored: list[int] = []
    daemons: list[LazyPages] = []

    async def make(size_mib: int) -> Dumped:
        d = Dumped(tmp_path, size_mib, restored)
        await d.dump()
        return d

    make.daemons = daemons
    yield make
    for pid in restored:
        kill_and_reap(pid)
    for lp in daemons:
        await lp.abort()


async def started(dumped, d: Dumped) -> LazyPages:
    lp = await LazyPages.start(d.criu, d.images, d.workdir)
    dumped.daemons.append(lp)
    return lp


async def finished(lp: LazyPages, d: Dumped, manifest: Manifest | None = None) -> LazyResult:
    # A generous bound: finished() must never hang, whatever happened to the daemon.
    return await asyncio.wait_for(lp.finished(manifest or d.manifest(), d.images), 120)


async def test_a_lazy_restore_brings_every_page_back(dumped):
    d = await dumped(200)
    manifest = d.manifest()
    lp = await started(dumped, d)
    assert (d.workdir / "lazy-pages.socket").exists() and lp.restore_args == ["--lazy-pages"]
    pid = await d.restore(lp)
    os.kill(pid, signal.SIGUSR1)  # its check faults pages in while the daemon fills the rest
    result = await finished(lp, d, manifest)
    assert result.ok and not result.corrupt and result.error == "", result
    assert 200 * MIB <= result.bytes <= 300 * MIB
    assert result.seconds > 0
    assert lp.log_path == d.workdir / "lazy-pages.log" and "UFFD transferred pages" in lp.log_path.read_text()
    wait_for(lambda: "OK" in lines(d.out) or "BAD" in d.out.read_text(), what="the job's check")
    os.kill(pid, signal.SIGUSR1)  # and again, every page in
    wait_for(lambda: lines(d.out).count("OK") == 2 or "BAD" in d.out.read_text(), what="the job's second check")
    assert "BAD" not in d.out.read_text() and procs.alive(pid)
    await lp.abort()
    await lp.abort()  # idempotent


async def test_a_corrupt_pages_image_is_reported_without_waiting_for_the_daemon(dumped):
    d = await dumped(200)
    manifest = d.manifest()
    pages = max(d.images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    lp = await started(dumped, d)
    pid = await d.restore(lp)
    result = await finished(lp, d, manifest)
    assert not result.ok and result.corrupt, result
    assert result.error == f"epoch 4: {pages.name} fails its checksum"
    kill_and_reap(pid)  # the caller kills the job, then the daemon
    await lp.abort()
    assert not procs.alive(lp.pid)


async def test_a_killed_daemon_fails_the_restore_and_never_hangs(dumped):
    # 1 GiB: the daemon's fill takes most of a second after the restore returns (the restore
    # itself needs the daemon: its own faults are served on the way).
    d = await dumped(1024)
    lp = await started(dumped, d)
    pid = await d.restore(lp)
    os.kill(lp.pid, signal.SIGKILL)
    result = await finished(lp, d)
    assert not result.ok and not result.corrupt, result
    assert result.error == "lazy-pages was killed by signal 9"
    assert result.bytes < 1024 * MIB
    kill_and_reap(pid)


async def test_a_job_that_ends_while_its_pages_arrive_needed_no_more(dumped):
    d = await dumped(200)
    lp = await started(dumped, d)
    pid = await d.restore(lp)
    os.kill(pid, signal.SIGSTOP)  # no faults; the background fill goes on until the job is gone
    kill_and_reap(pid)
    result = await finished(lp, d)
    # Every page it touched was served (the daemon is well); the agent tells a kill on purpose
    # (the job's end) from a daemon's failure by the daemon's exit and counts, not by the job.
    assert result.ok and not result.corrupt, result


def test_the_log_judges_a_task_exited_meanwhile_complete_and_any_other_short_task_not():
    from revenant.agent.lazyrestore.lazy import judge_log

    log = ("uffd: Received PID: 7, uffd: 5\nuffd: Received PID: 8, uffd: 6\n"
           "uffd: 7-5: UFFD transferred pages: (961/52111)\nuffd: 7--5: EXIT\n"
           "uffd: 8-6: UFFD transferred pages: (10/20)\n")
    assert judge_log(log, 0)[0] == "lazy-pages ended with only 10 of 20 pages of pid 8 transferred"
    assert judge_log(log.replace("(10/20)", "(20/20)"), 0) == ("", (961 + 20) * 4096)
    assert judge_log(log, 137)[0] == "lazy-pages was killed by signal 9"  # a failed exit: never complete


def daemons_of(workdir: Path) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "lazy-pages" in child.cmdline() and str(workdir) in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("bad, why", [("missing", "it is not a directory"),
                                      ("empty", "it holds no criu images (no pstree.img)"),
                                      ("garbage", "Error (criu/")])
async def test_a_bad_images_dir_is_refused_and_leaves_no_daemon(tmp_path, bad, why):
    images, workdir = tmp_path / "images", tmp_path / "wd"
    if bad != "missing":
        images.mkdir()
    if bad == "garbage":  # criu's own complaint
        (images / "pstree.img").write_bytes(b"not an image" * 10)
    with pytest.raises(CriuError) as err:
        await LazyPages.start(criu.locate_criu(), images, workdir, timeout_s=30)
    msg = str(err.value)
    assert "\n" not in msg and str(images) in msg and why in msg, msg
    assert daemons_of(workdir) == []


async def test_a_daemon_not_ready_in_time_is_killed(tmp_path):
    # A "criu" that never says it is ready.
    fake, pidfile = tmp_path / "criu", tmp_path / "fake.pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 600\n")
    fake.chmod(0o755)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "pstree.img").write_bytes(b"")
    with pytest.raises(CriuError, match=r"not ready after 0\.5 s"):
        await LazyPages.start(str(fake), tmp_path / "images", tmp_path / "wd", timeout_s=0.5)
    assert not procs.alive(int(pidfile.read_text()))


AGENT = """import asyncio, sys
from pathlib import Path
from revenant.agent.lazyrestore.lazy import LazyPages
from revenant.agent.pipeline import criu

async def main():
    lp = await LazyPages.start(criu.locate_criu(), Path(sys.argv[1]), Path(sys.argv[2]))
    if sys.argv[3] == "handed-over":
        lp.handed_over()
    print(lp.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("when", ["before the job runs", "once it runs"])
async def test_a_daemon_never_outlives_an_agent_that_dies_before_its_job_runs(dumped, when):
    """The agent killed with a lazy restore's daemon started: before the restore has the job
    running, nobody will ever connect, and the daemon goes with the agent (its tether,
    agent/lazyrestore/tether.py); once the job runs, the daemon outlives the agent, serving it."""
    d = await dumped(8)
    with subprocess.Popen([sys.executable, "-c", AGENT, str(d.images), str(d.workdir),
                           "handed-over" if when == "once it runs" else "waiting"],
                          stdout=subprocess.PIPE, text=True) as agent:
        try:
            tether = psutil.Process(int(agent.stdout.readline()))
            [daemon] = tether.children()
            assert "lazy-pages" in daemon.cmdline()
            agent.kill()
            agent.wait(30)
            if when == "before the job runs":
                gone, _ = psutil.wait_procs([tether, daemon], timeout=5)
                assert len(gone) == 2, "the daemon outlived its agent"
            else:
                time.sleep(1)
                assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE
                tether.kill()  # killing the tether kills the daemon
                gone, _ = psutil.wait_procs([daemon], timeout=5)
                assert gone == [daemon]
        finally:
            agent.kill()
