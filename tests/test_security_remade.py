"""What criu makes again by path, as root, at a restore (docs/security.md, "Root in a user's
directory"): a unix socket bound to a name (bound again, then given its owner and mode by path),
a named FIFO, a deleted file (written again beside its old path).  criu follows links there,
so a job holding one in a directory that a user can change is refused at the dump, with one
line; in a directory only root can change, or in the job's own /tmp, it checkpoints and comes
back whole.  And the restore's check of what criu opened runs while criu still holds the job
under ptrace: nothing, not even the user's SIGCONT, runs it first."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO
from helpers import until

from revenant.agent.files import beneath
from revenant.agent.pipeline.steps import BaseStep, RestoreContext
from revenant.agent.storage.epochs import EpochError, JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

NOBODY = pwd.getpwnam("nobody")
# The jobs run with the system's python and their scripts copied next to their workdir: a job
# whose command line names a path under /tmp keeps the host's /tmp (agent/running/launcher.py), and a
# checkout (and its venv) may well lie under /tmp.
PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.fixture
def base():
    """/var/tmp/<base> (root's 0755), with ``wd`` (root's 0755) and ``wd/users`` (nobody's)."""
    base = Path(tempfile.mkdtemp(prefix="revenant-remade-", dir="/var/tmp"))
    base.chmod(0o755)
    (base / "wd" / "users").mkdir(parents=True)
    (base / "wd").chmod(0o755)
    shutil.copy(REPO / "tests" / "jobs" / "remade.py", base / "remade.py")
    os.chown(base / "wd" / "users", NOBODY.pw_uid, NOBODY.pw_gid)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def lines(out: Path) -> list[str]:
    return out.read_text().splitlines()


def ping(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        return s.recv(16)


@pytest.mark.unit
def test_a_directory_is_changeable_unless_root_owns_it_and_no_one_else_may_write_it(tmp_path):
    root_fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        tmp_path.chmod(0o755)
        (tmp_path / "a" / "b").mkdir(parents=True)
        assert beneath.changeable(str(tmp_path / "a" / "b" / "sock"), root_fd) is None
        (tmp_path / "a").chmod(0o775)
        assert beneath.changeable(str(tmp_path / "a" / "b" / "sock"), root_fd) == str(tmp_path / "a")
        (tmp_path / "a").chmod(0o1777)  # sticky: no one else moves root's b in it
        assert beneath.changeable(str(tmp_path / "a" / "b" / "sock"), root_fd) is None
        # but not as the last: an entry criu gave the user there, the user may replace
        assert beneath.changeable(str(tmp_path / "a" / "sock"), root_fd) == str(tmp_path / "a")
        (tmp_path / "a").chmod(0o755)
        os.chown(tmp_path / "a" / "b", NOBODY.pw_uid, NOBODY.pw_gid)
        assert beneath.changeable(str(tmp_path / "a" / "b" / "sock"), root_fd) == str(tmp_path / "a" / "b")
        assert beneath.changeable(str(tmp_path / "gone" / "sock"), root_fd) == str(tmp_path / "gone")
        (tmp_path / "l").symlink_to(tmp_path / "a")
        assert beneath.changeable(str(tmp_path / "l" / "b" / "sock"), root_fd) == str(tmp_path / "l")
        dev = os.stat(tmp_path / "a").st_dev  # a filesystem only the job has: nobody else reaches it
        assert beneath.changeable(str(tmp_path / "a" / "b" / "sock"), root_fd, {dev}) is None
    finally:
        os.close(root_fd)


@pytest.mark.criu
async def test_a_job_holding_a_socket_fifo_or_deleted_file_where_a_user_writes_is_refused_and_runs_on(
        base, supervisors):
    users = base / "wd" / "users"
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(base / "remade.py"), str(users)], workdir=str(base / "wd"), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 5)
    with pytest.raises(RevenantError) as refused:
        await sup.checkpoint("1", 1, stop=True)
    why = str(refused.value)
    assert f"{users} can be changed by a user other than root" in why, why
    assert len(why.splitlines()) == 1
    assert JobFiles(sup.storage, "1").committed() == []
    at = len(lines(out))
    await until(lambda: len(lines(out)) >= at + 10)  # the vacate's dump failed: the job was resumed
    assert ping(users / "sock") == b"pong\n"


# Jobs that reach the same by other ways (an independent review's): each sets up in ``d`` (the
# user's directory), then counts.
OTHER_WAYS = {
    "a deleted working directory": "os.makedirs(d + '/x/tgt'); os.chdir(d + '/x/tgt'); os.rmdir(d + '/x/tgt')",
    "a socket bound by a relative name, then a chdir away":
        "os.chdir(d); s = socket.socket(socket.AF_UNIX); s.bind('sock'); s.listen(); os.chdir('/')",
    "a socket bound to a relative name that looks abstract":
        "os.chdir(d); s = socket.socket(socket.AF_UNIX); s.bind('@x'); s.listen(); os.chdir('/')",
    "a socket bound through a link to the job's own /tmp":
        "os.symlink('/tmp', d + '/l'); s = socket.socket(socket.AF_UNIX); s.bind(d + '/l/sock'); s.listen()",
    "a deleted file in the host's /dev/shm": "f = open(d + '/gone', 'w'); os.unlink(d + '/gone')",
    "a descriptor in flight in a socket's queue":
        "a, b = socket.socketpair(); f = os.open(d + '/f', os.O_RDWR | os.O_CREAT); "
        "socket.send_fds(a, [b'x'], [f]); os.close(f)",
}
COUNT = "import os, socket, sys, time\nd = sys.argv[1]\n{setup}\nn = 0\nwhile True:\n" \
        "    n += 1\n    print(n, flush=True)\n    time.sleep(0.02)\n"


@pytest.mark.criu
@pytest.mark.parametrize("way", sorted(OTHER_WAYS))
async def test_other_ways_to_the_same_are_refused_at_the_dump_too(base, supervisors, way):
    users = base / "wd" / "users"
    if "/dev/shm" in way:  # named in the job's arguments: it keeps the host's /dev/shm
        users = Path(tempfile.mkdtemp(prefix="revenant-remade-", dir="/dev/shm")) / "users"
        users.mkdir()
        os.chown(users, NOBODY.pw_uid, NOBODY.pw_gid)
        users.parent.chmod(0o755)
    (base / "wd" / "job.py").write_text(COUNT.format(setup=OTHER_WAYS[way]))
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(base / "wd" / "job.py"), str(users)], workdir=str(base / "wd"),
                   user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 5)
    with pytest.raises(RevenantError) as refused:
        await sup.checkpoint("1", 1, stop=True)
    why = str(refused.value)
    if "in flight" in way:
        assert "descriptors in flight in a unix socket's queue (1 message(s) carrying SCM_RIGHTS)" in why, why
    else:
        assert f"can be changed by a user other than root" in why and str(users) in why, why
    assert JobFiles(sup.storage, "1").committed() == []
    at = len(lines(out))
    await until(lambda: len(lines(out)) >= at + 5)  # resumed, unharmed
    if "/dev/shm" in way:
        shutil.rmtree(users.parent, ignore_errors=True)


WATCHER = """import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
assert libc.inotify_add_watch(fd, sys.argv[1].encode(), 0x100) >= 0  # IN_CREATE
n = 0
while True:
    n += 1
    print(n, flush=True)
    time.sleep(0.02)
"""


@pytest.mark.criu
async def test_an_inotify_watch_that_criu_adds_again_through_a_swapped_directory_is_caught(base, supervisors):
    """criu adds each watch again as root, by path, following links: a directory of the user's
    swapped for a link to a root-only one would let the job watch names it may not see."""
    users, wd = base / "outside", base / "wd"  # outside the workdir: a restore moves nothing aside there
    watched, victim = users / "w", base / "victim"
    watched.mkdir(parents=True)
    for d in (users, watched):
        os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    victim.mkdir(mode=0o700)
    (wd / "watcher.py").write_text(WATCHER)
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(wd / "watcher.py"), str(watched)], workdir=str(wd), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 5)
    await sup.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in sup.jobs)
    os.rename(watched, users / "w.orig")
    os.symlink(os.path.relpath(victim, users), watched)  # relative: it leads there from criu's root too
    # Refused by criu itself where it cannot follow the link from the root it restores the job's
    # mounts in, else by the agent's check while criu still holds the job.
    with pytest.raises(RevenantError, match=r"criu opened anon_inode:inotify \S+ \(process \d+: fd \d+, "
                                            r"anon_inode:inotify \S+ at the dump\)|fsnotify: Unable to open .*/outside/w"):
        await sup.restore(spec, 2)
    os.unlink(watched)
    os.rename(users / "w.orig", watched)
    await sup.restore(spec, 3)
    at = len(lines(out))
    await until(lambda: len(lines(out)) >= at + 5)


@pytest.mark.criu
async def test_the_restoring_node_checks_those_paths_again_before_criu_runs(base, supervisors):
    """Root's at the dump, a user's on the node that restores: refused there before criu runs."""
    wd = base / "wd"
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(base / "remade.py"), str(wd / "held")], workdir=str(wd), user="root")
    (wd / "held").mkdir()
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 5)
    await sup.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in sup.jobs)
    os.chown(wd / "held", NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(RevenantError, match=rf"restore of job 1 refused: the job held a unix socket bound to "
                                            rf"{wd}/held/sock, and {wd}/held can be changed by a user other than root"):
        await sup.restore(spec, 2)
    os.chown(wd / "held", 0, 0)
    await sup.restore(spec, 3)
    at = len(lines(out))
    await until(lambda: len(lines(out)) >= at + 5)


@pytest.mark.criu
@pytest.mark.parametrize("where", ["root's directory", "the job's own /tmp"])
async def test_a_job_holding_them_where_only_root_writes_comes_back_whole(base, supervisors, where):
    held = base / "wd" if where == "root's directory" else Path("/tmp")
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    arg = str(held) if held != Path("/tmp") else "own-tmp"
    spec = JobSpec(id="1", argv=[PYTHON, str(base / "remade.py"), arg], workdir=str(base / "wd"), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 5)
    reply = await sup.checkpoint("1", 1, stop=True)
    assert reply.epoch is not None
    await until(lambda: "1" not in sup.jobs)
    at = len(lines(out))
    await sup.restore(spec, 2)
    await until(lambda: len(lines(out)) >= at + 10)
    got = lines(out)
    assert [int(ln.split()[0]) for ln in got] == list(range(1, len(got) + 1))  # one unbroken count
    assert got[-1].endswith("kept after unlink")  # the deleted file, back with its content
    if held != Path("/tmp"):
        assert stat.S_ISSOCK(os.lstat(held / "sock").st_mode) and ping(held / "sock") == b"pong\n"
        assert not [p for p in os.listdir(held) if "ghost" in p]


class _Watch(BaseStep):
    """Records, when the restore's check runs, whether criu has written its pidfile yet (it does
    so right after its post-restore action, before it gives the processes the job's credentials
    and lets them run); refuses if told."""

    name = "watch"

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.pidfile_written: list[bool] = []

    async def before_resume(self, ctx: RestoreContext) -> None:
        self.pidfile_written.append((ctx.workdir / "pid").exists())
        if self.refuse:
            raise EpochError(f"restore of job {ctx.job} refused by the watch")


@pytest.mark.criu
async def test_the_restore_check_runs_before_the_job_is_its_users_and_a_refusal_kills_it_unrun(
        tmp_path, supervisors):
    sup = supervisors("n1", allow_root_jobs=True)
    counter = REPO / "tests" / "jobs" / "counter.py"
    spec = JobSpec(id="1", argv=[sys.executable, str(counter), "100000", "0.02"], workdir=str(tmp_path))
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(lines(out)) >= 3)
    await sup.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in sup.jobs)
    at = len(lines(out))
    watch = _Watch(refuse=True)
    sup.engine.steps.append(watch)
    with pytest.raises(RevenantError, match="refused by the watch"):
        await sup.restore(spec, 2)
    assert watch.pidfile_written == [False]  # criu still held the processes as root's
    await asyncio.sleep(1.0)
    assert len(lines(out)) == at  # killed before it ever ran: not one more line
    assert "1" not in sup.jobs or sup.jobs["1"].exited.is_set()
    watch.refuse = False
    await sup.restore(spec, 3)
    await until(lambda: len(lines(out)) >= at + 3)
    assert watch.pidfile_written == [False, False]


@pytest.mark.criu
def test_the_restore_check_tells_watches_of_different_directories_apart(tmp_path):
    """The check itself, on two live watchers standing for the job at the dump and restored (each
    pid 1 of a PID namespace of its own, as a job's init is)."""
    from revenant.agent.files.jobfiles import HELD, HELD_FORMAT
    from revenant.agent.files.jobfiles_restore import swapped
    from revenant.agent.processes.jobprocs import held_paths
    import msgspec
    import subprocess

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", WATCHER,
                               str(tmp_path / d)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) for d in ("a", "b")]
    try:
        for p in procs:
            p.stdout.readline()
        init = [int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0]) for p in procs]
        (epoch / HELD).write_bytes(msgspec.json.encode({HELD_FORMAT: "2", **held_paths(init[0])}))
        assert swapped(init[0], [], epoch) is None
        why = swapped(init[1], [], epoch)
        assert why is not None and why.startswith("anon_inode:inotify "), why
        b, a = os.stat(tmp_path / "b"), os.stat(tmp_path / "a")
        assert f"{b.st_ino:x}" in why and f"{a.st_ino:x} at the dump" in why
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
