"""The checkpoint/restore engine: a pipeline of steps around criu.

    checkpoint:  step.before_dump ... criu dump ... step.after_dump ... commit epoch ... prune
    restore:     pick newest verified epoch ... step.before_restore ... criu restore ... step.after_restore

Steps plug in before and after criu without touching the engine: output
rollback is a step today; GPU suspend/resume (cuda-checkpoint), pre-dump and
deduplicated storage are steps of the same shape.  ``on_dump_failed`` runs
shielded from cancellation, so a step that changed the job (suspended its GPU,
say) always gets to undo it.

By default criu dumps straight into the epoch's temporary directory on the
shared storage: through the page cache that freezes the job no longer than a
raw ``criu dump`` (measured: dumping to tmpfs first froze it *longer* on these
machines, and doubled the writes).  For storage whose writes are slow while the
job is frozen (network filesystems), ``staging_dir`` makes criu dump to a
node-local directory and the images move to shared storage after the job has
resumed.  Either way the epoch is committed only once it is complete there.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import platform
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from revenant.agent import procs
from revenant.agent.criu import last_error_line
from revenant.agent.epochs import EpochError, JobFiles, Manifest, cpu_flags, rollback_outputs
from revenant.common.errors import CriuError, RevenantError

log = logging.getLogger(__name__)

_FROZEN_RE = re.compile(r"Frozen time:\s*(\d+)\s*us")


class NoSpace(RevenantError):
    code = "no_space"


@dataclass
class DumpContext:
    job: str
    generation: int
    pid: int
    files: JobFiles
    # Node-local scratch: criu's log, the action script, step notes.
    workdir: Path
    stop: bool
    manifest: Manifest
    # Extra lines for criu's post-dump action script (run while the job is frozen).
    post_dump_script: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class RestoreContext:
    job: str
    generation: int
    files: JobFiles
    epoch_dir: Path
    workdir: Path
    manifest: Manifest
    pid: int = 0
    notes: list[str] = field(default_factory=list)


class Step(Protocol):
    name: str

    async def before_dump(self, ctx: DumpContext) -> None: ...
    async def after_dump(self, ctx: DumpContext) -> None: ...
    async def on_dump_failed(self, ctx: DumpContext) -> None: ...
    async def before_restore(self, ctx: RestoreContext) -> None: ...
    async def after_restore(self, ctx: RestoreContext) -> None: ...


class BaseStep:
    name = "step"

    async def before_dump(self, ctx: DumpContext) -> None:
        pass

    async def after_dump(self, ctx: DumpContext) -> None:
        pass

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        pass

    async def before_restore(self, ctx: RestoreContext) -> None:
        pass

    async def after_restore(self, ctx: RestoreContext) -> None:
        pass


class OutputRollback(BaseStep):
    """Records each output file's size while the job is frozen; cuts it back before a restore."""

    name = "output-rollback"
    SIZES = "output-sizes"

    async def before_dump(self, ctx: DumpContext) -> None:
        out = ctx.workdir / self.SIZES
        for path in [ctx.files.output]:
            ctx.post_dump_script.append(f"stat -c '%s' {_sh(str(path))} >> {_sh(str(out))} || echo 0 >> {_sh(str(out))}")

    async def after_dump(self, ctx: DumpContext) -> None:
        sizes = (ctx.workdir / self.SIZES).read_text().split()
        ctx.manifest.outputs = {str(ctx.files.output): int(sizes[0])}

    async def before_restore(self, ctx: RestoreContext) -> None:
        ctx.notes += await asyncio.to_thread(rollback_outputs, ctx.manifest)


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def tree_pids(root: int) -> list[int]:
    try:
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    """A zombie is not alive (where pid 1 never reaps, a dead agent lingers as one)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _remove(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def signal_tree(root: int, sig: int) -> None:
    for pid in tree_pids(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Engine:
    def __init__(self, *, criu_path: str, criu_version: str, node: str, storage: Path, work_roots: list[Path],
                 staging: Path | None = None, steps: list[Step] | None = None, concurrency: int = 2,
                 criu_timeout_s: float = 3600.0) -> None:
        self.criu = criu_path
        self.criu_version = criu_version
        self.node = node
        self.storage = storage
        # Node-local scratch for criu's logs and scripts, fastest first.
        self.work_roots = work_roots
        # Dump here first (network storage); None: dump straight into the epoch.
        self.staging = staging
        self.steps: list[Step] = steps if steps is not None else [OutputRollback()]
        self.slots = asyncio.Semaphore(concurrency)
        self.criu_timeout_s = criu_timeout_s
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
                if owner != os.getpid() and not _alive(owner):
                    log.info("removing stale staging %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(self, job: str, generation: int, pid: int, *, stop: bool) -> tuple[Manifest, list[str]]:
        """Dump ``job`` (root ``pid``) into a new committed epoch.

        ``stop`` (vacate): the job is left stopped after the dump and killed only
        once the epoch has committed; on any failure it is resumed, unharmed.
        """
        files = JobFiles(self.storage, job)
        self.pending += 1
        try:
            async with self.slots:
                return await self._checkpoint(files, job, generation, pid, stop)
        finally:
            self.pending -= 1

    async def _checkpoint(self, files: JobFiles, job: str, generation: int, pid: int, stop: bool) -> tuple[Manifest, list[str]]:
        workdir = self._new_dir(self.work_roots, job)
        staging = self._new_dir([self.staging], job) if self.staging is not None else None
        manifest = Manifest(job=job, epoch=0, generation=generation, node=self.node, created_at=time.time(),
                            criu_version=self.criu_version, kernel=platform.release(), cpu_flags=cpu_flags())
        ctx = DumpContext(job=job, generation=generation, pid=pid, files=files, workdir=workdir, stop=stop,
                          manifest=manifest)
        started = time.monotonic()
        frozen = False  # the job is stopped by --leave-stopped and must be resumed on failure
        tmp: Path | None = None
        committed = False
        try:
            for step in self.steps:
                await step.before_dump(ctx)
            script = workdir / "action.sh"
            script.write_text("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\n"
                              + "\n".join(ctx.post_dump_script) + "\n")
            script.chmod(0o755)
            tmp = files.new_tmp(self.node)
            images = staging if staging is not None else tmp
            # -v2: errors and warnings only; a verbose log is written while the job is frozen.
            argv = [self.criu, "dump", "-t", str(pid), "-D", str(images), "-W", str(workdir), "-o", "dump.log",
                    "-v2", "--display-stats", "--action-script", str(script),
                    "--leave-stopped" if stop else "--leave-running"]
            done = await procs.run(argv, self.criu_timeout_s)
            frozen = stop and done.returncode == 0
            if done.returncode != 0:
                text = self._criu_log(workdir / "dump.log", done.output)
                full = [ln.strip() for ln in text.splitlines()
                        if "No space left on device" in ln or "Disk quota exceeded" in ln]
                if full:
                    raise NoSpace(f"no space left writing the checkpoint of {job}: {full[0]}")
                raise CriuError(f"criu dump failed: {last_error_line(text)}")
            m = _FROZEN_RE.search(done.output)
            manifest.freeze_s = int(m.group(1)) / 1e6 if m else 0.0
            manifest.dump_s = time.monotonic() - started
            for step in self.steps:
                await step.after_dump(ctx)
            manifest = await asyncio.to_thread(files.commit, tmp, manifest, staging)
            tmp = None
            committed = True
            if stop:
                signal_tree(pid, signal.SIGKILL)
                frozen = False
            return manifest, ctx.notes
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"no space left writing the checkpoint of {job}: {exc.filename or ''}".rstrip(": ")) from None
            raise EpochError(f"checkpoint of {job} failed: {exc}") from None
        finally:
            if not committed:
                await asyncio.shield(self._undo_dump(ctx, frozen, tmp))
            # Deleting GiBs of staging takes a while: not on the event loop.
            await asyncio.to_thread(_remove, workdir, staging)

    async def _undo_dump(self, ctx: DumpContext, frozen: bool, tmp: Path | None) -> None:
        if frozen:
            signal_tree(ctx.pid, signal.SIGCONT)
        if tmp is not None:
            await asyncio.to_thread(ctx.files.discard, tmp)
        for step in self.steps:
            try:
                await step.on_dump_failed(ctx)
            except Exception as exc:  # keep undoing the others
                log.error("step %s could not undo a failed dump of %s: %s", step.name, ctx.job, exc)

    # ------------------------------------------------------------------ restore

    async def restore(self, job: str, generation: int) -> tuple[int, Manifest, list[str]]:
        """Restore ``job`` from its newest verified epoch as our child; returns (pid, manifest, notes)."""
        files = JobFiles(self.storage, job)
        self.pending += 1
        try:
            async with self.slots:
                manifest, notes = await asyncio.to_thread(files.newest_verified)
                workdir = self._new_dir(self.work_roots, f"restore-{job}")
                ctx = RestoreContext(job=job, generation=generation, files=files,
                                     epoch_dir=files.epoch_dir(manifest.epoch), workdir=workdir,
                                     manifest=manifest, notes=notes)
                try:
                    for step in self.steps:
                        await step.before_restore(ctx)
                    pidfile = workdir / "pid"
                    argv = [self.criu, "restore", "-D", str(ctx.epoch_dir), "-W", str(workdir), "-o", "restore.log",
                            "-v4", "--restore-detached", "--restore-sibling", "--pidfile", str(pidfile)]
                    done = await procs.run(argv, self.criu_timeout_s)
                    if done.returncode != 0:
                        raise CriuError(f"criu restore failed: {self._criu_error(workdir / 'restore.log', done.output)}")
                    ctx.pid = int(pidfile.read_text().strip())
                    for step in self.steps:
                        await step.after_restore(ctx)
                    return ctx.pid, manifest, ctx.notes
                finally:
                    await asyncio.to_thread(_remove, workdir)
        finally:
            self.pending -= 1

    # ------------------------------------------------------------------ helpers

    def _new_dir(self, roots: list[Path], name: str) -> Path:
        """A fresh directory under the first usable root (named so a successor can tell it is stale)."""
        for root in roots:
            try:
                root.mkdir(parents=True, exist_ok=True)
                path = root / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
                path.mkdir()
                return path
            except OSError as exc:
                last = exc
        raise EpochError(f"no usable scratch directory in {', '.join(map(str, roots))}: {last}")

    @staticmethod
    def _criu_log(logfile: Path, output: str) -> str:
        try:
            text = logfile.read_text(errors="replace")
        except OSError:
            text = ""
        return text + "\n" + output if text else output

    @classmethod
    def _criu_error(cls, logfile: Path, output: str) -> str:
        return last_error_line(cls._criu_log(logfile, output))
