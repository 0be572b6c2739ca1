"""What a job's processes hold, read from /proc: its processes (the namespace's init and
everything below it), the filesystems mounted in its own mount namespace, the regular files it
holds open for writing, and every path it holds at all (descriptors, mappings, working and root
directories, programs).  Read while the job is frozen at a dump (agent/files/jobfiles.py) and while
it is still stopped after a restore (agent/files/jobfiles_restore.py)."""

from __future__ import annotations

import ctypes
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Kernel interfaces, not data: never copied nor put back (a job's private /dev/shm is criu's).
PSEUDO = ("/proc/", "/sys/", "/dev/")


def job_pids(root: int) -> list[int]:
    """``root`` and all its descendants (every thread's children)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return pids


def _launcher_tmpfs(mountinfo: str) -> set[str]:
    """The tmpfs mounted on /tmp and /dev/shm in a mountinfo, by device."""
    devs = set()
    for line in mountinfo.splitlines():
        fields, _, fs = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 4 and parts[4] in ("/tmp", "/dev/shm") and fs.split()[:1] == ["tmpfs"]:
            devs.add(parts[2])
    return devs


def job_fds(root: int) -> Iterator[tuple[int, str, str]]:
    """(pid, fd, what /proc says it leads to) for every descriptor of the job's processes."""
    for pid in job_pids(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                yield pid, fd, os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue


_SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


def copy_fd(pidfd: int, fd: int) -> int:
    """A descriptor of ours for the process's (behind ``pidfd``) descriptor ``fd``
    (pidfd_getfd(2)); raises OSError."""
    mine = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if mine < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return mine


def job_sockets(root: int) -> Iterator[socket.socket]:
    """Each socket the job's processes hold, once, as a socket of ours (a copy of a descriptor
    of theirs: pidfd_getfd(2)), closed once the caller moves on.  Asked directly, a socket says
    what it is at the cost of a few system calls; /proc/net/tcp walks the whole connection hash
    table of the host (milliseconds, whatever the job holds)."""
    seen: set[str] = set()
    pidfds: dict[int, int] = {}
    try:
        for pid, fd, target in job_fds(root):
            if not target.startswith("socket:[") or target in seen:
                continue
            try:
                if pid not in pidfds:
                    pidfds[pid] = os.pidfd_open(pid)
                mine = copy_fd(pidfds[pid], int(fd))
            except OSError:
                continue
            seen.add(target)
            try:
                sk = socket.socket(fileno=mine)
            except OSError:  # not a socket after all (the descriptor was reused since)
                os.close(mine)
                continue
            with sk:
                yield sk
    finally:
        for pidfd in pidfds.values():
            os.close(pidfd)


def _mount_devs(mountinfo: str) -> set[str]:
    return {line.split()[2] for line in mountinfo.splitlines() if line.strip()}


def private_devs(root: int) -> set[int]:
    """Devices of the job's private tmpfs ``/tmp`` and ``/dev/shm`` (agent/running/launcher.py), mounted in
    its own mount namespace and nowhere in ours: criu dumps their contents itself.  (Only those:
    a host filesystem unmounted from the host since the job started is no private one.)"""
    try:
        return private_devs_in(Path(f"/proc/{root}/mountinfo").read_text())
    except OSError:
        return set()


def private_devs_in(theirs: str) -> set[int]:
    """:func:`private_devs` from the job's mountinfo, already read (``theirs``)."""
    try:
        ours = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return set()
    devs = set()
    for majmin in _launcher_tmpfs(theirs) - _mount_devs(ours):
        major, _, minor = majmin.partition(":")
        devs.add(os.makedev(int(major), int(minor)))
    return devs


@dataclass
class OpenFile:
    path: str
    source: str  # /proc/<pid>/fd/<n>: opens the very file, whatever namespace the path is in
    st: os.stat_result
    append: bool


def fd_info(pid: int, fd: str | int) -> tuple[int, int]:
    """(mnt_id, flags) of a process's descriptor, from its fdinfo; OSError if it is gone or says neither."""
    mnt = flags = -1
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "mnt_id":
                mnt = int(value)
            elif key == "flags":
                flags = int(value, 8)
    if mnt < 0 or flags < 0:
        raise OSError(0, f"/proc/{pid}/fdinfo/{fd} names no mnt_id or flags")
    return mnt, flags


def external_id(mnt_id: int, ino: int) -> str:
    """criu's name for a file dumped as external (criu/files-reg.c dump_one_reg_file): hex, both."""
    return f"file[{mnt_id:x}:{ino:x}]"


def _fd_flags(pid: int, fd: str) -> int | None:
    try:
        return fd_info(pid, fd)[1]
    except (OSError, ValueError):
        return None


def open_for_writing(root: int) -> dict[str, OpenFile]:
    """Regular files the job's processes hold open for writing, by path."""
    skip = private_devs(root)
    found: dict[str, OpenFile] = {}
    for pid, fd, path in job_fds(root):
        if not path.startswith("/") or path.endswith(" (deleted)") or path.startswith(PSEUDO):
            continue  # sockets, pipes; criu keeps unlinked files (ghosts) itself; /proc, /sys: not data
        flags = _fd_flags(pid, fd)
        if flags is None or flags & os.O_ACCMODE == os.O_RDONLY:
            continue
        source = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(source)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_dev in skip:
            continue
        append = bool(flags & os.O_APPEND)
        if path in found:
            found[path].append = found[path].append and append
        else:
            found[path] = OpenFile(path, source, st, append)
    return found


def _nspid(pid: int) -> str:
    """``pid`` as its own PID namespace numbers it: what criu gives it again at a restore."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return line.split()[-1]
    return str(pid)


def _kind(target: str) -> str:
    """What a descriptor leads to, as a restore can reproduce it: a path as it is (`` (deleted)``
    included), anything else by its kind only (``socket:[]``, ``pipe:[]``, ``anon_inode:[eventfd]``:
    inode numbers change)."""
    return target if target.startswith("/") else re.sub(r"\[\d+\]$", "[]", target)


def _watches(pid: int, fd: str) -> str:
    """An inotify or fanotify descriptor's watches, as device and inode each (its fdinfo): criu
    adds each again as root, by the path it finds for it, following links."""
    marks = []
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith(("inotify ", "fanotify ")):
                    fields = dict(f.split(":", 1) for f in line.split()[1:] if ":" in f)
                    marks.append(f"{fields.get('sdev', '?')}:{fields.get('ino', '?')}")
    except OSError:
        return " ?"
    return "".join(" " + m for m in sorted(marks))


def held_paths(root: int, links: dict[str, str] | None = None, writable: set[str] | None = None) -> dict[str, str]:
    """Everything the job's processes hold, by what holds it: ``"<pid> fd <n>"`` (every
    descriptor, whatever it leads to: _kind; an inotify or fanotify one with its watches),
    ``"<pid> map <path>"`` (a mapping needs the right
    to read the file: the process's own set of mapped files is what binds it), ``"<pid> cwd"``,
    ``"<pid> root"``, ``"<pid> exe"`` (pids as the job's namespace numbers them).  criu opens
    each again, by path, when it restores: each must lead where it did at the dump (a path
    merely held elsewhere in the job proves nothing: an O_PATH descriptor of a file the job may
    not read would put its path in the set).  ``links``: filled with each key's /proc link;
    ``writable``: with the paths mapped shared and writable (written without any open or write)."""
    held: dict[str, str] = {}
    for pid in job_pids(root):
        try:
            ns = _nspid(pid)
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        proc = {f"{ns} {name}": f"/proc/{pid}/{name}" for name in ("cwd", "root", "exe")}
        proc.update({f"{ns} fd {fd}": f"/proc/{pid}/fd/{fd}" for fd in fds})
        for key, link in proc.items():
            try:
                held[key] = _kind(os.readlink(link))
            except OSError:
                continue
            if held[key] in ("anon_inode:inotify", "anon_inode:[fanotify]"):
                held[key] += _watches(pid, key.rsplit(" ", 1)[-1])
            if links is not None:
                links[key] = link
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                    # By file, not by range: a restore may split or merge them.  Not deleted ones:
                    # criu's restorer maps /dev/zero of its own (agent/files/remade.py checks ghosts).
                    if path.startswith("/") and not path.endswith(" (deleted)"):
                        held[f"{ns} map {path}"] = path
                        if writable is not None and fields[1][1] == "w" and fields[1][3] == "s":
                            writable.add(path)
        except OSError:
            pass
    return held
