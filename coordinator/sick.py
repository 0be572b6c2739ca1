"""Proactive moves, the shell: carry out what :mod:`revenant.coordinator.proactive` decides.

Each tick (twice a second) reads the node table, lets the rules decide, and starts each action
as a task: a fresh epoch (``cause: health``) or a move.  A move first makes sure a healthy node
can take the job (else the job stays, and a ``migration_skipped`` event says why), then vacates
it with eviction: the node commits a last epoch, stops the job and reports it ``evicted``, and
failover restores it on the healthy node (published as ``migrated``).  A move whose checkpoint
fails leaves the job running where it was (``migration_failed``).  Actions take tokens from a
bucket (``restore_rate_per_s``) and at most ``max_concurrent_restores`` run at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from nats.aio.msg import Msg

from revenant.common.config import CoordinatorConfig
from revenant.common.errors import RevenantError
from revenant.common.events import EventPublisher
from revenant.common.metrics import CoordinatorMetrics
from revenant.coordinator import lifecycle as lc
from revenant.coordinator.failover import Failover, TokenBucket
from revenant.coordinator.jobs import JobService
from revenant.coordinator.placement import NoNodeAvailable, place
from revenant.coordinator.proactive import RETRY_S, Action, ProactiveRules, Settings
from revenant.messages import AnomalyEvent, ClusterEvent, JobEvent, MessageError, NodeStatus, decode_as, subjects

log = logging.getLogger(__name__)

TICK_S = 0.5


class ProactiveMoves:
    def __init__(self, config: CoordinatorConfig, jobs: JobService, failover: Failover, events: EventPublisher,
                 nodes: Callable[[], Iterable], metrics: CoordinatorMetrics | None = None, *,
                 placement: Callable[[], list[NodeStatus]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """``nodes``: the detector's records as the nodes report them (no snapshot: a tick must stay
        cheap at many nodes); ``placement``: the node table placement sees (cordoned)."""
        self.config = config
        self.rules = ProactiveRules(Settings.of(config))
        self.jobs = jobs
        self.failover = failover
        self.events = events
        self.nodes = nodes
        self.placement = placement or (lambda: self.rules.cordon(list(nodes())))
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.bucket = TokenBucket(config.restore_rate_per_s, config.max_concurrent_restores, clock())
        self.slots = asyncio.Semaphore(config.max_concurrent_restores)
        self.busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                self.tick()
                await asyncio.sleep(TICK_S)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def cordon(self, nodes: list[NodeStatus]) -> list[NodeStatus]:
        return self.rules.cordon(nodes)

    async def on_anomaly(self, msg: Msg) -> None:
        try:
            ev = decode_as(msg.data, AnomalyEvent)
        except MessageError as exc:
            log.warning("bad anomaly event on %s: %s", msg.subject, exc)
            return
        reason = f"anomaly: {ev.metric} = {ev.value:g} (mean {ev.mean:g}, std {ev.std:g})"
        if self.rules.anomaly(ev.node, ev.metric, reason):
            log.warning("node %s: %s", ev.node, reason)

    def tick(self) -> list[asyncio.Task[None]]:
        now = self.clock()
        change = self.rules.update(self.nodes(), now)
        if change is not None:
            self._announce(change)
        started = []
        for action in self.rules.actions(list(self.jobs.jobs.values()), now, self.busy):
            self.busy.add(action.job)
            task = asyncio.create_task(self._one(action), name=f"proactive-{action.action}-{action.job}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            started.append(task)
        return started

    def _announce(self, change: str) -> None:
        sick, total = self.rules.sick, self.rules.total
        kind = f"proactive_{change}"
        reason = (f"{sick} of {total} nodes sick at once (more than {self.config.proactive_pause_fraction:.0%}): "
                  f"proactive moves paused; jobs are still checkpointed" if change == "paused"
                  else f"{sick} of {total} nodes sick: proactive moves resumed")
        (log.error if change == "paused" else log.warning)(reason)
        if self.metrics is not None:
            self.metrics.set_proactive_paused(change == "paused")
        self.events.emit(subjects.cluster_event(kind),
                         ClusterEvent(kind=kind, at=self.wall(), silent=sick, total=total, reason=reason))

    async def _one(self, action: Action) -> None:
        try:
            async with self.slots:
                while (delay := self.bucket.take(self.clock())) > 0:
                    await asyncio.sleep(delay)
                if action.action == "migrate":
                    await self._move(action)
                else:
                    await self._checkpoint(action)
        finally:
            self.busy.discard(action.job)

    def _still(self, action: Action) -> bool:
        """The job still runs where the action was decided (a user or a failover may have moved it)."""
        rec = self.jobs.jobs.get(action.job)
        return rec is not None and rec.state == lc.State.RUNNING and rec.node == action.node \
            and rec.generation == action.generation

    async def _checkpoint(self, action: Action) -> None:
        if not self._still(action):
            return
        why = "; ".join(action.reasons)
        log.warning("job %s: node %s is sick (%s): checkpointing it now", action.job, action.node, why)
        try:
            rec, _ = await self.jobs.checkpoint(action.job, stop=False, force=True, cause="health",
                                                reasons=action.reasons)
        except RevenantError as exc:
            if not self._retry(action, exc):
                log.warning("job %s: proactive checkpoint failed (tried again in %g s): %s", action.job,
                            RETRY_S, exc)
                self.rules.retry_later(action.job, action.action, self.clock())
            return
        if self.metrics is not None:
            self.metrics.count_proactive("checkpoint", action.code)
        log.info("job %s: proactive checkpoint %s committed", action.job,
                 rec.epochs[-1].n if rec.epochs else "-")

    async def _move(self, action: Action) -> None:
        if not self._still(action):
            return
        why = "; ".join(action.reasons)
        rec = self.jobs.get(action.job)
        try:
            target = place(self.placement(), self.jobs.jobs_per_node(), exclude={action.node},
                           restore=True, gpus=rec.gpus, gpu_driver=rec.gpu_driver)
        except NoNodeAvailable as exc:
            log.warning("job %s: node %s is sick (%s) but the job stays: %s", action.job, action.node, why, exc)
            self._event(action, "migration_skipped", f"no healthy node can take it: {exc}")
            self.rules.retry_later(action.job, action.action, self.clock())
            return
        log.warning("job %s: node %s is sick (%s): moving it (%s can take it)", action.job, action.node, why, target)
        evict = f"moved off sick node {action.node}: {why}"
        try:
            await self.jobs.checkpoint(action.job, stop=True, force=True, evict=evict, cause="health",
                                       reasons=action.reasons)
        except RevenantError as exc:
            if self._retry(action, exc):
                return
            log.warning("job %s: move failed; it keeps running on %s: %s", action.job, action.node, exc)
            self._event(action, "migration_failed", f"it keeps running on {action.node}: {exc}")
            self.rules.retry_later(action.job, action.action, self.clock())
            return
        if self.metrics is not None:
            self.metrics.count_proactive("migrate", action.code)
        self.failover.moved(action.job, action.reasons)
        self.failover.recover_job(action.job, action.node, evicted=evict)

    def _retry(self, action: Action, exc: RevenantError) -> bool:
        """A checkpoint of the job was already in progress (its schedule's, an operator's): nothing
        was done, and the action is due again at the next tick."""
        if exc.code != lc.JobBusy.code:
            return False
        log.info("job %s: %s; the proactive %s waits for it", action.job, exc, action.action)
        self.rules.unmark(action.job, action.action)
        return True

    def _event(self, action: Action, kind: str, reason: str) -> None:
        self.events.emit(subjects.job_event(action.job, kind),
                         JobEvent(job=action.job, kind=kind, at=self.wall(), node=action.node,
                                  generation=action.generation, reason=reason, cause="health",
                                  reasons=list(action.reasons)))
