"""A job's own files at the dump: which it holds open for writing, their sizes, copies.

criu restores a process's open files by path and refuses one whose size changed
since the dump; a file that only grew (a log in append mode) restores "fine"
with everything written after the epoch duplicated.  So while criu holds the
job frozen (its post-dump action script), :class:`Snapshot` records, for every
regular file any process of the job holds open for writing:

* its size, owner, mode, inode and mtime, and whether every descriptor of it is
  in append mode;
* a copy, inside the epoch, of each file opened for writing *without* O_APPEND
  (rewritten in place: ``"w"``, ``"r+"``, a database): a reflink where the
  filesystem clones (instant, whatever the size), else a copy in the kernel for
  files up to ``file_snapshot_max_bytes``.  A larger file is recorded "not
  copied" with a fingerprint of its content (:func:`fingerprint`).  An append-mode
  file is cut back on restore, and copied as well up to ``APPEND_COPY_MAX_BYTES``
  (or reflinked), for when it was renamed away or replaced since;
* a listing of the job's working directory (inode, size, mtime of every
  entry, at most ``workdir_scan_max_entries``), so a restore can move aside
  what appeared or changed after the epoch (``agent/files/jobfiles_restore.py``).

Files on a filesystem mounted inside the job's own mount namespace (its private
``/tmp`` and ``/dev/shm``) are skipped: criu dumps their contents itself.

The action script and this module meet over two FIFOs, so the work runs in
the agent (in a thread, no interpreter to start) while criu waits; the job
stays frozen only as long as the scan and the copies take.
"""

from __future__ import annotations

import os
import pwd
import select
import stat
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from revenant.agent.files import dirwatch, remade, workdir_scan
from revenant.agent.files.asuser import files as userfiles
from revenant.agent.files.workdir_scan import ASIDE_PREFIX, UNTRACKED  # noqa: F401 - known here
from revenant.agent.processes.jobprocs import PSEUDO, OpenFile, held_paths, open_for_writing
from revenant.agent.storage.epochs import (FILES_DIR, HELD, LISTING, REMADE, USER_FILES, USER_SOCKETS, EpochError,
                                          JobFile)
from revenant.agent.storage.fileio import copy_bytes, reflink

# In an epoch (HELD): every path the job held at the dump (held_paths), what its restore may open.
# Its key saying that every descriptor is in it (not only those of paths), with its format.
HELD_FORMAT = "format"
# Workdirs whose changes are never moved aside: shared by everything on the node.
SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/media", "/mnt",
                         "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var",
                         "/var/tmp", "/var/lib"})
_SAMPLE = 64 * 1024
# An append-mode file is cut back to its size on restore; one this small is copied as well (a
# reflink whatever its size), so that it comes back even if it was renamed away or replaced since
# the dump (a rotated log, a file a tool moved and wrote again).
APPEND_COPY_MAX_BYTES = 64 * 1024
_SAMPLE_BLOCKS = 16
_BLOCK = 4096


def fingerprint(fd: int, size: int) -> str:
    """CRC-32 of a file's first ``size`` bytes, sampled: the first and last 64 KiB and 16 blocks
    spread between (all of it up to 192 KiB).  Checks a file that has no copy: a rewrite of its
    header or its tail (a database's page 1, a log's last line) always shows."""
    if size <= 3 * _SAMPLE:
        spans = [(0, size)]
    else:
        step = (size - 2 * _SAMPLE) // (_SAMPLE_BLOCKS + 1)
        spans = [(0, _SAMPLE)] + [(_SAMPLE + i * step, _BLOCK) for i in range(1, _SAMPLE_BLOCKS + 1)]
        spans.append((size - _SAMPLE, _SAMPLE))
    crc = 0
    for offset, length in spans:
        crc = zlib.crc32(os.pread(fd, length, offset), crc)
    return f"{crc:08x}:{size}"


# ------------------------------------------------------------------ the working directory

def _is_home(real: str) -> bool:
    """``real`` is its owner's home directory (one lookup: never an enumeration of every user)."""
    try:
        return os.path.realpath(pwd.getpwuid(os.stat(real).st_uid).pw_dir) == real
    except (OSError, KeyError):
        return False


def eligible_workdir(workdir: str, storage: Path) -> str | None:
    """Why ``workdir``'s changes after an epoch are not moved aside, or None if they are."""
    if not workdir:
        return "the job has no working directory"
    real = os.path.realpath(workdir)
    if real in SYSTEM_DIRS or real.startswith(PSEUDO) or real == "/dev/shm":
        return f"the working directory {real} is shared by the whole node"
    if _is_home(real):
        return f"the working directory {real} is a home directory (the user's other files are in it)"
    storage_real = os.path.realpath(storage)
    if storage_real == real or storage_real.startswith(real + "/") or real.startswith(storage_real + "/"):
        return f"the working directory {real} overlaps revenant's storage"
    return None


def scan_workdir(workdir: str, max_entries: int, skip: frozenset[str] = frozenset(),
                 stats: dict[str, os.stat_result] | None = None) -> dict[str, list[int]] | None:
    """``relative path: [inode, size, mtime_ns, is_dir]`` of everything under ``workdir`` on its
    own filesystem, revenant's moved-aside folders, ``skip`` (absolute paths), ``__pycache__``
    and NFS's ``.nfs*`` placeholders excepted (``stats``, if given, gets each entry's stat but a
    directory's); None if there are more than ``max_entries``.  Walked through descriptors, from ``/``, never
    through a link (agent/files/beneath.py): a working directory, or a directory in it, swapped for a
    link is never listed (the walk raises OSError, or leaves the entry out)."""
    found = workdir_scan.scan(workdir, max_entries, skip)
    if found is None:
        return None
    if stats is not None:
        stats.update(found.stats)
    return found.listing


# ------------------------------------------------------------------ the snapshot, while frozen

@dataclass
class SnapshotResult:
    files: dict[str, JobFile] = field(default_factory=dict)
    workdir: str = ""
    workdir_note: str = ""  # why the workdir was not listed ("" if it was)
    error: str = ""  # the snapshot failed: the dump must fail with this line
    seconds: float = 0.0  # how long it held the job frozen
    ran: bool = False  # the action script said "frozen"
    done: bool = False  # serve() has answered
    taken: object = None  # the working directory's snapshot (agent/files/workdir.py Taken), if one was taken
    job_caused: bool = False  # the error is the job's own doing (manifest.JobCaused)


class Snapshot:
    """The post-dump rendezvous: :meth:`script_lines` go into criu's action script, :meth:`serve`
    runs in a thread of its own while criu dumps, :meth:`release` (always called once criu has
    exited) lets it go, whether or not the script ever spoke.

    The agent holds both FIFOs open read-write from the start, so nothing on either side ever
    blocks in open(): the script's "frozen" waits in one pipe, the answer in the other, and the
    script's wait for it is bounded (``timeout_s``): a snapshot that hangs fails the dump and
    the job resumes, it never stays frozen."""

    def __init__(self, root: int, epoch_tmp: Path, scratch: Path, *, workdir: str, storage: Path,
                 max_bytes: int, max_entries: int, timeout_s: float = 120.0,
                 taker: Callable[[dict[str, os.stat_result], frozenset[str], set[str] | None], object] | None = None,
                 pre: workdir_scan.Scan | None = None,
                 fresh: Callable[[str, os.stat_result], bool] = lambda rel, st: True,
                 user_files: dict[str, userfiles.Held] | None = None) -> None:
        self.root = root
        # The FIFOs and deleted files criu was told to dump as external (agent/files/asuser/files.py).
        self.user_files = user_files or {}
        self.taker = taker  # the working directory's snapshot (agent/files/workdir.py Taker.take), or None
        # The working directory listed before the freeze (agent/files/workdir_scan.py), and which of
        # its files the freeze stats again (the rest are checked once the job runs: workdir_taken.py).
        self.pre = pre
        self.fresh = fresh
        self.epoch_tmp = epoch_tmp
        self.workdir = workdir
        self.storage = storage
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self.fifo_in = scratch / "frozen.fifo"
        self.fifo_out = scratch / "done.fifo"
        os.mkfifo(self.fifo_in, 0o600)
        os.mkfifo(self.fifo_out, 0o600)
        self._in = os.open(self.fifo_in, os.O_RDWR | os.O_NONBLOCK)
        self._out = os.open(self.fifo_out, os.O_RDWR | os.O_NONBLOCK)
        self._released = threading.Event()
        self.result = SnapshotResult()
        self._later: list[tuple[str, object]] = []  # written once the job runs again: (name, value)

    def script_lines(self) -> list[str]:
        """Shell for the post-dump action: say "frozen", wait (bounded) for the answer; anything
        but "ok" fails the dump."""
        q_in, q_out = _sh(str(self.fifo_in)), _sh(str(self.fifo_out))
        return [f"echo frozen > {q_in}",
                f"r=$(timeout {max(1, int(self.timeout_s))} sh -c 'head -n 1 < \"$0\"' {q_out})",
                '[ "$r" = ok ] || exit 1']

    def release(self) -> None:
        self._released.set()

    def why_failed(self) -> str:
        """The snapshot's reason for a failed dump, or "" if it has none."""
        if self.result.error:
            return self.result.error
        if self.result.ran and not self.result.done:
            return (f"the job's files were not snapshotted within {self.timeout_s:g} s "
                    "(file_snapshot_timeout_s); the job was resumed")
        return ""

    def serve(self) -> SnapshotResult:
        """Wait for the script's "frozen", take the snapshot, answer; then wait for release()."""
        word = "error"
        try:
            if self._wait_frozen():
                self.result.ran = True
                started = time.monotonic()
                try:
                    self.take()
                    word = "ok"
                finally:
                    self.result.seconds = time.monotonic() - started
                    if self._released.is_set():  # criu gave up waiting: nobody finishes what was taken
                        getattr(self.result.taken, "abandon", lambda: None)()
        except Exception as exc:  # noqa: BLE001 - any failure must fail the dump, not hang it
            self.result.error = self.result.error or f"cannot snapshot the job's files: {exc}"
        finally:
            self.result.done = True
            try:
                os.write(self._out, word.encode() + b"\n")
                self._write_later()
                self._released.wait()  # the script may still be on its way to read the answer
            finally:
                os.close(self._in)
                os.close(self._out)
        return self.result

    def _wait_frozen(self) -> bool:
        poller = select.poll()
        poller.register(self._in, select.POLLIN)
        said = b""
        while not self._released.is_set():
            if poller.poll(100):
                said += os.read(self._in, 64)
                if b"frozen" in said:
                    return True
        return False

    def take(self) -> None:
        """The snapshot itself (the job is frozen): open files, their copies, the workdir listing."""
        carried = frozenset(userfiles.dumped(self.epoch_tmp) & self.user_files.keys()) if self.user_files \
            else frozenset()
        why, again, sockets = remade.refusal(self.root, self.epoch_tmp, carried)
        if why:
            self.result.error = why
            raise EpochError(why)
        self._write(REMADE, again)
        if sockets.make or sockets.nameless:
            self._write(USER_SOCKETS, sockets)
        if carried:
            try:
                self._write(USER_FILES, userfiles.taken(self.user_files, set(carried), self.epoch_tmp, self.max_bytes))
            except EpochError as exc:
                self.result.error = str(exc)
                raise
        files = open_for_writing(self.root)
        copies = self.epoch_tmp / FILES_DIR
        for i, (path, of) in enumerate(sorted(files.items())):
            try:
                self.result.files[path] = self._record(of, copies, i)
            except OSError as exc:
                self.result.error = f"cannot snapshot {path}: {exc.strerror or exc}"
                raise
        # Mapped shared and writable: written with no open the gate would see, nor any write(2).
        writable: set[str] = set()
        held = held_paths(self.root, writable=writable)
        self._write(HELD, {HELD_FORMAT: "2", **held})
        self.result.workdir = self.workdir
        why = eligible_workdir(self.workdir, self.storage)
        if why is None and os.path.realpath(self.workdir) != self.workdir:
            why = f"the working directory {self.workdir} leads through a link now: its changes are not tracked"
        listing = None
        stats: dict[str, os.stat_result] = {}
        changed: set[str] | None = None  # the directories listed anew while frozen (None: all of them)
        top = self.workdir.rstrip("/") + "/"
        held_rel = frozenset(p[len(top):] for p in writable if p.startswith(top))  # relative, as the listing's
        if why is None:
            try:
                if self.pre is not None and self.pre.workdir == self.workdir:
                    found = workdir_scan.rescan(self.pre, self.max_entries, frozenset(files), self.fresh, held_rel,
                                                dirwatch.shared() if self.pre.since >= 0 else None)
                    if found is not None:
                        listing = found.listing
                        stats.update(found.stats)
                        changed = found.changed
                else:
                    listing = scan_workdir(self.workdir, self.max_entries, frozenset(files), stats)
            except OSError as exc:
                why = f"cannot list the working directory: {exc.strerror}"
            else:
                if listing is None:
                    why = f"the working directory has more than {self.max_entries} entries (workdir_scan_max_entries)"
        self.result.workdir_note = why or ""
        if listing is not None:
            self._later.append((LISTING, listing))
            if self.taker is not None:
                try:
                    self.result.taken = self.taker(stats, held_rel, changed)
                except OSError as exc:
                    self.result.error = f"cannot snapshot the working directory: {exc.strerror or exc}"
                    raise
                except EpochError as exc:
                    self.result.error = str(exc)
                    self.result.job_caused = getattr(exc, "job_caused", False)
                    raise

    def _write_later(self) -> None:
        """What the snapshot took that need not be written while the job is frozen (the listing:
        thousands of entries), written once it was answered; a failure fails the dump."""
        try:
            for name, value in self._later:
                self._write(name, value)
        except OSError as exc:
            self.result.error = self.result.error or f"cannot write the job's file listing: {exc.strerror or exc}"
        self._later = []

    def _write(self, name: str, value: object) -> None:
        """``value`` as JSON in the epoch, private as the images are (agent/storage/private.py)."""
        with open(os.open(self.epoch_tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(msgspec.json.encode(value))

    def _record(self, of: OpenFile, copies: Path, i: int) -> JobFile:
        st = of.st
        entry = JobFile(size=st.st_size, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                        ino=st.st_ino, mtime_ns=st.st_mtime_ns, append=of.append)
        src = os.open(of.source, os.O_RDONLY)
        try:
            copies.mkdir(exist_ok=True, mode=0o700)
            name = f"{FILES_DIR}/{i}"
            dst = os.open(self.epoch_tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if reflink(src, dst):
                    entry.copy = name
                elif st.st_size <= (min(APPEND_COPY_MAX_BYTES, self.max_bytes) if of.append else self.max_bytes):
                    copy_bytes(src, dst, st.st_size)
                    entry.copy = name
            finally:
                os.close(dst)
            if not entry.copy:
                os.unlink(self.epoch_tmp / name)
                entry.no_copy = "append-only: cut back to its size on restore" if of.append else (
                    f"{st.st_size} bytes, over file_snapshot_max_bytes ({self.max_bytes}), "
                    "on a filesystem without reflinks")
            if of.append or not entry.copy:  # what a cut back, or a restore without a copy, checks
                entry.sample = fingerprint(src, st.st_size)
            return entry
        finally:
            os.close(src)


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
