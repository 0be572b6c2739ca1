"""The engine step for a job's own files: taken while criu holds the job frozen
(agent/files/jobfiles.py), put back before a restore (agent/files/jobfiles_restore.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import msgspec

from revenant.agent.files import (aside, dirwatch, jobfiles_restore, remade, workdir, workdir_packs,
                                  workdir_restore, workdir_scan)
from revenant.agent.files.asuser import files as userfiles
from revenant.agent.files.asuser import sockets as usersockets
from revenant.agent.files.gate import firstwrites
from revenant.agent.files.jobfiles import Snapshot, SnapshotResult, eligible_workdir
from revenant.agent.network import criuimages, netstate
from revenant.agent.pipeline.steps import BaseStep, DumpContext, RestoreContext
from revenant.agent.storage import packs
from revenant.agent.storage.epochs import EpochError, FileEntry, JobFiles, Manifest
from revenant.messages import CheckpointPolicy, JobResource

log = logging.getLogger(__name__)

# DumpContext.state's key for the epoch's packer of working-directory files (agent/files/workdir_packs.py).
_PACKER = "workdir-packer"
# RestoreContext.state's key for the epoch's files recorded by identity (rel -> inode, size): watched
# for the job's first writes before it resumes (agent/files/gate/firstwrites.py).
_COLD = "workdir-cold"
# Once criu has exited, the snapshot's thread has answered (or never started): this long at most.
_SETTLE_S = 5.0


def _in_thread(snap: Snapshot, name: str) -> asyncio.Future[SnapshotResult]:
    """``snap.serve`` in a thread of its own: never queued behind the default executor's
    other work while the job is frozen."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[SnapshotResult] = loop.create_future()

    def settle(result: SnapshotResult) -> None:
        if not done.done():
            done.set_result(result)

    def run() -> None:
        result = snap.serve()
        try:
            loop.call_soon_threadsafe(settle, result)
        except RuntimeError:
            pass  # the loop is gone (the agent stopped): nobody waits any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def _newest(files: JobFiles, job_workdir: str) -> workdir.Previous | None:
    """The newest committed epoch's snapshot of ``job_workdir``: its unchanged files are linked."""
    for n in reversed(files.committed()):
        try:
            m = files.read_signed(n)  # with image keys its copies' digests are vouched for by its signature
        except EpochError:
            continue
        # Digested otherwise than new epochs are (before image keys, or with an older key): linked, read again.
        same = (m.checksum, m.key_id) == (files.digest.name, files.digest.key_id)
        return workdir.previous(files.epoch_dir(n), m, job_workdir, same)
    return None


def prepare_workdir(files: JobFiles, job_workdir: str, full_every: int) -> tuple[workdir.Previous | None,
                                                                          workdir_packs.Packer]:
    """Before the dump (the job still runs): the previous snapshot, and the packer of this
    epoch's changed files, with the indexes of the packs of its segment it deduplicates against."""
    prev = _newest(files, job_workdir)
    n = files.next_number()  # the epoch this will be (one checkpoint of a job at a time)
    seg = packs.segment_of(n, full_every)
    base = [ref for ref in prev.packs if ref.startswith(f"{seg}/")] if prev is not None else []
    return prev, workdir_packs.Packer(files, n, seg, base)


def _always(rel: str, st: os.stat_result) -> bool:
    return True


def _scan_before(job_workdir: str, storage: Path, max_entries: int,
                 taking: workdir.Taker) -> workdir_scan.Scan | None:
    """The working directory listed before the freeze, split into what the freeze takes as it is
    and what it stats again, and the records of the files never written made (None: listed in
    full while frozen)."""
    if eligible_workdir(job_workdir, storage) is not None:
        return None
    try:
        pre = workdir_scan.scan(job_workdir, max_entries, watch=dirwatch.shared())
    except OSError:
        return None
    if pre is not None:
        taking.prepare(pre.stats)
        workdir_scan.split(pre, taking.fresh)
    return pre


class JobFilesStep(BaseStep):
    name = "job-files"

    def __init__(self, storage: Path, max_bytes: int = 64 * 1024**2, max_entries: int = 20_000,
                 timeout_s: float = 120.0, workdir_max_bytes: int = 4 * 1024**3, workdir_gate: bool = True) -> None:
        self.storage = storage
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self.workdir_max_bytes = workdir_max_bytes  # 0: no snapshot of the working directory
        self.workdir_gate = workdir_gate  # False: changed files copied while frozen (bench/file_freeze.py)

    async def before_dump(self, ctx: DumpContext) -> None:
        taker = pre = None
        fresh = _always
        if self.workdir_max_bytes > 0 and ctx.job_workdir:
            full_every = ctx.policy.full_every if ctx.policy is not None else CheckpointPolicy().full_every
            prev, packer = await asyncio.to_thread(prepare_workdir, ctx.files, ctx.job_workdir, full_every)
            ctx.state[_PACKER] = packer
            since = workdir.since_of(prev, ctx.pid)
            ctx.manifest.workdir_since_ns = since
            taking = workdir.Taker(ctx.job_workdir, ctx.epoch_tmp, ctx.shared_tmp, prev,
                                   workdir.users_uid(ctx.manifest.user), self.workdir_max_bytes,
                                   self.workdir_gate, packer=packer, since_ns=since, root=ctx.pid)
            taker, fresh = taking.take, taking.fresh
            # Listed now, while the job runs: the freeze visits its directories only.
            pre = await asyncio.to_thread(_scan_before, ctx.job_workdir, self.storage, self.max_entries, taking)
            if pre is not None:  # from now on a first write of the job's to one of them is journaled
                await _watch(ctx.job, ctx.pid, ctx.files, ctx.job_workdir, taking.recorded())
        # A user's FIFOs and deleted files where the user can change things: criu dumps them as
        # external, the restore takes them from the user (agent/files/asuser/files.py).
        held = await asyncio.to_thread(userfiles.held, ctx.pid)
        ctx.dump_args += userfiles.external_args(held)
        snap = Snapshot(ctx.pid, ctx.epoch_tmp, ctx.workdir, workdir=ctx.job_workdir, storage=self.storage,
                        max_bytes=self.max_bytes, max_entries=self.max_entries, timeout_s=self.timeout_s,
                        taker=taker, pre=pre, fresh=fresh, user_files=held)
        ctx.post_dump_script += snap.script_lines()
        ctx.why_failed.append(snap.why_failed)
        ctx.job_caused.append(lambda: snap.result.job_caused)
        ctx.state[self.name] = (snap, _in_thread(snap, f"snapshot-{ctx.job}"))

    async def _finish(self, ctx: DumpContext) -> SnapshotResult | None:
        """Let the snapshot's thread go (criu has exited) and take its result; None if it is still
        busy (a hung file system): it is abandoned, and the dump fails."""
        snap, serving = ctx.state.pop(self.name)
        snap.release()
        try:
            return await asyncio.wait_for(asyncio.shield(serving), _SETTLE_S)
        except asyncio.TimeoutError:
            log.error("job %s: the snapshot of its files is still busy after the dump; abandoned", ctx.job)
            return None

    async def after_dump(self, ctx: DumpContext) -> None:
        result = await self._finish(ctx)
        taken = result.taken if result is not None and isinstance(result.taken, workdir.Taken) else None
        try:
            await self._after_dump(ctx, result, taken)
        finally:
            if taken is not None:
                taken.abandon()  # finished already, or the dump failed: its gate never outlives the dump

    async def _after_dump(self, ctx: DumpContext, result: SnapshotResult | None, taken: workdir.Taken | None) -> None:
        if result is None or not result.ran:
            raise EpochError(f"checkpoint of {ctx.job} failed: the job's files were not snapshotted "
                             "while it was frozen")
        if result.error:
            raise EpochError(f"checkpoint of {ctx.job} failed: {result.error}")
        m = ctx.manifest
        m.job_files, m.workdir, m.workdir_note, m.files_s = result.files, result.workdir, result.workdir_note, \
            result.seconds
        if taken is not None:  # the job runs again: its changed files' copies, its unchanged ones' links
            await asyncio.to_thread(workdir.finish, taken)
            m.workdir_files, m.workdir_copied, m.workdir_linked = len(taken.files), taken.copied, taken.linked
            m.workdir_recorded = taken.recorded
            m.workdir_packs = taken.table
            m.files = {n: FileEntry(size=size, checksum=crc) for n, (size, crc) in taken.known.items()}
        try:  # as criu recorded them: read from its images, the job no longer frozen
            m.listening, m.connections = await asyncio.to_thread(criuimages.inet_sockets, ctx.epoch_tmp,
                                                                 netstate.MAX_LISTED)
        except (OSError, ValueError) as exc:
            log.warning("job %s: cannot read its sockets from the images: %s", ctx.job, exc)
        # The output's size as well, as epochs had it before job_files: an older agent restoring
        # this epoch still cuts the output back.
        out = str(ctx.files.output)
        if out in result.files:
            m.outputs = {out: result.files[out].size}

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        if self.name in ctx.state:
            result = await self._finish(ctx)
            if result is not None and isinstance(result.taken, workdir.Taken):
                result.taken.abandon()
        packer = ctx.state.pop(_PACKER, None)
        if packer is not None:  # after the gate let go: nothing packs any more
            await asyncio.to_thread(packer.discard)

    def check_restore(self, manifest: Manifest, epoch_dir: Path,
                      gpus: Sequence[str] = ()) -> list[jobfiles_restore.PutBack]:
        return jobfiles_restore.plan(manifest, epoch_dir)

    async def before_restore(self, ctx: RestoreContext) -> None:
        why = await asyncio.to_thread(remade.recheck_epoch, ctx.epoch_dir, ctx.manifest.user)
        if why:
            raise EpochError(f"restore of job {ctx.job} refused: {why}")
        planned = ctx.checked.get(self.name)  # what check_restore found for this epoch, moments ago

        def put_back() -> list[str]:
            todo = planned if planned is not None else jobfiles_restore.plan(ctx.manifest, ctx.epoch_dir)
            notes = jobfiles_restore.apply(todo)
            ctx.checked[self.name] = todo  # with each file's inode: checked before the job resumes
            m = ctx.manifest
            snapshot = taken = None
            if m.workdir_files and not m.workdir_note:  # read once: put back here, watched before it resumes
                taken = workdir.read(ctx.epoch_dir)
                ctx.state[_COLD] = {rel: (rec.ino, rec.size) for rel, rec in (taken or {}).items()
                                    if not rec.copy and not rec.racy}
                snapshot = None if ctx.leave_workdir else taken
            notes += aside.move_aside(m, ctx.epoch_dir, self.max_entries, leave=ctx.leave_workdir,
                                      snapshot=frozenset(snapshot or ()))
            if snapshot and os.path.isdir(m.workdir):  # after what appeared since went aside
                firsts = firstwrites.first_writes(ctx.files.dir / firstwrites.JOURNAL, m.created_at)
                notes += workdir_restore.apply(workdir_restore.plan(m, ctx.epoch_dir, snapshot, ctx.files, firsts))
            return notes
        ctx.notes += await asyncio.to_thread(put_back)
        await _user_sockets(ctx)
        await _user_files(ctx)

    async def before_resume(self, ctx: RestoreContext) -> None:
        cold = ctx.state.get(_COLD)
        if cold is not None and ctx.manifest.workdir:  # before the job runs again: its first writes
            await _watch(ctx.job, ctx.pid, ctx.files, ctx.manifest.workdir, cold)
        done = ctx.checked.get(self.name) or []
        path = await asyncio.to_thread(jobfiles_restore.swapped, ctx.pid, done, ctx.epoch_dir,
                                       bool(ctx.manifest.job_files), str(ctx.workdir))
        if path is not None:
            raise EpochError(f"restore of job {ctx.job} refused: criu opened {path}, which is not a file the job "
                             "had open at the dump (a directory on its path was swapped while it restored)")

    def inspect(self, pid: int) -> list[JobResource]:
        return remade.inspect(pid)


async def _watch(job: str, root: int, files: JobFiles, job_workdir: str, cold: dict[str, tuple[int, int]]) -> None:
    """The job's first writes to ``cold`` journaled from now on (agent/files/gate/firstwrites.py)."""
    watcher = firstwrites.shared()
    if watcher is not None and cold:
        await asyncio.to_thread(watcher.watch, job, root, files.dir / firstwrites.JOURNAL, job_workdir, cold)


async def _user_sockets(ctx: RestoreContext) -> None:
    """The epoch's sockets taken from the job's user: its listening ones made again by the user,
    for criu to inherit, and its images without their names, nor those of the connections they
    accepted (agent/files/asuser/sockets.py); after the put-back, which moves aside what appeared in
    the workdir since the epoch."""
    try:
        taken = await asyncio.to_thread(usersockets.read, ctx.epoch_dir)
    except (OSError, msgspec.DecodeError) as exc:
        raise EpochError(f"restore of job {ctx.job} refused: unreadable {usersockets.USER_SOCKETS}: {exc}") from None
    if not taken.make and not taken.nameless:
        return
    images = ctx.images or ctx.epoch_dir
    shadow = ctx.workdir / "images-named-by-user"
    try:
        await asyncio.to_thread(usersockets.shadow, images, shadow, taken)
        fds = await asyncio.to_thread(usersockets.make, taken.make)
    except (OSError, IndexError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise EpochError(f"restore of job {ctx.job} refused: cannot make its socket again as its user: {why}") from None
    ctx.pass_fds += fds
    ctx.images = shadow
    ctx.criu_args = (*ctx.criu_args, *usersockets.inherit_args(taken.make, fds))


async def _user_files(ctx: RestoreContext) -> None:
    """The epoch's FIFOs and deleted files taken from the job's user: opened or made by the user,
    for criu to inherit (agent/files/asuser/files.py); after the put-back."""
    try:
        files = await asyncio.to_thread(userfiles.read, ctx.epoch_dir)
    except (OSError, msgspec.DecodeError) as exc:
        raise EpochError(f"restore of job {ctx.job} refused: unreadable {userfiles.USER_FILES}: {exc}") from None
    if not files:
        return
    try:
        fds = await asyncio.to_thread(userfiles.make, files, ctx.epoch_dir, ctx.manifest.workdir)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise EpochError(f"restore of job {ctx.job} refused: cannot open its file again as its user: {why}") from None
    ctx.pass_fds += fds
    ctx.criu_args = (*ctx.criu_args, *userfiles.inherit_args(files, fds))
