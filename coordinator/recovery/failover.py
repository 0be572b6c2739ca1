"""Failover: restore a dead node's jobs elsewhere, never running a job twice.

The rules are plain classes fed with the current time (coordinator/recovery/guards.py):

* :class:`LeaseState` - a dead node's lease, read from the KV store only once
  the node is declared dead (watching every renewal of every node would cost
  more than a core at 20,000 nodes).  Its jobs wait until ``ttl + margin``
  after the last renewal, timed by the NATS server that stored it; the agent
  fenced itself ``fence_timeout_s`` < ``ttl`` after that renewal was acked.
  The margin covers skew between the coordinator's and the server's clocks.
* :class:`StormGuard` - if more than a fraction of the nodes go silent at once
  (the coordinator's own network, a switch, a mass reboot), failover pauses
  and an alert is published; it resumes once enough of them are back.
* :class:`TokenBucket` - restores started per second.

:class:`Failover` is the thin I/O shell that drives them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

import msgspec


from revenant.common.errors import RevenantError, described
from revenant.common.messaging.events import EventPublisher
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.placement import NoCapacity, node_address
from revenant.coordinator.recovery.guards import LeaseState, StormGuard, TokenBucket  # noqa: F401 (named here too)
from revenant.messages import ClusterEvent, FailoverReply, JobEvent, LeaseValue, NodeStatus, subjects

log = logging.getLogger(__name__)

# Failures of these kinds will not get better on another node.
NOT_RETRIABLE = {"no_epoch", "corrupt_epoch"}


class Failover:
    def __init__(self, config: CoordinatorConfig, js: JetStreamContext, jobs: JobService, events: EventPublisher,
                 nodes: Callable[[], list[NodeStatus]], last_heartbeat: Callable[[str], float | None], *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 on_result: Callable[[bool, str], None] | None = None,
                 node: Callable[[str], Any] | None = None) -> None:
        self.config = config
        self.node = node  # one node's record by name (cheaper than a walk of ``nodes()``), or None
        self.js = js
        self.jobs = jobs
        self.events = events
        self.nodes = nodes
        self.last_heartbeat = last_heartbeat
        self.clock = clock
        self.wall = wall
        self.on_result = on_result
        self.storm = StormGuard(config.failover_pause_fraction)
        self.bucket = TokenBucket(config.restore_rate_per_s, config.max_concurrent_restores, clock())
        self.slots = asyncio.Semaphore(config.max_concurrent_restores)
        self.pending_nodes: dict[str, int] = {}
        self._storm_stale = False
        # Jobs being recovered: one recovery per job, however many triggers.
        self.recovering: set[str] = set()
        # Jobs whose node reported them evicted while their recovery waited for its lease.
        self._evicted: dict[str, str] = {}
        # Jobs moved off a sick node (coordinator/recovery/sick.py): their restore is published "migrated".
        self.moves: dict[str, tuple[str, ...]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ inputs

    async def read_lease(self, node: str) -> LeaseState | None:
        """The lease ``node`` holds now, or None if it has none (expired, or never held)."""
        stream = f"KV_{subjects.LEASES_BUCKET}"
        for attempt in range(5):
            try:
                msg = await self.js.get_last_msg(stream, f"$KV.{subjects.LEASES_BUCKET}.{node}")
            except nats.js.errors.NotFoundError:
                return None
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("cannot read node %s's lease (%s); retrying", node, described(exc))
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
                return None
            try:
                incarnation = msgspec.msgpack.decode(msg.data or b"", type=LeaseValue).incarnation
            except (msgspec.DecodeError, TypeError):
                incarnation = ""
            renewed_at = msg.time.timestamp() if msg.time is not None else self.wall()
            return LeaseState(seq=msg.seq or 0, incarnation=incarnation, renewed_at=renewed_at)
        # The store does not answer: assume a renewal just now, the safe side.
        return LeaseState(seq=-1, incarnation="", renewed_at=self.wall())

    async def wait_for_lease_expiry(self, job: str, node: str, incarnation: str) -> bool:
        """Wait until ``node``'s lease (of that incarnation) has expired.  False if it was
        renewed meanwhile: the agent is alive and still holds its jobs."""
        ttl, margin = self.config.lease_ttl_s, self.config.lease_margin_s
        lease = await self.read_lease(node)
        logged = False
        while lease is not None and (not incarnation or not lease.incarnation or lease.incarnation == incarnation):
            wait = lease.expires_at(ttl, margin) - self.wall()
            if wait <= 0:
                return True
            if not logged:
                log.info("job %s: waiting %.2f s for node %s's lease to expire", job, wait, node)
                logged = True
            await asyncio.sleep(wait)  # timers may fire a little early: the loop reads again
            again = await self.read_lease(node)
            if again is not None and again.seq != lease.seq and again.seq != -1 and lease.seq != -1:
                return False
            lease = again
        return True

    def check_storm(self, nodes: list | None = None) -> None:
        """``nodes``: anything with ``name`` and ``state`` (detector records are cheapest)."""
        nodes = self.nodes() if nodes is None else nodes
        self._announce(self.storm.update(nodes, self.pending_nodes))

    def check_storm_counted(self, counts: dict[str, int], state: Callable[[str], str | None]) -> None:
        """:meth:`check_storm` from the detector's counts of each state and the state of each node
        whose failover is pending (few): no walk of 100,000 nodes each tick that saw a verdict."""
        dead_pending = sum(1 for name in self.pending_nodes if state(name) == "dead")
        self._announce(self.storm.count(counts["suspect"] + dead_pending,
                                        counts["alive"] + counts["suspect"] + counts["dead"]))

    async def operator(self, action: str, nodes: list) -> FailoverReply:
        """``revenant failover pause|resume|status``.  A hold is recorded in the store first, so
        that it outlives this leader (a new one starts held: :meth:`restore_hold`)."""
        self._announce(self.storm.update(nodes, self.pending_nodes))
        if action in ("pause", "resume"):
            await self.jobs.save_hold(action == "pause")
        if action == "pause":
            self._announce(self.storm.hold(), "an operator paused failover")
        elif action == "resume":
            why = ("an operator let this storm through" if self.storm.storm else "an operator resumed failover")
            self._announce(self.storm.release(), why)
        silent, total = self.storm.silent, self.storm.total
        reason = ("held by an operator" if self.storm.held
                  else f"{silent} of {total} nodes silent at once" if self.storm.paused
                  else "let through by an operator" if self.storm.acknowledged else "")
        return FailoverReply(paused=self.storm.paused, held=self.storm.held,
                             storm_acknowledged=self.storm.acknowledged, silent=silent, total=total,
                             recovering=len(self.recovering), reason=reason)

    async def restore_hold(self) -> None:
        """A new leader keeps an operator's hold."""
        try:
            held = await self.jobs.store.load_hold()
        except RevenantError as exc:
            log.error("%s; failover starts unheld", exc)
            return
        if held:
            log.warning("failover is held by an operator (revenant failover resume lifts it)")
            self.storm.hold()

    def _announce(self, change: str | None, by: str = "") -> None:
        if change is None:
            return
        silent, total = self.storm.silent, self.storm.total
        kind = "failover_paused" if change == "paused" else "failover_resumed"
        if by:
            reason = f"{by}: failover {change} ({silent} of {total} nodes silent)"
        elif change == "paused":
            reason = (f"{silent} of {total} nodes silent at once (more than "
                      f"{self.config.failover_pause_fraction:.0%}): failover paused")
        else:
            reason = f"{silent} of {total} nodes silent: failover resumed"
        (log.error if change == "paused" else log.warning)(reason)
        self.events.emit(subjects.cluster_event(kind),
                         ClusterEvent(kind=kind, at=self.wall(), silent=silent, total=total, reason=reason))

    def node_dead(self, node: str, incarnation: str = "") -> None:
        """Start recovering every job that ran on ``node`` (under agent ``incarnation``)."""
        for job in self.jobs.jobs_on(node):
            self.recover_job(job, node, incarnation)

    def recover_job(self, job: str, node: str, incarnation: str = "", evicted: str = "") -> None:
        """Recover ``job``, lost with ``node``.  ``evicted``: the node itself stopped the job (a
        drain or a fence) and said so, so there is no lease to wait for."""
        if job in self.recovering:
            if evicted:
                self._evicted[job] = evicted  # the recovery under way need not wait for a lease
            return
        self.recovering.add(job)
        if node not in self.pending_nodes:
            self._storm_stale = True  # one more silent node: judged before any recovery goes ahead
        self.pending_nodes[node] = self.pending_nodes.get(node, 0) + 1
        task = asyncio.create_task(self._recover(job, node, incarnation, evicted), name=f"failover-{job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def moved(self, job: str, reasons: tuple[str, ...]) -> None:
        """``job`` was stopped on its sick node for ``reasons``: its recovery is a proactive move."""
        self.moves[job] = reasons

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------ one job

    def _alive(self, node: str, incarnation: str) -> bool:
        """``node`` is alive with the agent that ran the job (``incarnation``; unknown: no)."""
        found = [self.node(node)] if self.node is not None else [n for n in self.nodes() if n.name == node]
        return bool(incarnation) and any(n is not None and n.state == "alive" and n.incarnation == incarnation
                                         for n in found)

    def _since_last_heartbeat(self, node: str) -> float | None:
        at = self.last_heartbeat(node)
        return None if at is None else round(self.clock() - at, 3)

    def _event(self, job: str, kind: str, dead: str, **kw) -> None:
        kw.setdefault("address", node_address(self.nodes(), kw.get("node", "")))  # where clients find it
        rec = self.jobs.jobs.get(job)
        self.events.emit(subjects.job_event(job, kind, user=rec.spec.user if rec is not None else ""),
                         JobEvent(job=job, kind=kind, at=self.wall(), from_node=dead,
                                  since_last_heartbeat_s=self._since_last_heartbeat(dead), **kw))

    async def _recover(self, job: str, dead: str, incarnation: str, evicted: str = "") -> None:
        ok = None
        evicted_during: set[str] = set()
        try:
            ok = await self._recover_inner(job, dead, incarnation, evicted)
        except RevenantError as exc:  # this coordinator stopped leading, or the store stopped answering
            log.error("job %s: recovery stopped: %s", job, exc)
        finally:
            self.recovering.discard(job)
            self.moves.pop(job, None)
            if self._evicted.pop(job, None) is not None:
                evicted_during.add(job)
            left = self.pending_nodes.get(dead, 1) - 1
            if left <= 0:
                self.pending_nodes.pop(dead, None)
            else:
                self.pending_nodes[dead] = left
            if self.storm.acknowledged:
                self.check_storm()  # a storm let through ends when its failovers do: re-arm the guard
        if self.on_result is not None and ok is not None:
            self.on_result(ok, "evicted" if evicted or job in evicted_during else "dead" if dead else "takeover")

    async def _recover_inner(self, job: str, dead: str, incarnation: str, evicted: str = "") -> bool | None:
        why = (f"node {dead} stopped it: {evicted}" if evicted else f"node {dead} is dead" if dead
               else "taken over from the previous leader")
        self._event(job, "restoring", dead, reason=why)
        # Taken before the lease wait: a frozen copy that its node is let thaw from now on voids
        # this failover (the leader records the thaw first), whatever the lease reads say.
        token = self.jobs.fence_token(job)
        # Never two copies: the dead node's agent fences itself before its lease expires.
        # (An eviction is the node's own word that the job has exited: nothing to wait for.)
        if dead and not evicted and not await self.wait_for_lease_expiry(job, dead, incarnation):
            if job not in self._evicted:
                log.warning("job %s: node %s renewed its lease meanwhile; it keeps the job", job, dead)
                return None
            # It came back, but had stopped the job meanwhile (a fence): the job goes on elsewhere.
            evicted = self._evicted[job]
        if self._storm_stale:
            # Nodes whose failover just began (a new leader taking over several at once) count
            # as silent now, not at the next tick: the guard sees them before any restore starts.
            self._storm_stale = False
            self.check_storm()
        while self.storm.paused:
            while self.storm.paused:
                await asyncio.sleep(0.2)
            # A node that reported the job stopped meanwhile (evicted) has nothing to keep.
            evicted = evicted or self._evicted.get(job, "")
            if not dead or evicted:
                break
            if not self.storm.acknowledged:
                # The nodes of one split come back within moments of each other, and the pause
                # ends with the first of them: one detection period for the others.
                await asyncio.sleep(self.config.node_timeout_s)
            if self._alive(dead, incarnation):
                # The storm ended because its nodes came back (a partition healed), with the agents
                # that ran their jobs (one restarted meanwhile lost them): the node's agent
                # reconciles once its lease is back, and the leader lets its copy thaw.
                log.warning("job %s: node %s came back while failover was paused; it keeps the job", job, dead)
                return None
            # Still paused (the guard judged again meanwhile): wait again, then look again.
        deadline = self.clock() + self.config.requeue_timeout_s
        last_error = ""
        async with self.slots:
            while True:
                delay = self.bucket.take(self.clock())
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                try:
                    outcome = await self.jobs.recover(job, dead, evicted, token)
                except NoCapacity as exc:  # it waits for room, not against the deadline, and lets others by
                    await self.jobs.step(job, lc.Waiting(f"{why}; waiting for room: {exc}"))
                    await self._wait_for_room()
                    deadline = self.clock() + self.config.requeue_timeout_s
                    continue
                except RevenantError as exc:
                    last_error = str(exc)
                    log.warning("job %s: recovery attempt failed: %s", job, exc)
                    if exc.code in NOT_RETRIABLE or self.clock() >= deadline:
                        await self.jobs.fail_recovery(job, f"{why} and the job could not be "
                                                           f"restored: {last_error}")
                        self._event(job, "failed", dead, reason=last_error)
                        return False
                    await asyncio.sleep(1.0)
                    continue
                if outcome is None:
                    return None  # someone else (a user, an earlier failover) already dealt with it
                kind, rec, epoch, notes = outcome
                if kind == "failed":
                    self._event(job, "failed", dead, reason=rec.reason)
                    return False
                moved = self.moves.get(job)
                if moved is not None and kind == "restored":
                    kind, extra = "migrated", {"cause": "health", "reasons": list(moved)}
                else:
                    extra = {}
                restored = next((e for e in rec.epochs if e.n == epoch), None) if kind != "requeued" else None
                if restored is not None:  # its clients find it again; its connections came back closed
                    extra.update(listening=list(restored.listening), closed=list(restored.connections))
                self._event(job, kind, dead, node=rec.node, generation=rec.generation, pid=rec.pid, epoch=epoch,
                            reason="; ".join(notes), **extra)
                log.warning("job %s %s on %s (generation %d) %s", job, kind, rec.node or "-", rec.generation,
                            self._since_words(dead))
                return True

    async def _wait_for_room(self) -> None:
        """A second without this restore's slot: a job that fits nowhere holds up no other."""
        self.slots.release()
        try:
            await asyncio.sleep(1.0)
        finally:
            await asyncio.shield(self.slots.acquire())  # cancelled or not, the slot comes back: it is released once

    def _since_words(self, dead: str) -> str:
        """When, for the log: never an empty node name (a take-over may not know the node)."""
        since = self._since_last_heartbeat(dead) if dead else None
        if since is not None:
            return f"{since:.2f} s after node {dead}'s last heartbeat"
        if dead:
            return f"(node {dead}: no heartbeat seen by this coordinator)"
        return "(taken over from the previous leader)"
