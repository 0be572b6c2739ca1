"""What a job's processes hold, read from /proc: its processes (the namespace's init and
everything below it), the filesystems mounted in its own mount namespace, the regular files it
holds open for writing, and every path it holds at all (descriptors, mappings, working and root
directories, programs).  Read while the job is frozen at a dump (agent/jobfiles.py) and while
it is still stopped after a restore (agent/jobfiles_restore.py)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

# Kernel interfaces, not data: never copied nor put back (a job's private /dev/shm is criu's).
PSEUDO = ("/proc/", "/sys/", "/dev/")
# Names the kernel gives what no directory holds (memfd_create, SysV shared memory): criu dumps
# and makes them again by their own means, never at a path.
UNNAMED = ("/memfd:", "/SYSV")


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


def _mount_devs(mountinfo: str) -> set[str]:
    return {line.split()[2] for line in mountinfo.splitlines() if line.strip()}


def private_devs(root: int) -> set[int]:
    """Devices of filesystems mounted in the job's own mount namespace and nowhere in ours
    (its private tmpfs ``/tmp`` and ``/dev/shm``): criu dumps their contents itself."""
    try:
        theirs = Path(f"/proc/{root}/mountinfo").read_text()
        ours = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return set()
    devs = set()
    for majmin in _mount_devs(theirs) - _mount_devs(ours):
        major, _, minor = majmin.partition(":")
        devs.add(os.makedev(int(major), int(minor)))
    return devs


@dataclass
class OpenFile:
    path: str
    source: str  # /proc/<pid>/fd/<n>: opens the very file, whatever namespace the path is in
    st: os.stat_result
    append: bool


def _fd_flags(pid: int, fd: str) -> int | None:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def open_for_writing(root: int) -> dict[str, OpenFile]:
    """Regular files the job's processes hold open for writing, by path."""
    skip = private_devs(root)
    found: dict[str, OpenFile] = {}
    for pid in job_pids(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            flags = _fd_flags(pid, fd)
            if flags is None or flags & os.O_ACCMODE == os.O_RDONLY:
                continue
            source = f"/proc/{pid}/fd/{fd}"
            try:
                st = os.stat(source)
                path = os.readlink(source)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_dev in skip or not path.startswith("/") \
                    or path.endswith(" (deleted)") or path.startswith(PSEUDO):
                continue  # criu keeps unlinked files (ghosts) itself; /proc, /sys: not data
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


def held_paths(root: int) -> dict[str, str]:
    """Every path the job's processes hold, by what holds it: ``"<pid> fd <n>"``, ``"<pid> map
    <path>"`` (a mapping needs the right to read the file: the process's own set of mapped files
    is what binds it), ``"<pid> cwd"``, ``"<pid> root"``, ``"<pid> exe"`` (pids as the job's
    namespace numbers them).  criu opens each again, by path, when it restores: each must lead where it did
    at the dump (a path merely held elsewhere in the job proves nothing: an O_PATH descriptor of
    a file the job may not read would put its path in the set)."""
    held: dict[str, str] = {}
    for pid in job_pids(root):
        try:
            ns = _nspid(pid)
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        links = {f"{ns} {name}": f"/proc/{pid}/{name}" for name in ("cwd", "root", "exe")}
        links.update({f"{ns} fd {fd}": f"/proc/{pid}/fd/{fd}" for fd in fds})
        for key, link in links.items():
            try:
                held[key] = os.readlink(link)
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6:  # by file, not by range: a restore may split or merge them
                        path = fields[5].rstrip("\n")
                        held[f"{ns} map {path}"] = path
        except OSError:
            pass
    return {key: path for key, path in held.items() if path.startswith("/") and not path.endswith(" (deleted)")}


def _unix_names(pid: int, cache: dict[str, dict[str, str]]) -> dict[str, str]:
    """The names unix sockets are bound to in ``pid``'s network namespace, by socket inode."""
    try:
        netns = os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return {}
    if netns not in cache:
        names: dict[str, str] = {}
        try:
            with open(f"/proc/{pid}/net/unix") as table:
                next(table, None)
                for line in table:
                    fields = line.split(maxsplit=7)
                    if len(fields) == 8:
                        names[fields[6]] = fields[7].rstrip("\n")
        except OSError:
            pass
        cache[netns] = names
    return cache[netns]


def _deleted(path: str) -> str | None:
    if not path.startswith("/") or not path.endswith(" (deleted)") or path.startswith(PSEUDO + UNNAMED):
        return None
    return path[: -len(" (deleted)")]


def made_again_by_path(root: int) -> list[tuple[str, str, int]]:
    """What criu makes again, as root, at a path of the job's when it restores it, rather than
    merely opening it: (what, path, pid) for each unix socket bound to a name in the filesystem
    (bound again there, then given its owner and mode by path), each named FIFO, and each
    file that was deleted while held (a "ghost": written again next to its old path).  Paths
    are as the holder's mount namespace sees them (``/proc/<pid>/root`` reaches them); a relative
    socket name is taken from the holder's working directory, as it was bound."""
    found: list[tuple[str, str, int]] = []
    sockets: dict[str, dict[str, str]] = {}
    for pid in job_pids(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                name = _unix_names(pid, sockets).get(target[len("socket:["):-1], "")
                if name and not name.startswith("@"):
                    found.append(("a unix socket bound to", os.path.join(cwd, name), pid))
            elif (gone := _deleted(target)) is not None:
                found.append(("a deleted file,", gone, pid))
            elif stat.S_ISFIFO(st.st_mode) and target.startswith("/"):
                found.append(("a named FIFO,", target, pid))
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    gone = _deleted(fields[5].rstrip("\n")) if len(fields) == 6 else None
                    if gone is not None:
                        found.append(("a deleted file,", gone, pid))
        except OSError:
            pass
    return found
