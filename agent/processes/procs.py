"""Child processes without asyncio's child watchers.

The agent is a child subreaper and restores jobs as its own children
(``criu restore --restore-sibling``), so it must reap processes that asyncio
never started.  To keep one owner for every ``waitpid``, the agent starts all
its subprocesses (criu included) with :class:`subprocess.Popen` and waits on
them through a pidfd registered with the event loop: no thread, no polling,
and no event loop blocked while criu runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import resource
import signal
import subprocess
import tempfile
from pathlib import Path
from dataclasses import dataclass

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def become_subreaper() -> None:
    """Orphans below us (restored jobs, their helpers) become our children, not init's."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


@functools.cache
def cpu_flags() -> list[str]:
    """The host's CPU flags (read once: they do not change while the agent runs)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return []
    return sorted(flags.split(":", 1)[1].split()) if flags else []


# The descriptor limit the agent was started with: what its jobs get (raise_nofile raises the agent's).
_JOB_NOFILE: tuple[int, int] | None = None


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's soft limit of open descriptors towards ``want`` (at most its hard
    limit), a margin for what the agent holds (bounded: agent/files/gate/cowgate.py MAX_GATED,
    agent/files/beneath.py Dirs.KEEP); its jobs keep the limit it had (die_with_parent).  The soft limit now."""
    global _JOB_NOFILE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _JOB_NOFILE is None:
        _JOB_NOFILE = (soft, hard)
    target = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the agent dies; the descriptor limit the agent started with."""
    prctl(PR_SET_PDEATHSIG, 9)
    if _JOB_NOFILE is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, _JOB_NOFILE)


def decode_status(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def tree_pids(root: int) -> list[int]:
    """``root`` and every process below it (empty if ``root`` is gone)."""
    try:
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


# The name a job's init runs under (its shell's $0), and what it runs besides the program, each
# for a moment (its loop, agent/running/launcher.py).
INIT_NAME = "revenant-init"
INIT_HELPERS = (("sleep", "0.2"), ("date", "+%s%3N"), ("stat", "-L", "-c", "%.3Y", "/dev/fd/3"))


def _nspid(pid: int) -> int:
    """``pid`` as its own PID namespace numbers it."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def program_pid(init: int) -> int:
    """The job's own program: the child of its ``init`` that is not one of the init's helpers
    (:data:`INIT_HELPERS`), the one its namespace numbered first (a process the init adopted was
    forked after it); 0 if there is none (the init not running yet, the program not forked yet, or
    ended)."""
    found: list[tuple[int, int]] = []
    try:
        parent = psutil.Process(init)
        if INIT_NAME not in parent.cmdline()[:4]:
            return 0  # still the namespace's setup (its mounts), which execs the init
        children = parent.children()
    except psutil.Error:
        return 0
    for child in children:
        try:
            if tuple(child.cmdline()) in INIT_HELPERS or child.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append((_nspid(child.pid), child.pid))
        except (psutil.Error, OSError, ValueError):
            continue
    return min(found)[1] if found else 0


def job_processes(init: int) -> list[int]:
    """Every process below a job's ``init``, but the init's own passing helpers (:data:`INIT_HELPERS`)."""
    out = []
    for pid in tree_pids(init)[1:]:
        try:
            proc = psutil.Process(pid)
            if proc.ppid() == init and tuple(proc.cmdline()) in INIT_HELPERS:
                continue
        except psutil.Error:
            continue
        out.append(pid)
    return out


def below(pid: int, roots: dict[int, str]) -> str | None:
    """What ``roots`` maps the nearest of ``pid`` and its ancestors to that it holds (a job's
    init: the job a process belongs to); None if none."""
    try:
        proc: psutil.Process | None = psutil.Process(pid)
        while proc is not None:
            if proc.pid in roots:
                return roots[proc.pid]
            proc = proc.parent()
    except psutil.Error:
        pass
    return None


def signal_tree(root: int, sig: int) -> None:
    for pid in tree_pids(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def freeze_tree(root: int) -> None:
    """SIGSTOP every process below ``root`` (not ``root`` itself: a job's init keeps watching its
    dead man's switch).  Twice over, for a process forked while the first pass ran."""
    for _ in range(2):
        for pid in tree_pids(root)[1:]:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass


def alive(pid: int) -> bool:
    """A zombie is not alive (where pid 1 never reaps, a dead agent lingers as one)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# Children someone is waiting for: the orphan reaper leaves them alone.
WATCHED: set[int] = set()


def spawn(argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
    """Popen, with the child registered as watched before anything else can run."""
    proc = subprocess.Popen(argv, **kwargs)
    WATCHED.add(proc.pid)
    return proc


async def wait_pid(pid: int) -> int:
    """Wait for our child ``pid`` to exit and reap it; returns the shell-style exit code."""
    WATCHED.add(pid)
    try:
        return await _wait_pid(pid)
    finally:
        WATCHED.discard(pid)


async def _wait_pid(pid: int) -> int:
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _reap_now(pid)
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return _reap_now(pid)


def _reap_now(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return -1  # already reaped elsewhere, or never ours: the status is lost
    return decode_status(status)


def reap_orphans() -> list[tuple[int, int]]:
    """Reap exited children nobody is waiting for (orphans adopted as subreaper)."""
    out = []
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return out
    for pid in children:
        if pid in WATCHED:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            try:
                _, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            out.append((pid, decode_status(status)))
    return out


@dataclass
class Completed:
    argv: list[str]
    returncode: int
    output: str


async def run(argv: list[str], timeout_s: float, *, cwd: str | None = None,
              env: dict[str, str] | None = None, umask: int | None = None,
              pass_fds: tuple[int, ...] = ()) -> Completed:
    """Run a command to completion, stdout and stderr merged; kill it on timeout or cancellation.
    ``umask``: the child's (criu dumping private images), else the agent's own.  ``pass_fds``:
    descriptors it inherits (criu restore's --inherit-fd)."""
    with tempfile.TemporaryFile() as out:
        # die_with_parent: a criu must not outlive the agent that would commit or undo its work.
        proc = spawn(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                     cwd=cwd, env=env, close_fds=True, pass_fds=pass_fds, preexec_fn=die_with_parent,
                     umask=-1 if umask is None else umask)
        waiter = asyncio.ensure_future(_waiter(proc))
        try:
            code = await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except BaseException:
            # Timed out or cancelled: never leave a criu running behind our back.
            proc.kill()
            await asyncio.shield(waiter)
            raise
        out.seek(0)
        return Completed(argv, code, out.read().decode(errors="replace"))


async def _waiter(proc: subprocess.Popen[bytes]) -> int:
    if proc.returncode is None:
        proc.returncode = await wait_pid(proc.pid)  # also keeps Popen from waiting again
    return proc.returncode


_CAP_SYS_RESOURCE = 24


def has_cap_sys_resource() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (effective): the kernel's condition for reading
    another user's rlimits with prlimit(2), as criu's dump does."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False
