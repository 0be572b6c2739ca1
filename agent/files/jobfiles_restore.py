"""Putting a job's own files back as they were at an epoch, before criu restores it.

Two phases, so a refused epoch changes nothing and the engine can try an older one:

* :func:`plan` checks every file the epoch covers against what is on disk now and
  decides what to do, or raises :class:`FilesChanged` naming the file and why:

  ==========================================  =========================================
  the file now                                 with a copy in the epoch / without one
  ==========================================  =========================================
  as at the dump, or only grown                put back from the copy / cut back to its
                                               size (its sampled fingerprint must match)
  rewritten in place, shorter, or gone         put back from the copy / **refused**
  ==========================================  =========================================

* :func:`apply` carries the plan out (:func:`put_back`), giving each file the
  owner and mode it had at the dump.  Then :func:`revenant.agent.files.aside.move_aside` moves whatever
  appeared or changed in the working directory after the epoch into
  ``<workdir>/revenant-after-epoch-<N>/`` (never deleted).

The job's user controls these directories and may swap any of them for a link while root
works there: every change is made through descriptors reached without following a link
(agent/files/beneath.py), never by path.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from revenant.agent.files import beneath
from revenant.agent.files.jobfiles import HELD, HELD_FORMAT, fingerprint
from revenant.agent.processes.jobprocs import held_paths, open_for_writing
from revenant.agent.storage.epochs import EpochError, FilesChanged, JobFile, Manifest
from revenant.agent.storage.fileio import copy_bytes

# Notes name every file; past this many moved-aside entries, the rest are counted.
MAX_NAMED = 50


@dataclass
class PutBack:
    path: str
    size: int
    source: str  # the file to take the first ``size`` bytes from: the epoch's copy or the file itself
    entry: JobFile | None  # owner and mode to give it; None: an old epoch's output (keep them)
    note: str
    new_inode: bool = False  # the job's output in revenant's storage (see put_back)
    make_parent: bool = False  # its directory is gone, and lies in the job's working directory
    workdir: str = ""  # that working directory (make_parent only)
    inode: tuple[int, int] | None = None  # (device, inode) of the file put back, once it is
    mtime_ns: int | None = None  # the mtime to give it (a working directory's file: make reads it)
    # Writes its ``size`` bytes into the descriptor it is given, from its start (a packed file of
    # the working directory: agent/files/workdir_restore.py); then ``source`` is not read.
    fill: Callable[[int], None] | None = None


def _stat(path: str, n: int) -> os.stat_result | None:
    """The file as it is now (None if gone); refuses what the epoch's file cannot be put back over."""
    try:
        fd, name = beneath.open_parent(path)
    except FileNotFoundError:
        return None
    except beneath.Unsafe:
        raise FilesChanged(f"a directory on the path of {path} is now a symlink; refusing epoch {n}") from None
    except OSError as exc:
        raise FilesChanged(f"cannot look at {path}: {exc.strerror}; refusing epoch {n}") from None
    try:
        st = beneath.lstat_in(fd, name)
    finally:
        os.close(fd)
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
            "not a regular file"
        raise FilesChanged(f"{path} is now {kind}; refusing to put epoch {n}'s file back over it")
    if os.path.realpath(path) != path:
        raise FilesChanged(f"a directory on the path of {path} is now a symlink; refusing epoch {n}")
    return st


def _sample(path: str, size: int) -> str:
    parent, name = beneath.open_parent(path)
    try:
        fd = beneath.open_file(parent, name, os.O_RDONLY)
    finally:
        os.close(parent)
    try:
        return fingerprint(fd, size)
    finally:
        os.close(fd)


def _in_storage(path: str, epoch_dir: Path) -> bool:
    return path.startswith(os.path.realpath(epoch_dir.parent.parent) + "/")  # <storage>/jobs/<id>/epochs/<n>


def _check(path: str, e: JobFile, n: int, epoch_dir: Path, workdir: str) -> PutBack:
    try:
        return _decide(path, e, n, epoch_dir, workdir)
    except OSError as exc:
        raise FilesChanged(f"cannot check {path}: {exc.strerror or exc}; refusing epoch {n}") from None


def _decide(path: str, e: JobFile, n: int, epoch_dir: Path, workdir: str) -> PutBack:
    st = _stat(path, n)
    unchanged = st is not None and (st.st_ino, st.st_size, st.st_mtime_ns) == (e.ino, e.size, e.mtime_ns)
    if e.copy and e.append and st is not None and st.st_ino == e.ino and st.st_size >= e.size and (
            not e.sample or _sample(path, e.size) == e.sample):
        return _cut_back(path, e, n, epoch_dir, st)  # the log only grew: cut back, not copied
    if e.copy:
        note = "" if unchanged else f"restored {path} from epoch {n}'s copy ({_how(st, e)} since the dump)"
        parent = os.path.dirname(path)
        make_parent = not os.path.isdir(parent)
        if make_parent and not (workdir and parent.startswith(workdir + "/")):
            raise FilesChanged(f"{path} cannot be put back: its directory {parent} is gone; refusing epoch {n}")
        return PutBack(path, e.size, str(epoch_dir / e.copy), e, note, _in_storage(path, epoch_dir), make_parent,
                       workdir if make_parent else "")
    why = f"epoch {n} holds no copy of it: {e.no_copy}" if e.no_copy else f"epoch {n} holds no copy of it"
    if st is None:
        raise FilesChanged(f"{path} is gone since epoch {n} and {why}")
    if st.st_size < e.size:
        raise FilesChanged(f"{path} is {st.st_size} bytes, shorter than at epoch {n} ({e.size}), and {why}")
    if not e.append and not unchanged and st.st_size == e.size:
        raise FilesChanged(f"{path} was rewritten in place since epoch {n} and {why}")
    if e.sample and _sample(path, e.size) != e.sample:
        raise FilesChanged(f"{path} was rewritten in place since epoch {n} (its first {e.size} bytes "
                           f"differ) and {why}")
    return _cut_back(path, e, n, epoch_dir, st)


def _cut_back(path: str, e: JobFile, n: int, epoch_dir: Path, st: os.stat_result) -> PutBack:
    grown = st.st_size - e.size
    note = f"cut {path} back {grown} bytes to its size at epoch {n}" if grown else ""
    return PutBack(path, e.size, path, e, note, _in_storage(path, epoch_dir))


def _how(st: os.stat_result | None, e: JobFile) -> str:
    if st is None:
        return "deleted"
    if st.st_size < e.size:
        return "truncated"
    if st.st_ino != e.ino:
        return "replaced"
    return "grown" if st.st_size > e.size else "rewritten"


def users_uid(user: str) -> int | None:
    """The uid of ``user`` here, None for root's job (or a record from before jobs had users);
    KeyError if the user is unknown here."""
    if user in ("", "root"):
        return None
    return pwd.getpwnam(user).pw_uid or None


def _users_uid(manifest: Manifest) -> int | None:
    try:
        return users_uid(manifest.user)
    except KeyError:
        raise FilesChanged(f"the job's user {manifest.user!r} is unknown here; refusing epoch {manifest.epoch}") from None


def plan(manifest: Manifest, epoch_dir: Path) -> list[PutBack]:
    """What putting the epoch's files back takes; raises FilesChanged if it cannot be done exactly.
    A user's job gets back only its user's own files: root never writes, nor gives its old mode
    back to, a file of another user's that the job could write at the dump (its owner may have
    taken that right away since)."""
    n = manifest.epoch
    uid = _users_uid(manifest)
    for path, e in sorted(manifest.job_files.items()):
        if uid is not None and e.uid != uid:
            raise FilesChanged(f"{path} belongs to uid {e.uid}, not to the job's user {manifest.user} (uid {uid}): "
                               f"a restore puts back only its user's own files; refusing epoch {n}")
    plan = [_check(path, e, n, epoch_dir, manifest.workdir) for path, e in sorted(manifest.job_files.items())]
    for path, size in manifest.outputs.items():  # an epoch from before job_files: its output only
        if path in manifest.job_files:
            continue  # written for older agents alongside job_files
        st = _stat(path, n)
        if st is None:
            raise FilesChanged(f"output file {path} is gone; cannot restore epoch {n}")
        if st.st_size < size:
            raise FilesChanged(f"output file {path} is {st.st_size} bytes, shorter than at the dump ({size}): "
                               f"data was lost; refusing to restore epoch {n}")
        grown = st.st_size - size
        plan.append(PutBack(path, size, path, None, f"cut {path} back {grown} bytes to its size at epoch {n}"
                            if grown else "", new_inode=True))
    return plan


def put_back(p: PutBack) -> None:
    """Make ``p.path`` hold the first ``p.size`` bytes of ``p.source``, with its owner and mode at the dump.

    The job's own files keep their inode, rewritten in place: programs remember it (SQLite
    refuses to write a database whose path now names another inode, "attempt to write a
    readonly database").  The job's output under revenant's storage gets a new inode
    instead: a stale copy of the job still running somewhere keeps writing into the old one,
    never into the restored job's output (the fence at the resource).  Every step goes through
    descriptors reached without following a link (agent/files/beneath.py); a directory that went
    (``p.make_parent``) is made again below ``p.workdir``, with the working directory's owner."""
    parent, name = _parent(p)
    try:
        _put_back_in(p, parent, name)
        os.fsync(parent)
    finally:
        os.close(parent)


def _parent(p: PutBack) -> tuple[int, str]:
    if not p.make_parent:
        return beneath.open_parent(p.path)
    workdir = p.workdir
    top = beneath.open_dir(workdir)
    try:
        st = os.fstat(top)
        rel = os.path.relpath(os.path.dirname(p.path), workdir).split("/")
        return beneath.walk(top, rel, p.path, make=(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))), \
            os.path.basename(p.path)
    finally:
        os.close(top)


def _put_back_in(p: PutBack, parent: int, name: str) -> None:
    existing = beneath.lstat_in(parent, name)
    in_place = not p.new_inode and existing is not None
    if p.fill is not None:
        src = -1
    elif p.source == p.path:  # cut back: the file is its own source
        src = beneath.open_file(parent, name, os.O_RDONLY)
    else:
        src = os.open(p.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    tmp = name if in_place else f".{name}.{secrets.token_hex(4)}"
    try:
        dst = beneath.open_file(parent, tmp, os.O_WRONLY if in_place else os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            if in_place and p.entry is not None and os.fstat(dst).st_uid != p.entry.uid:
                raise beneath.Unsafe(0, f"it is now owned by uid {os.fstat(dst).st_uid}, not uid {p.entry.uid} "
                                        "as at the dump", p.path)
            if p.fill is not None:
                p.fill(dst)
            elif not in_place or p.source != p.path:  # a new file, or from the epoch's copy
                copy_bytes(src, dst, p.size)
            os.ftruncate(dst, p.size)
            if p.entry is not None:
                mode, uid, gid = p.entry.mode, p.entry.uid, p.entry.gid
            else:
                st = os.fstat(src)
                mode, uid, gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
            os.fchown(dst, uid, gid)
            os.fchmod(dst, mode)  # after chown, which clears set-id bits
            if p.mtime_ns is not None:
                os.utime(dst, ns=(p.mtime_ns, p.mtime_ns))
            os.fsync(dst)
            done = os.fstat(dst)
            p.inode = (done.st_dev, done.st_ino)
        finally:
            os.close(dst)
        if not in_place:
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        if not in_place:
            try:
                os.unlink(tmp, dir_fd=parent)
            except OSError:
                pass
        raise
    finally:
        if src >= 0:
            os.close(src)


def apply(plan: list[PutBack]) -> list[str]:
    for p in plan:
        try:
            put_back(p)
        except OSError as exc:
            raise EpochError(f"cannot put back {p.path}: {exc.strerror or exc}") from None
    notes = [p.note for p in plan if p.note]
    if len(notes) > MAX_NAMED:  # a reply stays small: the rest are counted
        notes = notes[:MAX_NAMED] + [f"and {len(notes) - MAX_NAMED} more files cut back or restored"]
    return notes


_DELETED = " (deleted)"


def _same(was: str, now: str) -> bool:
    """A held path as at the dump; a file held deleted comes back as criu's ghost of it, deleted
    again, in the same directory (where the dump made sure no one but root can change a thing)."""
    return was == now or (was.endswith(_DELETED) and now.endswith(_DELETED)
                          and os.path.dirname(was) == os.path.dirname(now))


def _criu_own(link: str, path: str, scratch: str) -> bool:
    """One of the two descriptors criu's restorer still holds at its post-restore action: its
    log, in its scratch directory, and its /proc (a procfs root: a directory, inode 1)."""
    if scratch and path.startswith(scratch + "/"):
        return True
    try:
        st = os.stat(link)
    except OSError:
        return False
    return path == "/" and stat.S_ISDIR(st.st_mode) and st.st_ino == 1


def swapped(root: int, done: list[PutBack], epoch_dir: Path, covers_writable: bool = True,
            scratch: str = "") -> str | None:
    """A path the restored job (its init ``root``, still criu's) holds where it held another at
    the dump (each descriptor, mapping, working and root directory and program, by what holds
    it: the epoch's HELD), or a file it holds open for writing that is none of the files put
    back (``done``; unless the epoch, from before job_files, does not ``covers_writable``);
    None if there is none.  criu opens all of them again as root, by path,
    following links: a directory swapped for a link meanwhile would hand the job root's
    descriptor (or mapping) of a file outside its tree.  Checked at criu's post-restore action,
    while criu's restorer still holds descriptors of its own (its /proc, its log in ``scratch``),
    which it closes before the job runs: a descriptor the job did not have at the dump is one."""
    try:
        recorded = msgspec.json.decode((epoch_dir / HELD).read_bytes(), type=dict[str, str])
    except FileNotFoundError:
        recorded = None  # an epoch from before HELD: its writable files are checked
    except (OSError, msgspec.DecodeError) as exc:
        raise EpochError(f"epoch {epoch_dir.name}: unreadable {HELD}: {exc}") from None
    if recorded is not None:
        # Epochs from before HELD_FORMAT recorded only descriptors of paths, never deleted ones.
        complete = recorded.pop(HELD_FORMAT, "") == "2"
        links: dict[str, str] = {}
        for key, path in held_paths(root, links).items():
            was = recorded.get(key)
            if was is None and " fd " in key and _criu_own(links[key], path, scratch):
                continue  # closed by criu's restorer before the job runs
            if was is None and not complete and (not path.startswith("/") or path.endswith(_DELETED)):
                continue
            if was is None or not _same(was, path):
                return f"{path} (process {key.replace(' ', ': ', 1)}, {was or 'nothing'} at the dump)"
    if not covers_writable:
        return None
    expected = {p.inode for p in done if p.inode is not None}
    for path, of in open_for_writing(root).items():
        if (of.st.st_dev, of.st.st_ino) not in expected and not (scratch and path.startswith(scratch + "/")):
            return path
    return None
