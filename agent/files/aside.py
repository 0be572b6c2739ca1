"""Moving aside what appeared or changed in a job's working directory after an epoch, before
criu restores the job: into ``<workdir>/revenant-after-epoch-<N>/``, by renames, never a copy and
a delete, and never anything the job's files need (agent/files/jobfiles_restore.py puts those back).
The user controls the directory: every rename goes through descriptors reached without
following a link (agent/files/beneath.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Collection

import msgspec

from revenant.agent.files import beneath
from revenant.agent.files.jobfiles import ASIDE_PREFIX, LISTING, scan_workdir
from revenant.agent.files.jobfiles_restore import MAX_NAMED
from revenant.agent.storage.epochs import EpochError, Manifest


def _aside_dir(top: int, n: int, owner: tuple[int, int, int]) -> str:
    """A new folder's name in the working directory (``top``, a descriptor), made there with
    ``owner`` (uid, gid, mode: the working directory's)."""
    base, i = f"{ASIDE_PREFIX}{n}", 1
    while True:
        name = base if i == 1 else f"{base}-{i}"
        try:
            os.mkdir(name, 0o700, dir_fd=top)
        except FileExistsError:
            i += 1
            continue
        fd = beneath.walk(top, [name], name)
        try:
            if os.fstat(fd).st_uid != os.geteuid():  # swapped since it was made: never given away
                raise beneath.Unsafe(0, "it was replaced as it was made", name)
            os.fchown(fd, owner[0], owner[1])
            os.fchmod(fd, owner[2])
        finally:
            os.close(fd)
        return name


def _move(top: int, rel: str, aside: str, owner: tuple[int, int, int]) -> None:
    """Rename ``rel`` (below the working directory ``top``) to the same place below ``aside``,
    through descriptors reached without following a link; directories made there get ``owner``."""
    *dirs, name = rel.split("/")
    src = beneath.walk(top, dirs, rel)
    try:
        dst = beneath.walk(top, [aside, *dirs], rel, make=owner)
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
        st = os.fstat(top)
        owner = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode) | 0o700)  # the working directory's, once
        aside = _aside_dir(top, n, owner)
        for rel in moved:
            try:
                _move(top, rel, aside, owner)
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


def move_aside(manifest: Manifest, epoch_dir: Path, max_entries: int, leave: str = "",
               snapshot: frozenset[str] = frozenset()) -> list[str]:
    """Move what appeared or changed in the workdir after the epoch into a folder named after it;
    ``leave``: why the workdir must be left as it is (another job uses it); ``snapshot``: the
    files (relative paths) the epoch holds whole (agent/files/workdir.py), never moved while they are
    regular files: they are put back after this."""
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
    stats: dict[str, os.stat_result] = {}
    now = scan_workdir(workdir, max_entries, frozenset(manifest.job_files), stats)
    if now is None:
        return [f"the working directory's changes after epoch {n} were left in place: it now has more than "
                f"{max_entries} entries (workdir_scan_max_entries)"]
    keep = {rel for rel in snapshot if rel in stats and stat.S_ISREG(stats[rel].st_mode)}
    # A directory that holds one is entered, never moved whole (nor, once it is not one, moved at all:
    # a rename takes whatever the name holds by then; putting back through it is refused instead).
    holders = _holders(workdir, [*manifest.job_files, *(os.path.join(workdir, rel) for rel in snapshot)])
    moved = changed_since(listing, now, frozenset(keep) | holders)
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
    gone_all = {rel for rel in listing if rel not in now and not _inside(rel, moved_set) and rel not in snapshot
                and not (rel in holders and listing[rel][3])}
    gone = [rel for rel in gone_all if not _inside(rel, gone_all)]
    if gone:
        notes.append(f"{len(gone)} entr{'y' if len(gone) == 1 else 'ies'} of {workdir} at epoch {n} "
                     f"are gone since: {', '.join(sorted(gone)[:MAX_NAMED])}")
    return notes
