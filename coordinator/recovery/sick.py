"""Proactive moves, the shell: carry out what :mod:`revenant.coordinator.nodes.proactive` decides.

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

from revenant.common.errors import RevenantError
from revenant.common.messaging.events import EventPublisher
from revenant.common.serving.metrics import CoordinatorMetrics
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.proactive import RETRY_S, Action, ProactiveRules, Settings
from revenant.coordinator.recovery.failover import Failover, TokenBucket
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.placement import NoNodeAvailable
from revenant.messages import AnomalyEvent, ClusterEvent, JobEvent, MessageError, NodeStatus, decode_as, subjects

log = logging.getLogger(__name__)

TICK_S = 0.5
# Proactive actions in flight at once on one node (its agent dumps two at a time by default).
PER_NODE = 2


class ProactiveMoves:
    def __init__(self, config: CoordinatorConfig, jobs: JobService, failover: Failover, events: EventPublisher,
                 nodes: Callable[[], Iterable], metrics: CoordinatorMetrics | None = None, *,
                 attention: Callable[[], tuple[Iterable, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """``nodes``: the detector's records as the nodes report them (no snapshot), read when a
        move is placed; ``attention``: only those not alive and GREEN, and how many are alive or
        suspect (FailureDetector.attention), read each tick: a tick costs the sick nodes, not all."""
        self.config = config
        self.rules = ProactiveRules(Settings.of(config))
        self.jobs = jobs
        self.failover = failover
        self.events = events
        self.nodes = nodes
        self.attention = attention
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.bucket = TokenBucket(config.restore_rate_per_s, config.max_concurrent_restores, clock())
        self.slots = asyncio.Semaphore(config.max_concurrent_restores)
        self.busy: set[str] = set()
        self._per_node: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                try:
                    self.tick()
                except Exception:  # a bug in one tick must not orphan the actions in flight
                    log.exception("proactive moves: tick failed")
                await asyncio.sleep(TICK_S)
        except asyncio.CancelledError:
            # The term ended: its failover goes too.  A checkpoint cancelled here is the
            # take-over's business (a checkpoint whose reply went to a leader that is gone).
            for task in list(self._tasks):
                task.cancel()
            raise

    def cordon(self, nodes: list[NodeStatus]) -> list[NodeStatus]:
        return self.rules.cordon(nodes)

    @property
    def moves_paused(self) -> bool:
        """Moves wait while the storm guard holds them, or failover itself is paused (a move's
        restore would wait there, its job stopped)."""
        return self.rules.paused or self.failover.storm.paused

    async def on_anomaly(self, msg: Msg) -> None:
        try:
            ev = decode_as(msg.data, AnomalyEvent)
        except MessageError as exc:
            log.warning("bad anomaly event on %s: %s", msg.subject, exc)
            return
        parts = msg.subject.split(".")
        if len(parts) != 5 or parts[3] != ev.node:  # revenant.evt.node.<node>.anomaly: its own node's
            log.warning("dropped an anomaly of node %r published on %s", ev.node, msg.subject)
            return
        reason = f"anomaly: {ev.metric} = {ev.value:g} (mean {ev.mean:g}, std {ev.std:g})"
        if self.rules.anomaly(ev.node, ev.metric, reason):
            log.warning("node %s: %s", ev.node, reason)

    def tick(self) -> list[asyncio.Task[None]]:
        now = self.clock()
        if self.attention is not None:
            unwell, total = self.attention()
            change = self.rules.update(unwell, now, total)
        else:
            change = self.rules.update(self.nodes(), now)
        if change is not None:
            self._announce(change)
        # At most PER_NODE actions in flight per node: one hanging node never holds every slot.
        full = {node for node, n in self._per_node.items() if n >= PER_NODE}
        started = []
        for action in self.rules.actions(self.jobs.jobs.values(), now, self.busy, full_nodes=full,
                                         moves_paused=self.failover.storm.paused):
            self.busy.add(action.job)
            self._per_node[action.node] = self._per_node.get(action.node, 0) + 1
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
        self.events.emit(subjects.cluster_event(kind),
                         ClusterEvent(kind=kind, at=self.wall(), silent=sick, total=total, reason=reason))

    async def _one(self, action: Action) -> None:
        try:
            async with self.slots:
                while (delay := self.bucket.take(self.clock())) > 0:
                    await asyncio.sleep(delay)
                if action.action == "migrate" and (self.moves_paused or not self.rules.held(
                        action.node, "migrate", self.clock())):
                    # Paused, or the node got better, while it waited its turn: decided again later.
                    self.rules.unmark(action.job, action.action)
                elif action.action == "migrate":
                    await self._move(action)
                else:
                    await self._checkpoint(action)
        finally:
            self.busy.discard(action.job)
            left = self._per_node.get(action.node, 1) - 1
            if left > 0:
                self._per_node[action.node] = left
            else:
                self._per_node.pop(action.node, None)

    def _still(self, action: Action) -> bool:
        """The job still runs where the action was decided (a user or a failover may have moved
        it); if it is only busy (a checkpoint of its schedule's), the action is due again."""
        rec = self.jobs.jobs.get(action.job)
        if rec is not None and rec.state == lc.State.CHECKPOINTING and rec.generation == action.generation:
            self.rules.unmark(action.job, action.action)
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
        try:  # the detector's records, cordoned: no snapshot (phi and all) for a pre-check
            target, _ = self.jobs.place(rec.spec, exclude={action.node}, nodes=self.rules.cordon(list(self.nodes())),
                                        restore=True, gpus=rec.gpus, gpu_driver=rec.gpu_driver)
        except NoNodeAvailable as exc:
            log.warning("job %s: node %s is sick (%s) but the job stays: %s", action.job, action.node, why, exc)
            self._event(action, "migration_skipped", f"no healthy node can take it: {exc}")
            self.rules.retry_later(action.job, action.action, self.clock())
            return
        log.warning("job %s: node %s is sick (%s): moving it (%s can take it)", action.job, action.node, why, target)
        evict = f"moved off sick node {action.node}: {why}"
        self.failover.moved(action.job, action.reasons)  # before the reply: its eviction event may come first
        try:
            await self.jobs.checkpoint(action.job, stop=True, force=True, evict=evict, cause="health",
                                       reasons=action.reasons)
        except RevenantError as exc:
            self._move_failed(action, exc)
            return
        if self.metrics is not None:
            self.metrics.count_proactive("migrate", action.code)
        now = self.jobs.jobs.get(action.job)
        if now is not None and now.state == lc.State.RESTORING and (now.node, now.generation) == (
                action.node, action.generation):
            self.failover.recover_job(action.job, action.node, evicted=evict)

    def _move_failed(self, action: Action, exc: RevenantError) -> None:
        rec = self.jobs.jobs.get(action.job)
        if rec is None or rec.state not in (lc.State.RUNNING, lc.State.CHECKPOINTING):
            return  # it ended, or its eviction arrived first and failover has it
        self.failover.moves.pop(action.job, None)
        if self._retry(action, exc):
            return
        self.rules.retry_later(action.job, action.action, self.clock())
        if exc.code == "timeout":  # the node may yet stop it: then its "evicted" report restores it
            log.warning("job %s: no answer to the move from %s: %s", action.job, action.node, exc)
            self._event(action, "migration_failed", f"no answer from {action.node} ({exc}); if it stopped "
                                                    f"the job, failover restores it elsewhere")
            return
        log.warning("job %s: move failed; it keeps running on %s: %s", action.job, action.node, exc)
        self._event(action, "migration_failed", f"it keeps running on {action.node}: {exc}")

    def _retry(self, action: Action, exc: RevenantError) -> bool:
        """A checkpoint of the job was already in progress here (its schedule's, an operator's):
        nothing was done, and the action is due again at the next tick.  (The node's own "busy",
        say a dump a previous leader asked for, waits the retry delay.)"""
        if not isinstance(exc, lc.JobBusy):
            return False
        log.info("job %s: %s; the proactive %s waits for it", action.job, exc, action.action)
        self.rules.unmark(action.job, action.action)
        return True

    def _event(self, action: Action, kind: str, reason: str) -> None:
        rec = self.jobs.jobs.get(action.job)
        self.events.emit(subjects.job_event(action.job, kind, user=rec.spec.user if rec is not None else ""),
                         JobEvent(job=action.job, kind=kind, at=self.wall(), node=action.node,
                                  generation=action.generation, reason=reason, cause="health",
                                  reasons=list(action.reasons)))
