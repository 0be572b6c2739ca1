"""The job supervisor: launching jobs, watching them, and driving the engine for them.

A job runs in its own PID namespace, so it can be restored on any node without
PID collisions::

    agent ─ unshare --pid --fork --kill-child ─ sh (pid 1: revenant-init) ─ the job

* ``unshare`` dies with the agent (PR_SET_PDEATHSIG), and ``--kill-child`` makes
  the namespace's init die with ``unshare``, which takes the whole namespace.
* The init redirects stdin from /dev/null and appends stdout and stderr to
  ``<storage>/jobs/<id>/output.log``, then waits for the job and exits with its
  status.  ``unshare`` itself writes nowhere near the job's output.
* A restored job (``criu restore --restore-sibling``) becomes the agent's direct
  child; the agent is a child subreaper, so anything orphaned below it is its
  to reap too.  Either way the agent records the exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from revenant.agent import procs
from revenant.agent.engine import Engine, signal_tree
from revenant.agent.epochs import JobFiles, replace_with_prefix
from revenant.common.errors import CriuError, JobNotRunning, RevenantError, StaleGeneration
from revenant.common.metrics import AgentMetrics
from revenant.messages import AgentJobReply, EpochEvent, JobEvent, JobSpec, Message, subjects

log = logging.getLogger(__name__)

# pid 1 of the job's namespace.  Besides waiting for the job it is a dead man's
# switch: it holds the job's stamp file open as fd 3, and the agent touches that
# file (by path) each time it renews its lease.  If the stamp goes stale for
# FENCE_MS - the agent is dead, paused or cut off - it exits, and the kernel
# kills everything in the namespace.  A restore gives the stamp a new inode
# first, so a stale copy left behind on a paused node watches a file nobody
# touches any more, and fences itself.  No descriptor leads outside the job's
# files, so criu dumps it like any other regular file.
INIT_SCRIPT = """out=$1; stamp=$2; fence_ms=$3; shift 3
exec </dev/null >>"$out" 2>&1 3<"$stamp"
"$@" &
child=$!
while kill -0 $child 2>/dev/null; do
    sleep 0.2
    m=$(stat -L -c %.3Y /dev/fd/3 2>/dev/null) || continue
    now=$(date +%s%3N)
    if [ $((now - ${m%.*}${m#*.})) -gt "$fence_ms" ]; then
        exit 251
    fi
done
wait $child
"""
INIT_NAME = "revenant-init"
# The init's exit status when its switch fired (the agent tells it from a job's own 251
# by whether it had stopped resetting the switches).
SWITCH_EXIT = 251


class LaunchError(RevenantError):
    code = "launch_failed"


@dataclass
class JobRuntime:
    spec: JobSpec
    generation: int
    pid: int  # host pid of the namespace's init: the root criu dumps
    files: JobFiles
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A vacate is under way: the job's exit is reported when it ends (see _report_exit).
    vacating: bool = False
    # The vacate (or drain) committed this epoch and then stopped the job.
    stopped_at_epoch: int | None = None
    killing: bool = False
    kill_reason: str = ""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    # Stopped by its node (a drain, a fence), not by a user or itself: to be restored elsewhere.
    evicted: bool = False


@dataclass
class Launch:
    """A start or restore in progress: the job is not running yet, but will be."""

    generation: int
    superseded: str = ""  # why its result must not live (a newer generation, or a kill)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The new job's dead man's switch, reset with the running jobs' while it comes up.
    stamp: Path | None = None


class Supervisor:
    def __init__(self, node: str, storage: Path, engine: Engine | None, emit: Callable[[str, Message], None],
                 criu_error: str = "criu unusable", metrics: AgentMetrics | None = None,
                 switch_timeout_s: float = 1.2) -> None:
        self.metrics = metrics
        self.switch_timeout_s = switch_timeout_s
        self.node = node
        self.storage = storage
        self.engine = engine
        self.emit = emit
        self.criu_error = criu_error
        self.jobs: dict[str, JobRuntime] = {}
        # Starts and restores in flight, one per job: a newer generation or a kill
        # arriving meanwhile supersedes it, and its process is killed on arrival.
        self.launching: dict[str, Launch] = {}
        # When the dead man's switches were last reset, and when a gap long enough to fire them ended.
        self._touched_at = time.monotonic()
        self._switch_gap_at = -math.inf
        self._tasks: set[asyncio.Task[None]] = set()
        self.checkpoint_failures = 0

    # ------------------------------------------------------------------ queries

    @property
    def pending_ops(self) -> int:
        return self.engine.pending if self.engine else 0

    def _get(self, job: str, generation: int | None = None) -> JobRuntime:
        rt = self.jobs.get(job)
        if rt is None:
            raise JobNotRunning(f"job {job} is not running on {self.node}")
        if generation is not None and generation != rt.generation:
            raise StaleGeneration(f"job {job} runs generation {rt.generation} on {self.node}, not {generation}")
        return rt

    def _reply(self, rt: JobRuntime, **kw) -> AgentJobReply:
        return AgentJobReply(job=rt.spec.id, generation=rt.generation, node=self.node, pid=rt.pid,
                             output=str(rt.files.output), **kw)

    def _event(self, rt: JobRuntime, kind: str, **kw) -> None:
        self.emit(subjects.job_event(rt.spec.id, kind),
                  JobEvent(job=rt.spec.id, kind=kind, at=time.time(), node=self.node, generation=rt.generation,
                           pid=rt.pid, **kw))

    # ------------------------------------------------------------------ start

    async def start(self, spec: JobSpec, generation: int, fresh: bool = False) -> AgentJobReply:
        """Launch ``spec``.  ``fresh`` (a requeue): its earlier output is discarded, for a clean rerun."""
        subjects.check_name(spec.id, "job id")
        async with self._launch(spec.id, generation) as launch:
            return await self._start(spec, generation, fresh, launch)

    async def _start(self, spec: JobSpec, generation: int, fresh: bool, launch: Launch) -> AgentJobReply:
        if not spec.argv:
            raise LaunchError("empty command")
        if not os.path.isdir(spec.workdir):
            raise LaunchError(f"workdir {spec.workdir} does not exist on {self.node}")
        env = {**os.environ, **spec.env}
        if shutil.which(spec.argv[0], path=env.get("PATH")) is None and not (
                os.path.isfile(os.path.join(spec.workdir, spec.argv[0])) and "/" in spec.argv[0]):
            raise LaunchError(f"command not found on {self.node}: {spec.argv[0]}")
        files = JobFiles(self.storage, spec.id)
        files.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            await asyncio.to_thread(replace_with_prefix, files.output, 0)
        files.output.touch()
        await asyncio.to_thread(replace_with_prefix, files.stamp, 0)
        launch.stamp = files.stamp
        argv = ["unshare", "--pid", "--fork", "--kill-child", "setsid",
                "/bin/sh", "-c", INIT_SCRIPT, INIT_NAME, str(files.output), str(files.stamp),
                str(int(self.switch_timeout_s * 1000)), *spec.argv]
        wrapper = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=spec.workdir, env=env, preexec_fn=procs.die_with_parent, start_new_session=True)
        pid = await self._namespace_init(wrapper)
        rt = JobRuntime(spec=spec, generation=generation, pid=pid or 0, files=files)
        self.jobs[spec.id] = rt
        log.info("job %s (generation %d) started, pid %d", spec.id, generation, rt.pid)
        self._event(rt, "started")
        if pid is None:
            # Finished before we could even see it (`true`): report its exit all the same.
            procs.WATCHED.discard(wrapper.pid)
            code = wrapper.returncode if wrapper.returncode >= 0 else 128 - wrapper.returncode
            asyncio.get_running_loop().call_soon(self._exited, rt, code)
        else:
            self._watch(rt, wrapper.pid, wrapper)
        await self._check_superseded(rt, launch)
        return self._reply(rt)

    @contextlib.asynccontextmanager
    async def _launch(self, job: str, generation: int):
        """Claim ``job`` for starting ``generation``: never two starts or restores of one job at
        once, and never an older generation over a newer one.  An older copy, running or still
        starting, is killed first."""
        while (current := self.launching.get(job)) is not None:
            if current.generation >= generation:
                raise RevenantError(f"job {job} generation {current.generation} is already starting on {self.node}",
                                    code="already_running")
            current.superseded = f"superseded by generation {generation}"
            await current.done.wait()
        old = self.jobs.get(job)
        if old is not None and old.generation >= generation:
            raise RevenantError(f"job {job} generation {old.generation} already runs on {self.node}",
                                code="already_running")
        launch = Launch(generation)
        self.launching[job] = launch
        try:
            if old is not None:
                await self._kill(old, f"superseded by generation {generation}")  # never two copies
            yield launch
        finally:
            del self.launching[job]
            launch.done.set()

    async def _check_superseded(self, rt: JobRuntime, launch: Launch) -> None:
        """A kill or a newer generation came while ``rt`` was starting: it must not live."""
        if launch.superseded:
            await self._kill(rt, launch.superseded)
            raise StaleGeneration(f"job {rt.spec.id} generation {rt.generation} was {launch.superseded} "
                                  f"while it started on {self.node}")

    async def _namespace_init(self, wrapper: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
        """The host pid of the namespace's init, or None if the whole job has already exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(wrapper.pid).children()
            except psutil.Error:
                children = []
            if children:
                return children[0].pid
            if wrapper.poll() is not None:
                return None
            await asyncio.sleep(0.005)
        signal_tree(wrapper.pid, signal.SIGKILL)
        raise LaunchError(f"the job's namespace did not start within {timeout_s:g} s")

    def _watch(self, rt: JobRuntime, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        async def watch() -> None:
            code = await procs.wait_pid(pid)
            if popen is not None:
                popen.returncode = code  # reaped here: Popen must not think it still runs
            self._exited(rt, code)

        task = asyncio.create_task(watch(), name=f"watch-{rt.spec.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _exited(self, rt: JobRuntime, code: int) -> None:
        rt.exit_code = code
        rt.exited.set()
        if self.jobs.get(rt.spec.id) is rt:
            del self.jobs[rt.spec.id]
        if not rt.vacating:
            self._report_exit(rt)  # else the vacate reports it when it ends, however it ends

    def _report_exit(self, rt: JobRuntime) -> None:
        code = rt.exit_code if rt.exit_code is not None else -1
        if rt.stopped_at_epoch is not None:
            kind = "evicted" if rt.evicted else "vacated"
            log.info("job %s %s at epoch %d", rt.spec.id, kind, rt.stopped_at_epoch)
            self._event(rt, kind, epoch=rt.stopped_at_epoch, reason=rt.kill_reason)
            return
        if code == SWITCH_EXIT and not rt.killing and self._switch_may_have_fired():
            rt.evicted = True
            rt.kill_reason = "its dead man's switch fired: the agent was stalled or cut off"
        kind = "evicted" if rt.evicted else "killed" if rt.killing else "exited"
        log.info("job %s %s with status %d%s", rt.spec.id, kind, code, f" ({rt.kill_reason})" if rt.kill_reason else "")
        self._event(rt, kind, exit_code=code, reason=rt.kill_reason)

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(self, job: str, generation: int, stop: bool, evict_reason: str = "") -> AgentJobReply:
        """``stop``: vacate.  ``evict_reason`` (with ``stop``): the node stops it, to be restored elsewhere."""
        rt = self._get(job, generation)
        if self.engine is None:
            raise CriuError(f"cannot checkpoint on {self.node}: {self.criu_error}")
        if rt.lock.locked():
            raise RevenantError(f"job {job} already has a checkpoint in progress", code="busy", retriable=True)
        async with rt.lock:
            rt.vacating = stop
            try:
                return await self._checkpoint(rt, stop, evict_reason)
            finally:
                # However the vacate ended (committed, failed, cancelled by a drain's deadline or a
                # shutdown), an exit it held back is reported now, and a later one as it happens.
                if rt.vacating:
                    rt.vacating = False
                    if rt.exited.is_set():
                        self._report_exit(rt)

    async def _checkpoint(self, rt: JobRuntime, stop: bool, evict_reason: str) -> AgentJobReply:
        job, generation = rt.spec.id, rt.generation
        try:
            manifest, notes = await self.engine.checkpoint(job, generation, rt.pid, stop=stop)
        except RevenantError as exc:
            self.checkpoint_failures += 1
            if self.metrics is not None:
                self.metrics.observe_checkpoint(ok=False, duration_s=0.0)
            self.emit(subjects.epoch_event(job, "failed"),
                      EpochEvent(job=job, kind="failed", at=time.time(), node=self.node, generation=generation,
                                 error=str(exc)))
            raise
        if stop:
            # Committed, and the engine has killed the job: its exit is this vacate (or drain).
            rt.stopped_at_epoch = manifest.epoch
            rt.evicted, rt.kill_reason = bool(evict_reason), evict_reason
        self.checkpoint_failures = 0
        info = rt.files.info(manifest)
        if self.metrics is not None:
            self.metrics.observe_checkpoint(ok=True, duration_s=manifest.dump_s, freeze_s=manifest.freeze_s,
                                            size_bytes=info.bytes)
        self.emit(subjects.epoch_event(job, "created"),
                  EpochEvent(job=job, kind="created", at=time.time(), n=manifest.epoch, node=self.node,
                             generation=generation, bytes=info.bytes, freeze_s=manifest.freeze_s,
                             duration_s=manifest.dump_s))
        for n in await asyncio.to_thread(rt.files.prune, max(1, rt.spec.max_epochs)):
            self.emit(subjects.epoch_event(job, "pruned"),
                      EpochEvent(job=job, kind="pruned", at=time.time(), n=n, node=self.node, generation=generation))
        if stop:
            try:
                await asyncio.wait_for(rt.exited.wait(), 10)
            except asyncio.TimeoutError:
                log.error("job %s did not die after vacate; killing it", job)
                signal_tree(rt.pid, signal.SIGKILL)
        return self._reply(rt, epoch=info, notes=notes)

    # ------------------------------------------------------------------ restore

    async def restore(self, spec: JobSpec, generation: int) -> AgentJobReply:
        subjects.check_name(spec.id, "job id")
        async with self._launch(spec.id, generation) as launch:
            return await self._restore(spec, generation, launch)

    async def _restore(self, spec: JobSpec, generation: int, launch: Launch) -> AgentJobReply:
        if self.engine is None:
            raise CriuError(f"cannot restore on {self.node}: {self.criu_error}")
        files = JobFiles(self.storage, spec.id)
        # A new stamp inode fences any stale copy; touch_stamps keeps it fresh while criu restores.
        await asyncio.to_thread(replace_with_prefix, files.stamp, 0)
        launch.stamp = files.stamp
        pid, manifest, notes = await self.engine.restore(spec.id, generation)
        rt = JobRuntime(spec=spec, generation=generation, pid=pid, files=files)
        self.jobs[spec.id] = rt
        self._watch(rt, pid)
        # The coordinator publishes "restored": it alone knows whether this is a restart or a failover.
        log.info("job %s restored from epoch %d as generation %d, pid %d", spec.id, manifest.epoch, generation, pid)
        await self._check_superseded(rt, launch)
        return self._reply(rt, epoch=files.info(manifest), notes=notes)

    # ------------------------------------------------------------------ kill, purge, shutdown

    async def kill(self, job: str, generation: int, reason: str = "") -> AgentJobReply:
        """Kill ``job`` if it runs ``generation`` or an older one (a stale copy), or is starting it."""
        launch = self.launching.get(job)
        if launch is not None and launch.generation <= generation:
            launch.superseded = reason or f"killed as generation {launch.generation}"
            await launch.done.wait()  # the start or restore kills what it made
            return AgentJobReply(job=job, generation=launch.generation, node=self.node)
        rt = self.jobs.get(job)
        if rt is None:
            raise JobNotRunning(f"job {job} is not running on {self.node}")
        if rt.generation > generation:
            raise StaleGeneration(f"job {job} runs generation {rt.generation} on {self.node}, newer than {generation}")
        await self._kill(rt, reason or f"killed as generation {rt.generation}")
        return self._reply(rt)

    def kill_all(self, reason: str) -> list[str]:
        """SIGKILL every job now, without waiting (the self-fence; safe from another thread).
        Their exits are reported, with ``reason``, as the watchers see them."""
        self._supersede_launches(reason)
        doomed = list(self.jobs.values())
        for rt in doomed:
            rt.killing, rt.evicted, rt.kill_reason = True, True, reason
            signal_tree(rt.pid, signal.SIGKILL)
        return [rt.spec.id for rt in doomed]

    async def _kill(self, rt: JobRuntime, reason: str = "") -> None:
        rt.killing = True
        rt.kill_reason = rt.kill_reason or reason
        signal_tree(rt.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(rt.exited.wait(), 10)
        except asyncio.TimeoutError:
            log.error("job %s (pid %d) survived SIGKILL for 10 s", rt.spec.id, rt.pid)

    async def purge(self, job: str) -> AgentJobReply:
        subjects.check_name(job, "job id")
        if job in self.jobs:
            raise RevenantError(f"job {job} is still running on {self.node}; only finished jobs can be purged",
                                code="running")
        files = JobFiles(self.storage, job)
        freed = await asyncio.to_thread(files.purge)
        return AgentJobReply(job=job, generation=0, node=self.node, output=str(files.output), freed_bytes=freed)

    async def drain(self, budget_s: float, reason: str) -> None:
        """Checkpoint and stop every job, all at once, within ``budget_s``; each is reported
        "evicted", with its new epoch, for the coordinator to restore elsewhere.  A job that
        cannot be checkpointed in time is left for :meth:`shutdown`, which evicts it without one."""
        self._supersede_launches(reason)
        jobs = list(self.jobs.values())
        if not jobs or self.engine is None or budget_s <= 0:
            return
        log.info("draining %d job(s) within %g s", len(jobs), budget_s)

        async def one(rt: JobRuntime) -> None:
            try:
                await asyncio.wait_for(self.checkpoint(rt.spec.id, rt.generation, stop=True,
                                                       evict_reason=f"{reason}; checkpointed"), budget_s)
            except asyncio.TimeoutError:
                log.warning("job %s: no checkpoint within the drain budget (%g s)", rt.spec.id, budget_s)
            except RevenantError as exc:
                log.warning("job %s: checkpoint for the drain failed: %s", rt.spec.id, exc)

        await asyncio.gather(*(one(rt) for rt in jobs))

    async def shutdown(self, reason: str = "the agent is shutting down") -> None:
        """Kill every job left (they would die with the agent anyway), each reported "evicted"
        so that the coordinator restores it from its last epoch, and stop watching."""
        self._supersede_launches(reason)
        doomed = list(self.jobs.values())
        for rt in doomed:
            rt.evicted = True
        await asyncio.gather(*(self._kill(rt, reason) for rt in doomed))
        for task in list(self._tasks):
            task.cancel()

    def _supersede_launches(self, reason: str) -> None:
        """Every start or restore in flight: what it brings up is killed on arrival (thread-safe)."""
        for launch in list(self.launching.values()):
            launch.superseded = reason

    def touch_stamps(self) -> None:
        """The agent holds its lease: every job's dead man's switch is reset (safe from another thread)."""
        now = time.monotonic()
        if now - self._touched_at > self.switch_timeout_s:
            self._switch_gap_at = now
        self._touched_at = now
        for rt in list(self.jobs.values()):
            _touch(rt.files.stamp)
        for launch in list(self.launching.values()):
            if launch.stamp is not None:
                _touch(launch.stamp)

    def _switch_may_have_fired(self) -> bool:
        """Whether the switches went unreset long enough to fire, now or a moment ago."""
        now = time.monotonic()
        return now - self._touched_at > self.switch_timeout_s * 0.8 or now - self._switch_gap_at < 10.0

    def reap_orphans(self) -> None:
        for pid, code in procs.reap_orphans():
            log.info("reaped orphan %d (status %d)", pid, code)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError as exc:
        log.warning("cannot reset the dead man's switch %s: %s", path, exc)
