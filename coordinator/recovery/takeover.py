"""A new leader's first duty: finish what the previous leader left, and say which nodes
it found dead.

One detection period after taking office (so that nodes that are alive have
heartbeated), the new leader recovers every job stranded on a node that is gone or
half-way through a failover (:func:`lifecycle.takeover_plan`).

A standby tracks every node but neither speaks nor acts, and a leader killed in
the middle of a failover may never have published the `dead` event of the node
it was failing over.  So a new leader, when it takes over, publishes the `dead`
event of each node it finds dead, unless a leader already did: the stream holds
a `dead` event for that node newer than the node's last sign of life (its last
heartbeat as this coordinator saw it, its last `joined` or `recovered` event).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from revenant.common.errors import RevenantError, described
from revenant.common.messaging.events import EventPublisher
from revenant.coordinator.nodes.detector import FailureDetector
from revenant.coordinator.recovery.failover import Failover
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.messages import MessageError, NodeEvent, decode_as, subjects

log = logging.getLogger(__name__)

# Events that show a node alive after an earlier death.
_ALIVE_KINDS = ("joined", "recovered")


def announced(last_dead_at: float | None, alive_at: float) -> bool:
    """Whether a `dead` event for the node is already out: one newer than its last sign of life.
    ``last_dead_at`` is None when the stream could not be read (then it is published again:
    a second `dead` event is better than none)."""
    return last_dead_at is not None and last_dead_at > alive_at


async def _last_at(js: JetStreamContext, node: str, kind: str) -> float | None:
    """When the stream's last `kind` event for ``node`` happened (0.0: none); None if unknown."""
    try:
        msg = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.node_event(node, kind))
    except nats.js.errors.NotFoundError:
        return 0.0
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        log.warning("cannot read node %s's last %s event: %s", node, kind, described(exc))
        return None
    try:
        return decode_as(msg.data or b"", NodeEvent).at
    except MessageError:
        return 0.0


async def announce_dead(js: JetStreamContext, events: EventPublisher, detector: FailureDetector,
                        nodes: Iterable[str], clock: Callable[[], float], wall: Callable[[], float]) -> list[str]:
    """Publish the `dead` event of each of ``nodes`` that no leader published; returns those."""
    out = []
    for node in sorted(set(nodes)):
        rec = detector.nodes.get(node)
        if rec is not None and rec.state != "dead":
            continue  # alive again, or left cleanly: not this leader's to declare dead
        now, now_wall = clock(), wall()
        silence = now - rec.last_heartbeat_at if rec is not None and rec.last_heartbeat_at else None
        alive_at = now_wall - silence if silence is not None else 0.0
        for kind in _ALIVE_KINDS:
            at = await _last_at(js, node, kind)
            alive_at = max(alive_at, at or 0.0)
        if announced(await _last_at(js, node, "dead"), alive_at):
            continue
        reason = ("declared dead by the new leader, which takes over its jobs" if silence is not None
                  else "not heard from since this coordinator started; the new leader takes over its jobs")
        log.warning("node %s dead (%s)", node, reason)
        events.emit(subjects.node_event(node, "dead"),
                    NodeEvent(node=node, kind="dead", at=now_wall, incarnation=rec.incarnation if rec else "",
                              silence_s=round(silence or 0.0, 3), reason=reason))
        out.append(node)
    return out


# How recent a cancel a new leader sends its kill again for (its grace is at most an hour).
CANCEL_RESEND_S = 7200.0

async def take_over(inherited: dict[str, tuple[str, int, str]], delay_s: float, *, js: JetStreamContext,
                    events: EventPublisher, detector: FailureDetector, jobs: JobService, failover: Failover,
                    clock: Callable[[], float], wall: Callable[[], float]) -> None:
    """Finish what a previous leader left: jobs on nodes that are gone, half-done failovers;
    first, publish the `dead` event of every node found dead that no leader announced.
    ``inherited``: each job's (state, generation, node) when this term loaded the table."""
    await asyncio.sleep(delay_s)
    alive = {name for name, r in detector.nodes.items() if r.state in ("alive", "suspect")}
    plan = lc.takeover_plan(inherited, jobs.jobs, alive, failover.recovering)
    dead_nodes = {dead for _, dead in plan if dead} | {n for n, r in detector.nodes.items() if r.state == "dead"}
    await announce_dead(js, events, detector, dead_nodes, clock, wall)
    for job, dead in plan:
        if dead is None:
            log.warning("job %s: the old leader's checkpoint of it never answered; it runs on", job)
            try:
                await jobs.checkpoint_abandoned(job, inherited[job][1])
            except RevenantError as exc:
                log.error("job %s: cannot mark it running again: %s", job, exc)
            continue
        if dead:
            log.warning("taking over the recovery of job %s (node %s is gone)", job, dead)
        else:
            log.warning("taking over the recovery of job %s (it was %s)", job, inherited[job][0])
        rec = detector.nodes.get(dead) if dead else None
        failover.recover_job(job, dead, rec.incarnation if rec is not None else "")
    # A cancel the old leader recorded may never have reached the job's node: its kill is sent again.
    now = wall()
    await asyncio.gather(*(jobs.agents.abandon(r.node, job, r.generation, r.reason or "cancelled")
                           for job, r in list(jobs.jobs.items())
                           if r.state == lc.State.CANCELLED and r.node and now - r.updated_at < CANCEL_RESEND_S))
