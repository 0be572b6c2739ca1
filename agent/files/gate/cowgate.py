"""Copy files as they were at a moment, after that moment, without letting the job change them first,
and without ever making anyone else wait for long.

A job's working directory goes into its epoch as it was at the dump (agent/files/workdir.py), but
copying a large file while the job is frozen lengthens the freeze.  On a filesystem without reflinks
(ext4), this gate lets the copy happen after the job resumes:

* while the job is frozen, :meth:`CowGate.arm` takes a descriptor of each file to be copied
  (read-only, made by the caller without following links), notes its size and ctime, and marks
  its inode with fanotify's ``FAN_OPEN_PERM``: from then on, an open of it waits for the gate;
* after the job resumes, :meth:`CowGate.run` copies each file, its size at the dump and no more,
  from the descriptor; an open of a file not yet copied has that file copied first (by a copier
  thread, never by the thread that answers), then allowed, and its mark removed.

Nothing outside the job waits for long.  There is one gate per agent (:func:`shared`), with one
fanotify group, one answering thread that only looks and answers (it never copies and never
opens a file), and one copier; every checkpoint's files are a batch of it.  An open by a process
of the job waits for the copy (up to ``JOB_WAIT_S``); any other process waits ``OUTSIDER_WAIT_S``
at most and is then let through.  An open let through before its copy ended makes that copy
prove itself: if the file's ctime is not what it was at the dump once copied (a write, a
truncate, a write through a mapping change it), the copy is not the dump's, and is never kept:
the file is kept by identity only when someone else changed it, and the epoch fails when the
job did (below).

Whatever happens to the agent, the host goes on:

* the answering thread raising: every pending open is allowed, the group is closed (the kernel
  lets the rest through), every batch fails, and the next checkpoint makes a new gate;
* the agent stopped or hung (SIGSTOP, a debugger, the thread stuck): the keeper
  (agent/files/gate/keeper.py), a small process holding the same group, answers every event that
  waited ``keeper.STALE_S`` without the thread beating, and counts it for the agent;
* the agent killed (SIGKILL, the OOM killer): the keeper's pipe closes, the keeper exits with
  the group's last descriptor, and the kernel lets every waiting open through.

A file is changed without an open only by ``truncate(2)`` on its path, or through a mapping or
descriptor taken before the dump (the caller copies the files the job holds while it is frozen;
another process, say another job sharing the project directory, may hold one too).  Each change
of a gated file is reported with the pid that made it (agent/files/gate/changes.py): one by a
process outside the job makes the file not the job's to keep, as an early open does; one by the
job before its copy was settled (a truncate by path, a write through an open its keeper let go
while the agent was too slow to answer) fails the epoch, and so does a size change no event
explains.
A change between the freeze's look at a file and its marks (the job frozen: another process's)
shows in its size or ctime when it is armed.  Its times are otherwise no guide: a rename, chmod
or utime (git "freshens" existing objects) changes them and not a byte.

fanotify's permission events need CAP_SYS_ADMIN and a kernel with
CONFIG_FANOTIFY_ACCESS_PERMISSIONS (Debian's have it; :func:`available` says why not).
"""
from __future__ import annotations

import os
import subprocess
import threading
from typing import Callable

from revenant.agent.files.gate import group as _group
from revenant.agent.files.gate.group import JOB_WAIT_S, OUTSIDER_WAIT_S, available  # noqa: F401 - known here

_shared: _group.Group | None = None
_shared_lock = threading.Lock()


def shared() -> _group.Group:
    """The agent's one gate: made on first use, and again after it failed open (or a fork)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.broken or _shared.pid != os.getpid():
            if _shared is not None and _shared.pid == os.getpid():
                _shared.reap()
            _shared = _group.Group()
        return _shared


_WHY: str | None = None


def unavailable() -> str:
    """Why files cannot be gated here ("" if they can): fanotify's permission events (asked once),
    and the agent's gate up (its keeper process started: call it before a freeze, never in one)."""
    global _WHY
    if _WHY is None:
        _WHY = available()
    if _WHY:
        return _WHY
    try:
        shared()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the file gate cannot start: {exc}"
    return ""


def close_shared() -> None:
    global _shared
    with _shared_lock:
        gate, _shared = _shared, None
    if gate is not None and gate.pid == os.getpid():
        gate.close()


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descends(pid: int, root: int) -> bool:
    """``pid`` is ``root`` or a descendant of it (``root`` 0: never)."""
    for _ in range(64):
        if pid == root and pid > 0:
            return True
        if pid <= 1:
            return False
        pid = _parent(pid)
    return False


class CowGate:
    """One checkpoint's files, copied as they were when armed (see the module docstring)."""

    def __init__(self, copy: Callable[[int, str, int], None], root: int = 0) -> None:
        # copy(src_fd, dest, size): the copy itself (a plain copy, or one into packs), size bytes.
        self.copy_fn = copy
        self.root = root  # the job's first process: it and its descendants are the job (0: nobody)
        self.files: list[_group.File] = []
        self._gate = shared()

    def holds(self, pid: int) -> bool:
        """``pid`` is a process of the job (a descendant of its root)."""
        return descends(pid, self.root)

    def arm(self, fd: int, dest: str, name: str = "", st: os.stat_result | None = None) -> bool:
        """Gate the file behind ``fd`` (a descriptor of the caller's, read-only, kept by the gate
        once this returns True; ``st``: its fstat, if the caller has it) to be copied to ``dest``;
        call while nothing can change it (the job frozen).  False: the file is gated already (a
        second link to it, another checkpoint's), or the gate is full or failed: the caller copies."""
        return self._gate.arm(self, fd, dest, name, st if st is not None else os.fstat(fd))

    @property
    def gated(self) -> int:
        return len(self.files)

    def run(self) -> list[str]:
        """Copy every gated file (opens of them answered meanwhile); the errors, one per file."""
        try:
            for f in self.files:
                self._gate.copy(f)
        finally:
            self.close()
        return [f.error for f in self.files if f.error]

    def unkept(self) -> list[str]:
        """The copies (``dest``) of files another process changed before they were copied."""
        return [f.dest for f in self.files if f.unkept]

    def close(self) -> None:
        """Let every file not yet copied go (the dump failed, or the copies are done)."""
        for f in self.files:
            self._gate.let_go(f, "" if f.done else f"{f.name}: not copied")

