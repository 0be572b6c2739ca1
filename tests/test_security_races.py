"""Root's file operations in a directory a user controls, raced by that user (docs/security.md,
"Root in a user's directory").

The case that broke: a root job whose files lie in a directory an unprivileged user owns.  That
user loops ``renameat2(RENAME_EXCHANGE)``, swapping the directory with a symlink to a root-only
directory, while root restores the job (puts files back, cuts them back, moves entries aside,
and criu opens them).  Root must never touch anything outside the job's tree: the root-only
directory is compared, entry by entry (bytes, owner, mode, times, inode), before and after.
The victim's files have the names and the sizes of the job's, so that criu's size check would
not stop a swap on its own.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from revenant.agent.files import workdir, workdir_restore
from revenant.agent.storage.epochs import FILES_DIR, LISTING, WORKDIR_FILES, EpochError, FilesChanged, JobFile, JobFiles, \
    Manifest
from revenant.agent.files.aside import move_aside
from revenant.agent.files.jobfiles import HELD, scan_workdir
from revenant.agent.files.jobfiles_restore import apply, plan, swapped
from revenant.agent.processes.jobprocs import held_paths
from revenant.agent.running.launcher import reset_stamp
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

RACE_S = 10.0
NOBODY = pwd.getpwnam("nobody")
# A python nobody may run (the suite's own may live under root's home).
PYTHON = shutil.which("python3", path="/usr/bin:/bin")

# Swaps ``a`` (a real directory) and ``b`` (a symlink to the victim) until ``seconds`` have passed,
# then leaves ``a`` the real directory again; prints how many swaps it made.  A restore moves
# aside what appeared after the epoch, the link included: it makes the link again.
ATTACKER = textwrap.dedent("""
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    a, b, target, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    swap = lambda: libc.renameat2(-100, a.encode(), -100, b.encode(), 2)  # AT_FDCWD, RENAME_EXCHANGE
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        if swap() == 0:
            n += 1
        elif not os.path.lexists(b):
            try:
                os.symlink(target, b)
            except OSError:
                pass
    if os.path.islink(a):
        swap()
    print(n)
""")


def as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY.pw_gid)
    os.setuid(NOBODY.pw_uid)


def attack(deeper: Path, victim: Path, seconds: float) -> subprocess.Popen:
    evil = deeper.with_name("evil")
    subprocess.run([PYTHON, "-c", f"import os; os.symlink({str(victim)!r}, {str(evil)!r})"],
                   preexec_fn=as_nobody, check=True, timeout=30)
    return subprocess.Popen([PYTHON, "-c", ATTACKER, str(deeper), str(evil), str(victim), str(seconds)],
                            preexec_fn=as_nobody, stdout=subprocess.PIPE, text=True)


def snapshot(tree: Path) -> dict[str, tuple]:
    """Everything about every entry of ``tree`` that root could change."""
    seen = {}
    for root, dirs, files in os.walk(tree):
        for name in [".", *dirs, *files]:
            path = os.path.join(root, name)
            st = os.lstat(path)
            data = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else b""
            seen[os.path.relpath(path, tree)] = (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size,
                                                 st.st_mtime_ns, st.st_ctime_ns, data)
    return seen


@pytest.fixture
def stage():
    """/var/tmp/<base>: ``wd`` (root's 0755: a valid root job's workdir), ``wd/sub`` and
    ``wd/sub/deeper`` (nobody's), and ``victim`` (root's 0700), which nobody can name through a
    symlink of theirs but never read or write."""
    base = Path(tempfile.mkdtemp(prefix="revenant-race-", dir="/var/tmp"))
    base.chmod(0o755)
    deeper = base / "wd" / "sub" / "deeper"
    deeper.mkdir(parents=True)
    (base / "wd").chmod(0o755)
    for d in (deeper.parent, deeper):
        os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
        d.chmod(0o755)
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    (victim / "precious").write_text("root's own\n")
    yield base, deeper, victim
    shutil.rmtree(base, ignore_errors=True)


def _entry(path: Path, **kw) -> JobFile:
    st = path.stat()
    return JobFile(size=st.st_size, mode=st.st_mode & 0o7777, uid=st.st_uid, gid=st.st_gid, ino=st.st_ino,
                   mtime_ns=st.st_mtime_ns, **kw)


@pytest.mark.criu
def test_put_back_cut_back_and_move_aside_touch_nothing_outside_the_job_while_the_user_swaps(stage):
    base, deeper, victim = stage
    wd = base / "wd"
    state, log, closed = deeper / "state.bin", deeper / "log.txt", deeper / "closed.db"
    state.write_bytes(b"S" * 4096)
    log.write_bytes(b"line\n" * 100)
    closed.write_bytes(b"C" * 4096)  # closed at the dump: in the working directory's snapshot
    epoch = base / "storage" / "jobs" / "1" / "epochs" / "3"
    (epoch / FILES_DIR).mkdir(parents=True)
    shutil.copyfile(state, epoch / FILES_DIR / "0")
    shutil.copyfile(closed, epoch / FILES_DIR / "w0")
    held_now = frozenset({str(state), str(log)})
    (epoch / LISTING).write_bytes(msgspec.json.encode(scan_workdir(str(wd), 1000, held_now)))
    st = closed.stat()
    snap = {"sub/deeper/closed.db": workdir.WorkdirFile(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, 0o644,
                                                        st.st_uid, st.st_gid, f"{FILES_DIR}/w0")}
    (epoch / WORKDIR_FILES).write_bytes(msgspec.json.encode(snap))
    m = Manifest(job="1", epoch=3, generation=1, node="n", created_at=0, criu_version="4.2.1", kernel="k",
                 workdir=str(wd), job_files={str(state): _entry(state, copy=f"{FILES_DIR}/0"),
                                             str(log): _entry(log, append=True)}, workdir_files=1)
    (victim / "state.bin").write_bytes(b"V" * 4096)  # the same names and sizes as the job's files
    (victim / "log.txt").write_bytes(b"root\n" * 100)
    (victim / "closed.db").write_bytes(b"R" * 4096)
    before = snapshot(victim)
    held = os.open(deeper, os.O_RDONLY | os.O_DIRECTORY)  # the real directory, wherever it is renamed to
    attacker = attack(deeper, victim, RACE_S)
    done = put = refused = 0
    try:
        end = time.monotonic() + RACE_S
        i = 0
        while time.monotonic() < end:
            i += 1
            # The job ran on after the epoch: its files changed, and it made a new one.
            fd = os.open("log.txt", os.O_WRONLY | os.O_APPEND, dir_fd=held)
            os.write(fd, b"after\n")
            os.close(fd)
            for name in ("state.bin", "closed.db"):
                fd = os.open(name, os.O_WRONLY, dir_fd=held)
                os.write(fd, b"X" * 100)
                os.close(fd)
            os.close(os.open(f"new-{i}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=held))
            try:
                apply(plan(m, epoch))
                move_aside(m, epoch, 1000, snapshot=frozenset(snap))
                done += 1
            except (FilesChanged, EpochError):
                refused += 1
            try:  # the working directory's files, put back through the same swaps
                workdir_restore.apply(workdir_restore.plan(m, epoch, snap, JobFiles(base / "storage", "1")))
                put += 1
            except EpochError:
                refused += 1
    finally:
        swaps = int(attacker.communicate(timeout=RACE_S + 30)[0])
        os.close(held)
    assert snapshot(victim) == before
    assert swaps > 1000 and done + refused > 100, (swaps, done, refused)
    assert done > 0 and put > 0, f"{done} restores and {put} workdir put-backs got through against {swaps} swaps"
    print(f"{swaps} swaps; {done} put-backs and moves done, {put} of the workdir, {refused} refused")


JOB = textwrap.dedent("""
    import os, sys, time
    d = sys.argv[1]
    state = open(os.path.join(d, "state.bin"), "r+b")
    log = open(os.path.join(d, "log.txt"), "ab", buffering=0)
    i = 0
    while True:
        i += 1
        state.seek(0); state.write(b"%08d" % i); state.flush()
        log.write(b"step %08d\\n" % i)
        print(i, flush=True)
        time.sleep(0.02)
""")


@pytest.mark.criu
async def test_a_restore_with_real_criu_touches_nothing_outside_the_job_while_the_user_swaps(stage, supervisors):
    base, deeper, victim = stage
    wd = base / "wd"
    (deeper / "state.bin").write_bytes(b"S" * 4096)
    (deeper / "log.txt").write_bytes(b"")
    (wd / "job.py").write_text(JOB)
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[sys.executable, str(wd / "job.py"), str(deeper)], workdir=str(wd), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    while out.read_bytes().count(b"\n") < 20:
        await asyncio.sleep(0.05)
    await sup.checkpoint("1", 1, stop=True)  # vacate
    files = JobFiles(sup.storage, "1")
    m = files.read_manifest(files.committed()[-1])
    sizes = {Path(p).name: e.size for p, e in m.job_files.items() if p.startswith(str(deeper))}
    assert set(sizes) == {"state.bin", "log.txt"}, m.job_files
    for name, size in sizes.items():  # what criu's size check would let through
        (victim / name).write_bytes(b"R" * size)
    before = snapshot(victim)
    attacker = attack(deeper, victim, RACE_S)
    generation, restored, refused = 1, 0, []
    try:
        end = time.monotonic() + RACE_S
        while time.monotonic() < end:
            generation += 1
            try:
                await sup.restore(spec, generation)
            except RevenantError as exc:
                refused.append(str(exc))
                continue
            restored += 1
            await asyncio.sleep(0.2)
            await sup.kill("1", generation)
            await asyncio.wait_for(sup.jobs["1"].exited.wait(), 30) if "1" in sup.jobs else None
    finally:
        swaps = int(attacker.communicate(timeout=RACE_S + 60)[0])
    assert snapshot(victim) == before, (restored, refused[:3])
    assert swaps > 100 and restored + len(refused) >= 3, (swaps, restored, refused[:3])
    print(f"{swaps} swaps; {restored} restores, {len(refused)} refused: {sorted(set(refused))[:5]}")


@pytest.mark.unit
def test_the_users_cannot_touch_the_stamp_and_a_link_in_its_place_is_never_followed(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    files.dir.mkdir(parents=True)
    files.dir.chmod(0o711)  # as the launcher leaves it (agent/running/jobuser.py own_job_files)
    (tmp_path).chmod(0o755)
    (tmp_path / "storage").chmod(0o755)
    (tmp_path / "storage" / "jobs").chmod(0o755)
    files.stamp.write_text("")
    target = tmp_path / "roots-file"
    target.write_text("root's\n")
    before = target.stat().st_mtime_ns
    tried = subprocess.run([PYTHON, "-c", "import os, sys; os.unlink(sys.argv[1])", str(files.stamp)],
                           preexec_fn=as_nobody, capture_output=True, text=True, timeout=30)
    assert tried.returncode != 0 and "PermissionError" in tried.stderr
    files.stamp.unlink()
    files.stamp.symlink_to(target)  # had it been possible
    time.sleep(0.01)
    reset_stamp(files.stamp)
    assert target.stat().st_mtime_ns == before and target.read_text() == "root's\n"


# A job that holds a file open read-only and another mapped shared and writable (its descriptor
# closed): criu opens both again by path when it restores.
HOLDER = textwrap.dedent("""
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    d = sys.argv[1]
    ro = os.open(os.path.join(d, "ro.txt"), os.O_RDONLY)
    fd = os.open(os.path.join(d, "mm.txt"), os.O_RDWR)
    addr = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_READ | PROT_WRITE, MAP_SHARED
    os.close(fd)  # mapped only: no descriptor of it is left
    i = 0
    while True:
        i += 1
        print(i, os.pread(ro, 8, 0), ctypes.string_at(addr, 8), flush=True)
        if os.path.exists(os.path.join(sys.argv[2], "write")):
            ctypes.memmove(addr, b"PWNED!", 6)
        time.sleep(0.05)
""")


@pytest.mark.criu
@pytest.mark.parametrize("workdir_max_bytes", [0, 1024**2])
async def test_a_file_held_read_only_or_mapped_through_a_swapped_directory_is_never_handed_to_the_job(
        stage, supervisors, workdir_max_bytes):
    """The user swaps, before the restore, a directory of theirs in which the job holds a file
    open read-only and maps another, for a link to a root-only directory with files of the same
    names, sizes and modes.  Without the check, the job would read the one and write the other.
    With the working directory's snapshot, putting its files back through the link is refused
    first; without it, criu or the agent refuses what criu opened."""
    base, deeper, victim = stage
    wd = base / "wd"
    for name, data in (("ro.txt", b"users ro data\n"), ("mm.txt", b"users mm data\n")):
        (deeper / name).write_bytes(data)
        (victim / name).write_bytes(b"ROOTS" + data[5:])
        os.chown(deeper / name, NOBODY.pw_uid, NOBODY.pw_gid)
    (wd / "holder.py").write_text(HOLDER)
    sup = supervisors("n1", storage=base / "storage", allow_root_jobs=True, workdir_max_bytes=workdir_max_bytes)
    spec = JobSpec(id="1", argv=[sys.executable, str(wd / "holder.py"), str(deeper), str(wd)], workdir=str(wd),
                   user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    while out.read_bytes().count(b"\n") < 5:
        await asyncio.sleep(0.05)
    await sup.checkpoint("1", 1, stop=True)
    before = snapshot(victim)
    moved = deeper.with_name("deeper.orig")
    # A relative link: it leads to the victim whatever root criu resolves it from.
    link = os.path.relpath(victim, deeper.parent)
    script = f"import os; os.rename({str(deeper)!r}, {str(moved)!r}); os.symlink({link!r}, {str(deeper)!r})"
    subprocess.run([PYTHON, "-c", script], preexec_fn=as_nobody, check=True, timeout=30)
    (wd / "write").touch()  # the job would write through its mapping at once
    # Refused: by criu itself when it cannot resolve the link from where it restores the job's
    # mounts, else by the agent before the job resumes (criu opened a file the job did not hold).
    with pytest.raises(RevenantError, match=r"criu opened .*victim/(ro|mm)\.txt, which is not a file the job had|"
                                            r"Can't open file .*deeper/(ro|mm)\.txt on restore" if not workdir_max_bytes
                       else r"cannot put back .*deeper/(ro|mm)\.txt: deeper on its path is a link"):
        await sup.restore(spec, 2)
    await asyncio.sleep(0.5)
    assert snapshot(victim) == before
    assert b"ROOTS" not in out.read_bytes()
    assert "1" not in sup.jobs or sup.jobs["1"].exited.is_set()


def _holder(tmp_path: Path, *files: str) -> subprocess.Popen:
    """A process, pid 1 of a PID namespace of its own as a job's init is, holding ``files`` (of
    ``tmp_path``) open: the first with O_PATH, the others read-only."""
    code = textwrap.dedent("""
        import os, sys, time
        d, first, *rest = sys.argv[1:]
        fds = [os.open(os.path.join(d, first), os.O_PATH)] + [os.open(os.path.join(d, f), os.O_RDONLY) for f in rest]
        print(*fds, flush=True)
        time.sleep(60)
    """)
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code, str(tmp_path), *files],
                            stdout=subprocess.PIPE)


def _init_of(unshare: subprocess.Popen) -> int:
    unshare.stdout.readline()  # all held now
    return psutil.Process(unshare.pid).children()[0].pid


@pytest.mark.criu
def test_a_stopped_job_holding_a_path_where_it_held_another_at_the_dump_is_caught(tmp_path):
    """The check itself, on live processes standing for a restored job.  A read-only descriptor
    and a file mapped shared and writable (no descriptor left) are each named when the epoch's
    HELD says they led elsewhere, with what held it.  A descriptor the job did not have at the
    dump passes only if it is one of criu's restorer's own (closed before the job runs).  And a path the job held at the dump in another way (O_PATH,
    which needs no right to read the file) does not let a descriptor that led elsewhere pass."""
    (tmp_path / "ro.txt").write_text("ro\n")
    (tmp_path / "mm.txt").write_text("mm\n")
    job = subprocess.Popen([sys.executable, "-c", HOLDER.replace("while True:", "while i < 2000:"),
                            str(tmp_path), str(tmp_path)], stdout=subprocess.PIPE)
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    try:
        job.stdout.readline()  # both held now
        held = held_paths(job.pid)
        assert {str(tmp_path / "ro.txt"), str(tmp_path / "mm.txt")} <= set(held.values())
        (epoch / HELD).write_bytes(msgspec.json.encode(held))
        assert swapped(job.pid, [], epoch) is None
        # A descriptor the job did not have at the dump: refused, unless it is one of criu's own
        # (its log in its scratch directory, standing in here for ro.txt's directory).
        fewer = {k: p for k, p in held.items() if not (" fd " in k and p == str(tmp_path / "ro.txt"))}
        assert len(fewer) == len(held) - 1
        (epoch / HELD).write_bytes(msgspec.json.encode(fewer))
        assert swapped(job.pid, [], epoch).startswith(f"{tmp_path / 'ro.txt'} (process ")
        assert swapped(job.pid, [], epoch, scratch=str(tmp_path)) is None
        for path in ("ro.txt", "mm.txt"):
            elsewhere = {k: (str(tmp_path / "other") if p == str(tmp_path / path) else p) for k, p in held.items()}
            (epoch / HELD).write_bytes(msgspec.json.encode(elsewhere))
            assert swapped(job.pid, [], epoch).startswith(f"{tmp_path / path} (process ")
    finally:
        job.kill()
        job.wait()
        job.stdout.close()
    (tmp_path / "key").write_text("root's secret\n")
    (tmp_path / "mine").write_text("user's own \n")
    at_dump, now = _holder(tmp_path, "key", "mine"), _holder(tmp_path, "key", "key")
    try:
        (epoch / HELD).write_bytes(msgspec.json.encode(held_paths(_init_of(at_dump))))
        assert swapped(_init_of(now), [], epoch).startswith(f"{tmp_path / 'key'} (process 1: fd ")
    finally:
        for p in (at_dump, now):
            p.kill()
            p.wait()
            p.stdout.close()
