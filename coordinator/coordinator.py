"""The coordinator: membership and failure detection over NATS.

It listens to every heartbeat, drives the sans-IO :class:`FailureDetector`
with a periodic tick, probes suspect nodes directly, publishes node events to
the JetStream event stream and answers ``revenant.coord.nodes``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from revenant.common import bus
from revenant.common.config import CoordinatorConfig
from revenant.common.errors import BusError, RevenantError
from revenant.common.events import EventPublisher
from revenant.common.httpserver import HttpServer
from revenant.common.metrics import CoordinatorMetrics, health_routes
from revenant.common.loopmonitor import LoopMonitor
from revenant.coordinator.detector import FailureDetector, Transition
from revenant.coordinator.failover import Failover
from revenant.coordinator.jobs import JobService
from revenant.coordinator.leader import Leadership
from revenant.messages import (
    HealthSummary,
    FailoverRequest,
    Heartbeat,
    JobRecord,
    JobReply,
    JobRequest,
    JobsReply,
    JobsRequest,
    Message,
    SubmitRequest,
    MessageError,
    NodeEvent,
    NodesReply,
    NodesRequest,
    Probe,
    ProbeReply,
    decode_as,
    subjects,
)

log = logging.getLogger(__name__)

MAX_PROBES_IN_FLIGHT = 512
# Heartbeats waiting in the subscription beyond which the detector holds its verdicts:
# at least this many, and at least half a second's worth (one per node per second).
HEARTBEAT_BACKLOG = 2_000
# Nodes per nodes_reply.v1: a node's status with its capabilities is about 500 bytes.
NODES_PAGE_MAX = 300


class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, clock=time.monotonic, wall=time.time) -> None:
        self.config = config
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.detector = FailureDetector(config)
        self._clock = clock
        self._wall = wall
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._events: EventPublisher | None = None
        self._probe_slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._requests: set[asyncio.Task[None]] = set()
        self.jobs: JobService | None = None
        self.failover: Failover | None = None
        self.leadership: Leadership | None = None
        self._leader_tasks: list[asyncio.Task[None]] = []
        self.deposed = False
        self._storm_dirty = False
        self._hb_sub = None
        self._stopping = asyncio.Event()
        # Set once subscribed and serving; tests and embedders wait on it.
        self.ready = asyncio.Event()
        self._reconnected = False
        self.malformed_heartbeats = 0
        self.metrics = CoordinatorMetrics()
        self.loop_monitor = LoopMonitor()
        self.http: HttpServer | None = None
        if config.http_port >= 0:
            self.http = HttpServer(health_routes(
                render_metrics=self._render_metrics,
                summary=lambda: HealthSummary(nats_connected=self._nc is not None and self._nc.is_connected),
                stuck_for=lambda: self.loop_monitor.stuck_for(time.monotonic()),
                stuck_after_s=config.live_stuck_after_s,
                started=self.ready.is_set,
                extra=lambda: {"coordinator": self.name, "nodes": self.detector.counts()},
            ), config.http_host, config.http_port)

    # ------------------------------------------------------------------ lifecycle

    def _render_metrics(self) -> bytes:
        self.metrics.update_nodes(self.detector.snapshot(self._clock()))
        self.metrics.loop_lag.set(self.loop_monitor.lag_s)
        self.metrics.failover_paused.set(1 if self.failover is not None and self.failover.storm.paused else 0)
        return self.metrics.render()

    async def run(self) -> None:
        if self._stopping.is_set():
            return
        if self.http is not None:
            await self.http.start()
        try:
            await self._run()
        finally:
            if self.http is not None:
                await self.http.stop()

    async def _run(self) -> None:

        async def on_reconnect() -> None:
            self._reconnected = True

        self._nc = await bus.connect(self.config.nats_url, f"revenant-coordinator-{self.name}",
                                     on_reconnect=on_reconnect)
        self._js = self._nc.jetstream()
        self._events = EventPublisher(self._js, timeout_s=self.config.event_publish_timeout_s)
        try:
            await bus.ensure_event_stream(self._js)
            # A standby tracks every node too, so that it takes over with a warm view.
            self._hb_sub = await self._nc.subscribe(subjects.HEARTBEATS_ALL, cb=self._on_heartbeat,
                                                    pending_msgs_limit=1_000_000)
            self.jobs = JobService(self._nc, self._js, self.config, self._events,
                                   lambda: self.detector.snapshot(self._clock()), wall=self._wall)
            self.failover = Failover(self.config, self._js, self.jobs, self._events,
                                     lambda: self.detector.snapshot(self._clock()), self._last_heartbeat,
                                     clock=self._clock, wall=self._wall, on_result=self.metrics.count_failover)
            elected = asyncio.Event()

            async def on_elected() -> None:
                elected.set()

            self.leadership = Leadership(self._js, self.name, self.config.leader_lease_s,
                                         on_elected=on_elected, on_deposed=self._deposed)
            self.jobs.still_leader = self.leadership.holds
            self.jobs.may_act = self.leadership.fresh
            self.jobs.on_evicted = lambda job, node, why: self.failover.recover_job(job, node, evicted=why or "evicted")
            self.jobs.on_conflict = lambda why: self._deposed()
            self._events.start()
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._tick_loop(), name="detector-tick"),
                         tg.create_task(self.loop_monitor.run(), name="loop-monitor"),
                         tg.create_task(self.leadership.run(), name="leadership"),
                         tg.create_task(self._lead(elected, tg), name="lead")]
                log.info("coordinator %s up; waiting to lead", self.name)
                await self._stopping.wait()
                for task in tasks:
                    task.cancel()
                for task in self._leader_tasks:
                    task.cancel()
                self.failover.cancel()
        finally:
            for task in list(self._requests):
                task.cancel()
            await self._events.stop()
            for task in list(self._probe_tasks):
                task.cancel()
            nc, self._nc = self._nc, None
            try:
                await asyncio.wait_for(nc.drain(), 3)
            except (asyncio.TimeoutError, nats.errors.Error):
                await nc.close()
            log.info("coordinator %s stopped", self.name)

    def stop(self) -> None:
        self._stopping.set()

    async def _lead(self, elected: asyncio.Event, tg: asyncio.TaskGroup) -> None:
        """Once elected: load the job table, serve requests, run failover and checkpoints."""
        await elected.wait()
        assert self.jobs is not None and self._nc is not None
        await self.jobs.open()
        assert self.failover is not None
        await self.failover.restore_hold()
        # What the previous leader left, before this one touches anything (see _take_over).
        inherited = {job: (rec.state, rec.generation, rec.node) for job, rec in self.jobs.jobs.items()}
        await self._nc.subscribe(subjects.coordinator("nodes"), cb=self._on_nodes)
        for verb in ("submit", "jobs", "job", "checkpoint", "vacate", "restart", "purge", "failover"):
            await self._nc.subscribe(subjects.coordinator(verb), cb=self._on_job_request)
        self._leader_tasks = [tg.create_task(_supervised(self.jobs.consume_events), name="job-events"),
                              tg.create_task(_supervised(self.jobs.periodic_checkpoints), name="periodic-checkpoints"),
                              tg.create_task(self._take_over(inherited), name="take-over")]
        log.info("coordinator %s leads", self.name)
        self.ready.set()

    async def _take_over(self, inherited: dict[str, tuple[str, int, str]]) -> None:
        """Finish what a previous leader left: jobs on nodes that are gone, half-done failovers."""
        await asyncio.sleep(self.config.node_timeout_s + self.config.probe_timeout_s)
        assert self.jobs is not None and self.failover is not None
        alive = {n.name for n in self.detector.snapshot(self._clock()) if n.state in ("alive", "suspect")}
        for job, dead in takeover_plan(inherited, self.jobs.jobs, alive, self.failover.recovering):
            if dead is None:
                log.warning("job %s: the old leader's checkpoint of it never answered; it runs on", job)
                try:
                    await self.jobs.checkpoint_abandoned(job, inherited[job][1])
                except RevenantError as exc:
                    log.error("job %s: cannot mark it running again: %s", job, exc)
                continue
            if dead:
                log.warning("taking over the recovery of job %s (node %s is gone)", job, dead)
            else:
                log.warning("taking over the recovery of job %s (it was %s)", job, inherited[job][0])
            self.failover.recover_job(job, dead)

    def _deposed(self) -> None:
        self.deposed = True
        self.stop()

    def _last_heartbeat(self, node: str) -> float | None:
        rec = self.detector.nodes.get(node)
        return rec.last_heartbeat_at if rec is not None and rec.last_heartbeat_at else None

    # ------------------------------------------------------------------ inputs

    async def _on_heartbeat(self, msg: Msg) -> None:
        node = subjects.node_from_heartbeat(msg.subject)
        try:
            hb = decode_as(msg.data, Heartbeat)
        except MessageError as exc:
            self.malformed_heartbeats += 1
            self.metrics.count_heartbeat(malformed=True)
            if self.malformed_heartbeats & (self.malformed_heartbeats - 1) == 0:  # log 1, 2, 4, 8, ...
                log.warning("dropped bad heartbeat on %s (%d so far): %s", msg.subject, self.malformed_heartbeats, exc)
            return
        if hb.node != node:
            self.malformed_heartbeats += 1
            self.metrics.count_heartbeat(malformed=True)
            log.warning("dropped heartbeat for %r published on %s", hb.node, msg.subject)
            return
        self.metrics.count_heartbeat()
        self._emit(self.detector.heartbeat(hb, self._clock()))

    async def _on_nodes(self, msg: Msg) -> None:
        async def reply() -> NodesReply:
            req = decode_as(msg.data, NodesRequest)
            limit = max(1, min(req.limit, NODES_PAGE_MAX))
            names = sorted(self.detector.nodes)
            page = names[max(0, req.offset):max(0, req.offset) + limit]
            return NodesReply(nodes=self.detector.snapshot(self._clock(), page), coordinator=self.name,
                              coordinator_metrics_url=self.http.url if self.http is not None else "",
                              total=len(names), offset=req.offset)

        await bus.answer(msg, reply, "nodes request")

    async def _on_job_request(self, msg: Msg) -> None:
        bus.answer_in_task(self._requests, msg, self._job_request, "{verb} request")

    async def _job_request(self, verb: str, data: bytes) -> Message:
        jobs = self.jobs
        assert jobs is not None
        if verb == "submit":
            return JobReply(job=await jobs.submit(decode_as(data, SubmitRequest)))
        if verb == "failover":
            assert self.failover is not None
            req_f = decode_as(data, FailoverRequest)
            return await self.failover.operator(req_f.action, list(self.detector.nodes.values()))
        if verb == "jobs":
            decode_as(data, JobsRequest)
            return JobsReply(jobs=sorted(jobs.jobs.values(), key=lambda r: _job_sort_key(r.spec.id)))
        req = decode_as(data, JobRequest)
        subjects.check_name(req.job, "job id")
        if verb == "job":
            return JobReply(job=jobs.get(req.job))
        if verb in ("checkpoint", "vacate"):
            rec, notes = await jobs.checkpoint(req.job, stop=verb == "vacate")
        elif verb == "restart":
            rec, notes = await jobs.restart(req.job, req.node)
        elif verb == "purge":
            rec, notes = await jobs.purge(req.job)
        else:
            raise RevenantError(f"unknown request {verb!r}", code="unknown_command")
        return JobReply(job=rec, notes=notes)

    # ------------------------------------------------------------------ detection

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            if self._nc is None or not self._nc.is_connected:
                continue  # blind: no verdicts; the reconnect handler grants a grace period
            backlog = max(HEARTBEAT_BACKLOG, len(self.detector.nodes) // 2)
            if self._hb_sub is not None and self._hb_sub.pending_msgs > backlog:
                # Heartbeats are queued but not read yet (the loop was busy): a verdict now
                # would be on stale data.  Skipping the tick lets the stall guard grant grace.
                continue
            now = self._clock()
            if self._reconnected:
                self._reconnected = False
                self._emit(self.detector.grace_all(now, "coordinator reconnected to NATS"))
            transitions, probes = self.detector.tick(now)
            self._emit(transitions)
            if self._storm_dirty and self.leader and self.failover is not None:
                self._storm_dirty = False
                self.failover.check_storm(list(self.detector.nodes.values()))
            for node in probes:
                task = asyncio.create_task(self._probe(node))
                self._probe_tasks.add(task)
                task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, node: str) -> None:
        ok, incarnation = False, None
        async with self._probe_slots:
            try:
                reply = await bus.request(self._nc, subjects.probe(node), Probe(sent_at=self._wall(), sender=self.name),
                                          ProbeReply, self.config.probe_timeout_s)
                ok, incarnation = True, reply.incarnation
            except (BusError, RevenantError, MessageError) as exc:
                log.debug("probe of %s failed: %s", node, exc)
        self._emit(self.detector.probe_result(node, ok, self._clock(), incarnation))

    # ------------------------------------------------------------------ events

    @property
    def leader(self) -> bool:
        return self.leadership is not None and self.leadership.leader

    def _emit(self, transitions: list[Transition]) -> None:
        at = self._wall()
        for t in transitions:
            if t.kind != "joined":
                self._storm_dirty = True  # checked once per tick, not per transition
            level = logging.WARNING if t.kind in ("suspect", "dead") else logging.INFO
            log.log(level, "node %s %s (silent %.2f s%s)", t.node, t.kind, t.silence_s,
                    f", {t.reason}" if t.reason else "")
            event = NodeEvent(node=t.node, kind=t.kind, at=at, incarnation=t.incarnation,
                              silence_s=round(t.silence_s, 3), reason=t.reason)
            self.metrics.count_node_event(event)
            if not self.leader:
                continue  # a standby watches; only the leader speaks and acts
            if self._events is not None:
                self._events.emit(subjects.node_event(t.node, t.kind), event)
            if self.jobs is not None and (t.kind in ("dead", "left") or t.reason == "agent restarted"):
                self.jobs.node_lost(t.node, "died" if t.kind == "dead" else "shut down")
                # A clean shutdown reports its jobs' ends itself; a death or a restart cannot.
                if self.failover is not None and t.kind != "left":
                    self.failover.node_dead(t.node, t.previous_incarnation or t.incarnation)


def takeover_plan(inherited: dict[str, tuple[str, int, str]], jobs: dict[str, JobRecord], alive: set[str],
                  recovering: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str | None]]:
    """The jobs a new leader must recover, as (job, dead node or "") pairs; (job, None) for a
    checkpoint on a live node whose reply went to the old leader.

    ``inherited`` is each job's (state, generation, node) when this leader loaded
    the table.  Only a job this leader has not touched since is the old
    leader's unfinished business: a restart, launch or failover this leader
    started itself has moved the job on (a new generation or state) and is in
    flight, and redoing it would race it onto a second node.
    """
    out = []
    for job, rec in jobs.items():
        if job not in inherited or job in recovering or rec.state not in JobService.ACTIVE:
            continue
        if (rec.state, rec.generation, rec.node) != inherited[job]:
            continue
        if rec.state in ("restoring", "pending"):
            # A restore or launch the old leader started may or may not have finished:
            # do it again (the node kills any older generation it runs).
            out.append((job, ""))
        elif rec.node not in alive:
            out.append((job, rec.node))
        elif rec.state == "checkpointing":
            out.append((job, None))
    return out


def _job_sort_key(job_id: str) -> tuple[int, str]:
    return (int(job_id), "") if job_id.isdigit() else (1 << 62, job_id)


async def _supervised(loop_fn) -> None:
    """Run a background loop forever: a bug or a bus error restarts it, never the coordinator."""
    while True:
        try:
            await loop_fn()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting it in 1 s", getattr(loop_fn, "__qualname__", loop_fn))
            await asyncio.sleep(1.0)
