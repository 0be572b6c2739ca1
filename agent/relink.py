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
  name criu looks for, ``<old name> (deleted)``, made through descriptors (agent/beneath.py,
  never through a link) in a filesystem only the job's processes reach; criu then dumps it as
  any file, the tmpfs carries it, and the restore reopens it by that name;
* those names are removed again from the running job after the dump, and from the restored
  job before it resumes (RELINKED in the epoch names them);
* one anywhere else is refused, before anything freezes the job.

A job that makes such a file after that check and before criu freezes it fails that checkpoint
with criu's own error ("Can't create link remap"), and goes on; the next checkpoint relinks it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec

from revenant.agent import beneath
from revenant.agent.blockers import NotCheckpointable
from revenant.agent.jobprocs import copy_fd, job_pids, private_devs
from revenant.agent.remade import deleted_path
from revenant.agent.steps import BaseStep, DumpContext, RestoreContext
from revenant.messages import JobResource

# In an epoch: [directory, name] for each name made, as the job sees them.
RELINKED = "relinked.json"
_DELETED = " (deleted)"
_STATE = "relink"


def _held(root: int) -> Iterator[tuple[int, str, os.stat_result, str]]:
    """(pid, path as /proc shows it, the file's stat, how to open it) for each file the job holds
    under a removed name while it has another (descriptors and mappings both)."""
    for pid in job_pids(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if deleted_path(path) is not None and st.st_nlink and stat.S_ISREG(st.st_mode):
                yield pid, path, st, f"fd:{fd}"
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if deleted_path(path) is None:  # not removed, or no file of a filesystem (/SYSV, /dev/zero)
                continue
            try:
                st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
            except OSError:
                continue
            if st.st_nlink and stat.S_ISREG(st.st_mode):
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


def _dir_in(pid: int, directory: str, dev: int) -> int:
    """A descriptor of the job's ``directory`` (as its process ``pid`` sees it), reached without
    following a link, which must lie on the filesystem ``dev``."""
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = beneath.walk(root, [p for p in directory.split("/") if p], directory)
    finally:
        os.close(root)
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        raise beneath.Unsafe(errno.EXDEV, "not on the job's private filesystem", directory)
    return fd


def relink(root: int) -> list[list[str]]:
    """Give each such file of the job (its init ``root``) in its private tmpfs the name criu looks
    for; raises NotCheckpointable for one anywhere else.  The [directory, name] made."""
    private = private_devs(root)
    made: list[list[str]] = []
    seen: set[str] = set()
    try:
        for pid, path, st, how in _held(root):
            if path in seen:
                continue
            seen.add(path)
            old = path[: -len(_DELETED)]
            if st.st_dev not in private:
                raise NotCheckpointable(
                    f"the job holds {old}, a file whose name was removed while it keeps another name: "
                    "criu can checkpoint that only in the job's own /tmp or /dev/shm; open it by a name it has")
            directory, _, name = path.rpartition("/")
            dir_fd = _dir_in(pid, directory or "/", st.st_dev)
            try:
                src = _open(pid, how)
                try:
                    os.link(f"/proc/self/fd/{src}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
                finally:
                    os.close(src)
            except FileExistsError:
                continue  # a name the job made itself: criu compares the file it leads to
            finally:
                os.close(dir_fd)
            made.append([directory or "/", name])
    except BaseException:
        unlink(root, made)
        raise
    return made


def unlink(pid: int, made: list[list[str]]) -> None:
    """Remove the names made, from the job whose process ``pid`` sees them (best effort: a name
    the job removed or replaced meanwhile is left as it is)."""
    private = private_devs(pid)
    for directory, name in made:
        try:
            dir_fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = beneath.walk(dir_fd, [p for p in directory.split("/") if p], directory)
            finally:
                os.close(dir_fd)
            try:
                st = beneath.lstat_in(fd, name)
                if os.fstat(fd).st_dev in private and st is not None and stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)
        except OSError:
            continue


class RelinkStep(BaseStep):
    name = "relink"

    async def before_dump(self, ctx: DumpContext) -> None:
        try:
            made = await asyncio.to_thread(relink, ctx.pid)
        except NotCheckpointable as exc:
            raise NotCheckpointable(f"checkpoint of {ctx.job} refused: {exc}") from None
        ctx.state[_STATE] = made
        if made:
            (ctx.epoch_tmp / RELINKED).write_bytes(msgspec.json.encode(made))

    async def after_dump(self, ctx: DumpContext) -> None:
        if not ctx.stop:  # a vacate's job dies, and its private tmpfs with it
            await self._undo(ctx)

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        await self._undo(ctx)  # the job goes on

    async def _undo(self, ctx: DumpContext) -> None:
        made = ctx.state.pop(_STATE, None)
        if made:
            await asyncio.to_thread(unlink, ctx.pid, made)

    async def before_resume(self, ctx: RestoreContext) -> None:
        path = Path(ctx.epoch_dir) / RELINKED
        if not path.exists():
            return
        made = msgspec.json.decode(path.read_bytes(), type=list[list[str]])
        await asyncio.to_thread(unlink, ctx.pid, made)

    def inspect(self, pid: int) -> list[JobResource]:
        private = private_devs(pid)
        out, seen = [], set()
        for _, path, st, _ in _held(pid):
            if path in seen:
                continue
            seen.add(path)
            old = path[: -len(_DELETED)]
            if st.st_dev in private:
                out.append(JobResource(kind="file", what=f"{old} (removed; the file keeps another name)",
                                       verdict="carried", reason="named for criu while it dumps, in the job's own tmpfs"))
            else:
                out.append(JobResource(kind="file", what=f"{old} (removed; the file keeps another name)",
                                       verdict="blocking", reason="criu can checkpoint that only in the job's own "
                                                                  "/tmp or /dev/shm"))
        return out
