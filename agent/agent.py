"""The node agent: heartbeats with health and capabilities, and direct probes.

Lifecycle: ``await agent.run()`` connects, serves until :meth:`Agent.stop` is
called (SIGTERM in ``revenant agent``), then says goodbye with a last
``leaving`` heartbeat and drains its NATS connection.  ``stop()`` is safe to
call before ``run()`` and more than once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import secrets
import shutil
import socket
import time
from importlib import metadata
from pathlib import Path

import msgspec
import nats.errors
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg

from revenant.agent import procs
from revenant.agent.criu import inspect_criu
from revenant.agent.engine import Engine
from revenant.agent.epochs import JobFiles
from revenant.agent.jobs import Supervisor
from revenant.common.kv import open_bucket
from revenant.agent.liveness import Liveness
from revenant.agent.gpu import GpuMonitor
from revenant.agent.health import HealthSample, evaluate, probe_values
from revenant.common.loopmonitor import LoopMonitor
from revenant.common import bus
from revenant.common.config import AgentConfig
from revenant.common.errors import ConfigError, RevenantError
from revenant.common.events import EventPublisher
from revenant.common.httpserver import HttpServer
from revenant.common.metrics import AgentMetrics, health_routes
from revenant.messages import (
    AgentJobReply,
    AnomalyEvent,
    JobRecord,
    NodeEvent,
    Capabilities,
    CheckpointJob,
    KillJob,
    PurgeJob,
    RestoreJob,
    StartJob,
    CriuInfo,
    HealthSummary,
    decode_as,
    subjects,
)

log = logging.getLogger(__name__)


def _revenant_version() -> str:
    try:
        return metadata.version("revenant")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        subjects.check_name(config.node)
        self.config = config
        self.node = config.node
        self.incarnation = secrets.token_hex(8)
        self.storage = Path(config.storage)
        self.loop_monitor = LoopMonitor(stall_threshold_s=config.loop_stall_threshold_s)
        # Set once connected and serving; tests and embedders wait on it.
        self.ready = asyncio.Event()
        self.thresholds = config.health_thresholds()
        self.anomalies = config.anomaly_detector()
        self.metrics = AgentMetrics()
        self.gpu_monitor = GpuMonitor(job_of=self._job_of_pid, thresholds=self.thresholds.gpu)
        self.http: HttpServer | None = None
        if config.http_port >= 0:
            self.http = HttpServer(health_routes(
                render_metrics=self.metrics.render,
                summary=lambda: self.health,
                stuck_for=lambda: self.loop_monitor.stuck_for(time.monotonic()),
                stuck_after_s=config.live_stuck_after_s,
                started=self.ready.is_set,
                extra=lambda: {"node": self.node, "incarnation": self.incarnation,
                               "jobs": sorted(self.supervisor.jobs) if self.supervisor else []},
            ), config.http_host, config.http_port)
        self.capabilities = Capabilities()
        self.health = HealthSummary()
        self._nc: Client | None = None
        self._events: EventPublisher | None = None
        self.supervisor: Supervisor | None = None
        self.liveness = Liveness(self)
        self.fence_report: str = ""
        self.main_loop: asyncio.AbstractEventLoop | None = None
        self._js = None
        self._requests: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect, serve until stopped, then leave cleanly."""
        if self._stopping.is_set():
            return
        try:
            self.storage.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"storage {self.storage}: {exc.strerror or exc}") from None
        procs.become_subreaper()
        if self.http is not None:
            await self.http.start()  # /live answers while criu is being checked
        try:
            await self._serve()
        finally:
            await asyncio.to_thread(self.gpu_monitor.stop)
            if self.http is not None:
                await self.http.stop()

    async def _serve(self) -> None:
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
        )
        js = self._js = self._nc.jetstream()
        self.main_loop = asyncio.get_running_loop()
        try:
            await bus.ensure_event_stream(js)
        except RevenantError as exc:
            log.error("%s; job events will be retried", exc)
        self._events = EventPublisher(js)
        self._events.start()
        engine = None
        if criu.ok and criu.path and criu.version:
            engine = Engine(criu_path=criu.path, criu_version=criu.version, node=self.node, storage=self.storage,
                            work_roots=self._work_roots(),
                            staging=Path(self.config.staging_dir) if self.config.staging_dir else None,
                            concurrency=self.config.checkpoint_concurrency, criu_timeout_s=self.config.criu_timeout_s)
        await asyncio.to_thread(self._clean_half_written_epochs)
        self.supervisor = Supervisor(self.node, self.storage, engine, self._events.emit,
                                     criu_error=criu.error or "criu unusable", metrics=self.metrics,
                                     switch_timeout_s=self.config.fence_timeout_s)
        await self._nc.subscribe(subjects.node_commands(self.node), cb=self._on_command)
        self.health = await self.sample_health()
        await self.liveness.start()
        log.info("agent %s up (incarnation %s, criu %s)", self.node, self.incarnation,
                 self.capabilities.criu.version if self.capabilities.criu.ok else "unusable")
        try:
            async with asyncio.TaskGroup() as tg:
                monitor = tg.create_task(self.loop_monitor.run(), name="loop-monitor")
                probes = tg.create_task(self._health_loop(), name="health")
                self.ready.set()
                await self._stopping.wait()
                for task in (probes, monitor):
                    task.cancel()
        finally:
            await self._leave()

    def stop(self) -> None:
        """Ask the agent to stop; idempotent and safe before ``run()``."""
        self._stopping.set()

    def _clean_half_written_epochs(self) -> None:
        """Epochs this node was writing when an earlier agent died: never listed, now removed."""
        for job_dir in self.storage.glob("jobs/*"):
            JobFiles(self.storage, job_dir.name).clean_stale_tmp(self.node)

    def _work_roots(self) -> list[Path]:
        """Node-local scratch for criu's logs and scripts (small)."""
        roots = [Path(f"/var/tmp/revenant-{self.node}")]
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            roots.insert(0, Path(f"/dev/shm/revenant-{self.node}"))
        return roots

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
        if self._events is not None:
            await self._events.stop()
        await self.liveness.stop()  # the last heartbeat says "leaving"
        nc, self._nc = self._nc, None
        if nc is None:
            return
        try:
            if nc.is_connected:
                await asyncio.wait_for(nc.drain(), self.config.shutdown_grace_s)
            else:
                await nc.close()
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("drain did not finish cleanly: %s", exc or type(exc).__name__)
            await nc.close()
        log.info("agent %s stopped", self.node)

    # ------------------------------------------------------------------ heartbeats

    async def _inspect(self) -> Capabilities:
        criu: CriuInfo = await inspect_criu(self.config.criu_path, self.config.criu_check_timeout_s)
        await asyncio.to_thread(self.gpu_monitor.start)
        return Capabilities(
            hostname=socket.gethostname(),
            kernel=platform.release(),
            cpus=os.cpu_count() or 0,
            memory_total_bytes=psutil.virtual_memory().total,
            revenant_version=_revenant_version(),
            criu=criu,
            metrics_url=self.http.url if self.http is not None else "",
            gpu=self.gpu_monitor.kind,
            gpus=list(self.gpu_monitor.gpus),
        )

    def _job_of_pid(self, pid: int) -> str | None:
        """The job a (GPU-using) process belongs to: its namespace's init is a job's root."""
        sup = self.supervisor
        if sup is None:
            return None
        roots = {rt.pid: job for job, rt in sup.jobs.items()}
        try:
            proc: psutil.Process | None = psutil.Process(pid)
            while proc is not None:
                if proc.pid in roots:
                    return roots[proc.pid]
                proc = proc.parent()
        except psutil.Error:
            pass
        return None

    async def sample_health(self) -> HealthSummary:
        gpus = await self.gpu_monitor.read() if self.gpu_monitor.gpus else []
        worst_lag, recent_stalls = self.loop_monitor.take_window()
        try:
            free = shutil.disk_usage(self.storage).free
        except OSError:
            free = 0
        sample = HealthSample(
            loop_lag_s=worst_lag,
            loop_stalls=self.loop_monitor.stalls,
            recent_stalls=recent_stalls,
            memory_percent=psutil.virtual_memory().percent,
            storage_free_bytes=free,
            criu_ok=self.capabilities.criu.ok,
            criu_error=self.capabilities.criu.error,
            nats_connected=self._nc is not None and self._nc.is_connected,
            checkpoint_failures=self.supervisor.checkpoint_failures if self.supervisor else 0,
            pending_ops=self.supervisor.pending_ops if self.supervisor else 0,
            gpus=gpus,
            gpu_recent_xids=self.gpu_monitor.recent_xids() if gpus else {},
            gpu_errors=dict(self.gpu_monitor.errors),
        )
        summary = evaluate(sample, self.thresholds)
        self.metrics.update_health(summary)
        if self.supervisor is not None:
            self.metrics.set_jobs({"running": len(self.supervisor.jobs)})
        for a in self.anomalies.observe_all(probe_values(summary), time.monotonic()):
            self.metrics.count_anomaly(a.metric)
            log.warning("anomaly: %s = %g (mean %g, std %g)", a.metric, a.value, a.mean, a.std)
            if self._events is not None:
                self._events.emit(subjects.node_event(self.node, "anomaly"),
                                  AnomalyEvent(node=self.node, metric=a.metric, value=a.value, mean=a.mean,
                                               std=a.std, at=time.time()))
        return summary

    async def _health_loop(self) -> None:
        """Sample the probes each heartbeat interval; the liveness thread publishes the result."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self.health = await self.sample_health()
            if self.supervisor is not None:
                self.supervisor.reap_orphans()

    # ------------------------------------------------------------------ commands

    async def _on_command(self, msg: Msg) -> None:
        bus.answer_in_task(self._requests, msg, self._dispatch, "command {verb}")

    async def _dispatch(self, verb: str, data: bytes) -> AgentJobReply:
        sup = self.supervisor
        assert sup is not None
        if self.liveness.fenced:
            raise RevenantError(f"node {self.node} is self-fenced (its lease lapsed); try another node",
                                code="fenced", retriable=True)
        if self._stopping.is_set() and verb in ("start", "restore", "checkpoint"):
            raise RevenantError(f"node {self.node} is shutting down; try another node",
                                code="shutting_down", retriable=True)
        if verb == "start":
            cmd = decode_as(data, StartJob)
            return await sup.start(cmd.spec, cmd.generation, fresh=cmd.fresh)
        if verb == "checkpoint":
            ck = decode_as(data, CheckpointJob)
            return await sup.checkpoint(ck.job, ck.generation, ck.stop)
        if verb == "restore":
            rs = decode_as(data, RestoreJob)
            return await sup.restore(rs.spec, rs.generation)
        if verb == "kill":
            kj = decode_as(data, KillJob)
            return await sup.kill(kj.job, kj.generation, kj.reason)
        if verb == "purge":
            return await sup.purge(decode_as(data, PurgeJob).job)
        raise RevenantError(f"unknown command {verb!r}", code="unknown_command")

    # ------------------------------------------------------------------ fencing and reconciling

    async def after_fence(self) -> None:
        """The lease is back after a self-fence: report it, then reconcile."""
        if self._events is not None:
            self._events.emit(subjects.node_event(self.node, "fenced"),
                              NodeEvent(node=self.node, kind="fenced", at=time.time(), incarnation=self.incarnation,
                                        reason=self.fence_report))
        await self.reconcile()

    async def _on_reconnect(self) -> None:
        task = asyncio.create_task(self.reconcile())
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def reconcile(self) -> None:
        """Kill every local job whose generation has moved on, or that now belongs to another node."""
        sup = self.supervisor
        if sup is None or not sup.jobs:
            return
        try:
            kv = await open_bucket(self._js, subjects.JOBS_BUCKET, None, history=5)
        except RevenantError as exc:
            log.warning("cannot reconcile: %s", exc)
            return
        for job, rt in list(sup.jobs.items()):
            try:
                rec = msgspec.msgpack.decode((await kv.get(job)).value, type=JobRecord)
            except Exception as exc:  # missing key, bad record, timeout: leave the job alone
                log.debug("reconcile: no record for job %s: %s", job, exc)
                continue
            if rec.generation != rt.generation or rec.node != self.node:
                log.warning("job %s generation %d is stale (now generation %d on %s): killing it",
                            job, rt.generation, rec.generation, rec.node or "no node")
                await sup.kill(job, rt.generation, reason=f"superseded by generation {rec.generation}")
