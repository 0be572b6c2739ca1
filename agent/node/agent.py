"""The node agent: heartbeats with health and capabilities, direct probes, job commands.

Lifecycle (a :class:`~revenant.common.serving.service.Service`): ``await agent.run()``
connects, serves until :meth:`Agent.stop` is called (SIGTERM in ``revenant
agent``), then drains its node (every job checkpointed, stopped and reported
evicted), says goodbye with a last ``leaving`` heartbeat and drains its NATS
connection.  ``stop()`` is safe to call before ``run()`` and more than once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

import msgspec
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg

from revenant.agent.checkpointing.engine import Engine
from revenant.agent.checkpointing.guard import StorageGuard
from revenant.agent.checkpointing.predump import PreDumpStep
from revenant.agent.files.filestep import JobFilesStep
from revenant.agent.gpus import cuda, gpu
from revenant.agent.gpus.gpustep import GpuStep
from revenant.agent.network import netlock, netprobe
from revenant.agent.node import anomaly, checkable, reconcile
from revenant.agent.node.liveness import Liveness
from revenant.agent.node.probes import HealthProbes, anomaly_event
from revenant.agent.pipeline import progress
from revenant.agent.pipeline.criu import inspect_criu
from revenant.agent.processes import cgroups, procs
from revenant.agent.running.jobs import Supervisor
from revenant.agent.running.runtime import LeaderTerm
from revenant.agent.storage import imagekeys
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import ConfigError, RevenantError
from revenant.common.messaging import bus, events
from revenant.common.serving.httpserver import HttpServer
from revenant.common.serving.loopmonitor import LoopMonitor
from revenant.common.serving.metrics import AgentMetrics, health_routes
from revenant.common.serving.service import Service
from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig
from revenant.common.version import version
from revenant.messages import (AgentJobReply, Capabilities, CheckpointJob, CriuInfo, HealthSummary, KillJob, NodeEvent,
                               CheckJob, PurgeJob, RestoreJob, SignalJob, StartJob, decode_as, subjects)

log = logging.getLogger(__name__)


class Agent(Service):
    def __init__(self, config: AgentConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        subjects.check_name(config.node)
        self.config, self.node = config, config.node
        self.incarnation, self.storage = secrets.token_hex(8), Path(config.storage)
        self.clock, self.wall_clock = clock, wall_clock
        self.keys = imagekeys.for_config(config.image_integrity, config.image_keys, config.image_encryption)
        self.loop_monitor = LoopMonitor(stall_threshold_s=config.loop_stall_threshold_s, clock=clock)
        self.metrics = AgentMetrics()
        thresholds = config.health_thresholds()
        self.gpu_monitor = gpu.GpuMonitor(job_of=self._job_of_pid, thresholds=thresholds.gpu, clock=clock)
        detector = anomaly.AnomalyDetector.from_settings(config.anomaly_settings())
        self.probes = HealthProbes(self.storage, thresholds, detector, self.loop_monitor, self.gpu_monitor, self.metrics,
                                   clock=clock)
        self.http: HttpServer | None = None
        if config.http_port >= 0:
            self.http = HttpServer(health_routes(
                render_metrics=self.metrics.render,
                summary=lambda: self.health,
                stuck_for=lambda: self.loop_monitor.stuck_for(self.clock()),
                stuck_after_s=config.live_stuck_after_s,
                started=self.ready.is_set,
                extra=lambda: {"node": self.node, "incarnation": self.incarnation,
                               "jobs": sorted(self.supervisor.jobs) if self.supervisor else []},
            ), config.http_host, config.http_port)
        self.capabilities = Capabilities()
        self.cuda: cuda.Mechanism | None = None  # how this node suspends CUDA state (agent/gpus/cuda.py), or None
        self.cuda_why = ""  # ... and why not
        self.netlock: netlock.NetLockStep | None = None  # this node's own lock on a job's connections
        self.health = HealthSummary()
        self.leader_term = LeaderTerm()  # the newest leader term heard: older terms' commands are refused
        self.liveness = Liveness(
            config, self.node, self.incarnation,
            health=lambda: self.health, capabilities=lambda: self.capabilities,
            stuck_for=self.loop_monitor.stuck_for, on_heartbeat=self.metrics.heartbeats.inc,
            on_renewed=self._reset_switches, on_fence=self._fence, on_lease_back=self._lease_back,
            on_term=self.leader_term.heard, clock=clock, wall_clock=wall_clock)
        self.fence_report: str = ""  # what the last self-fence did, for the "fenced" event once the lease is back
        self._fenced_since_reset = False  # (the liveness thread's) a fence since the switches were last reset
        self.supervisor: Supervisor | None = None
        self.main_loop: asyncio.AbstractEventLoop | None = None
        self._nc: Client | None = None
        self._events: events.EventPublisher | None = None
        # Requests being answered, and reconciles: short-lived, cancelled first at shutdown, and outside
        # the service's task group on purpose: a request that arrives while it stops gets an answer.
        self._requests: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        """Connect and serve: criu and GPUs inspected, events, the supervisor, commands, liveness."""
        try:
            self.storage.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"storage {self.storage}: {exc.strerror or exc}") from None
        procs.become_subreaper()
        if self.http is not None:
            await self.http.start()  # /live answers while criu is being checked
        self.capabilities = await self._inspect()
        criu = self.capabilities.criu
        if not criu.ok:
            log.warning("criu unusable: %s", criu.error)
        self._nc = await bus.connect(
            self.config.nats_url,
            f"revenant-agent-{self.node}",
            ping_interval_s=self.config.ping_interval_s,
            max_outstanding_pings=self.config.max_outstanding_pings,
            reconnect_wait_s=self.config.reconnect_wait_s,
            on_reconnect=self._on_reconnect,
            **security.credentials(security.agent_identity(self.node), self.config.nats_creds),
        )
        js = self._nc.jetstream()
        self.main_loop = asyncio.get_running_loop()
        try:
            await bus.ensure_event_stream(js, bus.replicas_for(self._nc, self.config.nats_replicas))
        except RevenantError as exc:
            log.error("%s; job events will be retried", exc)
        self._events = events.EventPublisher(js, clock=self.clock)
        self._events.start()
        await asyncio.to_thread(self._clean_half_written_epochs)
        self.supervisor = Supervisor(self.node, self.storage, self._engine(criu), self._events.emit,
                                     criu_error=criu.error or "criu unusable", metrics=self.metrics,
                                     switch_timeout_s=self.config.fence_timeout_s,
                                     max_frozen_s=self.config.max_frozen_s, clock=self.clock,
                                     wall_clock=self.wall_clock, scratch=self.config.job_scratch(),
                                     allow_root_jobs=self.config.allow_root_jobs, leader_term=self.leader_term,
                                     cgroups=cgroups.NodeCgroups.start(self.node, self.config.job_cgroups,
                                                                       self.config.job_pids_max))
        with bus.map_exceptions(f"cannot subscribe to node {self.node}'s commands"):
            await self._nc.subscribe(subjects.node_commands(self.node), cb=self._on_command)
            await self._nc.flush(timeout=self.config.shutdown_grace_s)  # served once ready is set
        self.health = await self._sample_health()
        await self.liveness.start()
        log.info("agent %s up (incarnation %s, criu %s)", self.node, self.incarnation,
                 criu.version if criu.ok else "unusable")
        self.spawn(self.loop_monitor.run(), "loop-monitor")
        self.spawn(self._health_loop(), "health")
        self.spawn(self._load_loop(), "load")
        # A leader that never saw this node's previous agent die learns it here (its jobs died with it).
        self._in_task(lambda: self.reconcile(started=True))

    async def _shutdown(self) -> None:
        """Drain the node, say goodbye, close; copes with a start that got only part of the way."""
        try:
            await self._leave()
        finally:
            await asyncio.to_thread(self.gpu_monitor.stop)
            if self.http is not None:
                await self.http.stop()

    async def _leave(self) -> None:
        for task in list(self._requests):
            task.cancel()
        # RED from the next heartbeat on: no new work is placed here while the node drains.
        self.health = msgspec.structs.replace(self.health, state="RED",
                                              reasons=[*self.health.reasons, "draining: the agent is shutting down"])
        if self.supervisor is not None:
            reason = f"node {self.node} is shutting down"
            await self.supervisor.drain(self.config.drain_timeout_s, reason)
            await self.supervisor.shutdown(reason)
            await self.supervisor.policies.idle(self.config.shutdown_grace_s)  # their events go out below
        if self.netlock is not None:  # a vacate's held connections: their peers get a reset, not silence
            await self.netlock.close()
        if self._events is not None:
            await self._events.stop()
        await self.liveness.stop()  # the last heartbeat says "leaving"
        nc, self._nc = self._nc, None
        if nc is not None:
            await bus.close(nc, self.config.shutdown_grace_s, f"agent {self.node}")
            log.info("agent %s stopped", self.node)

    def _engine(self, criu: CriuInfo) -> Engine | None:
        if not (criu.ok and criu.path and criu.version):
            return None
        cfg = self.config
        engine = Engine(criu_path=criu.path, criu_version=criu.version, node=self.node, storage=self.storage,
                      work_roots=self._work_roots(), staging=Path(cfg.staging_dir) if cfg.staging_dir else None,
                      concurrency=cfg.checkpoint_concurrency, criu_timeout_s=cfg.criu_timeout_s,
                      job_files=JobFilesStep(self.storage, cfg.file_snapshot_max_bytes, cfg.workdir_scan_max_entries,
                                             cfg.file_snapshot_timeout_s, cfg.workdir_snapshot_max_bytes),
                      clock=self.clock, wall_clock=self.wall_clock, lazy_restore=self.capabilities.lazy_restore,
                      reporter=progress.Reporter(self.node, self._publish), keys=self.keys,
                      other_users=criu.features.get("other_users", False))
        # First the storage guard (nothing is frozen or written for a dump that cannot fit), then
        # the GPU, the policy's pre-dump, then the job's own files (while criu holds it frozen).
        # The GPU's state is suspended before a pre-dump or the dump read the job's memory.
        gpu_step = GpuStep(self.cuda, self.cuda_why, self.gpu_monitor.scan, lambda: self.capabilities,
                           cfg.gpu_lock_timeout_s)
        engine.steps[:0] = [StorageGuard(self._gpu_bytes), gpu_step,
                            PreDumpStep(criu.path, criu.features.get("mem_dirty_track", False), self._degraded,
                                        cfg.criu_timeout_s)]
        engine.steps += [self.netlock] if self.netlock else []
        return engine

    def _gpu_bytes(self, job: str) -> int:
        """The GPU memory ``job``'s processes held at the latest reading (0 where unknown)."""
        return sum(p.used_memory_bytes for g in self.health.gpus for p in g.processes if p.job == job)

    def _degraded(self, job: str, generation: int, why: str) -> None:
        log.warning("job %s: %s", job, why)
        if self.supervisor is not None:
            self.supervisor.policies.event(job, "degraded", generation, reason=why)

    def _clean_half_written_epochs(self) -> None:
        """Epochs this node was writing when an earlier agent died: never listed, now removed."""
        for job_dir in self.storage.glob("jobs/*"):
            try:
                files = JobFiles(self.storage, job_dir.name)
            except subjects.InvalidName:
                continue  # not a job's directory
            files.clean_stale_tmp(self.node)

    def _work_roots(self) -> list[Path]:
        """Node-local scratch for criu's logs and scripts (small)."""
        roots = [Path(f"/var/tmp/revenant-{self.node}")]
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            roots.insert(0, Path(f"/dev/shm/revenant-{self.node}"))
        return roots

    def _in_task(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``make()`` as a short-lived task of the agent (on its loop), cancelled at shutdown."""
        task = asyncio.create_task(make())
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    # ------------------------------------------------------------------ capabilities and health

    async def _inspect(self) -> Capabilities:
        cfg = self.config
        criu: CriuInfo = await inspect_criu(cfg.criu_path, cfg.criu_check_timeout_s)
        if criu.ok:
            await netprobe.inspect(criu, self._work_roots()[0], cfg.criu_check_timeout_s)
            self.netlock = await netlock.setup(cfg.nft_path, self.node, criu.features, self._work_roots()[0],
                                               hold_s=cfg.connection_hold_s)
        await asyncio.to_thread(self.gpu_monitor.start)
        self.cuda, self.cuda_why = await asyncio.to_thread(cuda.detect, cfg.gpu_checkpoint, cfg.gpu_libcuda,
                                                           cfg.gpu_cuda_checkpoint)
        if self.gpu_monitor.gpus:
            log.info("GPU checkpoints: %s%s", self.cuda.name if self.cuda else "none",
                     f" ({self.cuda_why})" if self.cuda_why else "")
        return Capabilities(
            hostname=socket.gethostname(),
            address=cfg.advertise_address or await asyncio.to_thread(bus.route_address, cfg.nats_url),
            kernel=platform.release(),
            cpus=os.cpu_count() or 0,
            memory_total_bytes=psutil.virtual_memory().total,
            revenant_version=version(),
            criu=criu,
            metrics_url=self.http.url if self.http is not None else "",
            gpu=self.gpu_monitor.kind,
            gpus=list(self.gpu_monitor.gpus),
            gpu_checkpoint=self.cuda.name if self.cuda else "none",
            gpu_checkpoint_why=self.cuda_why,
            cuda_version=getattr(self.cuda, "version", 0),
            gpu_remap=bool(self.cuda and self.cuda.remap),
            lazy_restore=self._lazy_restore(criu),
        )

    def _lazy_restore(self, criu: CriuInfo) -> bool:
        """restore_mode: lazy where criu can (userfaultfd: its uffd features), as auto does."""
        mode, able = self.config.restore_mode, criu.ok and all(criu.features.get(f) for f in ("uffd", "uffd-noncoop"))
        if mode == "lazy" and not able:
            log.error("restore_mode = lazy, but criu here has no userfaultfd (criu check --feature uffd-noncoop "
                      "fails): restores are eager")
        return mode != "eager" and able

    def _job_of_pid(self, pid: int) -> str | None:
        """The job a (GPU-using) process belongs to: its namespace's init is a job's root."""
        sup = self.supervisor
        if sup is None:
            return None
        return procs.below(pid, {rt.pid: job for job, rt in sup.jobs.items()})

    async def _sample_health(self) -> HealthSummary:
        sup = self.supervisor
        summary, anomalies = await self.probes.sample(
            self.capabilities.criu, nats_connected=self._nc is not None and self._nc.is_connected,
            checkpoint_failures=sup.checkpoint_failures if sup else 0, pending_ops=sup.pending_ops if sup else 0,
            running_jobs=len(sup.jobs) if sup else None)
        if self._events is not None:
            for a in anomalies:
                self._events.emit(subjects.node_event(self.node, "anomaly"),
                                  anomaly_event(self.node, a, self.wall_clock()))
        return summary

    async def _health_loop(self) -> None:
        """Sample the probes each heartbeat interval; the liveness thread publishes the result."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self.health = await self._sample_health()
            if self.supervisor is not None:
                self.supervisor.reap_orphans()
                await self.supervisor.expire_frozen(self.config.max_frozen_s)

    async def _load_loop(self) -> None:
        """The node's load each second, whatever the heartbeat interval: a scheduled checkpoint of a
        load-aware job is weighed against its average over the last few seconds (agent/checkpointing/load.py)."""
        while True:
            if self.supervisor is not None:
                self.supervisor.policies.sampler.sample()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ commands

    async def _publish(self, subject: str, data: bytes) -> None:
        """Core NATS, fire and forget (the progress of dumps and restores): nothing while disconnected."""
        if self._nc is not None and self._nc.is_connected:
            await self._nc.publish(subject, data)

    async def _on_command(self, msg: Msg) -> None:
        term = (msg.headers or {}).get(subjects.TERM_HEADER, "0")
        bus.answer_in_task(self._requests, msg, lambda verb, data: self._dispatch(verb, data, term), "command {verb}")

    async def _dispatch(self, verb: str, data: bytes, term: str = "0") -> AgentJobReply:
        sup = self.supervisor
        assert sup is not None
        sup.leader_term.take(int(term) if term.isdigit() else 0, f"the {verb} command")
        if self.liveness.fenced:
            raise RevenantError(f"node {self.node} is self-fenced (its lease lapsed); try another node",
                                code="fenced", retriable=True)
        if self.stopping and verb in ("start", "restore", "checkpoint"):
            raise RevenantError(f"node {self.node} is shutting down; try another node",
                                code="shutting_down", retriable=True)
        if verb == "start":
            cmd = decode_as(data, StartJob)
            return await sup.start(cmd.spec, cmd.generation, fresh=cmd.fresh, gpus=cmd.gpus)
        if verb == "checkpoint":
            ck = decode_as(data, CheckpointJob)
            return await sup.checkpoint(ck.job, ck.generation, ck.stop, ck.evict if ck.stop else "",
                                        scheduled=ck.scheduled, force=ck.force,
                                        why={"cause": ck.cause, "reasons": ck.reasons})
        if verb == "restore":
            rs = decode_as(data, RestoreJob)
            return await sup.restore(rs.spec, rs.generation, rs.leave_workdir, rs.epoch, rs.gpus)
        if verb == "kill":
            kj = decode_as(data, KillJob)
            return await sup.kill(kj.job, kj.generation, kj.reason, kj.signal, kj.grace_s)
        if verb == "signal":
            sj = decode_as(data, SignalJob)
            return sup.signal(sj.job, sj.generation, sj.signal, sj.all)
        if verb == "purge":
            return await sup.purge(decode_as(data, PurgeJob).job)
        if verb == "check":
            return await checkable.check(sup, decode_as(data, CheckJob))
        raise RevenantError(f"unknown command {verb!r}", code="unknown_command")

    # ------------------------------------------------------------------ the lease (called on the liveness thread)

    def _reset_switches(self) -> None:
        if self.supervisor is None:
            return
        gap = self.supervisor.touch_stamps()
        if self._fenced_since_reset:  # that gap was the fence's, reconciled already
            self._fenced_since_reset = False
        elif gap > self.config.fence_timeout_s:
            # Renewed in time, but the switches were reset too late (slow storage, a stalled
            # thread): they may have fired, and only a fence's reconcile thaws what they froze.
            log.error("dead man's switches reset only after %.1f s (fence %.1f s): treated as a self-fence",
                      gap, self.config.fence_timeout_s)
            self._fence(gap, "dead man's switches not reset")
            self._lease_back()

    def _fence(self, stale_s: float, what: str = "lease not renewed") -> None:
        # Freeze from the liveness thread: the main loop may be the very thing that is stuck.
        self._fenced_since_reset = True
        sup = self.supervisor
        frozen = sup.freeze_all(f"self-fenced: {what} for {stale_s:.1f} s") if sup is not None else []
        self.fence_report = f"{what} for {stale_s:.1f} s; froze {', '.join(frozen) or 'no jobs'}"

    def _lease_back(self) -> None:
        main = self.main_loop
        if main is not None and not main.is_closed():
            main.call_soon_threadsafe(self._in_task, self.after_fence)

    # ------------------------------------------------------------------ fencing and reconciling

    async def after_fence(self) -> None:
        """The lease is back after a self-fence: report it, then reconcile."""
        if self._events is not None:
            self._events.emit(subjects.node_event(self.node, "fenced"),
                              NodeEvent(node=self.node, kind="fenced", at=self.wall_clock(),
                                        incarnation=self.incarnation, reason=self.fence_report))
        await self.reconcile()

    async def _on_reconnect(self) -> None:
        self._in_task(lambda: self.reconcile(reconnected=True))

    async def reconcile(self, started: bool = False, reconnected: bool = False) -> None:
        """Ask the leader which local jobs moved on (killed) and which frozen ones may thaw, again
        once the lease is held if a thaw was declined.  ``started``: this agent has just started;
        ``reconnected``: its connection came back; either says so even with no jobs."""
        sup, nc, stopping = self.supervisor, self._nc, lambda: self.stopping
        if sup is None or nc is None or not (sup.jobs or started or reconnected):
            return
        answer = await reconcile.ask_leader(nc, sup, self.node, self.incarnation, self.clock, stopping,
                                            self.liveness.holds_lease, started, reconnected)
        if (answer is not None and await reconcile.apply(sup, answer, may_thaw=self.liveness.holds_lease())
                and await reconcile.when_held(self.liveness.holds_lease, stopping, self.clock)):
            await self.reconcile()

