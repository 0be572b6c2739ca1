"""A job's working directory listed: once in full before the freeze, then again while the job is
frozen at the cost of its directories only.

A project directory is large (a checkout with its ``.venv``: 12,000 files in 1,700 directories)
and almost all of it stands still.  The freeze must not grow with it, so:

* :func:`scan` lists everything (each entry's ``lstat``), before the dump, while the job runs;
* :func:`rescan`, while the job is frozen, takes each directory that did not change since the scan
  as the scan found it, its files' stats too, except those the caller wants fresh (``fresh``:
  files that may have been written since, which the snapshot reads); a directory that changed is
  listed again, in full.  Which changed, the kernel says where it can (agent/files/dirwatch.py:
  the scan watched each directory before reading it), with no system call for the others; else
  each directory is looked at (one ``stat``): one whose inode, mtime and ctime are those of the
  scan has the same entries (a create, unlink or rename in it changes its mtime).

A file whose stat came from the scan may have changed between the scan and the freeze: the
caller checks it once the job runs again (agent/files/workdir_taken.py), and a change fails the
epoch, never a record that is not the dump's.

Every directory is reached from the working directory without following a link
(agent/files/beneath.py), and at most a few dozen are open at once, whatever the tree.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Callable

from revenant.agent.files import beneath, dirwatch

# Caches the workdir may hold that are nobody's output.
UNTRACKED = frozenset({"__pycache__"})
ASIDE_PREFIX = "revenant-after-epoch-"


class TooMany(Exception):
    """More entries than the listing may hold."""


@dataclass
class Scan:
    workdir: str
    listing: dict[str, list[int]] = field(default_factory=dict)  # rel: [inode, size, mtime_ns, is_dir]
    stats: dict[str, os.stat_result] = field(default_factory=dict)  # each file's (not a directory's)
    dirs: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # rel ("" the top): inode, mtime, ctime
    kids: dict[str, list[str]] = field(default_factory=dict)  # a directory's listed entries (rels)
    # Split before the freeze (:func:`split`), by directory: what an unchanged directory gives as it
    # is (its subdirectories' and its settled files' listing entries and stats), the files the
    # freeze stats again, and the subdirectories to visit.
    settled: dict[str, tuple[dict[str, list[int]], dict[str, os.stat_result]]] = field(default_factory=dict)
    restat: dict[str, list[str]] = field(default_factory=dict)
    subdirs: dict[str, list[str]] = field(default_factory=dict)
    # From :func:`rescan` of a split scan: the directories listed anew (their entries' stats are fresh).
    changed: set[str] | None = None
    # The directories' watches (-1: none), and where the scan began in the watch's changes (-1: not watched).
    wds: dict[str, int] = field(default_factory=dict)
    since: int = -1


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


class _Walk:
    def __init__(self, workdir: str, max_entries: int, skip: frozenset[str],
                 watch: dirwatch.DirWatch | None = None) -> None:
        self.out = Scan(workdir)
        self.max_entries = max_entries
        self.skip = skip  # absolute paths never listed
        self.tree = beneath.Dirs(workdir)
        top = self.tree.get("")
        self.dev = os.fstat(top).st_dev
        self.watch = watch if watch is not None and dirwatch.local(top) else None
        if self.watch is not None:
            self.out.since = self.watch.mark()

    def enter(self, rel: str) -> int | None:
        """``rel``'s descriptor (the walk's), and its key noted; None if it is no longer a directory there."""
        try:
            fd = self.tree.get(rel)
        except OSError:
            if not rel:
                raise
            return None  # swapped for a link, or gone, since: not entered
        st = os.fstat(fd)
        if st.st_dev != self.dev or not stat.S_ISDIR(st.st_mode):
            return None
        self.out.dirs[rel] = _key(st)
        if self.watch is not None:  # before its entries are read: a change after that is told
            self.out.wds[rel] = self.watch.add(fd)
        if rel:
            self.out.listing[rel] = [st.st_ino, st.st_size, st.st_mtime_ns, 1]
        return fd

    def add(self, rel: str, st: os.stat_result) -> bool:
        """Whether ``rel`` is a directory to enter."""
        is_dir = stat.S_ISDIR(st.st_mode)
        self.out.listing[rel] = [st.st_ino, st.st_size, st.st_mtime_ns, int(is_dir)]
        if not is_dir:
            self.out.stats[rel] = st
        if len(self.out.listing) > self.max_entries:
            raise TooMany
        return is_dir

    def list_dir(self, rel: str, fd: int, stack: list[str]) -> None:
        """Every entry of ``rel`` stat'ed afresh; its directories onto ``stack``."""
        kids = self.out.kids[rel] = []
        try:
            names = [e.name for e in os.scandir(fd)]
        except OSError:
            names = []
        workdir = self.out.workdir
        for name in names:
            child = f"{rel}/{name}" if rel else name
            if (not rel and name.startswith(ASIDE_PREFIX)) or name in UNTRACKED or name.startswith(".nfs") \
                    or (self.skip and os.path.join(workdir, child) in self.skip):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != self.dev:
                continue  # a mount point: another filesystem, never listed nor moved
            kids.append(child)
            if self.add(child, st):
                stack.append(child)


def scan(workdir: str, max_entries: int, skip: frozenset[str] = frozenset(),
         watch: dirwatch.DirWatch | None = None) -> Scan | None:
    """Everything under ``workdir`` on its own filesystem, revenant's moved-aside folders, ``skip``
    (absolute paths), ``__pycache__`` and NFS's ``.nfs*`` placeholders excepted; None if there are
    more than ``max_entries``.  ``watch``: each directory watched for changes from now on."""
    walk = _Walk(workdir, max_entries, skip, watch)
    try:
        stack = [""]
        while stack:
            rel = stack.pop()
            fd = walk.enter(rel)
            if fd is not None:
                walk.list_dir(rel, fd, stack)
    except TooMany:
        return None
    finally:
        walk.tree.close()
    return walk.out


def split(pre: Scan, fresh: Callable[[str, os.stat_result], bool]) -> Scan:
    """Before the freeze: ``pre`` split by directory into what :func:`rescan` takes as it is and
    the files ``fresh`` names, which it stats again."""
    for rel, kids in pre.kids.items():
        listing, stats, restat, subdirs = {}, {}, [], []
        for child in kids:
            st = pre.stats.get(child)
            if st is None:
                subdirs.append(child)
                listing[child] = pre.listing[child]
            elif fresh(child, st):
                restat.append(child)
            else:
                listing[child] = pre.listing[child]
                stats[child] = st
        pre.settled[rel], pre.restat[rel], pre.subdirs[rel] = (listing, stats), restat, subdirs
    return pre


def rescan(pre: Scan, max_entries: int, skip: frozenset[str], fresh: Callable[[str, os.stat_result], bool],
           again: frozenset[str] = frozenset(), watch: dirwatch.DirWatch | None = None) -> Scan | None:
    """The listing now, from ``pre`` (see the module): the directories visited, those unchanged
    taken from ``pre`` but for the files :func:`split` named (with ``fresh``, if ``pre`` was not
    split before the freeze) and ``again`` (relative paths), which are stat'ed again.  ``watch``:
    the one ``pre`` was listed with, which says which directories changed since."""
    if not pre.settled:
        split(pre, fresh)
    return _rescan_split(pre, max_entries, skip, again, watch)


def _rescan_split(pre: Scan, max_entries: int, skip: frozenset[str], again: frozenset[str],
                  watch: dirwatch.DirWatch | None) -> Scan | None:
    walk = _Walk(pre.workdir, max_entries, skip)
    workdir, out = pre.workdir, walk.out
    top = walk.tree.get("")
    listing, stats = out.listing, out.stats
    out.changed = set()
    dirty = watch.dirty(pre.since) if watch is not None and pre.since >= 0 else None
    if dirty is not None and os.fstat(top).st_ino != pre.dirs.get("", (-1,))[0]:
        dirty = None  # the working directory itself is another now
    try:
        stack = [""]
        while stack:
            rel = stack.pop()
            settled = pre.settled.get(rel)
            wd = pre.wds.get(rel, -1)
            if settled is not None and dirty is not None and wd >= 0 and wd not in dirty \
                    and (not rel or rel.rpartition("/")[0] not in out.changed):
                pass  # unchanged, the kernel says; entered from a parent that was not listed anew
            elif settled is not None:
                try:  # by its path from the top, one call (see rescan)
                    st = os.stat(rel or ".", dir_fd=top, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_dev != walk.dev:
                    continue
                if pre.dirs.get(rel) != _key(st):
                    settled = None
            if settled is None:  # new or changed: entered without following a link, listed anew
                out.changed.add(rel)
                fd = walk.enter(rel)
                if fd is not None:
                    walk.list_dir(rel, fd, stack)
                continue
            listing.update(settled[0])
            stats.update(settled[1])
            for child in pre.restat[rel]:
                try:
                    st = os.stat(child, dir_fd=top, follow_symlinks=False)
                except OSError:
                    continue
                if walk.add(child, st):  # a file made a directory with its parent unchanged: entered
                    stack.append(child)
            stack.extend(pre.subdirs[rel])
        if skip:
            for path in skip:
                if path.startswith(workdir + "/"):
                    listing.pop(path[len(workdir) + 1:], None)
                    stats.pop(path[len(workdir) + 1:], None)
        for child in again:  # held since the split: stat'ed now
            if child in stats and child not in pre.restat.get(child.rpartition("/")[0], ()):
                try:
                    st = os.stat(child, dir_fd=top, follow_symlinks=False)
                except OSError:
                    continue
                walk.add(child, st)
        if len(listing) > max_entries:
            return None
    except TooMany:
        return None
    finally:
        walk.tree.close()
    return out
