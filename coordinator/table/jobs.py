"""The job service: the thin shell around the job lifecycle.

It feeds inputs to :func:`revenant.coordinator.table.lifecycle.transition` under the
job's lock, writes the record it returns to the store, publishes its events,
and carries out its commands through the agent client; each reply comes back
as the next input.  Because every input is applied to the record as it is now,
replies and agents' events may arrive in any order without a stale write winning
(a job that exits before its start reply is processed ends *completed*, not *running*).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

import msgspec

from revenant.common.errors import CheckpointSkipped, RevenantError, UnknownJob
from revenant.common.messaging.events import EventPublisher
from revenant.common.settings.config import CoordinatorConfig
from revenant.common.settings.limits import check_submit
from revenant.common.settings.resources import check_resources
from revenant.coordinator.table import lifecycle as lc, userlimits
from revenant.coordinator.table.agents import AgentClient, LeaderGuard, NotLeader, check_may_act
from revenant.coordinator.table.placement import (NoCapacity, NoNodeAvailable, node_address, own_node, place_job,
                                                  waived_notes, workdir_shared)
from revenant.coordinator.table.store import JobStore, Unsettled, WriteConflict, patiently
from revenant.messages import (EpochEvent, JobEvent, JobRecord, JobResources, JobSpec, LocalJob, NodeStatus, PurgeJob, ReconcileReply,
                               StaleJob, SubmitRequest, subjects)

log = logging.getLogger(__name__)

# A recovery's result: (kind, record, epoch, notes), kind "restored", "requeued" or "failed".
Recovery = tuple[str, JobRecord, int | None, list[str]]


class JobService:
    def __init__(self, store: JobStore, agents: AgentClient, config: CoordinatorConfig, events: EventPublisher,
                 nodes: Callable[[], list[NodeStatus]], leader: LeaderGuard, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.agents = agents
        self.config = config
        self.events = events
        self.nodes = nodes
        self.leader = leader
        self.wall = wall
        self.jobs = userlimits.JobTable()  # it counts each user's unfinished jobs too
        self._locks: dict[str, asyncio.Lock] = {}
        # (user, submit request id) -> the job it made, kept with the table (checked on use).
        self._by_request: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ the table

    async def open(self) -> None:
        self.jobs = userlimits.JobTable(await self.store.load())
        self._by_request = {(r.spec.user, r.spec.request_id): j for j, r in self.jobs.items() if r.spec.request_id}
        log.info("job table: %d job(s)", len(self.jobs))

    def made_by(self, user: str, request_id: str) -> JobRecord | None:
        """The live job that ``user``'s submit with ``request_id`` made, if any."""
        rec = self.jobs.get(self._by_request.get((user, request_id), ""))
        return rec if rec is not None and (rec.spec.user, rec.spec.request_id) == (user, request_id) else None

    def lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    def get(self, job: str) -> JobRecord:
        rec = self.jobs.get(job)
        if rec is None:
            raise UnknownJob(f"unknown job {job}")
        return rec

    def _workdir_rule(self, cmd: lc.Command) -> lc.Command:
        """A restore leaves the job's working directory as it is when other jobs work there too."""
        if isinstance(cmd, lc.Restore):
            return dataclasses.replace(cmd, leave_workdir=workdir_shared(cmd.spec, self.jobs.values()))
        return cmd

    def jobs_per_node(self) -> dict[str, int]:
        return self.jobs.per_node

    def jobs_on(self, node: str) -> list[str]:
        return [j for j, r in self.jobs.items() if r.node == node and r.state in lc.ACTIVE]

    async def save(self, rec: JobRecord) -> None:
        """Write ``rec`` (compare-and-set) and take it as this job's record."""
        check_may_act(self.leader.fresh)
        rec.updated_at = self.wall()
        try:
            await self.store.save(rec)
        except WriteConflict as conflict:
            await self._resolve(conflict, rec)
        self.jobs[rec.spec.id] = rec
        if rec.spec.request_id:
            self._by_request[(rec.spec.user, rec.spec.request_id)] = rec.spec.id

    async def _resolve(self, conflict: WriteConflict, mine: JobRecord) -> None:
        """Someone else wrote the job since this coordinator last did.  If the store says this
        one still leads, that was a deposed leader's late write: this one's record stands, unless
        the other moved the job on (:func:`lifecycle.moved_on`: a copy may run where it says),
        which this one then takes as the truth.  Otherwise this one is the stale leader and
        steps down, writing nothing."""
        key, why = conflict.job, str(conflict)
        leads = await self.leader.holds()
        if leads is None:
            raise Unsettled(f"cannot save job {key}: it changed in the store, and the leader lease "
                           f"could not be read to tell who leads")
        if not leads:
            log.error("%s: this one is no longer the leader", why)
            self.leader.step_down(why)
            raise NotLeader(f"{why}; this coordinator stepped down")
        stored = conflict.stored
        self.store.accept(conflict)
        if stored is not None and lc.moved_on(stored, mine):
            self.jobs[key] = stored
            log.warning("%s, which no longer leads, and moved it on (generation %d, %s on %s): "
                        "taken as the truth", why, stored.generation, stored.state, stored.node or "-")
            raise Unsettled(f"job {key} was moved on by another coordinator (now generation "
                           f"{stored.generation}, {stored.state}); try again")
        log.warning("%s, which no longer leads; this leader's record stands", why)
        try:
            await self.store.save(mine)
        except WriteConflict:
            raise Unsettled(f"cannot save job {key}: it keeps changing in the store; try again") from None

    async def step(self, job: str, inp: lc.Input | Callable[[JobRecord], lc.Input | None]) -> lc.Decision:
        """Apply one input to the job's record as it is now: write, publish, return the decision
        (whose commands the caller carries out).  ``inp`` may be built from the record (under
        the lock); None means nothing to do."""
        async with self.lock(job):
            rec = self.jobs.get(job)
            if rec is None and not isinstance(inp, lc.Submit):
                raise UnknownJob(f"unknown job {job}")
            if callable(inp):
                inp = inp(rec)
                if inp is None:
                    return lc.Decision()
            return await self._apply(rec, inp)

    async def record(self, job: str, inp: lc.Input) -> lc.Decision:
        """:meth:`step` with what a node already did (launched, dumped or restored the job, or
        let an attempt go): the record must learn it, so a job table that does not answer is asked
        again (:func:`patiently`)."""
        return await patiently(lambda: self.step(job, inp), f"job {job}")

    async def _apply(self, rec: JobRecord | None, inp: lc.Input) -> lc.Decision:
        """transition, write, publish: with the job's lock held."""
        decision = lc.transition(rec, inp, self.wall())
        if decision.record is not None:
            await self.save(decision.record)
        for emit in decision.events:
            self.event(decision.record or rec, emit.kind, **emit.fields)
        return decision

    def event(self, rec: JobRecord, kind: str, **kw) -> None:
        kw.setdefault("address", node_address(self.nodes(), rec.node))  # where clients find the job
        self.events.emit(subjects.job_event(rec.spec.id, kind, user=rec.spec.user), JobEvent(
            job=rec.spec.id, kind=kind, at=self.wall(), node=rec.node, generation=rec.generation, **kw))

    # ------------------------------------------------------------------ operations

    def place(self, spec: JobSpec, requested: str = "", exclude: set[str] | frozenset[str] = frozenset(),
              nodes: list[NodeStatus] | None = None, **kw) -> tuple[str, tuple[str, ...]]:
        """Where ``spec`` goes now (among ``nodes``, default all), and the GPUs it is given there
        (:func:`place_job`, with what every node's other unfinished jobs have taken)."""
        node, gpus = place_job(self.nodes() if nodes is None else nodes, self.jobs.per_node, requested, exclude,
                               ask=spec.resources, used=self.jobs.usage(but=spec.id), **kw)
        return node, tuple(gpus)

    async def submit(self, req: SubmitRequest, user: str = "", ask: JobResources | None = None) -> JobRecord:
        """Start ``req`` as a job of ``user`` (who decided: coordinator/table/requests.py, which also answers
        a repeat of a submit).  With no room now it waits, pending: coordinator/waiting.py starts it.
        ``ask``: its resources (:meth:`ResourcesConfig.ask`), worked out here if not given."""
        check_submit(req, user)  # before anything happens: a record that could not be stored or replied to
        if req.node:
            subjects.check_name(req.node)
        defaults = self.config.checkpoint
        ask = ask or self.config.resources.ask(req)  # the cluster's, as the submit overrides
        check_resources(ask, [(n.name, n.capabilities) for n in self.nodes() if n.state != "left"])
        spec = JobSpec(id="(new)", argv=list(req.argv), name=req.name or req.argv[0].rsplit("/", 1)[-1],
                       workdir=req.workdir, env=dict(req.env), checkpoint_interval_s=req.checkpoint_interval_s,
                       max_epochs=defaults.max_epochs_for(req), requeue=req.requeue, user=user,
                       policy=defaults.policy(req), on_sick=self.config.on_sick_for(req), request_id=req.request_id,
                       resources=ask)
        try:
            submit = lc.Submit(spec, *self.place(spec, req.node))
        except NoCapacity as exc:
            if req.node:
                raise  # it asked for that node: no waiting for another
            submit = lc.Submit(spec, "", waiting=f"waiting for room: {exc}")
        job_id = await self.store.next_id()
        submit = dataclasses.replace(submit, spec=msgspec.structs.replace(spec, id=job_id))
        commands = (await self.record(job_id, submit)).commands  # a write that timed out may have landed
        return await self.start(job_id, commands[0], req.node) if commands else self.get(job_id)

    async def start(self, job_id: str, cmd: lc.Command, requested: str = "") -> JobRecord:
        """Carry out a job's first start; a node going away hands it to the next one."""
        tried: set[str] = set()
        while True:
            try:
                reply = await self.agents.carry_out(cmd, self.config.start_timeout_s)
                break
            except RevenantError as exc:
                failed = f"start on {cmd.node} failed: {exc}"
                await self.agents.abandon(cmd.node, job_id, cmd.generation, failed)
                tried.add(cmd.node)
                retry, gpus = self._next_node(self.get(job_id).spec, requested, exc, tried)
                decision = await self.record(job_id, lc.LaunchFailed(cmd.generation, failed, retry, gpus))
                if not decision.commands:
                    raise RevenantError(f"job {job_id} could not start on {cmd.node}: {exc}", code=exc.code) from None
                log.info("job %s: %s refused it (%s); starting it on %s", job_id, cmd.node, exc.code, retry)
                cmd = decision.commands[0]
        await self.record(job_id, lc.Launched(cmd.generation, reply.pid, reply.output, reply.program_pid))
        return self.get(job_id)

    def _next_node(self, spec: JobSpec, requested: str, exc: RevenantError,
                   tried: set[str]) -> tuple[str | None, tuple[str, ...]]:
        """A node that refuses because it is going away (or fenced) is no reason to fail the
        job: unless the user asked for that node, it goes to the next one."""
        if requested or exc.code not in ("shutting_down", "fenced") or len(tried) >= 3:
            return None, ()
        try:
            return self.place(spec, exclude=tried)
        except NoNodeAvailable:
            return None, ()

    async def checkpoint(self, job: str, *, stop: bool, scheduled: bool = False, force: bool = False,
                         evict: str = "", cause: str = "", reasons: tuple[str, ...] = (),
                         stats: dict[str, float] | None = None) -> tuple[JobRecord, list[str]]:
        """Checkpoint (``stop``: vacate; with ``evict``, a move: the job is left restoring, for failover
        to place) the job.  ``scheduled``: a periodic one, which its node may skip under load
        (:class:`CheckpointSkipped`: the job runs on, nothing failed); ``force``: take it whatever
        the load.  ``cause``, ``reasons``: why, for the epoch event.  ``stats``, if given, is filled
        with criu's statistics of the dump (the agent's reply)."""
        asked = lc.CheckpointAsked(stop, scheduled, force, evict, cause, tuple(reasons))
        cmd = (await self.record(job, asked)).commands[0]  # nothing is sent before it is saved: asked again
        try:
            reply = await self.agents.carry_out(cmd, self.config.checkpoint_timeout_s)
        except RevenantError as exc:
            skipped = exc.code == CheckpointSkipped.code
            quiet = skipped or exc.code == "busy"  # nothing failed: the job runs on, or is checkpointed already
            await self.record(job, lc.CheckpointFailed(cmd.generation, "" if quiet else str(exc),
                                                       exc.code == "not_checkpointable"))
            if skipped and not isinstance(exc, CheckpointSkipped):
                raise CheckpointSkipped(str(exc)) from None
            raise
        await self.record(job, lc.Checkpointed(cmd.generation, stop, reply.epoch, tuple(reply.pruned),
                                               tuple(reply.epochs), reply.storage_bytes, evicted=bool(stop and evict)))
        if stats is not None:
            stats.update(reply.stats)
        return self.get(job), reply.notes

    async def checkpoint_abandoned(self, job: str, generation: int) -> None:
        """The leader that asked for this checkpoint is gone, and its reply with it: the job runs
        on (a vacate that did stop it reports "vacated" through the event stream)."""
        await self.step(job, lc.CheckpointFailed(generation))

    async def restart(self, job: str, node: str = "", epoch: int = 0,
                      stats: dict[str, float] | None = None) -> tuple[JobRecord, list[str]]:
        """Restore a vacated or failed job: from ``epoch`` exactly, or (0) its newest restorable one.
        ``stats``, if given, is filled with criu's statistics of the restore."""
        before: list[JobRecord] = []
        waived: list[str] = []

        def ask(rec: JobRecord) -> lc.Input:
            lc.check_restart(rec, epoch)  # before placement: a refusal names the job's state, not a node
            before.append(rec)
            need, driver = lc.gpus_of(rec, epoch)
            target, gpus = self.place(rec.spec, node, restore=True, gpus=need, gpu_driver=driver)
            waived[:] = waived_notes(job, self.nodes(), target)
            return lc.RestartAsked(target, epoch, gpus)

        cmd = self._workdir_rule((await self.step(job, ask)).commands[0])
        try:
            reply = await self.agents.carry_out(cmd, self.config.checkpoint_timeout_s)
        except RevenantError as exc:
            why = f"restart on {cmd.node} failed: {exc}"
            await self.agents.abandon(cmd.node, job, cmd.generation, why)
            await self.record(job, lc.RestartFailed(cmd.generation, why, before[0].state, before[0].node))
            raise
        notes = waived + reply.notes
        await self.record(job, lc.Restored(cmd.generation, reply.pid, reply.epoch, reply.output,
                                            announce="; ".join(notes) or True, kept=tuple(reply.kept),
                                            program_pid=reply.program_pid))
        if stats is not None:
            stats.update(reply.stats)
        return self.get(job), notes

    async def purge(self, job: str) -> tuple[JobRecord, list[str]]:
        """Delete a finished job's checkpoints, then its record (live or archived)."""
        # One lock for the whole purge: a restart waiting on it must not restore deleted epochs.
        async with self.lock(job):
            rec = self.jobs.get(job) or await self.store.load_archived(job)
            if rec is None:
                raise UnknownJob(f"unknown job {job}")
            lc.check_purge(rec)
            candidates = [n for n in self.nodes() if n.state == "alive"]
            if not candidates:
                raise NoNodeAvailable("no node is alive to remove the checkpoints")
            target = next((n.name for n in candidates if n.name == rec.node), candidates[0].name)
            reply = await self.agents.send(target, "purge", PurgeJob(job=job), self.config.start_timeout_s)
            # The record goes rather than being written: the decision's events, not its record.
            decision = lc.transition(rec, lc.Purged(), self.wall())
            check_may_act(self.leader.fresh)
            try:
                await self.store.remove(job)
            except WriteConflict as conflict:
                await self._resolve(conflict, rec)  # raises unless this leader's record stands
                await self.store.remove(job)
            self.jobs.pop(job, None)
            for emit in decision.events:
                self.event(decision.record or rec, emit.kind, **emit.fields)
        return decision.record or rec, [f"freed {reply.freed_bytes} bytes; the job's record is removed"]

    # ------------------------------------------------------------------ failover

    async def recover(self, job: str, dead: str, evicted: str = "", fence_token: int | None = None) -> Recovery | None:
        """Restore (or requeue) a job lost with node ``dead`` on another node.

        Returns None when there is nothing left to do (the job finished, was vacated, or
        already runs elsewhere), else (kind, record, epoch, notes).  Raises on a failed attempt.
        """
        waived: list[str] = []

        def choose(rec: JobRecord) -> lc.Input | None:
            if not lc.needs_recovery(rec, dead):
                return None
            nodes, restore = self.nodes(), bool(rec.epochs)  # a requeue is a new start: no waiver
            # A restore needs a node that can take the GPUs the job held at its newest epoch.
            kw = dict(restore=restore, gpus=rec.gpus, gpu_driver=rec.gpu_driver) if restore else {}
            try:
                target, gpus = self.place(rec.spec, exclude={dead} if dead else set(), **kw)
            except NoNodeAvailable:
                if not evicted:
                    raise
                # Its own node, if that is all there is: even sick (a proactive move whose target
                # went away meanwhile), as long as it is alive, rather than failing a job that ran.
                own = own_node(nodes, dead)
                target, gpus = self.place(rec.spec, own or "", any_health=bool(own), **kw)
            waived[:] = waived_notes(job, nodes, target) if restore else []
            return lc.Recover(dead, target, evicted, fence_token, gpus)

        decision = await self.step(job, choose)
        if decision.record is None:
            return None
        if decision.outcome == "failed":
            return "failed", decision.record, None, []
        *kills, launch = decision.commands
        for kill in kills:
            try:
                await self.agents.carry_out(kill, 5.0)
            except RevenantError:
                pass
        launch = self._workdir_rule(launch)
        timeout_s = self.config.checkpoint_timeout_s if isinstance(launch, lc.Restore) else self.config.start_timeout_s
        try:
            reply = await self.agents.carry_out(launch, timeout_s)
        except RevenantError as exc:
            why = f"attempt on {launch.node} failed: {exc}"
            await self.agents.abandon(launch.node, job, launch.generation, why)
            await self.step(job, lc.RecoveryAttemptFailed(launch.generation, why))
            raise
        await self.record(job, lc.Restored(launch.generation, reply.pid, reply.epoch, reply.output,
                                              program_pid=reply.program_pid))
        return ("restored" if reply.epoch else "requeued"), self.get(job), reply.epoch.n if reply.epoch else None, \
            waived + reply.notes

    async def save_hold(self, held: bool) -> None:
        """Record (or lift) an operator's failover hold with the job table (it outlives the leader)."""
        check_may_act(self.leader.fresh)
        await self.store.save_hold(held)

    async def fail_recovery(self, job: str, reason: str) -> None:
        await self.step(job, lc.RecoveryFailed(reason))

    # ------------------------------------------------------------------ agents' reports

    async def apply_event(self, ev: JobEvent) -> bool:
        """Apply an agent's job event; True if it evicted the job (to be recovered elsewhere)."""
        if ev.job not in self.jobs:
            return False  # a job this coordinator does not know
        return (await self.step(ev.job, lc.AgentReport(ev))).outcome == "evicted"

    async def apply_converted(self, ev: EpochEvent) -> None:
        """An older epoch became a delta: its own bytes and the job's storage in the listing."""
        if ev.job in self.jobs:
            await self.step(ev.job, lc.EpochConverted(ev))

    def lost_on(self, node: str, local: list[LocalJob]) -> list[str]:
        """Jobs the table has running on ``node`` that its freshly started agent does not run:
        they died with the agent before it (a new leader may never have seen that one die)."""
        here = {lj.job for lj in local}
        return [j for j in self.jobs_on(node) if j not in here
                and self.jobs[j].state in (lc.State.RUNNING, lc.State.CHECKPOINTING)]

    def fence_token(self, job: str) -> int | None:
        return getattr(self.jobs.get(job), "fence_token", None)

    async def reconcile(self, node: str, local: list[LocalJob]) -> ReconcileReply:
        """An agent's jobs: which moved on (kill), and which frozen ones may thaw.  A thaw is
        recorded (the job's fence token) before it is answered, so no failover that began
        earlier can still restore the job elsewhere."""
        stale = lc.stale_local_jobs(node, [lj for lj in local if not lj.frozen], self.jobs)
        thaw: list[LocalJob] = []
        for lj in local:
            if not lj.frozen or lj.job not in self.jobs:
                continue  # a job this leader does not know stays frozen (its node kills it in time)
            decision = await self.step(lj.job, lc.ThawAsked(node, lj.generation))
            if decision.outcome == "thaw":
                thaw.append(lj)
            else:
                rec = self.get(lj.job)
                stale.append(StaleJob(job=lj.job, generation=lj.generation,
                                      reason=f"frozen copy superseded: the job is {rec.state}, generation "
                                             f"{rec.generation} on {rec.node or 'no node'}"))
        return ReconcileReply(stale=stale, thaw=thaw, term=getattr(self.leader, "term", 0))
