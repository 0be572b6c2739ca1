"""The job service: the job table in JetStream KV and the job lifecycle.

Every mutation of a job runs under that job's lock and re-reads the record,
so replies from agents and events from the stream can arrive in any order
without a stale write winning (for example a job that exits before its start
reply has been processed ends *completed*, not *running*).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from revenant.common import bus
from revenant.common.config import CoordinatorConfig
from revenant.common.errors import BusError, JobNotRunning, RevenantError, UnknownJob
from revenant.common.events import EventPublisher
from revenant.coordinator.placement import NoNodeAvailable, place
from revenant.messages import (
    AgentJobReply,
    CheckpointJob,
    EpochInfo,
    KillJob,
    JobEvent,
    JobRecord,
    JobSpec,
    MessageError,
    NodeStatus,
    PurgeJob,
    RestoreJob,
    StartJob,
    SubmitRequest,
    decode,
    subjects,
)

log = logging.getLogger(__name__)

CONSUMER = "revenant-coordinator-jobs"
NEXT_ID_KEY = "next-id"
# An operator's `revenant failover pause`, kept with the job table so that it outlives the leader.
HOLD_KEY = "failover-hold"


class JobBusy(RevenantError):
    code = "busy"
    retriable = True


class NodeLost(RevenantError):
    code = "node_lost"
    retriable = True


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(JobRecord)


def _moved_on(stored: JobRecord, mine: JobRecord) -> bool:
    """Whether ``stored`` is ahead of ``mine``: a newer generation, or the same one finished."""
    done = ("completed", "failed")
    return stored.generation > mine.generation or (
        stored.generation == mine.generation and stored.state in done and mine.state not in done)


async def _nak(msg, delay_s: float = 1.0) -> None:
    try:
        await msg.nak(delay=delay_s)
    except nats.errors.Error:
        pass  # redelivered after ack_wait anyway


class NotLeader(RevenantError):
    code = "not_leader"
    retriable = True


class JobService:
    def __init__(self, nc: Client, js: JetStreamContext, config: CoordinatorConfig, events: EventPublisher,
                 nodes: Callable[[], list[NodeStatus]], *, wall: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self.events = events
        self.nodes = nodes
        self.wall = wall
        self.kv: KeyValue | None = None
        self.jobs: dict[str, JobRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # The store revision of each record this leader last read or wrote: every write is a
        # compare-and-set against it, so a deposed leader (say, one whose loop stalled past
        # its lease) can never overwrite what its successor wrote.
        self._revisions: dict[str, int] = {}
        self._save_locks: dict[str, asyncio.Lock] = {}
        # Asked before every write and every command to an agent: may this one act now?
        self.may_act: Callable[[], bool] | None = None
        # Asked when a write finds the record changed by someone else: does this one still lead?
        # (None: the store did not answer, so nobody can tell.)
        self.still_leader: Callable[[], Awaitable[bool | None]] | None = None
        self.on_conflict: Callable[[str], None] | None = None
        # A job its node stopped (drained, fenced): (job, node, why) to recover elsewhere.
        self.on_evicted: Callable[[str, str, str], None] | None = None
        self._periodic: set[str] = set()
        self._periodic_tasks: set[asyncio.Task[None]] = set()
        # Requests to agents in flight, by node: a node's death fails them at once.
        self._inflight: dict[str, set[asyncio.Task[AgentJobReply]]] = {}
        self._lost: dict[asyncio.Task[AgentJobReply], str] = {}

    # ------------------------------------------------------------------ table

    async def open(self) -> None:
        try:
            self.kv = await self.js.create_key_value(bucket=subjects.JOBS_BUCKET, history=5)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise BusError(f"cannot open the job table {subjects.JOBS_BUCKET}: {exc or type(exc).__name__}") from None
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            keys = []
        for key in keys:
            if key in (NEXT_ID_KEY, HOLD_KEY):
                continue
            try:
                entry = await self.kv.get(key)
                self.jobs[key] = _DEC.decode(entry.value)
                self._revisions[key] = entry.revision
            except (nats.js.errors.KeyNotFoundError, msgspec.DecodeError) as exc:
                log.error("job table entry %s unreadable: %s", key, exc)
        log.info("job table: %d job(s)", len(self.jobs))

    async def _save(self, rec: JobRecord) -> None:
        rec.updated_at = self.wall()
        self.jobs[rec.spec.id] = rec
        assert self.kv is not None
        key = rec.spec.id
        self._check_may_act()
        async with self._save_locks.setdefault(key, asyncio.Lock()):
            last = self._revisions.get(key)
            try:
                if last is None:
                    self._revisions[key] = await self.kv.create(key, _ENC.encode(rec))
                else:
                    self._revisions[key] = await self.kv.update(key, _ENC.encode(rec), last=last)
            except nats.js.errors.KeyWrongLastSequenceError:
                await self._conflict(key, _ENC.encode(rec))
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                raise BusError(f"cannot save job {key}: {exc or type(exc).__name__}") from None

    async def _conflict(self, key: str, value: bytes) -> None:
        """Someone else wrote job ``key`` since this coordinator last did.  If the store says this
        one still leads, that was a deposed leader's late write: this one's record stands, unless
        the other moved the job on (a newer generation: a copy may run where it says; or the same
        generation, ended), which this one then takes as the truth.  Otherwise this one is the
        stale leader and steps down, writing nothing."""
        why = f"job {key} was changed in the job table by another coordinator"
        leads = await self.still_leader() if self.still_leader is not None else False
        if leads is None:
            raise BusError(f"cannot save job {key}: it changed in the store, and the leader lease "
                           f"could not be read to tell who leads")
        if leads:
            try:
                entry = await self.kv.get(key)
                stored, mine = _DEC.decode(entry.value), _DEC.decode(value)
                if _moved_on(stored, mine):
                    self.jobs[key], self._revisions[key] = stored, entry.revision
                    log.warning("%s, which no longer leads, and moved it on (generation %d, %s on %s): "
                                "taken as the truth", why, stored.generation, stored.state, stored.node or "-")
                    raise BusError(f"job {key} was moved on by another coordinator (now generation "
                                   f"{stored.generation}, {stored.state}); try again")
                log.warning("%s, which no longer leads; this leader's record stands", why)
                self._revisions[key] = await self.kv.update(key, value, last=entry.revision)
                return
            except (nats.errors.Error, asyncio.TimeoutError, msgspec.DecodeError) as exc:
                raise BusError(f"cannot save job {key}: {exc or type(exc).__name__}") from None
        log.error("%s: this one is no longer the leader", why)
        if self.on_conflict is not None:
            self.on_conflict(why)
        raise NotLeader(f"{why}; this coordinator stepped down")

    async def save_hold(self, held: bool) -> None:
        """Record (or lift) an operator's failover hold in the store."""
        self._check_may_act()
        assert self.kv is not None
        try:
            if held:
                await self.kv.put(HOLD_KEY, b"held")
            else:
                await self.kv.delete(HOLD_KEY)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise BusError(f"cannot record the failover hold: {exc or type(exc).__name__}") from None

    async def load_hold(self) -> bool:
        assert self.kv is not None
        try:
            return (await self.kv.get(HOLD_KEY)).value == b"held"
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return False
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise BusError(f"cannot read the failover hold: {exc or type(exc).__name__}") from None

    async def _next_id(self) -> str:
        assert self.kv is not None
        for _ in range(20):
            try:
                entry = await self.kv.get(NEXT_ID_KEY)
                n = int(entry.value or b"1")
                await self.kv.update(NEXT_ID_KEY, str(n + 1).encode(), last=entry.revision)
                return str(n)
            except nats.js.errors.KeyNotFoundError:
                try:
                    await self.kv.create(NEXT_ID_KEY, b"2")
                    return "1"
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        raise BusError("cannot allocate a job id: the counter is contended")

    def lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    def get(self, job: str) -> JobRecord:
        rec = self.jobs.get(job)
        if rec is None:
            raise UnknownJob(f"unknown job {job}")
        return rec

    def jobs_per_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rec in self.jobs.values():
            if rec.node and rec.state in self.ACTIVE:
                out[rec.node] = out.get(rec.node, 0) + 1
        return out

    # ------------------------------------------------------------------ agent calls

    def _check_may_act(self) -> None:
        if self.may_act is not None and not self.may_act():
            raise NotLeader("this coordinator's leader lease is not fresh (its loop stalled, or the store "
                            "is slow to answer): it does not act")

    async def _agent(self, node: str, verb: str, msg, timeout_s: float) -> AgentJobReply:
        self._check_may_act()
        task = asyncio.ensure_future(
            bus.request(self.nc, subjects.node_command(node, verb), msg, AgentJobReply, timeout_s))
        self._inflight.setdefault(node, set()).add(task)
        try:
            return await task
        except asyncio.CancelledError:
            reason = self._lost.pop(task, None)
            if reason is None:
                raise
            raise NodeLost(f"node {node} {reason} during {verb}") from None
        finally:
            self._inflight.get(node, set()).discard(task)

    async def _abandon(self, node: str, job: str, generation: int, why: str) -> None:
        """Make sure an attempt whose reply never came (a timeout, a lost node) does not live on:
        the agent kills that generation, even if its start or restore is still in flight."""
        try:
            await self._agent(node, "kill", KillJob(job=job, generation=generation, reason=why), 5.0)
        except RevenantError as exc:
            log.info("job %s: no kill of generation %d on %s (%s)", job, generation, node, exc)

    def node_lost(self, node: str, reason: str) -> None:
        """Fail every request in flight to ``node`` (it was declared dead or left)."""
        for task in list(self._inflight.get(node, ())):
            self._lost[task] = reason
            task.cancel()

    def _event(self, rec: JobRecord, kind: str, **kw) -> None:
        self.events.emit(subjects.job_event(rec.spec.id, kind),
                         JobEvent(job=rec.spec.id, kind=kind, at=self.wall(), node=rec.node,
                                  generation=rec.generation, **kw))

    # ------------------------------------------------------------------ submit

    async def submit(self, req: SubmitRequest) -> JobRecord:
        if not req.argv:
            raise RevenantError("nothing to run: give a command after --", code="bad_request")
        if req.max_epochs < 1:
            raise RevenantError(f"--max-epochs must be at least 1, got {req.max_epochs}", code="bad_request")
        if req.checkpoint_interval_s is not None and req.checkpoint_interval_s <= 0:
            raise RevenantError("checkpoint interval must be positive", code="bad_request")
        if req.node:
            subjects.check_name(req.node)
        node = place(self.nodes(), self.jobs_per_node(), req.node)
        job_id = await self._next_id()
        spec = JobSpec(id=job_id, argv=list(req.argv), name=req.name or req.argv[0].rsplit("/", 1)[-1],
                       workdir=req.workdir, env=dict(req.env), checkpoint_interval_s=req.checkpoint_interval_s,
                       max_epochs=req.max_epochs, requeue=req.requeue)
        now = self.wall()
        rec = JobRecord(spec=spec, state="pending", node=node, generation=1, created_at=now)
        async with self.lock(job_id):
            await self._save(rec)
            self._event(rec, "submitted")
        generation, tried = 1, set()
        while True:
            try:
                reply = await self._agent(node, "start", StartJob(spec=spec, generation=generation),
                                          self.config.start_timeout_s)
                break
            except RevenantError as exc:
                await self._abandon(node, job_id, generation, f"start on {node} failed: {exc}")
                tried.add(node)
                # A node that refuses because it is going away (or fenced) is no reason to fail the
                # job: unless the user asked for that node, it goes to the next one.
                retry = None
                if not req.node and exc.code in ("shutting_down", "fenced") and len(tried) < 3:
                    try:
                        retry = place(self.nodes(), self.jobs_per_node(), exclude=tried)
                    except NoNodeAvailable:
                        pass
                async with self.lock(job_id):
                    rec = self.get(job_id)
                    if rec.state != "pending" or rec.generation != generation:
                        raise RevenantError(f"job {job_id} could not start on {node}: {exc}", code=exc.code) from None
                    if retry is None:
                        rec.state, rec.reason = "failed", f"start on {node} failed: {exc}"
                        await self._save(rec)
                        raise RevenantError(f"job {job_id} could not start on {node}: {exc}",
                                            code=exc.code) from None
                    log.info("job %s: %s refused it (%s); starting it on %s", job_id, node, exc.code, retry)
                    node, generation = retry, generation + 1
                    rec.node, rec.generation = node, generation
                    await self._save(rec)
        async with self.lock(job_id):
            rec = self.get(job_id)
            rec.output = reply.output
            if rec.state == "pending":
                rec.state, rec.pid, rec.last_checkpoint_at = "running", reply.pid, self.wall()
            await self._save(rec)
        return rec

    # ------------------------------------------------------------------ checkpoint / vacate

    async def checkpoint(self, job: str, *, stop: bool) -> tuple[JobRecord, list[str]]:
        async with self.lock(job):
            rec = self.get(job)
            if rec.state == "checkpointing":
                raise JobBusy(f"job {job} already has a checkpoint in progress")
            if rec.state != "running":
                raise JobNotRunning(f"job {job} is {rec.state}, not running")
            rec.state = "checkpointing"
            node, generation = rec.node, rec.generation
            await self._save(rec)
        try:
            reply = await self._agent(node, "checkpoint", CheckpointJob(job=job, generation=generation, stop=stop),
                                      self.config.checkpoint_timeout_s)
        except RevenantError:
            async with self.lock(job):
                rec = self.get(job)
                if rec.state == "checkpointing" and rec.generation == generation:
                    rec.state = "running"
                    await self._save(rec)
            raise
        async with self.lock(job):
            rec = self.get(job)
            if reply.epoch is not None:
                rec.epochs = [e for e in rec.epochs if e.n != reply.epoch.n] + [reply.epoch]
                rec.epochs = rec.epochs[-max(1, rec.spec.max_epochs):]
                rec.last_checkpoint_at = self.wall()
            if rec.generation == generation and rec.state == "checkpointing":
                if stop:
                    rec.state, rec.node, rec.pid = "vacated", "", 0
                else:
                    rec.state = "running"
            await self._save(rec)
            return rec, reply.notes

    # ------------------------------------------------------------------ restart

    async def restart(self, job: str, node: str = "") -> tuple[JobRecord, list[str]]:
        async with self.lock(job):
            rec = self.get(job)
            if rec.state not in ("vacated", "failed"):
                raise RevenantError(f"job {job} is {rec.state}; only a vacated or failed job can be restarted",
                                    code="bad_state")
            if not rec.epochs:
                raise RevenantError(f"job {job} has no checkpoint to restart from", code="no_epoch")
            target = place(self.nodes(), self.jobs_per_node(), node)
            previous = (rec.state, rec.node, rec.reason)
            rec.generation += 1
            rec.state, rec.node, rec.pid, rec.reason, rec.exit_code = "restoring", target, 0, "", None
            generation = rec.generation
            await self._save(rec)
        try:
            reply = await self._agent(target, "restore", RestoreJob(spec=rec.spec, generation=generation),
                                      self.config.checkpoint_timeout_s)
        except RevenantError as exc:
            await self._abandon(target, job, generation, f"restart on {target} failed: {exc}")
            async with self.lock(job):
                rec = self.get(job)
                if rec.state == "restoring" and rec.generation == generation:
                    rec.state, rec.node, rec.reason = previous[0], previous[1], f"restart on {target} failed: {exc}"
                    await self._save(rec)
            raise
        async with self.lock(job):
            rec = self.get(job)
            if rec.state == "restoring" and rec.generation == generation:
                rec.state, rec.pid, rec.last_checkpoint_at = "running", reply.pid, self.wall()
            rec.output = reply.output or rec.output
            self._known_epoch(rec, reply.epoch)
            await self._save(rec)
            self._event(rec, "restored", pid=reply.pid, epoch=reply.epoch.n if reply.epoch else None,
                        reason="; ".join(reply.notes))
            return rec, reply.notes

    # ------------------------------------------------------------------ failover

    ACTIVE = ("pending", "running", "checkpointing", "restoring")

    def jobs_on(self, node: str) -> list[str]:
        return [j for j, r in self.jobs.items() if r.node == node and r.state in self.ACTIVE]

    async def recover(self, job: str, dead: str, evicted: str = "") -> tuple[str, JobRecord, int | None, list[str]] | None:
        """Restore (or requeue) a job lost with node ``dead`` on another node.

        Returns None when there is nothing left to do (the job finished, was
        vacated, or already runs elsewhere), else (kind, record, epoch) with kind
        "restored", "requeued" or "failed".  Raises on a failed attempt.
        """
        async with self.lock(job):
            rec = self.get(job)
            if rec.state not in self.ACTIVE or (rec.state == "running" and rec.node not in (dead, "")):
                return None
            previous = (rec.node, rec.generation)
            try:
                target = place(self.nodes(), self.jobs_per_node(), exclude={dead} if dead else set())
            except NoNodeAvailable:
                if not evicted:
                    raise
                target = place(self.nodes(), self.jobs_per_node())  # its own node, if that is all there is
            # A launch the old leader left (no dead node) barely ran: start it again, requeue or not.
            relaunch = not dead and rec.state == "pending"
            if not rec.epochs and not rec.spec.requeue and not relaunch:
                lost = f"node {dead} stopped it ({evicted})" if evicted else f"node {dead} died"
                rec.state, rec.pid, rec.reason = "failed", 0, (
                    f"{lost} and the job has no checkpoint (submit with --requeue to rerun it)")
                await self._save(rec)
                return "failed", rec, None, []
            rec.generation += 1
            rec.node, rec.pid, rec.reason, rec.exit_code = target, 0, "", None
            rec.state = "restoring" if rec.epochs else "pending"
            generation, spec = rec.generation, rec.spec
            await self._save(rec)
        if previous[0] not in (dead, target, ""):
            # A half-finished earlier attempt (say, of a coordinator that died) must not live on.
            try:
                await self._agent(previous[0], "kill", KillJob(job=job, generation=previous[1]), 5.0)
            except RevenantError:
                pass
        try:
            if rec.epochs:
                reply = await self._agent(target, "restore", RestoreJob(spec=spec, generation=generation),
                                          self.config.checkpoint_timeout_s)
            else:
                reply = await self._agent(target, "start", StartJob(spec=spec, generation=generation, fresh=True),
                                          self.config.start_timeout_s)
        except RevenantError as exc:
            await self._abandon(target, job, generation, f"attempt on {target} failed: {exc}")
            async with self.lock(job):
                rec = self.get(job)
                if rec.generation == generation and rec.state in ("restoring", "pending"):
                    rec.state, rec.node, rec.reason = "restoring", "", f"attempt on {target} failed: {exc}"
                    await self._save(rec)
            raise
        async with self.lock(job):
            rec = self.get(job)
            if rec.generation == generation and rec.state in ("restoring", "pending"):
                rec.state, rec.pid, rec.last_checkpoint_at = "running", reply.pid, self.wall()
                rec.output = reply.output or rec.output
                self._known_epoch(rec, reply.epoch)
                await self._save(rec)
            return ("restored" if reply.epoch else "requeued"), rec, reply.epoch.n if reply.epoch else None, reply.notes

    @staticmethod
    def _known_epoch(rec: JobRecord, epoch: EpochInfo | None) -> None:
        """A restore's reply describes its epoch in full (an event only numbers it)."""
        if epoch is not None:
            rec.epochs = [epoch if e.n == epoch.n else e for e in rec.epochs]

    @staticmethod
    def _add_epoch(rec: JobRecord, ev: JobEvent) -> None:
        if ev.epoch is not None and all(e.n != ev.epoch for e in rec.epochs):
            rec.epochs = (rec.epochs + [EpochInfo(n=ev.epoch, created_at=ev.at, node=ev.node,
                                                  generation=ev.generation)])[-max(1, rec.spec.max_epochs):]

    async def checkpoint_abandoned(self, job: str, generation: int) -> None:
        """The leader that asked for this checkpoint is gone, and its reply with it: the job runs
        on (a vacate that did stop it reports "vacated" through the event stream)."""
        async with self.lock(job):
            rec = self.get(job)
            if rec.state == "checkpointing" and rec.generation == generation:
                rec.state = "running"
                await self._save(rec)

    async def fail_recovery(self, job: str, reason: str) -> None:
        async with self.lock(job):
            rec = self.get(job)
            if rec.state in self.ACTIVE:
                rec.state, rec.node, rec.pid, rec.reason = "failed", "", 0, reason
                await self._save(rec)

    # ------------------------------------------------------------------ purge

    async def purge(self, job: str) -> tuple[JobRecord, list[str]]:
        async with self.lock(job):
            rec = self.get(job)
            if rec.state not in ("completed", "failed"):
                raise RevenantError(f"job {job} is {rec.state}; only a finished job can be purged", code="bad_state")
            candidates = [n for n in self.nodes() if n.state == "alive"]
            if not candidates:
                raise NoNodeAvailable("no node is alive to remove the checkpoints")
            target = next((n.name for n in candidates if n.name == rec.node), candidates[0].name)
            reply = await self._agent(target, "purge", PurgeJob(job=job), self.config.start_timeout_s)
            rec.epochs = []
            await self._save(rec)
            self._event(rec, "purged")
            return rec, [f"freed {reply.freed_bytes} bytes"]

    # ------------------------------------------------------------------ events from agents

    async def consume_events(self) -> None:
        """Apply agents' job events (exits) from a durable consumer, so none is lost across restarts."""
        sub = await self.js.pull_subscribe(
            subjects.JOB_EVENTS_ALL, durable=CONSUMER,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_wait=30, max_ack_pending=1000))
        try:
            await self._consume(sub)
        finally:
            try:
                await sub.unsubscribe()  # or the connection's drain waits on it
            except nats.errors.Error:
                pass

    async def _consume(self, sub) -> None:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as exc:
                log.warning("job event fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if self.may_act is not None and not self.may_act():
                # A leader whose lease is not fresh (its loop stalled) must not apply, or ack,
                # what a successor may be the one to see: the events are redelivered.
                for msg in msgs:
                    await _nak(msg)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    event = decode(msg.data)
                    if isinstance(event, JobEvent):
                        await self.apply_event(event)
                except MessageError as exc:
                    log.warning("bad job event on %s: %s", msg.subject, exc)
                except RevenantError as exc:
                    # Not applied (the store did not answer, or this one no longer leads): redelivered.
                    log.warning("job event on %s not applied yet: %s", msg.subject, exc)
                    await _nak(msg)
                    continue
                await msg.ack()

    async def apply_event(self, ev: JobEvent) -> None:
        if ev.kind not in ("exited", "killed", "vacated", "evicted"):
            return
        async with self.lock(ev.job):
            rec = self.jobs.get(ev.job)
            if rec is None or rec.generation != ev.generation or rec.node != ev.node:
                return  # a stale copy's exit, or a job we do not know
            if ev.kind == "vacated":
                # Normally the vacate's reply says so first; this covers a lost reply (or leader).
                if rec.state in ("running", "checkpointing"):
                    self._add_epoch(rec, ev)
                    rec.state, rec.node, rec.pid = "vacated", "", 0
                    await self._save(rec)
                return
            if ev.kind == "evicted":
                # Its node stopped it (a drain, a fence): it goes on elsewhere, from its newest epoch.
                if rec.state in self.ACTIVE:
                    self._add_epoch(rec, ev)
                    # Saved as restoring: should this leader die first, its successor redoes it.
                    rec.state, rec.pid, rec.reason = "restoring", 0, ev.reason
                    await self._save(rec)
                    if self.on_evicted is not None:
                        self.on_evicted(ev.job, ev.node, ev.reason)
                return
            if rec.state not in self.ACTIVE:
                return
            if ev.kind == "killed" and rec.state in ("pending", "restoring"):
                return  # an attempt this coordinator abandoned (or superseded): its retry goes on
            code = ev.exit_code if ev.exit_code is not None else -1
            rec.exit_code = code
            rec.state = "completed" if code == 0 and ev.kind == "exited" else "failed"
            rec.pid = 0
            if rec.state == "failed":
                rec.reason = ev.reason or ("killed" if ev.kind == "killed" else f"exited with status {code}")
            await self._save(rec)

    # ------------------------------------------------------------------ periodic checkpoints

    async def periodic_checkpoints(self) -> None:
        """Checkpoint running jobs whose interval has passed (one in flight per job)."""
        while True:
            now = self.wall()
            alive = {n.name for n in self.nodes() if n.state == "alive"} if any(
                r.spec.checkpoint_interval_s for r in self.jobs.values()) else set()
            for rec in list(self.jobs.values()):
                interval = rec.spec.checkpoint_interval_s
                if (interval and rec.state == "running" and rec.node in alive and rec.spec.id not in self._periodic
                        and now - rec.last_checkpoint_at >= interval):
                    self._periodic.add(rec.spec.id)
                    task = asyncio.create_task(self._periodic_one(rec.spec.id))
                    self._periodic_tasks.add(task)  # kept (a bare task may be garbage-collected)
                    task.add_done_callback(self._periodic_tasks.discard)
            await asyncio.sleep(min(1.0, self.config.tick_interval_s * 10))

    async def _periodic_one(self, job: str) -> None:
        try:
            await self.checkpoint(job, stop=False)
        except RevenantError as exc:
            log.warning("periodic checkpoint of job %s failed: %s", job, exc)
            async with self.lock(job):
                rec = self.jobs.get(job)
                if rec is not None:
                    rec.last_checkpoint_at = self.wall()  # retry after a full interval, not at once
        finally:
            self._periodic.discard(job)

