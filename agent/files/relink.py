"""Files a job holds by a name that was removed while the file keeps another name.

glibc's ``sem_open`` makes every POSIX semaphore under a temporary name in /dev/shm, maps it,
links it to its own name and removes the temporary one: so every Lock, Queue and Value of
Python's multiprocessing under the ``spawn`` and ``forkserver`` start methods.  /proc shows such
a mapping as ``/dev/shm/sem.XXXXXX (deleted)`` while the file lives on under its other name, and
criu cannot dump it by the path it is seen by: it wants ``--link-remap``, which has criu (root)
link the file again beside its old name, by path, while it dumps.  In a directory the job's user
can change, a swap at that moment would have root link the user's file wherever the user points
(into a configuration directory, say).  So revenant never passes ``--link-remap``:

* before criu runs, each such file in the job's private ``/tmp`` or ``/dev/shm`` gets the very
  name criu looks for, ``<old name> (deleted)``, made through descriptors (agent/files/beneath.py,
  never through a link) in a filesystem only the job's processes reach; criu then dumps it as
  any file, the tmpfs carries it, and the restore reopens it by that name;
* those names are removed again from the running job after the dump, and from the restored
  job before it resumes (RELINKED in the epoch names them);
* one anywhere else, on a filesystem safe to look at, is refused before criu runs (after the
  steps before this one: a GPU suspend, a pre-dump), in one line, and the job goes on.

Nothing is looked at on a filesystem a user may serve (FUSE, which could stall root for ever):
each descriptor's mount (its fdinfo ``mnt_id``) and each mapping's device (its ``maps`` line)
is read first, from /proc alone.  Only holders that share the job's mount namespace and root
count; the names are made from the job's init's root and removed only if they still lead to the
file they were made for, and only while the init is the process its pidfd holds.  A restored
job gets the name criu reopened the file by renamed back to the file's old name and removed,
so that it holds the file by exactly the removed name it held before (the name never grows).
A job that makes such a file after this step and before criu freezes it fails that checkpoint
with criu's own error ("Can't create link remap"), and goes on; the next checkpoint names it.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec

from revenant.agent.files import beneath
from revenant.agent.files.remade import deleted_path
from revenant.agent.pipeline.blockers import NotCheckpointable
from revenant.agent.pipeline.steps import BaseStep, DumpContext, RestoreContext
from revenant.agent.processes.jobprocs import copy_fd, fd_info, job_pids, private_devs, private_devs_in
from revenant.messages import JobResource

# In an epoch: [directory, name, device, inode] for each name made, as the job sees them.
RELINKED = "relinked.json"
_DELETED = " (deleted)"
_STATE = "relink"
# Filesystems whose files root may stat without a user answering for them.
_UNSAFE_FS = ("fuse", "fuseblk", "fuse.", "9p", "nfs", "cifs", "smb3", "ceph", "gfs2", "ocfs2", "lustre")
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Mounts:
    """The job's mounts (its init's mountinfo): which are its private tmpfs, and which are safe to
    stat, by mount id and by device."""

    def __init__(self, root: int) -> None:
        self.safe_ids: set[int] = set()
        self.safe_devs: set[int] = set()
        try:
            theirs = Path(f"/proc/{root}/mountinfo").read_text()
        except OSError:
            theirs = ""
        self.private = private_devs_in(theirs) if theirs else set()
        for line in theirs.splitlines():
            fields, _, rest = line.partition(" - ")
            parts, fstype = fields.split(), (rest.split() or [""])[0]
            if len(parts) < 5 or fstype.startswith(_UNSAFE_FS):
                continue
            major, _, minor = parts[2].partition(":")
            self.safe_ids.add(int(parts[0]))
            self.safe_devs.add(os.makedev(int(major), int(minor)))


def _mnt_id(pid: int, fd: str) -> int:
    try:
        return fd_info(pid, fd)[0]
    except (OSError, ValueError):
        return -1


def _same_world(root: int, pid: int) -> bool:
    """Whether ``pid`` sees the files as the job's init does (its mount namespace and root)."""
    try:
        return (os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink(f"/proc/{root}/ns/mnt")
                and os.stat(f"/proc/{pid}/root")[1:3] == os.stat(f"/proc/{root}/root")[1:3])
    except OSError:
        return False


def _held(root: int, mounts: _Mounts) -> Iterator[tuple[int, str, os.stat_result, str]]:
    """(pid, path as /proc shows it, the file's stat, how to open it) for each regular file the job
    holds under a removed name while it has another, on a filesystem safe to look at; each path
    once, whoever else holds it."""
    seen: set[str] = set()
    for pid, path, st, how in _holders(root, mounts):
        if path not in seen:
            seen.add(path)
            yield pid, path, st, how


def _holders(root: int, mounts: _Mounts) -> Iterator[tuple[int, str, os.stat_result, str]]:
    for pid in job_pids(root):
        if not _same_world(root, pid):
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if deleted_path(path) is None or _mnt_id(pid, fd) not in mounts.safe_ids:
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except (OSError, ValueError):
                continue
            if st.st_nlink and stat.S_ISREG(st.st_mode):
                yield pid, path, st, f"fd:{fd}"
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or deleted_path(fields[5].rstrip("\n")) is None:
                continue  # not removed, or no file of a filesystem (/SYSV, /dev/zero)
            major, _, minor = fields[3].partition(":")
            try:
                if os.makedev(int(major, 16), int(minor, 16)) not in mounts.safe_devs:
                    continue
                path = os.readlink(f"/proc/{pid}/map_files/{fields[0]}")  # unescaped, unlike maps
                st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
            except (OSError, ValueError):
                continue
            if deleted_path(path) is not None and st.st_nlink and stat.S_ISREG(st.st_mode):
                yield pid, path, st, f"map:{fields[0]}"


def _open(pid: int, how: str) -> int:
    kind, _, which = how.partition(":")
    if kind == "map":
        return os.open(f"/proc/{pid}/map_files/{which}", os.O_RDONLY | os.O_CLOEXEC)
    pidfd = os.pidfd_open(pid)
    try:
        return copy_fd(pidfd, int(which))
    finally:
        os.close(pidfd)


def _dir_in(root_fd: int, directory: str, dev: int) -> int:
    """A descriptor of the job's ``directory`` (below its root ``root_fd``), reached without
    following a link, which must lie on the filesystem ``dev``."""
    fd = beneath.walk(root_fd, [p for p in directory.split("/") if p], directory)
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        raise beneath.Unsafe(errno.EXDEV, "not on the job's private filesystem", directory)
    return fd


def _open_root(pid: int, pidfd: int | None = None) -> int:
    """The root directory of the process ``pid``, opened while it is still the process ``pidfd``
    holds (a pid reused by another job's process meanwhile would lead to that job's files)."""
    fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, 0)  # ProcessLookupError: gone
        return fd
    except BaseException:
        os.close(fd)
        raise


def relink(root: int) -> list[list]:
    """Give each such file of the job (its init ``root``) in its private tmpfs the name criu looks
    for; raises NotCheckpointable for one anywhere else.  The [directory, name, dev, ino] made."""
    mounts = _Mounts(root)
    made: list[list] = []
    root_fd = _open_root(root)
    try:
        for pid, path, st, how in _held(root, mounts):
            old = path[: -len(_DELETED)]
            if st.st_dev not in mounts.private:
                raise NotCheckpointable(
                    f"the job holds {old}, a file whose name was removed while it keeps another name: "
                    "criu can checkpoint that only in the job's own /tmp or /dev/shm; open it by a name it has")
            directory, _, name = path.rpartition("/")
            try:
                src = _open(pid, how)
            except OSError:
                continue  # the process or the descriptor is gone: nothing to name
            try:
                dir_fd = _dir_in(root_fd, directory or "/", st.st_dev)
                try:
                    os.link(f"/proc/self/fd/{src}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
                finally:
                    os.close(dir_fd)
            except FileExistsError:
                continue  # a name the job made itself: criu compares the file it leads to
            except OSError as exc:
                raise NotCheckpointable(f"the job holds {old}, a file whose name was removed while it keeps "
                                        f"another name, and it cannot be named for criu: "
                                        f"{exc.strerror or exc}") from None
            finally:
                os.close(src)
            made.append([directory or "/", name, st.st_dev, st.st_ino])
    except BaseException:
        _remove(root_fd, made, None)
        raise
    finally:
        os.close(root_fd)
    return made


def _remove(root_fd: int, made: list[list], restored: set[int] | None) -> None:
    """Remove the names made (best effort), each only if it still leads to its file.  ``restored``
    (the restored job's private devices): criu reopened the file by that name, in a tmpfs nobody
    but criu has touched yet, where it is renamed back to the file's old name first and removed
    there, so the job holds it by the removed name it held at the dump."""
    for directory, name, dev, ino in made:
        try:
            fd = beneath.walk(root_fd, [p for p in directory.split("/") if p], directory)
        except OSError:
            continue
        try:
            st = beneath.lstat_in(fd, name)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            if (st.st_dev, st.st_ino) != (dev, ino) if restored is None else st.st_dev not in restored:
                continue
            old = name[: -len(_DELETED)] if name.endswith(_DELETED) else ""
            if restored is not None and old and \
                    _libc.renameat2(fd, name.encode(), fd, old.encode(), _RENAME_NOREPLACE) == 0:
                name = old
            os.unlink(name, dir_fd=fd)
        except OSError:
            continue
        finally:
            os.close(fd)


def unlink(pid: int, made: list[list], pidfd: int | None = None, restored: bool = False) -> None:
    """Remove the names made from the job whose init is ``pid`` (see :func:`_remove`)."""
    try:
        root_fd = _open_root(pid, pidfd)
    except OSError:
        return  # gone: its private tmpfs with it
    try:
        _remove(root_fd, made, private_devs(pid) if restored else None)
    finally:
        os.close(root_fd)


class RelinkStep(BaseStep):
    name = "relink"

    async def before_dump(self, ctx: DumpContext) -> None:
        try:
            made = await asyncio.to_thread(relink, ctx.pid)
        except NotCheckpointable as exc:
            raise NotCheckpointable(f"checkpoint of {ctx.job} refused: {exc}") from None
        if made:
            ctx.state[_STATE] = (made, os.pidfd_open(ctx.pid))
            (ctx.epoch_tmp / RELINKED).write_bytes(msgspec.json.encode(made))

    async def after_dump(self, ctx: DumpContext) -> None:
        # A vacate's job dies, and its private tmpfs with it; a job left running loses the names.
        await self._undo(ctx, remove=not ctx.stop)

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        await self._undo(ctx, remove=True)  # the job goes on

    async def _undo(self, ctx: DumpContext, remove: bool) -> None:
        held = ctx.state.pop(_STATE, None)
        if held is None:
            return
        made, pidfd = held
        try:
            if remove:
                await asyncio.to_thread(unlink, ctx.pid, made, pidfd)
        finally:
            os.close(pidfd)

    async def before_resume(self, ctx: RestoreContext) -> None:
        # After JobFilesStep's check, which compares the paths criu opened with the dump's.
        path = Path(ctx.epoch_dir) / RELINKED
        if not path.exists():
            return
        made = msgspec.json.decode(path.read_bytes(), type=list[list])
        await asyncio.to_thread(unlink, ctx.pid, made, None, True)  # criu still holds the processes

    def inspect(self, pid: int) -> list[JobResource]:
        mounts = _Mounts(pid)
        out = []
        for _, path, st, _ in _held(pid, mounts):
            what = f"{path[: -len(_DELETED)]} (removed; the file keeps another name)"
            if st.st_dev in mounts.private:
                out.append(JobResource(kind="file", what=what, verdict="carried",
                                       reason="named for criu while it dumps, in the job's own tmpfs"))
            else:
                out.append(JobResource(kind="file", what=what, verdict="blocking",
                                       reason="criu can checkpoint that only in the job's own /tmp or /dev/shm"))
        return out
