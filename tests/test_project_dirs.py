"""Jobs in real project directories (issue 44): a dataset the job only reads is never copied, jobs
sharing a checkout with its ``.venv`` checkpoint together, and nothing outside a job ever waits
on the agent for long.  Real criu, two supervisors (nodes) on one shared storage."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from conftest import REPO
from helpers import until
from test_job_files import exact_steps, node_dies, steps_in
from revenant.agent.files import workdir as wdsnap
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

JOB = REPO / "tests" / "jobs" / "projectjob.py"
sys.path.insert(0, str(JOB.parent))
from projectjob import CHUNK, chunk  # noqa: E402
from test_job_user import PYTHON, test_user, workdir  # noqa: E402,F401 - fixtures: an unprivileged user, its workdir


# A shell job printing "step N" every 50 ms.
TICKER = "i=0; while :; do echo \"step $i\"; i=$((i+1)); sleep 0.05; done"


def write_dataset(path: Path, size: int) -> None:
    """``size`` bytes of real content (every chunk written: never a sparse file)."""
    base = random.Random(7).randbytes(CHUNK)
    with open(path, "wb") as f:
        for i in range(size // CHUNK):
            f.write(chunk(i, base))
        f.flush()
        os.fsync(f.fileno())


def older_than_the_job(*paths: Path) -> None:
    """Wait until ``paths`` were last changed before a job started now would count as started
    (agent/files/workdir.py SINCE_MARGIN_NS)."""
    margin = wdsnap.SINCE_MARGIN_NS / 1e9 + 0.5
    newest = max(p.stat().st_ctime for p in paths)
    time.sleep(max(0.0, newest + margin - time.time()))


class Outsider:
    """A process that is no part of any job, opening files of the project in a loop, timed; and
    every process of the host but the jobs' (whose opens of their own files wait for their copy)
    watched for state D in fanotify (waiting on a gate): ``in_d``, those seen waiting for more than
    a second on end (an outsider may wait half a second)."""

    def __init__(self, paths: list[Path], jobs: Callable[[], list[int]] = lambda: []) -> None:
        self.paths = paths
        self.jobs = jobs  # the jobs' root pids
        self.longest = 0.0
        self.opens = 0
        self.in_d: set[str] = set()
        self._stop = threading.Event()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _OUTSIDER, *map(str, paths)], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        since: dict[str, float] = {}  # pid: when first seen waiting, this time
        while not self._stop.wait(0.05):
            now, seen = time.monotonic(), set()
            ours = set()
            for root in self.jobs():
                try:
                    ours |= {root, *(c.pid for c in psutil.Process(root).children(recursive=True))}
                except psutil.Error:
                    continue
            for d in Path("/proc").iterdir():
                if not d.name.isdigit() or int(d.name) in ours:
                    continue
                try:
                    text = (d / "stat").read_text()
                    state = text[text.rindex(")") + 2]
                    if state == "D" and "fanotify" in (d / "wchan").read_text():
                        seen.add(d.name)
                        if now - since.setdefault(d.name, now) > 1.0:
                            self.in_d.add(f"{d.name} {text[:text.rindex(')') + 1]}")
                except (OSError, ValueError):
                    continue
            since = {pid: t for pid, t in since.items() if pid in seen}

    def stop(self) -> None:
        self._stop.set()
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        self._thread.join(10)
        waits = [float(x) for x in out.split()]
        self.opens = len(waits)
        self.longest = max(waits, default=0.0)


_OUTSIDER = """
import os, random, signal, sys, time
paths = sys.argv[1:]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
try:
    while True:
        p = random.choice(paths)
        t = time.monotonic()
        try:
            os.close(os.open(p, os.O_RDONLY))
        except OSError:
            pass
        print(time.monotonic() - t, flush=True)
        time.sleep(0.005)
finally:
    sys.stdout.flush()
"""


@pytest.mark.timeout(600)
async def test_a_5_gib_dataset_the_job_only_reads_is_recorded_never_copied_and_comes_back(tmp_path, supervisors):
    n1, n2 = supervisors("n1"), supervisors("n2")
    wd = tmp_path / "project"
    wd.mkdir()
    data = wd / "data.bin"
    write_dataset(data, 5 * 2**30)
    (wd / "config.json").write_text('{"lr": 0.001}\n')
    older_than_the_job(data, wd / "config.json")
    spec = JobSpec(id="1", argv=[sys.executable, str(JOB), "a", "100000", "0.02", str(data)], workdir=str(wd),
                   max_epochs=2)
    await n1.start(spec, 1)
    files = JobFiles(n1.storage, "1")
    out = files.output
    await until(lambda: steps_in(out) >= 10)
    done = await n1.checkpoint("1", 1, stop=False)
    m = files.read_manifest(done.epoch.n)
    assert m.workdir_since_ns > 0 and m.workdir_recorded >= 5 * 2**30, (m.workdir_since_ns, m.workdir_recorded)
    assert m.workdir_copied <= 16 * 2**20, m.workdir_copied  # the state file; never the dataset
    stored = sum(p.stat().st_blocks * 512 for p in files.epoch_dir(done.epoch.n).rglob("*") if p.is_file())
    assert stored < 256 * 2**20, stored  # criu's images of a small process, and the state file
    snap = wdsnap.read(files.epoch_dir(done.epoch.n))
    assert snap["data.bin"].copy == "", snap
    # The state file is copied: by the snapshot, or as one of the job's own files where the freeze
    # caught the job between its open and its close (agent/files/jobfiles.py).
    state = str(wd / "state-a.json")
    assert (snap["state-a.json"].copy if "state-a.json" in snap else m.job_files[state].copy), (snap, m.job_files)
    at = steps_in(out)
    await until(lambda: steps_in(out) >= at + 10)
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())
    restored = await n2.restore(spec, 2)  # a failover: the state put back, the dataset as it is
    assert restored.epoch.n == done.epoch.n
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 10)
    await n2.kill("1", 2, "test over")
    assert "INCONSISTENT" not in out.read_text()
    exact_steps(out)


def left_waiting() -> list[str]:
    """Processes waiting on a fanotify gate now and still a second later: stuck."""
    def waiting() -> dict[str, str]:
        found = {}
        for d in Path("/proc").iterdir():
            try:
                text = (d / "stat").read_text()
                if text[text.rindex(")") + 2] == "D" and "fanotify" in (d / "wchan").read_text():
                    found[d.name] = text[:text.rindex(")") + 1]
            except (OSError, ValueError):
                continue
        return found
    first = waiting()
    time.sleep(1)
    return sorted(v for k, v in waiting().items() if k in first)


def _project(tmp_path: Path) -> Path:
    """A copy of this repository with its virtual environment, as users run jobs from."""
    project = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(project)], check=True, timeout=300)
    subprocess.run(["cp", "-a", str(REPO / ".venv"), str(project / ".venv")], check=True, timeout=600)
    return project


@pytest.mark.timeout(1500)
async def test_eight_jobs_sharing_a_project_directory_checkpoint_together_and_nothing_else_waits(
        tmp_path, supervisors):
    n1 = supervisors("n1")
    project = _project(tmp_path)
    entries = sum(len(d) + len(f) for _, d, f in os.walk(project))
    assert entries > 10_000, entries
    # Every regular file of the checkout, __pycache__ aside: what each epoch must record, not copy.
    checkout = sum(p.stat().st_size for p in project.rglob("*")
                   if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts)
    older_than_the_job(*(p for p in project.rglob("*") if not p.is_symlink()))  # the newest copied last
    names = [f"j{i}" for i in range(8)]
    specs = {n: JobSpec(id=n, argv=[sys.executable, str(JOB), n, "1000000", "0.02"], workdir=str(project),
                        max_epochs=2) for n in names}
    for spec in specs.values():
        await n1.start(spec, 1)
    await until(lambda: all(steps_in(JobFiles(n1.storage, n).output) >= 5 for n in names))
    sources = [p for p in project.rglob("*.py") if ".venv" in p.parts][:300]
    outsider = Outsider(sources + [project / f"state-{n}.json" for n in names],
                        lambda: [n1.jobs[n].pid for n in names if n in n1.jobs])
    failed: list[str] = []
    epochs: dict[str, int] = {}
    try:
        for round_no in range(25):
            began = time.monotonic()
            results = await asyncio.gather(*(n1.checkpoint(n, 1, stop=False) for n in names), return_exceptions=True)
            for n, r in zip(names, results):
                if isinstance(r, BaseException):
                    failed.append(f"{n}: {r}")
                else:
                    epochs[n] = r.epoch.n
            print(f"round {round_no}: {time.monotonic() - began:.1f} s", flush=True)
    finally:
        outsider.stop()
    assert failed == [], failed[:5]
    assert outsider.opens > 100 and outsider.longest <= 1.0, (outsider.opens, outsider.longest)
    assert not outsider.in_d, sorted(outsider.in_d)[:5]
    assert left_waiting() == []
    # Each epoch stored the job's own state, never the checkout.
    for n in names:
        m = JobFiles(n1.storage, n).read_manifest(epochs[n])
        assert m.workdir_copied <= 64 * 2**10 and m.workdir_recorded == checkout, (n, m.workdir_copied,
                                                                                 m.workdir_recorded, checkout)
    at = {n: steps_in(JobFiles(n1.storage, n).output) for n in names}
    await until(lambda: all(steps_in(JobFiles(n1.storage, n).output) >= at[n] + 5 for n in names))
    for name in names:
        text = JobFiles(n1.storage, name).output.read_text()
        assert "INCONSISTENT" not in text, (name, text[-300:])


def _as_user(user, *argv: str, **kw) -> subprocess.CompletedProcess:
    def drop() -> None:
        os.setgroups([])
        os.setgid(user.gid)
        os.setuid(user.uid)
    return subprocess.run(list(argv), preexec_fn=drop, timeout=60, **kw)


_ATTACKER = """
import os, sys, time
grow, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    os.truncate(grow, 100 * 2**30)  # by path: no open for a gate to see
    time.sleep(0.002)
    os.truncate(grow, 3)
    time.sleep(0.002)
"""


@pytest.mark.timeout(600)
async def test_a_user_can_neither_hang_other_processes_nor_fill_the_storage_nor_exhaust_descriptors(
        tmp_path, supervisors, test_user, workdir):
    """Issue 44's attacks, as an unprivileged user against everyone else: a file of theirs linked
    into their workdir from elsewhere, a gated file grown to 100 GiB by path after the freeze, and
    15,000 files written in their workdir while another job checkpoints."""
    import resource
    n1 = supervisors("n1", allow_root_jobs=False)
    elsewhere = Path(workdir.parent) / f"{workdir.name}-elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, test_user.uid, test_user.gid)
    try:
        shared = elsewhere / "shared.txt"
        _as_user(test_user, "/bin/sh", "-c", f"echo shared > {shared} && chmod 644 {shared} && "
                 f"ln {shared} {workdir}/linked.txt", check=True)
        many = workdir / "many"
        spec = JobSpec(id="1", user=test_user.name, workdir=str(workdir), argv=[
            "/bin/sh", "-c", "echo abc > grow.bin; echo more >> linked.txt; mkdir -p many; i=0; "
            "while [ $i -lt 15000 ]; do echo $i > many/f$i; i=$((i+1)); done; "
            "i=0; while :; do echo \"step $i\"; i=$((i+1)); sleep 0.05; done"])
        other_wd = Path(workdir.parent) / f"{workdir.name}-other"
        other_wd.mkdir()
        os.chown(other_wd, test_user.uid, test_user.gid)
        other = JobSpec(id="2", user=test_user.name, workdir=str(other_wd), argv=[
            "/bin/sh", "-c", "i=0; while :; do echo $i > state; echo \"step $i\"; i=$((i+1)); sleep 0.05; done"])
        await n1.start(spec, 1)
        await n1.start(other, 1)
        out = JobFiles(n1.storage, "1").output
        await until(lambda: steps_in(out) >= 5, timeout=120)
        assert len(list(many.iterdir())) == 15_000
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, soft[1]))  # as the unit's default
        # A round without the attacker first: what 15,000 files cost the agent anyway.
        results = list(await asyncio.gather(n1.checkpoint("1", 1, stop=False), n1.checkpoint("2", 1, stop=False),
                                            return_exceptions=True))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        attacker = subprocess.Popen([PYTHON, "-c", _ATTACKER, str(workdir / "grow.bin"), "60"],
                                    preexec_fn=lambda: (os.setgid(test_user.gid), os.setuid(test_user.uid)))
        outsider = Outsider([shared, workdir / "grow.bin", workdir / "linked.txt", other_wd / "state"],
                            lambda: [n1.jobs[j].pid for j in ("1", "2") if j in n1.jobs])
        try:
            for _ in range(4):
                results += await asyncio.gather(n1.checkpoint("1", 1, stop=False), n1.checkpoint("2", 1, stop=False),
                                                return_exceptions=True)
        finally:
            outsider.stop()
            attacker.kill()
            attacker.wait()
            resource.setrlimit(resource.RLIMIT_NOFILE, soft)
        # The other job's checkpoints never fail for this user's files.
        others = results[1::2]
        assert all(not isinstance(r, BaseException) for r in others), others
        # The attacker's own fail at most with its own file's change, never a descriptor shortage.
        for r in results[0::2]:
            if isinstance(r, BaseException):
                assert "Too many open files" not in str(r) and ("grow.bin" in str(r) or "budget" in str(r)
                                                                  or "workdir_snapshot_max_bytes" in str(r)), r
        assert outsider.opens > 50 and outsider.longest <= 1.0, (outsider.opens, outsider.longest)
        assert not outsider.in_d, sorted(outsider.in_d)[:5]
        assert left_waiting() == []
        biggest = max((p.stat().st_blocks * 512 for p in n1.storage.rglob("*") if p.is_file()), default=0)
        assert biggest < 64 * 2**20, biggest  # no 100 GiB of zeros, nor any GiB of them
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 * 1024  # KiB: the grown file's cost
        assert n1.jobs["1"].pid and not n1.jobs["1"].exited.is_set()
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
        shutil.rmtree(Path(workdir.parent) / f"{workdir.name}-other", ignore_errors=True)


@pytest.mark.timeout(300)
async def test_one_users_burst_of_checkpoints_does_not_queue_another_users_behind_it(
        tmp_path, supervisors, test_user, workdir):
    """One slot on the node: root's four checkpoints asked first, then the user's one.  The slot
    goes round the users, so the user's dump is the second or third, never the fifth."""
    n1 = supervisors("n1", concurrency=1)
    for n in range(1, 5):
        wd = tmp_path / f"root{n}"
        wd.mkdir()
        await n1.start(JobSpec(id=str(n), workdir=str(wd), argv=["/bin/sh", "-c", TICKER]), 1)
    await n1.start(JobSpec(id="5", user=test_user.name, workdir=str(workdir), argv=["/bin/sh", "-c", TICKER]), 1)
    for n in range(1, 6):
        await until(lambda: steps_in(JobFiles(n1.storage, str(n)).output) >= 3, timeout=60)
    done: list[str] = []

    async def checkpoint(job: str) -> None:
        await n1.checkpoint(job, 1, stop=False)
        done.append(job)

    tasks = []
    for job in ("1", "2", "3", "4", "5"):  # in this order, each queued before the next is asked
        tasks.append(asyncio.create_task(checkpoint(job)))
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert sorted(done) == ["1", "2", "3", "4", "5"]
    assert done.index("5") <= 2, done  # first come: it would be the last


@pytest.mark.timeout(300)
async def test_a_checkpoint_a_job_fails_itself_counts_against_the_job_not_the_nodes_health(tmp_path, supervisors):
    """A job over its working directory's budget fails its own checkpoints: the node's count of
    failed checkpoints (its health: YELLOW, then RED) stays 0.  A job criu cannot dump (it holds
    /dev/fuse) counts, as before."""
    n1 = supervisors("n1", workdir_max_bytes=1 << 20)
    wd = tmp_path / "over"
    wd.mkdir()
    await n1.start(JobSpec(id="1", workdir=str(wd), argv=["/bin/sh", "-c", "head -c 4194304 /dev/urandom > big.bin; "
                                                         + TICKER]), 1)
    await until(lambda: steps_in(JobFiles(n1.storage, "1").output) >= 3, timeout=60)
    for _ in range(3):
        with pytest.raises(Exception, match="workdir_snapshot_max_bytes"):
            await n1.checkpoint("1", 1, stop=False)
    assert n1.checkpoint_failures == 0
    fuse = tmp_path / "fuse"
    fuse.mkdir()
    await n1.start(JobSpec(id="2", workdir=str(fuse), argv=[sys.executable, "-c", "import os, time\n"
                                                            "fd = os.open('/dev/fuse', os.O_RDWR)\n"
                                                            "while True:\n    print('step 1', flush=True)\n"
                                                            "    time.sleep(0.05)\n"]), 1)
    await until(lambda: steps_in(JobFiles(n1.storage, "2").output) >= 3, timeout=60)
    with pytest.raises(Exception, match="criu dump failed"):
        await n1.checkpoint("2", 1, stop=False)
    assert n1.checkpoint_failures == 1
