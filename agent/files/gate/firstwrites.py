"""A job's first write to a file its epoch recorded by identity only, journaled as it happens, so
that a restore of that epoch can cut the file back.

A file of the working directory that nobody wrote since the job started (a dataset, a log left by
an earlier run) is recorded by its identity, never copied (agent/files/workdir.py).  If the job
first writes it after an epoch, that epoch holds none of its bytes: a job restored from it would
find what it wrote later, and a log it appends to would get those lines twice.

So, before each dump (from its listing, taken while the job runs) and before a restored job
resumes (from its epoch's), the agent watches each such file of each of its jobs for changes (fanotify notification events, agent/files/gate/changes.py: they never make anyone wait),
and when a process of the job changes one, appends a line to the job's journal on shared storage
(``first-writes.jsonl``: when, which file, its inode, its size at the epoch) and stops watching it
for that job (its next epoch keeps it: it was written since the job started).  A change by any
other process is not the job's, and is left to the rule for those (left as it is).

A restore of an epoch that recorded the file by identity, finding it journaled as first written
by the job after the epoch, cuts it back to its size at the epoch where it only grew, same inode
(the bytes before that size are the epoch's, for a job that appends to it), and otherwise leaves
it and says the epoch's content is gone (agent/files/workdir_restore.py).  A write in the moment
between it and its journal line reaching the storage (the node dying then) is not journaled.

At most ``MAX_WATCHED`` files are watched by the agent at once; past it, a job's other recorded
files are not, and the first checkpoint that finds that logs it.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from revenant.agent.files.gate import changes as gatechanges
from revenant.agent.files.gate.cowgate import descends

log = logging.getLogger(__name__)

JOURNAL = "first-writes.jsonl"  # in the job's directory on shared storage
MAX_WATCHED = 100_000


class Entry(msgspec.Struct, array_like=True):
    time: float  # wall clock, when the event was read
    path: str  # relative to the job's working directory
    ino: int
    size: int  # at the epoch that recorded it


@dataclass
class _Job:
    root: int  # its first process: it and its descendants are the job
    journal: Path
    workdir: str
    files: dict[gatechanges.Handle, tuple[str, int, int]] = field(default_factory=dict)  # (rel, inode, size)
    by_path: dict[str, int] = field(default_factory=dict)  # rel -> inode watched


class Watcher:
    """The agent's one watcher (:func:`shared`): its group, and the thread that reads it."""

    def __init__(self) -> None:
        self._changes = gatechanges.Changes()
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._watchers: dict[gatechanges.Handle, set[str]] = {}  # file -> the jobs watching it
        self.watched = 0
        self._thread = threading.Thread(target=self._run, name="first-writes", daemon=True)
        self._thread.start()

    def watch(self, job: str, root: int, journal: Path, workdir: str, cold: dict[str, tuple[int, int]]) -> int:
        """Blocking: watch the files ``cold`` (relative path -> (inode, size): those not written
        since the job started) for the job's first writes, instead of what it watched before; how
        many are."""
        try:
            top = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("job %s: its working directory's first writes are not watched: %s", job, exc)
            self.forget(job)
            return 0
        try:
            with self._lock:
                old = self._jobs.get(job)
                if old is not None and old.workdir != workdir:
                    self._drop(job)
                    old = None
                for other in [j for j, st in self._jobs.items() if j != job and not _alive(st.root)]:
                    self._drop(other)  # ended without a word
                state = old or _Job(root, journal, workdir)
                state.root, state.journal = root, journal
                keep = {h: (rel, ino, cold[rel][1]) for h, (rel, ino, _) in state.files.items()
                        if rel in cold and cold[rel][0] == ino}
                for h in set(state.files) - set(keep):
                    self._unwatch(job, h, top)
                state.files = keep
                state.by_path = {rel: ino for rel, ino, _ in keep.values()}
                self._jobs[job] = state
            todo = [(rel, ino, size) for rel, (ino, size) in sorted(cold.items()) if state.by_path.get(rel) != ino]
            self._mark(job, state, top, todo)
            return len(state.files)
        finally:
            os.close(top)

    def _mark(self, job: str, state: _Job, top: int, todo: list[tuple[str, int, int]]) -> None:
        unwatched = 0
        dirs: dict[str, int] = {"": top}
        try:
            for rel, ino, size in todo:
                head, _, name = rel.rpartition("/")
                with self._lock:
                    full = self.watched >= MAX_WATCHED
                if full:
                    unwatched += 1
                    continue
                try:
                    d = dirs.get(head)
                    if d is None:
                        d = dirs[head] = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                                 dir_fd=top)
                    if os.stat(name, dir_fd=d, follow_symlinks=False).st_ino != ino:
                        continue  # changed since the listing: the next epoch has it
                    h = self._changes.mark_at(d, name)
                except OSError:
                    continue  # gone, or a link on its way: nothing of the epoch's to watch
                with self._lock:
                    if job in self._jobs:
                        state.files[h] = (rel, ino, size)
                        state.by_path[rel] = ino
                        jobs = self._watchers.setdefault(h, set())
                        self.watched += not jobs
                        jobs.add(job)
        finally:
            for head, d in dirs.items():
                if head:
                    os.close(d)
        if unwatched:
            log.warning("job %s: %d of its working directory's files recorded by identity are not watched for a "
                        "first write (the agent watches %d at most): a restore leaves them as they are",
                        job, unwatched, MAX_WATCHED)

    def forget(self, job: str) -> None:
        """The job is no longer the agent's: nothing of it is watched any more."""
        with self._lock:
            if job in self._jobs:
                self._drop(job)

    def _drop(self, job: str) -> None:
        """(Under the lock.)"""
        state = self._jobs.pop(job)
        top = _open_dir(state.workdir)
        try:
            for h in list(state.files):
                self._unwatch(job, h, top)
        finally:
            if top >= 0:
                os.close(top)

    def _unwatch(self, job: str, h: gatechanges.Handle, top: int) -> None:
        """(Under the lock.)  The job no longer watches ``h``; nor the group, if no job does."""
        jobs = self._watchers.get(h)
        if jobs is None:
            return
        jobs.discard(job)
        if not jobs:
            del self._watchers[h]
            self.watched -= 1
            if top >= 0:
                self._changes.unmark_handle(top, h)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._changes.fd, select.POLLIN)
        while True:
            try:
                poller.poll()
                changed, lost = self._changes.read()
                if lost:
                    log.warning("first writes: fanotify's queue overflowed; some may not be journaled")
                for h, pid in changed:
                    self._changed(h, pid)
            except Exception as exc:  # noqa: BLE001 - a watcher that fails stops journaling, never the agent
                log.error("first writes are no longer journaled: %r", exc)
                return

    def _changed(self, h: gatechanges.Handle, pid: int) -> None:
        with self._lock:
            jobs = [(job, self._jobs[job]) for job in self._watchers.get(h, ()) if job in self._jobs]
        for job, state in jobs:
            got = state.files.get(h)
            if got is None or not descends(pid, state.root):
                continue
            rel, ino, size = got
            try:
                _append(state.journal, Entry(time=time.time(), path=rel, ino=ino, size=size))
            except OSError as exc:
                log.warning("job %s: cannot journal its first write to %s: %s", job, rel, exc)
                continue
            with self._lock:
                if state.files.pop(h, None) is not None:
                    state.by_path.pop(rel, None)
                    top = _open_dir(state.workdir)
                    try:
                        self._unwatch(job, h, top)
                    finally:
                        if top >= 0:
                            os.close(top)


def _open_dir(path: str) -> int:
    """A descriptor of ``path`` to find files by handle on its filesystem (-1: gone)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


def _alive(pid: int) -> bool:
    return pid > 0 and os.path.exists(f"/proc/{pid}")


def _append(journal: Path, entry: Entry) -> None:
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, msgspec.json.encode(entry) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def first_writes(journal: Path, since: float) -> dict[str, Entry]:
    """The job's first writes journaled at ``since`` (wall clock) or later, by relative path (the
    earliest of each); a line cut short (a crash as it was written) is skipped."""
    try:
        data = journal.read_bytes()
    except FileNotFoundError:
        return {}
    found: dict[str, Entry] = {}
    for line in data.splitlines():
        try:
            entry = msgspec.json.decode(line, type=Entry)
        except msgspec.DecodeError:
            continue
        if entry.time >= since and entry.path not in found:
            found[entry.path] = entry
    return found


_shared: Watcher | None = None
_unavailable = ""
_shared_lock = threading.Lock()


def shared() -> Watcher | None:
    """The agent's watcher, made on first use (None where fanotify cannot report changes: said once)."""
    global _shared, _unavailable
    with _shared_lock:
        if _shared is None and not _unavailable:
            try:
                _shared = Watcher()
            except OSError as exc:
                _unavailable = str(exc)
                log.warning("first writes to a job's recorded files are not watched: %s", exc)
        return _shared
