"""The checkpoint/restore engine: a pipeline of steps around criu.

    checkpoint:  step.before_dump ... criu dump ... step.after_dump ... commit epoch ... prune
    restore:     pick newest verified epoch ... step.before_restore ... criu restore ... step.after_restore

Steps plug in before and after criu without touching the engine: the storage guard, pre-dump,
GPU suspend/resume (agent/gpus/gpustep.py) and the job's own files (output included:
agent/files/jobfiles.py, agent/files/jobfiles_restore.py).  A step may refuse an epoch before
anything is changed (``check_restore``): for files that changed (FilesChanged) the restore falls
back to the next older epoch, as it does for one that fails verification; any other refusal
(GPUs this node lacks) fails it.  ``on_dump_failed`` runs shielded from cancellation, so a step
that changed the job (suspended its GPU, say) always gets to undo it; a step that fails after
criu restored the job kills what criu restored, so it never runs on half-restored.

By default criu dumps straight into the epoch's temporary directory on the shared storage (through
the page cache that freezes the job no longer than a raw ``criu dump``; tmpfs first froze it longer
here).  ``staging_dir`` (slow network storage), or encrypted images (agent/storage/sealed.py, staged
in node-local scratch), make criu dump node-local and the images go to the storage after the job
has resumed.  Either way the epoch is committed only once it is complete there.  While criu writes,
a follower (agent/storage/imagesum.py) starts the images' writeback and, where the CPUs allow,
takes their digests (keyed with the image keys: ``keys``); the commit reads only what it has left
and makes the epoch durable with one syncfs (fileio.py ``Durable``; bench/commit_path.py).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import platform
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from revenant.agent.checkpointing.guard import resident_bytes
from revenant.agent.files.filestep import JobFilesStep
from revenant.agent.files.relink import RelinkStep
from revenant.agent.checkpointing import choice
from revenant.agent.checkpointing.slots import FairSlots, Slot
from revenant.agent.lazyrestore import deltaserve, lazy
from revenant.agent.pipeline import blockers, criu, criustats, progress
from revenant.agent.pipeline.handshake import Handshake
from revenant.agent.pipeline.steps import DumpContext, RestoreAsk, RestoreContext, Step, check_before_resume
from revenant.agent.processes import procs
from revenant.agent.storage import packs
from revenant.agent.storage.epochs import CorruptEpoch, EpochError, JobFiles, Manifest
from revenant.agent.storage.manifest import JobCaused
from revenant.agent.storage.fileio import Durable
from revenant.agent.storage.imagekeys import ImageKeys
from revenant.agent.storage.imagesum import Follower
from revenant.agent.storage.private import DUMP_UMASK, private_dir
from revenant.common.errors import CriuError, RevenantError
from revenant.messages import CheckpointPolicy

log = logging.getLogger(__name__)

Restored = tuple[int, Manifest, list[str], "lazy.LazyFetch | None", dict[str, float]]  # Engine.restore's


class _BeforeCriu(CorruptEpoch):
    """Pages found corrupt before criu ran: the epoch refused as a failed verification, the next tried."""


class NoSpace(RevenantError):
    code = "no_space"


def _remove(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Undo:
    """What a dump that does not commit leaves to undo."""

    frozen: bool = False  # stopped by --leave-stopped: resume it
    resume: Callable[[], None] = lambda: None
    tmp: Path | None = None  # the epoch being written: discard it
    follower: Follower | None = None  # reading the images criu writes: stop it first


class Engine:
    def __init__(self, *, criu_path: str, criu_version: str, node: str, storage: Path, work_roots: list[Path],
                 staging: Path | None = None, steps: list[Step] | None = None, concurrency: int = 2,
                 criu_timeout_s: float = 3600.0, job_files: JobFilesStep | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, lazy_restore: bool = False,
                 reporter: progress.Reporter | None = None, keys: ImageKeys | None = None,
                 other_users: bool = False) -> None:
        self.criu, self.other_users = criu_path, other_users  # the latter: it can dump other users' jobs
        self.keys = keys  # every epoch signed, none unsigned restored (agent/storage/imagekeys.py)
        # Tells whoever watches how far each dump and restore has come (agent/pipeline/progress.py).
        self.reporter = reporter or progress.Reporter(node)
        # Restore lazily (criu lazy-pages; the agent's restore_mode and criu's uffd features).
        self.lazy = lazy_restore
        self.criu_version, self.node, self.storage = criu_version, node, storage
        # Node-local scratch for criu's logs and scripts, fastest first.
        self.work_roots = work_roots
        # Dump here first (network storage); None: dump straight into the epoch (encrypted: into work_roots).
        self.staging = staging
        self.steps: list[Step] = steps if steps is not None else [
            job_files or JobFilesStep(storage), RelinkStep()]
        self.slots = FairSlots(concurrency)  # shared fairly between users (agent/checkpointing/slots.py)
        self.criu_timeout_s = criu_timeout_s
        # Durations (monotonic) and the manifest's creation time (wall clock).
        self.clock, self.wall_clock = clock, wall_clock
        self.pending = 0
        self.clean_stale_staging()

    def clean_stale_staging(self) -> None:
        """Remove scratch and staging left by agents that died mid-dump (staging may hold GiBs)."""
        for root in [*self.work_roots, *([self.staging] if self.staging else [])]:
            try:
                entries = list(root.iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    owner = int(entry.name.rsplit("-", 2)[-2])
                except (ValueError, IndexError):
                    continue
                if owner != os.getpid() and not procs.alive(owner):
                    log.info("removing stale staging %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(self, job: str, generation: int, pid: int, *, stop: bool, workdir: str = "",
                         user: str = "", policy: CheckpointPolicy | None = None,
                         spoiled: Callable[[], str] = lambda: "", resume: Callable[[], None] | None = None
                         ) -> tuple[Manifest, list[str], dict[str, float]]:
        """Dump ``job`` (root ``pid``, working directory ``workdir``, owned by ``user``, which the
        manifest records) into a new committed epoch; returns it, notes, and criu's statistics.

        ``stop`` (vacate): the job is left stopped after the dump and killed only
        once the epoch has committed; on any failure it is resumed (``resume``; default:
        SIGCONT), unharmed.  ``spoiled``, asked once the dump is written and before the
        commit: why the image must not be kept (the job was frozen meanwhile), or "".
        """
        files = JobFiles(self.storage, job, self.keys)
        self.pending += 1
        try:
            async with await self.slots.acquire(user or "root") as slot:
                resume = resume or functools.partial(procs.signal_tree, pid, signal.SIGCONT)
                return await self._checkpoint(files, job, generation, pid, stop, workdir, user, policy, spoiled, resume,
                                              slot)
        finally:
            self.pending -= 1

    async def _checkpoint(self, files: JobFiles, job: str, generation: int, pid: int, stop: bool,
                          job_workdir: str, user: str, policy: CheckpointPolicy | None,
                          spoiled: Callable[[], str], resume: Callable[[], None],
                          slot: Slot | None = None) -> tuple[Manifest, list[str], dict[str, float]]:
        workdir = self._new_dir(self.work_roots, job)
        # Encrypted images (agent/storage/sealed.py) are staged node-local: none is written plain to the storage.
        roots = [self.staging] if self.staging is not None else self.work_roots if files.seals else []
        staging = self._new_dir(roots, job) if roots else None
        manifest = Manifest(job=job, epoch=0, generation=generation, node=self.node, created_at=self.wall_clock(),
                            criu_version=self.criu_version, kernel=platform.release(), cpu_flags=procs.cpu_flags(),
                            user=user)
        ctx = DumpContext(job=job, generation=generation, pid=pid, files=files, workdir=workdir, stop=stop,
                          manifest=manifest, job_workdir=job_workdir, policy=policy)
        started = self.clock()
        undo = _Undo(resume=resume)
        committed = False
        durable = watch = None
        try:
            undo.tmp = files.new_tmp(self.node)
            ctx.epoch_tmp, ctx.shared_tmp = (staging if staging is not None else undo.tmp), undo.tmp
            watch = self.reporter.watch(job, user, "dump", functools.partial(progress.dir_bytes, ctx.epoch_tmp),
                                        functools.partial(resident_bytes, pid))
            durable = Durable(undo.tmp)  # before anything is written there (see fileio.Durable)
            undo.follower = None if files.seals else Follower(ctx.epoch_tmp, writeback=not staging, digest=files.digest)
            await self._clear_stale_proc_dir(ctx)  # before any criu runs (a step's pre-dump, say)
            if found := await asyncio.to_thread(blockers.blockers, pid):  # before anything freezes the job
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                raise blockers.NotCheckpointable(f"checkpoint of {job} refused: the job holds {found[0]}{more}")
            for step in self.steps:
                await step.before_dump(ctx)
            output = await self._dump(ctx, ctx.epoch_tmp, undo)
            if slot is not None:  # criu is done with the job: its copies and the commit hold no slot
                slot.release()
            watch.op = "commit"
            stats = criustats.read(ctx.workdir / criustats.DUMP_FILE)
            manifest.freeze_s = criu.frozen_time_s(output)
            manifest.dump_s = self.clock() - started
            for step in self.steps:
                await step.after_dump(ctx)
            if why := spoiled():
                raise RevenantError(f"checkpoint of {job} discarded: {why}; its image would restore it "
                                    f"stopped", code="frozen", retriable=True)
            manifest = await asyncio.to_thread(files.commit, undo.tmp, manifest, staging, self.clock, undo.follower,
                                               durable)
            undo.tmp = None
            committed = True
            log.info("checkpoint of %s: epoch %d, %.1f MiB, criu %.3f s (frozen %.3f s), commit %.3f s",
                     job, manifest.epoch, manifest.total_bytes / 2**20, manifest.dump_s, manifest.freeze_s,
                     manifest.commit_s)
            if stop:
                procs.signal_tree(pid, signal.SIGKILL)
                undo.frozen = False
            return manifest, ctx.notes, stats
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"no space left writing the checkpoint of {job}: {exc.filename or ''}".rstrip(": ")) from None
            raise EpochError(f"checkpoint of {job} failed: {exc}") from None
        finally:
            if watch is not None:
                watch.stop()
            if not committed:
                await asyncio.shield(self._undo_dump(ctx, undo))
            if durable is not None:
                durable.close()
            # Deleting GiBs of staging takes a while: not on the event loop.
            await asyncio.to_thread(_remove, workdir, staging)

    async def _dump(self, ctx: DumpContext, images: Path, undo: _Undo) -> str:
        """Run ``criu dump`` into ``images``; its output (with the stats), or the error it ended with."""
        script = ctx.workdir / "action.sh"
        script.write_text(criu.action_script(ctx.post_dump_script))
        script.chmod(0o755)
        argv = criu.dump_argv(self.criu, pid=ctx.pid, images=images, workdir=ctx.workdir, action_script=script,
                              leave_running=not ctx.stop, extra=ctx.dump_args,
                              keep_connections=ctx.keep_connections)
        follower = undo.follower.start() if undo.follower is not None else None
        try:
            done = await procs.run(argv, self.criu_timeout_s, umask=DUMP_UMASK)  # images 0600 from the start
        finally:
            if follower is not None:
                follower.criu_exited()
        undo.frozen = ctx.stop and done.returncode == 0
        if done.returncode != 0:
            text = criu.read_log(ctx.workdir / criu.DUMP_LOG, done.output)
            full = criu.no_space_line(text)
            if full is not None:
                raise NoSpace(f"no space left writing the checkpoint of {ctx.job}: {full}")
            kept = await self._keep_log(ctx.files, "dump", ctx.generation, text)
            own = next((why for ask in ctx.why_failed if (why := ask())), "")
            if own:
                cls = JobCaused if any(caused() for caused in ctx.job_caused) else EpochError
                raise cls(f"checkpoint of {ctx.job} failed: {own}{kept}")
            raise CriuError(f"criu dump failed: {criu.error_line(text)}{kept}")
        return done.output

    async def _clear_stale_proc_dir(self, ctx: DumpContext) -> None:
        """The job's init works in the job's directory (agent/running/launcher.py), where criu's parasite
        mounts its proc: a criu killed mid-dump would leave that behind and fail every later dump."""
        try:
            stale = await criu.clear_stale_proc_dir(ctx.files.dir)
        except (OSError, CriuError) as exc:
            log.warning("job %s: cannot remove criu's stale proc mountpoint: %s", ctx.job, exc)
            return
        if stale is not None:
            log.warning("job %s: removed %s, left behind by a criu killed mid-dump", ctx.job, stale)

    async def _keep_log(self, files: JobFiles, kind: str, generation: int, text: str) -> str:
        """Keep a failed criu run's log on shared storage (its scratch is deleted): the error's
        pointer to it, or "" if it could not be kept."""
        name = criu.log_name(kind, self.wall_clock(), generation, self.node)
        try:
            path = await asyncio.to_thread(criu.keep_log, text, files.dir, name)
        except OSError as exc:
            log.warning("job %s: cannot keep criu's %s log: %s", files.job, kind, exc)
            return ""
        return f" (criu log: {path})"

    async def _undo_dump(self, ctx: DumpContext, undo: _Undo) -> None:
        await asyncio.to_thread(blockers.repair_off, ctx.pid)  # a dump that went wrong may have left them so
        if undo.frozen:
            undo.resume()
        if undo.follower is not None:  # before the discard: it reads the images
            await asyncio.to_thread(undo.follower.abandon)
        for step in self.steps:  # before the discard: a step may still be writing into the epoch
            try:
                await step.on_dump_failed(ctx)
            except Exception as exc:  # keep undoing the others
                log.error("step %s could not undo a failed dump of %s: %s", step.name, ctx.job, exc)
        if undo.tmp is not None:
            await asyncio.to_thread(ctx.files.discard, undo.tmp)

    # ------------------------------------------------------------------ restore

    async def restore(self, job: str, generation: int, ask: RestoreAsk = RestoreAsk()) -> Restored:
        """Restore ``job`` from its newest verified epoch (``ask.epoch``: exactly that one) as our
        child; returns (pid, manifest, notes, fetch, criu's statistics).  ``ask.leave_workdir``: why
        the job's working directory must be left as it is (it is shared).  A delta epoch
        (agent/storage/packs.py) gets a temporary directory of images next to the epochs.  With
        ``self.lazy``, lazily (agent/lazyrestore/): ``fetch`` (else None) is the rest, to be awaited."""
        files = JobFiles(self.storage, job, self.keys)
        self.pending += 1
        try:
            async with await self.slots.acquire(ask.user or "root"):
                checked: dict[str, object] = {}
                refused: dict[int, str] = {}  # epochs whose pages failed before criu ran (_BeforeCriu)

                def check(m: Manifest) -> None:  # the steps' verdicts on each candidate epoch, newest first
                    if m.epoch in refused:
                        raise CorruptEpoch(refused[m.epoch])
                    checked.update((s.name, s.check_restore(m, files.epoch_dir(m.epoch), ask.gpus))
                                   for s in self.steps)

                lazy_here = self.lazy and not await asyncio.to_thread(lazy.eager_next, files)
                while True:
                    manifest, notes = await asyncio.to_thread(choice.chosen, files, ask.epoch, check,
                                                              lazy.lazy_serves if lazy_here else None)
                    lazy_now, notes = lazy_here and lazy.served_lazily(manifest), notes + (
                        ["restored eagerly: its images are encrypted"] if self.lazy and manifest.encryption else [])
                    try:
                        return await self._restore_chosen(files, manifest, notes, generation, ask, checked, lazy_now)
                    except _BeforeCriu as exc:
                        refused[manifest.epoch] = str(exc)  # (an operator's epoch: NoEpoch, from check)
        finally:
            self.pending -= 1

    async def _restore_chosen(self, files: JobFiles, manifest: Manifest, notes: list[str], generation: int,
                              ask: RestoreAsk, checked: dict[str, object], lazy_here: bool) -> Restored:
        workdir: Path | None = self._new_dir(self.work_roots, f"restore-{files.job}")
        assert workdir is not None
        images = fetch = None
        ctx = RestoreContext(job=files.job, generation=generation, files=files,
                             epoch_dir=files.epoch_dir(manifest.epoch), workdir=workdir,
                             manifest=manifest, notes=notes, leave_workdir=ask.leave_workdir, checked=checked,
                             criu_args=ask.criu_args)
        try:
            if manifest.encryption:  # its images decrypted into node-local scratch (agent/storage/sealed.py)
                ctx.images = images = self._new_dir(self.work_roots, f"images-{files.job}")
                await asyncio.to_thread(files.open_sealed, manifest, images)
            elif packs.converted(manifest) or (lazy_here and deltaserve.plain_servable(manifest)):
                # served from its recipes (else rebuilt), or its page images checked by extent as served
                ctx.images = images = files.new_tmp(self.node)
                try:
                    ctx.lazy = await lazy.delta_images(self.criu, files, manifest, images, workdir, lazy_here)
                except CorruptEpoch as exc:
                    raise _BeforeCriu(str(exc)) from None
            elif lazy_here:
                ctx.lazy = await lazy.LazyPages.start(self.criu, ctx.epoch_dir, workdir)
            pid, manifest, notes, stats = await self._restore(ctx)
            if ctx.lazy is not None:  # the page server and its directories live on until the last page
                ctx.lazy.handed_over()  # the job runs: its daemon outlives this agent from now on
                keep = functools.partial(self._keep_log, files, "lazy-pages", generation)
                fetch = lazy.LazyFetch(ctx.lazy, manifest, ctx.images or ctx.epoch_dir, workdir, keep, images)
                workdir = images = None
            return pid, manifest, notes, fetch, stats
        finally:
            if ctx.lazy is not None and fetch is None:
                await ctx.lazy.abort()
            if workdir is not None or images is not None:  # (no await once the fetch is handed over)
                await asyncio.to_thread(_remove, workdir, images)

    async def _restore(self, ctx: RestoreContext) -> tuple[int, Manifest, list[str], dict[str, float]]:
        try:
            return await self._restore_steps(ctx)
        finally:
            for fd in ctx.pass_fds:  # criu's now, or nobody's
                os.close(fd)
            ctx.pass_fds.clear()

    async def _restore_steps(self, ctx: RestoreContext) -> tuple[int, Manifest, list[str], dict[str, float]]:
        for step in self.steps:
            await step.before_restore(ctx)
        pidfile = ctx.workdir / "pid"
        shake = Handshake(ctx.workdir, "resume", self.criu_timeout_s)
        script = ctx.workdir / "action.sh"
        script.write_text(criu.action_script(shake.script_lines("restored $CRTOOLS_INIT_PID"), "post-restore"))
        script.chmod(0o755)
        argv = criu.restore_argv(self.criu, images=ctx.images or ctx.epoch_dir, workdir=ctx.workdir, pidfile=pidfile,
                                 action_script=script, keep_connections=ctx.keep_connections)
        argv += [*ctx.criu_args, *(ctx.lazy.restore_args if ctx.lazy is not None else [])]
        total = 0 if ctx.lazy is not None else ctx.manifest.total_bytes  # a lazy restore reads its pages later
        watch = self.reporter.watch(ctx.job, ctx.manifest.user, "restore", progress.RestoredBytes(ctx.workdir), total)
        verdict: list[BaseException | None] = []
        checking = asyncio.ensure_future(check_before_resume(self.steps, ctx, shake, verdict))
        try:
            done = await procs.run(argv, self.criu_timeout_s, pass_fds=tuple(ctx.pass_fds))
        finally:
            watch.stop()
            checking.cancel()
            await asyncio.gather(checking, return_exceptions=True)
            shake.close()
        if verdict and verdict[0] is not None:
            if ctx.pid > 0:  # criu kills it on the refusal: this is only in case criu could not
                procs.signal_tree(ctx.pid, signal.SIGKILL)
            raise verdict[0]  # refused before it ever ran
        if done.returncode != 0:
            text = criu.read_log(ctx.workdir / criu.RESTORE_LOG, done.output)
            kept = await self._keep_log(ctx.files, "restore", ctx.generation, text)
            raise CriuError(f"criu restore failed: {criu.error_line(text)}{kept}")
        ctx.pid = int(pidfile.read_text().strip())
        try:
            if not verdict:
                raise EpochError(f"restore of job {ctx.job} refused: criu let it go without the agent's check")
            procs.signal_tree(ctx.pid, signal.SIGCONT)
            for step in self.steps:
                await step.after_restore(ctx)
        except BaseException:  # half restored (its GPU not resumed, say): it must not run on as the job
            procs.signal_tree(ctx.pid, signal.SIGKILL)
            raise
        return ctx.pid, ctx.manifest, ctx.notes, criustats.read(ctx.workdir / criustats.RESTORE_FILE)

    # ------------------------------------------------------------------ helpers

    def _new_dir(self, roots: list[Path], name: str) -> Path:
        """A fresh private directory (0700: staging holds images) under the first usable root (named for its successor)."""
        for root in roots:
            try:
                root.mkdir(parents=True, exist_ok=True, mode=0o700)
                path = root / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
                path.mkdir(mode=0o700)
                return private_dir(path)
            except OSError as exc:
                last = exc
        raise EpochError(f"no usable scratch directory in {', '.join(map(str, roots))}: {last}")
