"""A job's working directory as part of its epoch: every regular file in it as it was at the dump.

A program that opens, writes and closes its files (PostgreSQL's relation files, SQLite without a
long-lived handle, a training script rewriting ``model.ckpt``, ``git``) holds none of them open
at the dump, so agent/files/jobfiles.py's copies of open files do not cover them.  The restored process
expects their content as of the epoch, and only the epoch can give it.  So:

* a file nobody has written since the job started (its ctime older than the job's start,
  ``since_ns``: a dataset, a virtual environment, a git object store) is recorded by its identity
  only (inode, size, mtime, ctime, mode, owner: ``copy`` ""): never copied, never gated, whatever
  its size, and not counted against the budget.  A file once written stays written: the next
  epochs keep it (linked while it is unchanged);
* while the job is frozen, :meth:`Taker.take` records every other regular file of the working
  directory (the listing agent/files/jobfiles.py walks: path, inode, size, mtime, ctime, mode,
  owner) and keeps its content in the epoch (``files/w<i>``), its size at the dump and no more:
  a hard link to the previous epoch's copy where the file is unchanged since (same inode, size,
  mtime and ctime: ctime cannot be set back by a program), made once the job runs again
  (:func:`finish`); else a copy (a reflink where the filesystem clones), made after the job
  resumes behind agent/files/gate/cowgate.py's gate (an open of the file by the job waits for its
  copy; anyone else's waits half a second at most), or while it is frozen for a file the job
  holds (a descriptor or a mapping writes without an open), for a file with other links (which
  may lie outside the working directory: never gated), and where fanotify cannot gate.  What
  one epoch copies is bounded by ``workdir_snapshot_max_bytes``: over it the dump fails, naming
  the largest files, and the job resumes; never a partial snapshot;
* before criu restores, agent/files/workdir_restore.py puts back every file that changed since,
  or went: its content, size, mode, owner and mtime, in place (the inode a program may know is
  kept) or made again.  agent/files/aside.py moves aside only what appeared after the epoch.  A
  file recorded by identity that changed since is left as it is now, and the restore says so.

A user's job covers only its user's own files (root never writes another user's file back).
A restore is idempotent: one cut short (the agent killed) is completed by the next restore of
the epoch, which is what failover does.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from revenant.agent.files import beneath, jobfiles_restore, workdir_packs, workdir_taken
from revenant.agent.files.gate import cowgate
from revenant.agent.storage.epochs import FILES_DIR, EpochError, Manifest
from revenant.agent.storage.manifest import JobCaused
from revenant.agent.storage.fileio import copy_bytes, reflink
from revenant.agent.storage.manifest import WorkdirFile
from revenant.agent.storage.manifest import read_workdir as read  # an epoch's snapshot (callers know it here)
# What a snapshot took, and its finish once the job runs again (re-exported: callers know them here).
from revenant.agent.files.workdir_taken import SCRATCH, Taken, finish, link_all  # noqa: F401

_COPY = f"{FILES_DIR}/w"
# The largest files an over-budget error names.
_NAMED = 3
# A file changed this close to the dump is "racy" (WorkdirFile): 2 s where its filesystem keeps
# whole seconds (its times have no fraction), 20 ms where it keeps finer (the kernel's clock ticks).
RACY_NS = (2_000_000_000, 20_000_000)


# The job's start, less this, is its snapshots' ``since_ns``: a file written just before it started
# (its script, its config) is copied, and so is any file whose filesystem's clock runs this far behind.
SINCE_MARGIN_NS = 2 * 1_000_000_000


def since_of(prev: Previous | None, root: int) -> int:
    """The moment before which a file not written since is recorded, not copied: the previous
    epoch's (a restored job keeps its first start's), or the start of the job's first process."""
    if prev is not None:
        return prev.since_ns  # 0 for an epoch from before: every file copied, as it was
    try:
        with open(f"/proc/{root}/stat", "rb") as f:
            started_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0
    started_ns = btime * 1_000_000_000 + started_ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return max(0, started_ns - SINCE_MARGIN_NS)


class Changed(EpochError):
    """A file changed between its listing and its copy, while the job was frozen: by another process."""


class OverBudget(JobCaused):
    code = "workdir_budget"


@dataclass
class Previous:
    """The newest committed epoch's snapshot of the same working directory."""

    dir: Path
    files: dict[str, WorkdirFile]
    sums: dict[str, tuple[int, str]]  # its copies' (size, CRC-32), by name
    packs: list[str] = field(default_factory=list)  # its packed files' packs (Manifest.workdir_packs)
    since_ns: int = 0  # Manifest.workdir_since_ns


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def previous(epoch_dir: Path, m: Manifest, workdir: str, same_digest: bool = True) -> Previous | None:
    """Epoch ``m``'s snapshot to link unchanged files from, if it took one of ``workdir``; None if
    not, or if it cannot be read (then every file is copied).  Not ``same_digest`` (its files were
    digested otherwise than the new epoch's are): their digests are left "", for the commit to take."""
    if m.workdir != workdir or not m.workdir_files:
        return None
    try:
        files = read(epoch_dir)
    except EpochError:
        return None
    if not files:
        return None
    return Previous(epoch_dir, files, {n: (e.size, e.checksum if same_digest else "") for n, e in m.files.items()},
                    m.workdir_packs, m.workdir_since_ns)


def users_uid(user: str) -> int | None:
    """The uid whose files a job of ``user`` covers; None: every file (root's job)."""
    try:
        return jobfiles_restore.users_uid(user)
    except KeyError:
        raise EpochError(f"the job's user {user!r} is unknown here") from None


class Taker:
    """The snapshot of the working directory, taken while the job is frozen (see the module)."""

    def __init__(self, workdir: str, epoch_tmp: Path, link_dir: Path, prev: Previous | None, uid: int | None,
                 budget: int, gate: bool = True, racy_ns: tuple[int, int] = RACY_NS,
                 packer: workdir_packs.Packer | None = None, since_ns: int = 0, root: int = 0) -> None:
        self.workdir = workdir
        self.epoch_tmp = epoch_tmp  # where copies go (node-local staging, or the epoch's directory)
        self.link_dir = link_dir  # the epoch's directory on shared storage: links go there
        self.prev = prev
        self.uid = uid
        self.budget = budget
        self.on_step: Callable[[str], None] = lambda step: None  # crash tests stop here
        self.racy_ns = racy_ns  # a file changed this close to the dump is never trusted by its times
        # Copy changed files after the job resumes, behind a gate, where fanotify allows it.
        self.gate = gate and not gate_unavailable()  # (the agent's gate started now, never while frozen)
        self.packer = packer  # changed files of its pack_min or more go into its pack (agent/files/workdir_packs.py)
        self._packed: dict[str, str] = {}  # their copies' paths (what the gate copies to): their copy names
        # A file whose ctime is older than this, and which no earlier epoch kept the content of,
        # was never written since the job started: recorded, not copied (0: every file is copied).
        self.since_ns = since_ns
        self.root = root  # the job's first process: its opens of a gated file wait for the copy
        self._written = frozenset(rel for rel, was in prev.files.items() if was.copy) if prev is not None \
            else frozenset()
        # prepare(): the same records twice, on purpose: by path with the stat they came from
        # (take() without a pre-scan compares it), and by directory (the freeze adds a whole
        # unchanged directory with one dict.update).
        self._settled: dict[str, tuple[os.stat_result, WorkdirFile]] = {}
        self._settled_in: dict[str, dict[str, WorkdirFile]] = {}
        # Before the freeze: what says each of the previous epoch's files is unchanged, for those
        # whose copy (or pages) this epoch can keep: the freeze compares, and decides nothing more.
        self._unchanged: dict[str, tuple[tuple[int, int, int, int], WorkdirFile]] = {}
        if prev is not None:
            base = set(packer.base) if packer is not None else set()
            readable = {i for i, ref in enumerate(prev.packs) if ref in base}  # its segment's packs, readable
            for rel, was in prev.files.items():
                if was.racy:
                    continue
                if was.runs is not None:
                    if len(was.runs) % 3 or not readable.issuperset(was.runs[0::3]):
                        continue
                elif prev.sums.get(was.copy, (-1, ""))[0] != was.size:
                    continue
                self._unchanged[rel] = (was.ino, was.size, was.mtime_ns, was.ctime_ns), was

    def fresh(self, rel: str, st: os.stat_result) -> bool:
        """Whether the freeze must stat ``rel`` again (its stat ``st`` from before the freeze): a
        file of the job's user written since the job started may have been written since; one that
        was not is recorded by that stat, and checked once the job runs again (workdir_taken.finish)."""
        return stat.S_ISREG(st.st_mode) and (self.uid is None or st.st_uid == self.uid) \
            and (st.st_ctime_ns >= self.since_ns or rel in self._written)

    def prepare(self, stats: dict[str, os.stat_result]) -> None:
        """Before the freeze, from its listing (agent/files/workdir_scan.py): the records of the files
        never written since the job started, kept by :meth:`take` where the freeze's stat is that one."""
        uid, regular, since, written = self.uid, stat.S_ISREG, self.since_ns, self._written
        self._settled = {rel: (st, WorkdirFile(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                               stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, ""))
                         for rel, st in stats.items()
                         if regular(st.st_mode) and (uid is None or st.st_uid == uid) and st.st_ctime_ns < since
                         and rel not in written}
        self._settled_in: dict[str, dict[str, WorkdirFile]] = {}  # the same, by directory
        for rel, (_, rec) in self._settled.items():
            self._settled_in.setdefault(rel.rpartition("/")[0], {})[rel] = rec

    def recorded(self) -> dict[str, tuple[int, int]]:
        """After :meth:`prepare`: (inode, size) of each file it recorded by identity."""
        return {rel: (st.st_ino, st.st_size) for rel, (st, _) in self._settled.items()}

    def take(self, stats: dict[str, os.stat_result], held: frozenset[str] = frozenset(),
             changed: set[str] | None = None) -> Taken:
        """``held``: the paths, relative to the workdir as the listing's, that the job maps shared
        and writable: copied while it is frozen, as a write
        through a mapping needs no open the gate would see (files it holds open for writing are
        its job files, not listed here: agent/files/jobfiles.py).  ``changed``: the directories
        whose entries ``stats`` has afresh, the others' being those :meth:`prepare` saw (None:
        every entry checked against them)."""
        taken = Taken(link_from=self.prev.dir if self.prev is not None else Path(), link_to=self.link_dir,
                      packer=self.packer, epoch_tmp=self.epoch_tmp,
                      kept_table=self.prev.packs if self.prev is not None else [], workdir=self.workdir)
        todo: list[tuple[str, WorkdirFile]] = []
        inodes: dict[tuple[int, int], WorkdirFile] = {}
        now = time.time_ns()
        coarse, fine = now - self.racy_ns[0], now - self.racy_ns[1]
        # Held through any of its links: every link of it is racy (decided before the first is linked).
        held_inodes = {(stats[rel].st_dev, stats[rel].st_ino) for rel in held if rel in stats}
        unchanged, uid, regular = self._unchanged, self.uid, stat.S_ISREG
        since, written = self.since_ns, self._written
        # Records made before the freeze, for files whose stat is still that one (prepare).
        files = taken.files
        if changed is not None:
            for head, recs in self._settled_in.items():
                if head not in changed:
                    files.update(recs)
            for rel in held:
                files.pop(rel, None)
            for rel in files.keys() - stats.keys():
                del files[rel]  # left out of the listing while frozen (the job's own open files)
        else:
            for rel, (was, rec) in self._settled.items():
                if stats.get(rel) is was and rel not in held:
                    files[rel] = rec
        for i, rel in enumerate(sorted(stats.keys() - files.keys())):
            st = stats[rel]
            if not regular(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue  # not a regular file, or another user's: left as it is
            key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if st.st_ctime_ns < since and rel not in written and rel not in held:
                # Never written since the job started: its identity is its record.
                files[rel] = WorkdirFile(*key, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, "")
                continue
            racy = max(st.st_ctime_ns, st.st_mtime_ns) > (fine if st.st_mtime_ns % 10**9 else coarse) \
                or (st.st_dev, st.st_ino) in held_inodes
            rec = WorkdirFile(*key, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, f"{_COPY}{i}", racy=racy)
            taken.files[rel] = rec
            if st.st_nlink > 1:
                first = inodes.setdefault((st.st_dev, st.st_ino), rec)
                if first is not rec:  # another link to a file already taken: one copy (never opened twice)
                    rec.copy = first.copy  # (and its runs, if it is packed, the first's: finish)
                    continue
            hit = None if racy else unchanged.get(rel)
            if hit is not None and hit[0] == key:
                self._keep(hit[1], rec, taken)
            else:
                todo.append((rel, rec))
        self._check_budget(todo)
        gate = None
        try:  # else copied while frozen
            gate = cowgate.CowGate(self._gate_copy, self.root) if todo and self.gate else None
        except (OSError, subprocess.SubprocessError) as exc:
            logging.getLogger(__name__).warning("the file gate cannot start (%s): %d files copied while frozen",
                                                exc, len(todo))
        try:
            if todo:
                self._copy_all(todo, held, gate, taken)
        except BaseException:
            if gate is not None:
                gate.close()
            taken.abandon()
            raise
        if gate is not None and gate.gated:
            taken.gate = gate
        elif gate is not None:
            gate.close()
        return taken

    def _copy_all(self, todo: list[tuple[str, WorkdirFile]], held: frozenset[str], gate: cowgate.CowGate | None,
                  taken: Taken) -> None:
        """Gate each changed file (or copy it now: one the job holds, past the gate's descriptors);
        ``held``: relative paths."""
        (self.epoch_tmp / FILES_DIR).mkdir(mode=0o700, exist_ok=True)
        dirs = beneath.Dirs(self.workdir)  # each directory walked to once, a few kept open
        tmp = str(self.epoch_tmp)
        try:
            for rel, rec in todo:
                try:
                    src, st = self._open(dirs, rel, rec)
                except Changed:  # the job is frozen: another process writes it, not the job's to keep
                    workdir_taken.unkept(rec)
                    continue
                dest = f"{tmp}/{rec.copy}"  # a string: a Path costs 10 µs, and this is the freeze
                packed = self.packer is not None and rec.size >= self.packer.pack_min
                if packed:
                    self._packed[dest] = rec.copy
                if gate is not None and rel not in held and st.st_nlink == 1 and _arm(gate, src, dest, rel, st):
                    self.on_step(f"gated {rel}")
                else:
                    try:
                        if packed:  # into the scratch file, packed from there once the job runs (finish)
                            taken.repack.append((rec.copy, self._frozen_copy(src, rec.size, taken), rec.size))
                        else:
                            _copy_now(src, dest, rec.size)
                    finally:
                        os.close(src)
                    self.on_step(f"copied {rel}")
                if packed:
                    rec.runs = []  # set once it is packed (finish)
                    continue  # its bytes: the new pages it adds (finish)
                taken.copied += rec.size
        finally:
            dirs.close()

    def _frozen_copy(self, src: int, size: int, taken: Taken) -> int:
        """Copy a file to be packed into the epoch's one scratch file, at a page boundary (a clone
        where the filesystem can); where it starts.  One file, not one each: thousands of files
        made and removed each epoch slow the next epoch's creates (ext4 leaves a removed inode
        unused for seconds to minutes)."""
        if taken.scratch < 0:
            taken.scratch = os.open(self.epoch_tmp / SCRATCH, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                    0o600)
        at = -(-os.fstat(taken.scratch).st_size // 4096) * 4096
        copy_bytes(src, taken.scratch, size, at)
        return at

    def _gate_copy(self, src: int, dest: str, size: int) -> None:
        """The gate's copy of a changed file, its ``size`` bytes at the dump: into the pack, or whole."""
        copy = self._packed.get(dest)
        if copy is not None and self.packer is not None:
            self.packer.pack(src, copy, 0, size)
        else:
            _copy_now(src, dest, size)

    def _keep(self, was: WorkdirFile, rec: WorkdirFile, taken: Taken) -> None:
        """``rec`` is unchanged since the previous epoch (``was``): its copy is that epoch's, linked
        after the job resumes (link_all: the copy never changes, the decision is made here), or its
        runs are that epoch's, over packs this epoch's segment reads."""
        if was.runs is not None:
            taken.kept[rec.copy], rec.runs = (was.runs, was.crc), []
        else:
            taken.links.append((was.copy, rec.copy))  # names: a Path each costs 10 µs, 10,000 of them a freeze
            taken.known[rec.copy] = self.prev.sums[was.copy]  # type: ignore[union-attr]
        taken.linked += rec.size

    def _check_budget(self, todo: list[tuple[str, WorkdirFile]]) -> None:
        total = sum(rec.size for _, rec in todo)
        if total <= self.budget:
            return
        largest = sorted(todo, key=lambda t: -t[1].size)[:_NAMED]
        if self._clones(*largest[0]):
            return
        named = ", ".join(f"{rel} ({size_text(rec.size)})" for rel, rec in largest)
        raise OverBudget(f"the working directory's changes since the last epoch are {size_text(total)} in {len(todo)} "
                         f"files, over workdir_snapshot_max_bytes ({size_text(self.budget)}); the largest: {named}")

    def _clones(self, rel: str, rec: WorkdirFile) -> bool:
        """A file of the workdir clones into the epoch (the same filesystem, with reflinks): copies
        then cost no bytes, whatever the budget.  Tried on ``rel`` itself, into a scratch name."""
        dirs = beneath.Dirs(self.workdir)
        probe = self.epoch_tmp / ".reflink-probe"
        try:
            try:
                src, _ = self._open(dirs, rel, rec)
            except EpochError:
                return False
            try:
                dst = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    return reflink(src, dst)
                finally:
                    os.close(dst)
                    os.unlink(probe)
            finally:
                os.close(src)
        finally:
            dirs.close()

    def _open(self, dirs: beneath.Dirs, rel: str, rec: WorkdirFile) -> tuple[int, os.stat_result]:
        """A read-only descriptor of ``rel``, checked to be the file the listing saw, and its stat."""
        head, _, name = rel.rpartition("/")
        try:
            src = beneath.open_file(dirs.get(head), name, os.O_RDONLY)
        except FileNotFoundError:
            raise Changed(f"{os.path.join(self.workdir, rel)} went while the job was frozen") from None
        except OSError as exc:
            raise EpochError(f"cannot snapshot {os.path.join(self.workdir, rel)}: {exc.strerror or exc}") from None
        st = os.fstat(src)
        if st.st_ino != rec.ino or st.st_size != rec.size or st.st_ctime_ns != rec.ctime_ns:
            os.close(src)
            raise Changed(f"cannot snapshot {os.path.join(self.workdir, rel)}: it changed while the job was "
                          "frozen (another process writes it)")
        return src, st


def gate_unavailable() -> str:
    """Why changed files are copied while the job is frozen here ("" if they need not be)."""
    return cowgate.unavailable()


def _arm(gate: cowgate.CowGate, src: int, dest: str, rel: str, st: os.stat_result) -> bool:
    try:
        return gate.arm(src, dest, rel, st)
    except OSError:  # out of descriptors or marks: copied now instead
        return False


def _copy_now(src: int, dest: Path | str, size: int) -> None:
    """``size`` bytes of ``src`` (its size at the dump: never what it grew to since) into ``dest``."""
    dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if reflink(src, dst):
            if os.fstat(dst).st_size != size:
                os.ftruncate(dst, size)
        else:
            copy_bytes(src, dst, size)
    finally:
        os.close(dst)
