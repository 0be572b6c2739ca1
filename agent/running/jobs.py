"""The job supervisor: which jobs run here, at which generation, and what happens to them.

It coordinates the parts that do the work: the launcher (``agent/running/launcher.py``: the PID namespace,
revenant-init, the job's files), the engine (``agent/checkpointing/engine.py``: checkpoint and restore), the
checkpoint bookkeeping (``agent/checkpointing/checkpoints.py``) and the exit classifier (``agent/processes/exits.py``).

A restored job (``criu restore --restore-sibling``) becomes the agent's direct child; the agent is a
child subreaper, so it reaps anything orphaned below.  A lazy restore's pages: ``agent/lazyrestore/fetches.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from pathlib import Path
from typing import Callable, Sequence

import msgspec

from revenant.agent.checkpointing.checkpoints import CheckpointBook, Why
from revenant.agent.checkpointing.engine import Engine
from revenant.agent.checkpointing.policy import PolicyRunner
from revenant.agent.lazyrestore.fetches import FETCH_WAIT_S, PageFetches
from revenant.agent.network import netlock
from revenant.agent.processes import procs
from revenant.agent.pipeline.steps import RestoreAsk
from revenant.agent.processes.cgroups import Layout, NodeCgroups
from revenant.agent.processes.exits import ExitClassifier
from revenant.agent.processes.procs import signal_tree
from revenant.agent.running.freezing import Freezer
from revenant.agent.running import signals
from revenant.agent.running.launcher import Launcher, new_stamp, reset_stamp
from revenant.agent.running.exiting import JobExits
from revenant.agent.running.runtime import JobRuntime, Launch, LeaderTerm
from revenant.agent.storage.imagekeys import ImageKeys
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import CriuError, JobNotRunning, RevenantError, StaleGeneration
from revenant.common.serving.metrics import AgentMetrics
from revenant.messages import AgentJobReply, JobEvent, JobSpec, Message, subjects

log = logging.getLogger(__name__)


class Supervisor(JobExits):
    def __init__(self, node: str, storage: Path, engine: Engine | None, emit: Callable[[str, Message], None],
                 criu_error: str = "criu unusable", metrics: AgentMetrics | None = None,
                 switch_timeout_s: float = 1.2, *, max_frozen_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, scratch: dict[str, str] | None = None,
                 allow_root_jobs: bool = True, cgroups: NodeCgroups | None = None,
                 leader_term: LeaderTerm | None = None) -> None:
        self.switch_timeout_s = switch_timeout_s
        self.clock = clock
        self.node = node
        self.storage = storage
        self.engine = engine
        self.emit = emit
        self.criu_error = criu_error
        self.wall_clock = wall_clock
        self.cgroups = cgroups or NodeCgroups(node, Layout(why_none="job_cgroups is off"))
        self.launcher = Launcher(node, storage, switch_timeout_s, max_frozen_s=max_frozen_s, clock=clock,
                                 scratch=scratch, allow_root_jobs=allow_root_jobs)
        self.launcher.criu_other_users = getattr(engine, "other_users", False)
        self.exits = ExitClassifier(switch_timeout_s, clock)
        self.book = CheckpointBook(node, emit, metrics, wall_clock, owner=self.owner)
        self.policies = PolicyRunner(node, self.book, emit, wall_clock=wall_clock)
        self.jobs: dict[str, JobRuntime] = {}
        self._owners: dict[str, str] = {}  # every job's user, kept past its runtime (its later epoch events)
        self.freezer = Freezer(self.jobs, self.exits, clock)  # the self-fence's SIGSTOP and SIGCONT
        self.leader_term = leader_term or LeaderTerm()  # whose commands it takes
        # Starts and restores in flight, one per job: a newer generation or a kill arriving
        # meanwhile supersedes it, and its process is killed on arrival.
        self.launching: dict[str, Launch] = {}
        # The newest generation of each job killed here: a start or restore of it arriving late never runs.
        self.killed: dict[str, int] = {}
        self.fetches = PageFetches(self)  # lazily restored jobs whose pages are still arriving
        # The jobs' pid watchers: a drain needs them after the agent's loops stopped (shutdown ends them).
        self._watchers: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ queries

    @property
    def pending_ops(self) -> int:
        return self.engine.pending if self.engine else 0

    @property
    def checkpoint_failures(self) -> int:
        return self.book.failures

    def _get(self, job: str, generation: int | None = None) -> JobRuntime:
        rt = self.jobs.get(job)
        if rt is None:
            raise JobNotRunning(f"job {job} is not running on {self.node}")
        if generation is not None and generation != rt.generation:
            raise StaleGeneration(f"job {job} runs generation {rt.generation} on {self.node}, not {generation}")
        return rt

    def _reply(self, rt: JobRuntime, **kw) -> AgentJobReply:
        return AgentJobReply(job=rt.spec.id, generation=rt.generation, node=self.node, pid=rt.pid,
                             program_pid=procs.program_pid(rt.pid), output=str(rt.files.output), **kw)

    @property
    def keys(self) -> ImageKeys | None:
        """The cluster's image keys its engine signs and checks epochs with (agent/storage/imagekeys.py)."""
        return self.engine.keys if self.engine is not None else None

    def owner(self, job: str) -> str:
        """``job``'s user, for its events' subjects ("": unknown here, or a job from before users)."""
        rt = self.jobs.get(job)
        if rt is not None:
            self._owners[job] = rt.spec.user
        return self._owners.get(job, "")

    def _event(self, rt: JobRuntime, kind: str, **kw) -> None:
        self.emit(subjects.job_event(rt.spec.id, kind, self.node, user=self.owner(rt.spec.id)),
                  JobEvent(job=rt.spec.id, kind=kind, at=self.wall_clock(), node=self.node, generation=rt.generation,
                           pid=rt.pid, **kw))

    # ------------------------------------------------------------------ start

    async def start(self, spec: JobSpec, generation: int, fresh: bool = False,
                    gpus: Sequence[str] = ()) -> AgentJobReply:
        """Launch ``spec`` (on ``gpus``: its CUDA_VISIBLE_DEVICES).  ``fresh`` (a requeue): its earlier
        output is discarded, for a clean rerun."""
        subjects.check_name(spec.id, "job id")
        async with self._launch(spec.id, generation) as launch:
            return await self._start(spec, generation, fresh, launch, gpus)

    async def _start(self, spec: JobSpec, generation: int, fresh: bool, launch: Launch,
                     gpus: Sequence[str]) -> AgentJobReply:
        user = self.launcher.user(spec)  # as its user: never root unless allowed
        env = self.launcher.check(spec, user) | ({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {})
        files = await self.launcher.prepare(spec.id, fresh, user, env)
        files.keys = self.keys
        launch.stamp = files.stamp
        cgroup, notes = self.cgroups.make(spec.id, generation, spec.resources)
        try:
            started = await self.launcher.spawn(spec, files, env, user, cgroup)
        except BaseException:
            self.cgroups.retire(cgroup)
            raise
        rt = JobRuntime(spec=spec, generation=generation, pid=started.pid or 0, files=files, cgroup=cgroup)
        self.jobs[spec.id] = rt
        log.info("job %s (generation %d) started, pid %d", spec.id, generation, rt.pid)
        self._event(rt, "started")
        if started.pid is None:  # finished before we could even see it (`true`): report its exit all the same
            asyncio.get_running_loop().call_soon(self._exited, rt, started.exit_code)
        else:
            self._watch(rt, started.wrapper.pid, started.wrapper)
            await signals.program_started(rt)
        await self._check_superseded(rt, launch)
        return self._reply(rt, notes=notes)

    @contextlib.asynccontextmanager
    async def _launch(self, job: str, generation: int):
        """Claim ``job`` for starting ``generation``: never two starts or restores of one job at once,
        never an older generation over a newer one (an older copy, running or starting, is killed first)."""
        while True:
            if self.killed.get(job, 0) >= generation:  # a kill (a cancel) came before this launch, or while it waited
                raise StaleGeneration(f"job {job} generation {generation} was killed on {self.node} before it started")
            if (current := self.launching.get(job)) is None:
                break
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

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(self, job: str, generation: int, stop: bool, evict_reason: str = "", *,
                         scheduled: bool = False, force: bool = False, why: Why | None = None) -> AgentJobReply:
        """``stop``: vacate (``evict_reason``: the node stops it, to be restored elsewhere); ``scheduled``:
        periodic (skipped under load, agent/checkpointing/policy.py), ``force``: whatever the load; ``why``: the
        epoch event's cause and reasons."""
        rt = self._get(job, generation)
        if rt.frozen_at is not None:
            # Its image would hold stopped processes, and come back stopped wherever restored.
            raise RevenantError(f"job {job} is frozen (node {self.node}'s lease lapsed); it can be "
                                f"checkpointed once the leader lets it thaw", code="frozen", retriable=True)
        if self.engine is None:
            raise CriuError(f"cannot checkpoint on {self.node}: {self.criu_error}")
        if rt.lock.locked():
            raise RevenantError(f"job {job} already has a checkpoint in progress", code="busy", retriable=True)
        warnings = self.policies.admit(job, generation, rt.spec.policy, scheduled=scheduled, force=force)
        async with rt.lock:
            await self.fetches.wait(rt, FETCH_WAIT_S)  # never a dump of a job whose pages are still arriving
            rt.vacating = stop
            try:
                return await self._checkpoint(rt, stop, evict_reason, warnings, why or {})
            finally:
                # However the vacate ended (committed, failed, cancelled by a drain's deadline or a
                # shutdown), an exit it held back is reported now, and a later one as it happens.
                if rt.vacating:
                    rt.vacating = False
                    if rt.exited.is_set():
                        self._report_exit(rt)

    async def _checkpoint(self, rt: JobRuntime, stop: bool, evict: str, warnings: list[str], why: Why) -> AgentJobReply:
        job, generation = rt.spec.id, rt.generation
        assert self.engine is not None
        since = self.clock()
        try:
            manifest, notes, stats = await self.engine.checkpoint(
                job, generation, rt.pid, stop=stop, user=rt.spec.user, workdir=rt.spec.workdir,
                # An eviction's job goes to another node, where its connections come back closed: none are held.
                policy=msgspec.structs.replace(rt.spec.policy, connections="close") if evict else rt.spec.policy,
                spoiled=functools.partial(self.freezer.spoiled, rt, since),
                resume=functools.partial(self.freezer.resume, rt))
        except RevenantError as exc:
            self.book.failed(job, generation, exc, **why)
            raise
        if stop:
            # Committed, and the engine has killed the job: its exit is this vacate (or drain).
            netlock.vacated(self.engine.steps, job)
            rt.stopped_at_epoch, rt.stopped_gpus = manifest.epoch, (manifest.gpus, manifest.gpu_driver)
            rt.evicted, rt.kill_reason = bool(evict), evict
        info, pruned, kept, storage = await self.policies.committed(rt.files, generation, manifest,
                                                                    rt.spec.max_epochs, rt.spec.policy, why)
        if stop:
            try:
                await asyncio.wait_for(rt.exited.wait(), 10)
            except asyncio.TimeoutError:
                log.error("job %s did not die after vacate; killing it", job)
                signal_tree(rt.pid, signal.SIGKILL)
        return self._reply(rt, epoch=info, notes=warnings + notes, pruned=pruned, epochs=kept, storage_bytes=storage,
                           stats=stats)

    # ------------------------------------------------------------------ restore

    async def restore(self, spec: JobSpec, generation: int, leave_workdir: str = "", epoch: int = 0,
                      gpus: Sequence[str] = ()) -> AgentJobReply:
        """From the newest restorable epoch, or (``epoch``) exactly that one; onto ``gpus``."""
        subjects.check_name(spec.id, "job id")
        async with self._launch(spec.id, generation) as launch:
            return await self._restore(spec, generation, launch, leave_workdir, epoch, gpus)

    async def _restore(self, spec: JobSpec, generation: int, launch: Launch, leave_workdir: str,
                       epoch: int, gpus: Sequence[str]) -> AgentJobReply:
        if self.engine is None:
            raise CriuError(f"cannot restore on {self.node}: {self.criu_error}")
        user = self.launcher.user(spec)  # criu restores the credentials it dumped: root's only where allowed
        self.launcher.check_workdir(spec, user)  # a restore puts files back there as root
        files = JobFiles(self.storage, spec.id, self.keys)
        # A new stamp inode fences any stale copy; touch_stamps keeps it fresh while criu restores.
        await asyncio.to_thread(new_stamp, files)
        launch.stamp = files.stamp
        async with self.policies.lock(files):  # never while its older epochs are being converted
            cgroup, limits = self.cgroups.make(spec.id, generation, spec.resources)
            ask = RestoreAsk(epoch, leave_workdir, tuple(gpus), tuple(cgroup.criu_args() if cgroup else ()), spec.user)
            try:
                pid, manifest, notes, fetch, stats = await self.engine.restore(spec.id, generation, ask)
            except BaseException:
                self.cgroups.retire(cgroup)
                await asyncio.shield(netlock.restore_failed(self.engine.steps, spec.id))
                raise
        notes = limits + notes
        rt = JobRuntime(spec=spec, generation=generation, pid=pid, files=files, cgroup=cgroup)
        self.jobs[spec.id] = rt
        self._watch(rt, pid)
        self.fetches.start(rt, fetch)
        # The coordinator publishes "restored": it alone knows whether this is a restart or a failover.
        log.info("job %s restored from epoch %d as generation %d, pid %d", spec.id, manifest.epoch, generation, pid)
        await self._check_superseded(rt, launch)
        return self._reply(rt, epoch=await self.policies.described(files, manifest), notes=notes, stats=stats,
                           kept=netlock.kept_of(self.engine.steps, spec.id))

    # ------------------------------------------------------------------ kill, purge, shutdown

    async def kill(self, job: str, generation: int, reason: str = "", signum: int = 0,
                   grace_s: float = 0.0) -> AgentJobReply:
        """Kill ``job`` if it runs ``generation`` or an older one (a stale copy), or is starting it;
        a start or restore of that generation that comes later is refused.  ``signum`` (a
        cancel's): sent first, with ``grace_s`` to end before SIGKILL."""
        self.killed[job] = max(generation, self.killed.get(job, 0))
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
        if signum and await signals.ask_to_end(rt, signum, grace_s, reason):
            return self._reply(rt)
        await self._kill(rt, reason or f"killed as generation {rt.generation}")
        return self._reply(rt)

    def signal(self, job: str, generation: int, signum: int, every: bool = False) -> AgentJobReply:
        """Deliver ``signum`` to the job's program (``every``: every process of the job)."""
        rt = self._get(job, generation)
        return self._reply(rt, signalled=signals.signal_job(rt, signum, every, self.node))

    # ------------------------------------------------------------------ fencing by freezing

    def freeze_all(self, reason: str) -> list[str]:
        """SIGSTOP every job's processes now (the self-fence; safe from another thread).  A
        frozen job writes and does nothing; it thaws only on the leader's word (:meth:`thaw`),
        or is killed after ``max_frozen_s`` (:meth:`expire_frozen`).  Starts and restores in
        flight are superseded, as they were never reported running.  The namespace's init is
        left running: its dead man's switch is the backstop if this agent stops for good."""
        self._supersede_launches(reason)
        return self.freezer.freeze_all(reason)

    def thaw(self, job: str, generation: int, fences: int | None = None) -> bool:
        """SIGCONT a frozen job (the leader kept it here); False if it is not that one, frozen, or
        if this node fenced again since the leader was asked (``fences``: :attr:`fences` then)."""
        return self.freezer.thaw(job, generation, fences)

    @property
    def fences(self) -> int:  # how many times this node has fenced (freeze_all) so far
        return self.freezer.fences

    async def expire_frozen(self, max_frozen_s: float) -> None:
        """Kill each job frozen for longer than ``max_frozen_s`` (reported evicted: the leader
        restores it from its last epoch)."""
        now = self.clock()
        for rt in list(self.jobs.values()):
            if rt.frozen_at is not None and now - rt.frozen_at > max_frozen_s:
                rt.evicted = True
                await self._kill(rt, f"frozen for {now - rt.frozen_at:.0f} s (max_frozen_s) without "
                                     f"the leader's word to go on")

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
        files = JobFiles(self.storage, job, self.keys)
        async with self.policies.lock(files):
            freed = await asyncio.to_thread(files.purge)
        return AgentJobReply(job=job, generation=0, node=self.node, output=str(files.output), freed_bytes=freed)

    async def drain(self, budget_s: float, reason: str) -> None:
        """Checkpoint and stop every job, all at once, within ``budget_s``; each is reported
        "evicted", with its new epoch, for the coordinator to restore elsewhere.  A job that
        cannot be checkpointed in time is left for :meth:`shutdown`, which evicts it without one."""
        self._supersede_launches(reason)
        jobs = [rt for rt in self.jobs.values() if rt.frozen_at is None]  # frozen: restored from their epoch
        if not jobs or self.engine is None or budget_s <= 0:
            return
        log.info("draining %d job(s) within %g s", len(jobs), budget_s)

        async def one(rt: JobRuntime) -> None:
            try:
                await asyncio.wait_for(self.checkpoint(rt.spec.id, rt.generation, stop=True, why={"cause": "drain"},
                                                       evict_reason=f"{reason}; checkpointed"), budget_s)
            except asyncio.TimeoutError:
                log.warning("job %s: no checkpoint within the drain budget (%g s)", rt.spec.id, budget_s)
            except RevenantError as exc:
                log.warning("job %s: checkpoint for the drain failed: %s", rt.spec.id, exc)

        await asyncio.gather(*(one(rt) for rt in jobs))

    async def shutdown(self, reason: str = "the agent is shutting down") -> None:
        """Kill every job left (each reported "evicted": the coordinator restores it), stop watching."""
        self._supersede_launches(reason)
        doomed = list(self.jobs.values())
        for rt in doomed:
            rt.evicted = True
        await asyncio.gather(*(self._kill(rt, reason) for rt in doomed))
        await self.fetches.stop()
        for task in list(self._watchers):
            task.cancel()

    def _supersede_launches(self, reason: str) -> None:  # what starts and restores bring up is killed (thread-safe)
        for launch in list(self.launching.values()):
            launch.superseded = reason

    def touch_stamps(self) -> float:
        """The agent holds its lease: every job's dead man's switch is reset (safe from another
        thread).  The longest any switch may have gone unreset (:meth:`ExitClassifier.switches_reset`)."""
        started = self.clock()
        for rt in list(self.jobs.values()):
            reset_stamp(rt.files.stamp)
        for launch in list(self.launching.values()):
            if launch.stamp is not None:
                reset_stamp(launch.stamp)
        return self.exits.switches_reset(started)

    def reap_orphans(self) -> None:
        for pid, code in procs.reap_orphans():
            log.info("reaped orphan %d (status %d)", pid, code)
        self.cgroups.tidy()

