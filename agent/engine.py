"""The checkpoint/restore engine: a pipeline of steps around criu.

    checkpoint:  step.before_dump ... criu dump ... step.after_dump ... commit epoch ... prune
    restore:     pick newest verified epoch ... step.before_restore ... criu restore ... step.after_restore

Steps plug in before and after criu without touching the engine: output
rollback is a step today; GPU suspend/resume (cuda-checkpoint), pre-dump and
deduplicated storage are steps of the same shape.  ``on_dump_failed`` runs
shielded from cancellation, so a step that changed the job (suspended its GPU,
say) always gets to undo it.

The freeze is kept short by dumping to node-local staging (tmpfs when it has
room) and copying the images to shared storage only after the job has resumed;
the epoch is committed once it is complete there.
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
    staging: Path
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
        out = ctx.staging / self.SIZES
        for path in [ctx.files.output]:
            ctx.post_dump_script.append(f"stat -c '%s' {_sh(str(path))} >> {_sh(str(out))} || echo 0 >> {_sh(str(out))}")

    async def after_dump(self, ctx: DumpContext) -> None:
        sizes = (ctx.staging / self.SIZES).read_text().split()
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


def tree_rss(root: int) -> int:
    total = 0
    for pid in tree_pids(root):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def signal_tree(root: int, sig: int) -> None:
    for pid in tree_pids(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Engine:
    def __init__(self, *, criu_path: str, criu_version: str, node: str, storage: Path, staging_roots: list[Path],
                 steps: list[Step] | None = None, concurrency: int = 2, criu_timeout_s: float = 3600.0) -> None:
        self.criu = criu_path
        self.criu_version = criu_version
        self.node = node
        self.storage = storage
        # Node-local places to dump to, fastest first; the first with room for the job wins.
        self.staging_roots = staging_roots
        self.steps: list[Step] = steps if steps is not None else [OutputRollback()]
        self.slots = asyncio.Semaphore(concurrency)
        self.criu_timeout_s = criu_timeout_s
        self.pending = 0
        self.clean_stale_staging()

    def clean_stale_staging(self) -> None:
        """Remove staging left by agents that died mid-dump (it may hold GiBs of tmpfs)."""
        for root in self.staging_roots:
            try:
                entries = list(root.iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    owner = int(entry.name.rsplit("-", 2)[-2])
                except (ValueError, IndexError):
                    continue
                if owner != os.getpid() and not psutil.pid_exists(owner):
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
        staging = self._new_staging(job, need_bytes=int(tree_rss(pid) * 1.25))
        manifest = Manifest(job=job, epoch=0, generation=generation, node=self.node, created_at=time.time(),
                            criu_version=self.criu_version, kernel=platform.release(), cpu_flags=cpu_flags())
        ctx = DumpContext(job=job, generation=generation, pid=pid, files=files, staging=staging, stop=stop,
                          manifest=manifest)
        started = time.monotonic()
        frozen = False  # the job is stopped by --leave-stopped and must be resumed on failure
        tmp: Path | None = None
        committed = False
        try:
            for step in self.steps:
                await step.before_dump(ctx)
            script = staging / "action.sh"
            script.write_text("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\n"
                              + "\n".join(ctx.post_dump_script) + "\n")
            script.chmod(0o755)
            argv = [self.criu, "dump", "-t", str(pid), "-D", str(staging), "-o", "dump.log", "-v4",
                    "--display-stats", "--action-script", str(script),
                    "--leave-stopped" if stop else "--leave-running"]
            done = await procs.run(argv, self.criu_timeout_s)
            frozen = stop and done.returncode == 0
            if done.returncode != 0:
                raise CriuError(f"criu dump failed: {self._criu_error(staging / 'dump.log', done.output)}")
            m = _FROZEN_RE.search(done.output)
            manifest.freeze_s = int(m.group(1)) / 1e6 if m else 0.0
            manifest.dump_s = time.monotonic() - started
            for step in self.steps:
                await step.after_dump(ctx)
            tmp = files.new_tmp(self.node)
            manifest = await asyncio.to_thread(files.commit, staging, tmp, manifest)
            tmp = None
            manifest.dump_s = time.monotonic() - started
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
            shutil.rmtree(staging, ignore_errors=True)

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
                workdir = self._new_staging(f"restore-{job}")
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
                    shutil.rmtree(workdir, ignore_errors=True)
        finally:
            self.pending -= 1

    # ------------------------------------------------------------------ helpers

    def _new_staging(self, name: str, need_bytes: int = 0) -> Path:
        root = self.staging_roots[-1]
        for candidate in self.staging_roots:
            try:
                candidate.mkdir(parents=True, exist_ok=True)
                if shutil.disk_usage(candidate).free >= need_bytes:
                    root = candidate
                    break
            except OSError:
                continue
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir()
        return path

    @staticmethod
    def _criu_error(logfile: Path, output: str) -> str:
        try:
            text = logfile.read_text(errors="replace")
        except OSError:
            text = ""
        return last_error_line(text + "\n" + output if text else output)
