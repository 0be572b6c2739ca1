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
  owner and mode it had at the dump.  Then :func:`move_aside` moves whatever
  appeared or changed in the working directory after the epoch into
  ``<workdir>/revenant-after-epoch-<N>/`` (never deleted).

The job's user controls these directories and may swap any of them for a link while root
works there: every change is made through descriptors reached without following a link
(agent/beneath.py), never by path.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

import msgspec

from revenant.agent import beneath
from revenant.agent.epochs import EpochError, FilesChanged, JobFile, Manifest
from revenant.agent.fileio import copy_bytes
from revenant.agent.jobfiles import ASIDE_PREFIX, LISTING, fingerprint, open_for_writing, scan_workdir

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


def plan(manifest: Manifest, epoch_dir: Path) -> list[PutBack]:
    """What putting the epoch's files back takes; raises FilesChanged if it cannot be done exactly."""
    n = manifest.epoch
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
    descriptors reached without following a link (agent/beneath.py); a directory that went
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
    if p.source == p.path:  # cut back: the file is its own source
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
            if not in_place or p.source != p.path:  # a new file, or from the epoch's copy
                copy_bytes(src, dst, p.size)
            os.ftruncate(dst, p.size)
            st = os.fstat(src)
            mode, uid, gid = ((p.entry.mode, p.entry.uid, p.entry.gid) if p.entry is not None
                              else (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid))
            os.fchown(dst, uid, gid)
            os.fchmod(dst, mode)  # after chown, which clears set-id bits
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


def swapped(root: int, done: list[PutBack]) -> str | None:
    """A file the restored job (its init ``root``, still stopped) holds open for writing that is
    none of the files put back (``done``), or None.  criu opens the job's files by path, following
    links: a directory the user swapped for a link after the put-back would hand the job a
    descriptor of a file outside its tree, opened by root."""
    expected = {p.inode for p in done if p.inode is not None}
    for path, of in open_for_writing(root).items():
        if (of.st.st_dev, of.st.st_ino) not in expected:
            return path
    return None


# ------------------------------------------------------------------ the working directory

def _aside_dir(top: int, n: int) -> str:
    """A new folder's name in the working directory (``top``, a descriptor), made there with the
    working directory's owner."""
    base, i = f"{ASIDE_PREFIX}{n}", 1
    st = os.fstat(top)
    while True:
        name = base if i == 1 else f"{base}-{i}"
        try:
            os.mkdir(name, 0o700, dir_fd=top)
        except FileExistsError:
            i += 1
            continue
        fd = beneath.walk(top, [name], name)
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o7777 | 0o700)
        finally:
            os.close(fd)
        return name


def _move(top: int, rel: str, aside: str) -> None:
    """Rename ``rel`` (below the working directory ``top``) to the same place below ``aside``,
    through descriptors reached without following a link."""
    *dirs, name = rel.split("/")
    st = os.fstat(top)
    src = beneath.walk(top, dirs, rel)
    try:
        dst = beneath.walk(top, [aside, *dirs], rel, make=(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode) | 0o700))
        try:
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)  # a rename, never a copy and delete
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _inside(rel: str, dirs: set[str]) -> bool:
    parts = rel.split("/")
    return any("/".join(parts[:i]) in dirs for i in range(1, len(parts)))


def changed_since(listing: dict[str, list[int]], now: dict[str, list[int]],
                  holds: frozenset[str] = frozenset()) -> list[str]:
    """Entries (relative paths) that appeared or changed after the listing was taken: new, replaced
    (another inode: renamed into place), or, for a file, another size or mtime (written after the
    dump; a file renamed into place can even get the old one's inode number back, which ext4
    reuses at once).  Outermost only: a new or replaced directory moves whole, unless it ``holds``
    one of the job's covered files (those are put back where they were: it is entered instead).
    Directories' own mtimes are not changes."""
    moved: list[str] = []
    dirs: set[str] = set()
    for rel in sorted(now):
        if _inside(rel, dirs) or rel in holds:
            continue
        ino, size, mtime, is_dir = now[rel]
        then = listing.get(rel)
        if then is None or then[0] != ino or then[3] != is_dir or (not is_dir and (then[1], then[2]) != (size, mtime)):
            moved.append(rel)
            dirs.add(rel)
    return moved


def _held_open() -> set[tuple[int, int]]:
    """(device, inode) of every file a process on this node holds open: never moved away from it."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            held.add((st.st_dev, st.st_ino))
    return held


def _holders(workdir: str, covered: Collection[str]) -> frozenset[str]:
    """Relative paths of the directories in ``workdir`` that hold a covered file."""
    holds = set()
    for path in covered:
        if path.startswith(workdir + "/"):
            parts = path[len(workdir) + 1:].split("/")
            holds.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(holds)


def _dev(workdir: str, rel: str) -> int | None:
    try:
        return os.lstat(os.path.join(workdir, rel)).st_dev
    except OSError:  # gone since the scan
        return None


def _move_all(workdir: str, moved: list[str], n: int) -> str:
    """Move each of ``moved`` into a new folder of ``workdir``; the folder's path."""
    try:
        top = beneath.open_dir(workdir)
    except OSError as exc:
        raise EpochError(f"cannot move entries of {workdir} aside: {exc.strerror or exc}") from None
    try:
        aside = _aside_dir(top, n)
        for rel in moved:
            try:
                _move(top, rel, aside)
            except FileNotFoundError:
                continue  # gone since the scan: nothing to move
            except OSError as exc:
                raise EpochError(f"cannot move {os.path.join(workdir, rel)} aside to "
                                 f"{os.path.join(workdir, aside, rel)}: {exc.strerror or exc}") from None
    except OSError as exc:
        raise EpochError(f"cannot make a folder in {workdir} to move entries aside: {exc.strerror or exc}") from None
    finally:
        os.close(top)
    return os.path.join(workdir, aside)


def move_aside(manifest: Manifest, epoch_dir: Path, max_entries: int, leave: str = "") -> list[str]:
    """Move what appeared or changed in the workdir after the epoch into a folder named after it;
    ``leave``: why the workdir must be left as it is (another job uses it)."""
    n, workdir = manifest.epoch, manifest.workdir
    if not workdir:
        return []
    if manifest.workdir_note or leave:
        return [f"the working directory's changes after epoch {n} were left in place: {manifest.workdir_note or leave}"]
    try:
        listing = msgspec.json.decode((epoch_dir / LISTING).read_bytes(), type=dict[str, list[int]])
    except (OSError, msgspec.DecodeError) as exc:
        raise EpochError(f"epoch {n}: unreadable {LISTING}: {exc}") from None
    if not os.path.isdir(workdir):
        return [f"the working directory {workdir} is not there: nothing moved aside"]
    now = scan_workdir(workdir, max_entries, frozenset(manifest.job_files))
    if now is None:
        return [f"the working directory's changes after epoch {n} were left in place: it now has more than "
                f"{max_entries} entries (workdir_scan_max_entries)"]
    moved = changed_since(listing, now, _holders(workdir, manifest.job_files))
    notes = []
    if moved:
        held = _held_open()
        busy = [rel for rel in moved if not now[rel][3] and (_dev(workdir, rel), now[rel][0]) in held]
        if busy:
            notes.append(f"left {', '.join(busy[:MAX_NAMED])} in {workdir}, though changed after epoch {n}: "
                         "a process on this node holds it open")
            moved = [rel for rel in moved if rel not in set(busy)]
    if moved:
        aside = _move_all(workdir, moved, n)
        named = ", ".join(moved[:MAX_NAMED]) + (f" and {len(moved) - MAX_NAMED} more" if len(moved) > MAX_NAMED else "")
        notes.append(f"moved {len(moved)} entr{'y' if len(moved) == 1 else 'ies'} of {workdir} that appeared or "
                     f"changed after epoch {n} to {aside}: {named}")
    moved_set = set(moved)
    gone_all = {rel for rel in listing if rel not in now and not _inside(rel, moved_set)}
    gone = [rel for rel in gone_all if not _inside(rel, gone_all)]
    if gone:
        notes.append(f"{len(gone)} entr{'y' if len(gone) == 1 else 'ies'} of {workdir} at epoch {n} "
                     f"are gone since: {', '.join(sorted(gone)[:MAX_NAMED])}")
    return notes
