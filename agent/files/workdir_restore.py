"""Putting a job's working directory back as it was at an epoch (its snapshot: agent/files/workdir.py),
before criu restores the job and after agent/files/aside.py moved aside what appeared since.

Every file that changed or went since the epoch gets back its content, size, mode, owner and
mtime: in place where the path still names a regular file (the inode a program knows is kept),
made again, with its directories, where it went.  Idempotent: a put-back cut short is completed
by the next restore of the epoch.  Every path is walked from the working directory without
following a link (agent/files/beneath.py).
"""

from __future__ import annotations

import functools
import os
import pwd
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from revenant.agent.files import beneath
from revenant.agent.files.gate.firstwrites import Entry
from revenant.agent.files.jobfiles_restore import MAX_NAMED, PutBack, put_back
from revenant.agent.files.workdir import WorkdirFile, size_text
from revenant.agent.storage.chain import Recipe, stream, workdir_recipe
from revenant.agent.storage.epochs import EpochError, JobFile, Manifest
from revenant.agent.storage.manifest import EpochStore


@dataclass
class Plan:
    workdir: str
    epoch: int
    todo: list[PutBack] = field(default_factory=list)
    files: int = 0  # files in the snapshot
    unchanged: int = 0
    # Files recorded by identity (never written since the job started, or written by another
    # process as the epoch was taken) that changed since: left as they are now (no copy holds them).
    left: list[str] = field(default_factory=list)
    # Of those, the ones the job itself first wrote after the epoch (agent/files/gate/firstwrites.py):
    # cut back to their size at it where they only grew (in todo), else left with their content lost.
    cut: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


def plan(manifest: Manifest, epoch_dir: Path, snapshot: dict[str, WorkdirFile], files: EpochStore,
         firsts: dict[str, Entry] | None = None) -> Plan:
    """What putting the working directory back as at the epoch takes (after agent/files/aside.py moved
    aside what appeared since, and anything that is no longer a regular file where one was).
    A packed file's pages are read from ``files``' packs (agent/files/workdir_packs.py).  ``firsts``:
    the job's first writes since the epoch, by relative path (agent/files/gate/firstwrites.py)."""
    workdir, n = manifest.workdir, manifest.epoch
    out = Plan(workdir, n, files=len(snapshot))
    keep_setgid = _setgid_rule(manifest.user)
    dirs = beneath.Dirs(workdir)  # each directory walked to once, a few kept open
    gone: set[str] = set()
    try:
        for rel, rec in sorted(snapshot.items()):
            head, _, name = rel.rpartition("/")
            parent = None
            if head not in gone:
                try:
                    parent = dirs.get(head)
                except FileNotFoundError:
                    gone.add(head)
                except OSError as exc:
                    raise EpochError(f"cannot put back {os.path.join(workdir, rel)}: {exc.strerror or exc}") \
                        from None
            st = beneath.lstat_in(parent, name) if parent is not None else None
            if st is not None and stat.S_ISREG(st.st_mode) and rec.same(st):
                out.unchanged += 1
                continue
            path = os.path.join(workdir, rel)
            mode = rec.mode if keep_setgid(rec.gid) else rec.mode & ~stat.S_ISGID
            entry = JobFile(size=rec.size, mode=mode, uid=rec.uid, gid=rec.gid, ino=rec.ino, mtime_ns=rec.mtime_ns)
            if not rec.copy:
                first = (firsts or {}).get(rel)
                if first is None or first.ino != rec.ino:
                    out.left.append(rel)
                elif st is not None and stat.S_ISREG(st.st_mode) and st.st_ino == rec.ino and st.st_size > rec.size:
                    # Only grown since: its first rec.size bytes are the epoch's (a log appended to).
                    out.cut.append(rel)
                    out.todo.append(PutBack(path, rec.size, path, entry, "", mtime_ns=rec.mtime_ns))
                else:
                    out.lost.append(rel)
                continue
            fill = None
            if rec.runs is not None:
                what = f"epoch {n}: the working directory's {rel}"
                fill = functools.partial(_fill, files, workdir_recipe(manifest, rec, what), rec.size, rec.crc, what)
            out.todo.append(PutBack(path, rec.size, str(epoch_dir / rec.copy), entry, "",
                                    make_parent=st is None, workdir=workdir, mtime_ns=rec.mtime_ns, fill=fill))
    finally:
        dirs.close()
    return out


def _fill(files: EpochStore, recipe: Recipe, size: int, crc: str, what: str, fd: int) -> None:
    """A packed file's content, from its packs, into ``fd`` from its start (checked: CorruptEpoch)."""
    os.lseek(fd, 0, os.SEEK_SET)
    with open(os.dup(fd), "wb") as out:
        stream(files, recipe, size, crc, what, out)


def _setgid_rule(user: str) -> Callable[[int], bool]:
    """Whether a file of ``user``'s job may get its set-group-id bit back for a group: only if
    the user is still in that group (root never hands back a group the user has left)."""
    if user in ("", "root"):
        return lambda gid: True
    try:
        pw = pwd.getpwnam(user)
        groups = set(os.getgrouplist(user, pw.pw_gid))
    except KeyError:
        return lambda gid: False
    return groups.__contains__


def apply(p: Plan, on_step: Callable[[str], None] = lambda step: None) -> list[str]:
    for todo in p.todo:
        on_step(f"put back {todo.path}")
        try:
            put_back(todo)
        except OSError as exc:
            raise EpochError(f"cannot put back {todo.path}: {exc.strerror or exc}") from None
    notes = []
    if p.cut:
        notes.append(f"cut back {len(p.cut)} files of {p.workdir} to their size at epoch {p.epoch}: the job first "
                     f"wrote them after it, and they only grew since: {_named(p.cut)}")
    if p.lost:
        notes.append(f"left {len(p.lost)} files of {p.workdir} as they are now: the job first wrote them after "
                     f"epoch {p.epoch}, which recorded them by identity only, and they did not only grow: "
                     f"their content at the epoch is gone: {_named(p.lost)}")
    cut = set(p.cut)
    put = [t for t in p.todo if os.path.relpath(t.path, p.workdir) not in cut]
    if put:
        notes.append(f"put back {len(put)} of the {p.files} files of {p.workdir} as they were at epoch {p.epoch} "
                     f"({size_text(sum(t.size for t in put))}; changed or gone since): "
                     f"{_named([os.path.relpath(t.path, p.workdir) for t in put])}")
    if p.left:
        notes.append(f"left {len(p.left)} files of {p.workdir} as they are now: changed or gone since epoch {p.epoch}, "
                     f"and not kept by it (not written since the job started, or written by another process as it was "
                     f"taken): {_named(p.left)}")
    return notes


def _named(names: list[str]) -> str:
    return ", ".join(names[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")
