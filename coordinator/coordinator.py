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

from revenant.common.errors import BusError, RevenantError, described
from revenant.common.messaging import bus, handshake
from revenant.common.messaging.events import EventPublisher
from revenant.common.messaging.kv import raise_replicas
from revenant.common.messaging.rawsub import RawSubscriber, starting_with
from revenant.common.serving import gcpause
from revenant.common.serving.httpserver import HttpServer
from revenant.common.serving.loopmonitor import LoopMonitor
from revenant.common.serving.metrics import CoordinatorMetrics, health_routes
from revenant.common.serving.service import Service, supervised
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.detector import FailureDetector, Transition
from revenant.coordinator.nodes.heartbeats import ClientSubscription, HeartbeatIntake, TransitionLog, ask_full_heartbeats
from revenant.coordinator.nodes.leader import Leadership, Term
from revenant.coordinator.recovery.failover import Failover
from revenant.coordinator.recovery.sick import ProactiveMoves
from revenant.coordinator.recovery.takeover import take_over
from revenant.coordinator.table.agents import AgentClient, check_may_act
from revenant.coordinator.table.archive import Archiver
from revenant.coordinator.table.job_events import EPOCHS_CONSUMER, JobEventConsumer
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.paging import fitting
from revenant.coordinator.table.placement import allocated
from revenant.coordinator.table.periodic import PeriodicCheckpoints
from revenant.coordinator.table.requests import USER_VERBS, ClientRequests, check_admin, requester_of
from revenant.coordinator.table.store import KvJobStore
from revenant.coordinator.waiting import WaitingJobs
from revenant.messages import (ClusterEvent, FailoverRequest, HealthSummary, Message, MessageError, NodeEvent,
                               NodesReply, NodesRequest, Probe, ProbeReply, ReconcileRequest, decode_as, subjects)

log = logging.getLogger(__name__)

MAX_PROBES_IN_FLIGHT = 512
NODES_PAGE_MAX = 300  # nodes per nodes_reply.v1: a node's status with its capabilities is about 500 bytes
# Requests the leader answers on revenant.coord.<verb> (admin's), and on revenant.user.*.<verb>
# (users', coordinator/table/requests.py) all of them but reconcile, which is the agents'.
REQUEST_VERBS = ("submit", "jobs", "job", "checkpoint", "vacate", "restart", "purge", "failover", "reconcile",
                 "check", "cancel", "signal")


class Coordinator(Service):
    # Ready once it leads and serves requests; a standby never is.
    ready_after_start = False

    def __init__(self, config: CoordinatorConfig, *, clock=time.monotonic, wall=time.time) -> None:
        super().__init__()
        self.config = config
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.detector = FailureDetector(config)
        self._clock = clock
        self._wall = wall
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._events: EventPublisher | None = None
        self._probe_slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)
        # Requests being answered: outside the service's task group on purpose, since a request
        # that arrives while the service stops must still get its answer ("shutting down").
        self._requests: set[asyncio.Task[None]] = set()
        self.jobs: JobService | None = None
        self._client_requests: ClientRequests | None = None
        self.failover: Failover | None = None
        self._proactive: ProactiveMoves | None = None
        self.leadership: Leadership | None = None
        # The term it leads now (None while a standby), and how often it stepped down.
        self._term: Term | None = None
        self.step_downs = 0
        self._storm_dirty = False
        self._reconnected = False
        # Heartbeats come on a connection of their own, straight to the detector (coordinator/nodes/heartbeats.py).
        self._intake = HeartbeatIntake(self.detector, clock, self._emit)
        self._transition_log = TransitionLog(clock)
        self._hb_sub: RawSubscriber | ClientSubscription | None = None
        self.metrics = CoordinatorMetrics()
        self.loop_monitor = LoopMonitor(clock=clock)
        self.http: HttpServer | None = None
        if config.http_port >= 0:
            self.http = HttpServer(health_routes(
                render_metrics=self._render_metrics,
                summary=lambda: HealthSummary(nats_connected=self._bus_connected() and self._events is not None
                                              and self._events.connected),
                stuck_for=lambda: self.loop_monitor.stuck_for(self._clock()),
                stuck_after_s=config.live_stuck_after_s,
                started=self.ready.is_set,
                extra=lambda: {"coordinator": self.name, "nodes": self.detector.counts()},
            ), config.http_host, config.http_port)

    # ------------------------------------------------------------------ lifecycle

    @property
    def malformed_heartbeats(self) -> int:
        return self._intake.malformed

    def _bus_connected(self) -> bool:  # what verdicts need: the main and the heartbeat connection
        return self._nc is not None and self._nc.is_connected and self._hb_sub is not None and self._hb_sub.connected

    def _render_metrics(self) -> bytes:
        self.metrics.count_heartbeats(*self._intake.counts_since_last())
        self.metrics.update_nodes(self.detector.nodes.values(), per_node=self.config.node_metrics)
        self.metrics.loop_lag.set(self.loop_monitor.lag_s)
        self.metrics.failover_paused.set(1 if self.failover is not None and self.failover.storm.paused else 0)
        self.metrics.set_proactive_paused(self.leader and self._proactive is not None and self._proactive.rules.paused)
        return self.metrics.render()

    async def _start(self) -> None:
        if self.http is not None:
            await self.http.start()

        async def on_reconnect() -> None:
            self._reconnected = True
            if self.jobs is not None:
                self.jobs.agents.connection_lost()
            await ask_full_heartbeats(self._nc, self.name, self._wall())

        self._nc = await bus.connect(self.config.nats_url, f"revenant-coordinator-{self.name}",
                                     on_reconnect=on_reconnect, ping_interval_s=self.config.ping_interval_s,
                                     max_outstanding_pings=self.config.max_outstanding_pings,
                                     **security.credentials(security.COORDINATOR, self.config.nats_creds))
        self._js = self._nc.jetstream()
        here = self._nc.connected_url.netloc if self._nc.connected_url else ""  # one server's loss: one reconnect
        self._events = await EventPublisher.on_own_connection(
            starting_with(self.config.nats_url, here), f"revenant-coordinator-{self.name}-events",
            {**security.credentials(security.COORDINATOR, self.config.nats_creds), "in_order": True},
            timeout_s=self.config.event_publish_timeout_s, clock=self._clock)
        replicas = bus.replicas_for(self._nc, self.config.nats_replicas)
        log.info("coordinator %s: streams and buckets with %d replica(s)", self.name, replicas)
        await bus.ensure_event_stream(self._js, replicas, owner=True)
        # The agents create the lease bucket and may not update it: one with too few replicas is raised here.
        await raise_replicas(self._js, subjects.LEASES_BUCKET, replicas, owner=True)
        # A standby tracks every node too, so that it takes over with a warm view.
        if handshake.plain_urls(self.config.nats_url):
            # On the main connection's server first: one server's loss is one reconnect for both.
            urls = starting_with(self.config.nats_url, here)
            self._hb_sub = RawSubscriber(urls, f"revenant-coordinator-{self.name}-heartbeats", subjects.HEARTBEATS_ALL,
                                         self._intake, creds=self.config.nats_creds or None,
                                         on_reconnect=self._heartbeats_back)
        else:  # TLS: through the client library (its reconnects: on_reconnect above)
            self._hb_sub = ClientSubscription(self._nc, subjects.HEARTBEATS_ALL, self._intake)
        await self._hb_sub.start()
        await ask_full_heartbeats(self._nc, self.name, self._wall())
        self.leadership = Leadership(self._js, self.name, self.config.leader_lease_s,
                                     on_elected=self._elected, on_deposed=self._deposed, clock=self._clock,
                                     replicas=replicas, quiet_moment=gcpause.rewalk_if_due)
        gcpause.choose_rewalk()  # the whole heap's walk (a second at 100,000 nodes) right after a renewal
        agents = AgentClient(self._nc, self.leadership.fresh,
                             lambda node: getattr(self.detector.nodes.get(node), "incarnation", ""),
                             lambda: self.leadership.term)
        self.jobs = JobService(KvJobStore(self._js, replicas), agents, self.config, self._events, self._nodes,
                               self.leadership, wall=self._wall)
        self._client_requests = ClientRequests(self.jobs)
        self._job_events = JobEventConsumer(self._js, self.jobs, self._evicted, refused=self.metrics.events_refused.inc)
        self._conversions = JobEventConsumer(self._js, self.jobs, self._evicted, subjects.EPOCHS_CONVERTED,
                                             EPOCHS_CONSUMER, refused=self.metrics.events_refused.inc)
        self._periodic = PeriodicCheckpoints(self.jobs, self.detector.nodes.values,  # records, not a snapshot
                                             min(1.0, self.config.tick_interval_s * 10), self._wall)
        self._events.start()
        self.spawn(self._tick_loop(), "detector-tick")
        self.spawn(self.loop_monitor.run(), "loop-monitor")
        self.spawn(self.leadership.run(), "leadership")
        log.info("coordinator %s up; waiting to lead", self.name)

    def _nodes(self) -> list:
        """The node table as placement sees it: the detector's records (no snapshot), cordons applied."""
        nodes = list(self.detector.nodes.values())
        return self._proactive.cordon(nodes) if self._proactive is not None else nodes

    def _evicted(self, job: str, node: str, why: str) -> None:
        if self.failover is not None:
            self.failover.recover_job(job, node, evicted=why)

    async def _shutdown(self) -> None:
        if self.failover is not None:
            self.failover.cancel()
        for task in list(self._requests):
            task.cancel()
        if self._events is not None:
            await self._events.stop()
        if self._hb_sub is not None:
            await self._hb_sub.close()
        nc, self._nc = self._nc, None
        await bus.close(nc, 3, f"coordinator {self.name}")
        if self.http is not None:
            await self.http.stop()
        log.info("coordinator %s stopped", self.name)

    async def _elected(self) -> None:
        assert self.leadership is not None
        self._term = term = Term(self.leadership.terms)
        self.spawn(self._lead(term), f"lead-{term.number}")

    async def _lead(self, term: Term) -> None:
        """One term as the leader: load the job table, serve requests, run failover and
        checkpoints, until the term ends (:meth:`_deposed`, or a stop).  Everything leader-only
        is the term's (``term.add``, ``term.subscriptions``) and ends with it."""
        assert self.jobs is not None and self._nc is not None and self.leadership is not None
        try:
            await self.jobs.open()  # a new term reads the table afresh: another leader may have written
            self.failover = failover = self._new_failover()
            await failover.restore_hold()
            # What the previous leader left, before this one touches anything (see take_over).
            inherited = {job: (rec.state, rec.generation, rec.node) for job, rec in self.jobs.jobs.items()}
            for subject in (subjects.coordinator("nodes"), subjects.user_requests("nodes")):
                term.subscriptions.append(await self._nc.subscribe(subject, cb=self._on_nodes))
            for subject in [subjects.coordinator(verb) for verb in REQUEST_VERBS] + \
                    [subjects.user_requests(verb) for verb in USER_VERBS if verb != "nodes"]:
                term.subscriptions.append(await self._nc.subscribe(subject, cb=self._on_job_request))
            await self._nc.flush(timeout=self.config.leader_lease_s)  # the server has them: ready means ready
            await ask_full_heartbeats(self._nc, self.name, self._wall(), self.leadership.term)  # announces the term
            if term.over.is_set():
                return  # deposed while taking office
            term.add(self.spawn(supervised(self._job_events.run), "job-events"))
            term.add(self.spawn(supervised(self._conversions.run), "epoch-conversions"))
            term.add(self.spawn(supervised(self._periodic.run), "periodic-checkpoints"))
            term.add(self.spawn(supervised(WaitingJobs(self.jobs).run), "waiting-jobs"))
            self._proactive = proactive = ProactiveMoves(self.config, self.jobs, failover, self._events,
                                                         self.detector.nodes.values, self.metrics,
                                                         attention=self.detector.attention,
                                                         clock=self._clock, wall=self._wall)
            term.subscriptions.append(await self._nc.subscribe(subjects.ANOMALIES_ALL, cb=proactive.on_anomaly))
            term.add(self.spawn(supervised(proactive.run), "proactive-moves"))
            archiver = Archiver(self.jobs, self.config.job_retention_s, wall=self._wall)
            term.add(self.spawn(supervised(archiver.run), "job-archive"))
            term.add(self.spawn(take_over(
                inherited, self.config.node_timeout_s + self.config.probe_timeout_s, js=self._js,
                events=self._events, detector=self.detector, jobs=self.jobs, failover=failover,
                clock=self._clock, wall=self._wall), "take-over"))
            log.info("coordinator %s leads (term %d)", self.name, term.number)
            self._leader_event("leader_elected", f"coordinator {self.name} leads")
            self.ready.set()
            await term.over.wait()
        except (RevenantError, nats.errors.Error) as exc:
            # Leading on a table it could not read would be leading blind: step down, campaign again.
            if self._term is term:
                self.leadership.step_down(f"cannot take office: {described(exc)}")
        finally:
            if not self.stopping:  # a stop drains the connection, answering what already arrived
                await term.unsubscribe()

    def _new_failover(self) -> Failover:
        """Each term its own: a hold, a storm or a recovery of an earlier term is not this one's."""
        assert self._js is not None and self.jobs is not None and self._events is not None
        return Failover(self.config, self._js, self.jobs, self._events, self._nodes, self._last_heartbeat,
                        clock=self._clock, wall=self._wall, on_result=self.metrics.count_failover,
                        node=self.detector.nodes.get)

    def stop(self) -> None:
        super().stop()
        if self._term is not None:
            self._term.end()
        if self.failover is not None:
            self.failover.cancel()  # no restore starts once a stop is asked for

    def _deposed(self) -> None:
        """The leader lease is lost: every leader-only part stops at once (requests, job events,
        checkpoints, failovers, the take-over), the node table stays warm, and the leadership
        campaigns again (coordinator/nodes/leader.py).  A new term reloads the job table."""
        term, self._term = self._term, None
        if term is None:
            return  # not leading: a write conflict noticed after the step-down
        self.ready.clear()
        term.end()
        self._proactive = None  # its cordons and pause were this term's
        if self.failover is not None:
            self.failover.cancel()
        self.step_downs += 1
        why = self.leadership.why if self.leadership is not None else ""
        log.warning("coordinator %s stepped down (%s); standing by", self.name, why or "lease lost")
        self._leader_event("leader_stepped_down", why)

    def _leader_event(self, kind: str, reason: str) -> None:
        if self._events is not None:
            self._events.emit(subjects.cluster_event(kind),
                              ClusterEvent(kind=kind, at=self._wall(), reason=reason, coordinator=self.name))

    def _last_heartbeat(self, node: str) -> float | None:
        return getattr(self.detector.nodes.get(node), "last_heartbeat_at", None) or None

    # ------------------------------------------------------------------ inputs

    async def _heartbeats_back(self) -> None:
        self._reconnected = True  # heartbeats were missed while it was away: a grace period, not verdicts
        await ask_full_heartbeats(self._nc, self.name, self._wall())

    async def _on_nodes(self, msg: Msg) -> None:
        async def reply() -> NodesReply:
            req = decode_as(msg.data, NodesRequest)
            limit = max(1, min(req.limit, NODES_PAGE_MAX))
            names = self.detector.names()
            page = names[max(0, req.offset):max(0, req.offset) + limit]
            # As many as fit one message: a node with many GPUs takes several kilobytes.
            statuses = self.detector.snapshot(self._clock(), page)
            if self._proactive is not None and self.leader:  # a cordon shows as the leader sees it
                jobs = self.jobs.jobs
                statuses = allocated(self._proactive.cordon(statuses), jobs.usage(), jobs.per_node)
            return NodesReply(nodes=fitting(statuses), coordinator=self.name,
                              coordinator_metrics_url=self.http.url if self.http is not None else "",
                              total=len(names), offset=req.offset)

        await bus.answer(msg, reply, "nodes request")

    async def _on_job_request(self, msg: Msg) -> None:
        subject = msg.subject  # who asks: admin or the user it names (coordinator/table/requests.py)
        bus.answer_in_task(self._requests, msg, lambda verb, data: self._job_request(verb, data, subject),
                           "{verb} request")

    async def _job_request(self, verb: str, data: bytes, subject: str) -> Message:
        jobs, asker = self.jobs, requester_of(subject)
        assert jobs is not None and self._client_requests is not None
        if verb == "failover":
            assert self.failover is not None
            req_f = decode_as(data, FailoverRequest)
            if req_f.action != "status":
                check_admin(asker, f"failover {req_f.action}")
            return await self.failover.operator(req_f.action, list(self.detector.nodes.values()))
        if verb == "reconcile":
            check_admin(asker, "reconcile")
            # An agent kills what this answer names: only a leader whose lease is fresh may say.
            check_may_act(jobs.leader.fresh)
            req_r = decode_as(data, ReconcileRequest)
            if req_r.started or req_r.reconnected:  # what was asked of it meanwhile may never be answered
                # A reconnect may have lost replies of this very agent; a start, only an earlier one's.
                jobs.agents.node_lost(req_r.node, "restarted" if req_r.started else "reconnected to NATS",
                                      spare=req_r.incarnation if req_r.started and not req_r.reconnected else "")
            if req_r.started:
                for job in jobs.lost_on(req_r.node, req_r.jobs):
                    self._evicted(job, req_r.node, f"node {req_r.node}'s agent restarted without it")
            return await jobs.reconcile(req_r.node, req_r.jobs)
        return await self._client_requests.answer(verb, data, asker)

    # ------------------------------------------------------------------ detection

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            if not self._bus_connected():
                continue  # blind: no verdicts; the reconnect handlers grant a grace period
            if self._hb_sub is not None and self._hb_sub.backlogged:
                # Heartbeats wait unread (the loop was busy): a verdict now would be on stale
                # data.  Skipping the tick lets the stall guard grant grace.
                continue
            now = self._clock()
            if self._reconnected:
                self._reconnected = False
                self._emit(self.detector.grace_all(now, "coordinator reconnected to NATS"))
            transitions, probes = self.detector.tick(now)
            self._emit(transitions)
            self._transition_log.flush()
            if self._storm_dirty and self.leader and self.failover is not None:
                self._storm_dirty = False
                self.failover.check_storm_counted(self.detector.counts(), self.detector.state)
            for node in probes:
                self.spawn(self._probe(node), f"probe-{node}")

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
            self._transition_log.log(t)
            event = NodeEvent(node=t.node, kind=t.kind, at=at, incarnation=t.incarnation,
                              silence_s=round(t.silence_s, 3), reason=t.reason)
            self.metrics.count_node_event(event)
            if not self.leader:
                continue  # a standby watches; only the leader speaks and acts
            if self._events is not None:
                # A join or a recovery is said again by every heartbeat: written without an ack wait.
                self._events.emit(subjects.node_event(t.node, t.kind), event,
                                  acked=t.kind not in ("joined", "recovered"))
            if self.jobs is not None and (t.kind in ("dead", "left") or t.reason == "agent restarted"):
                self.jobs.agents.node_lost(t.node, "died" if t.kind == "dead" else "shut down")
                # A clean shutdown reports its jobs' ends itself; a death or a restart cannot.
                if self.failover is not None and t.kind != "left":
                    self.failover.node_dead(t.node, t.previous_incarnation or t.incarnation)
