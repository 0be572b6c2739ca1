"""After a reconnect or a self-fence: which local jobs may go on, in the leader's words.

The agent lists what it runs; the leader answers which moved on (killed here) and which
frozen ones may thaw (SIGCONT).  A frozen job never thaws without that answer: while no
leader answers the agent asks again, backing off, and :meth:`Supervisor.expire_frozen` kills a
job frozen past ``max_frozen_s`` (reported ``evicted``, so that it is restored from its last
epoch elsewhere).

A frozen job is listed as ``frozen`` (asking to thaw) only while this node holds its lease:
the leader's thaw voids every failover of the job begun before it, and only a lease held from
then on keeps a later one from starting.  The thaw is applied only if the lease is still held
and the node has not fenced since it asked: an answer held up by the cut that brought a new
fence may come after a failover that began meanwhile restored the job elsewhere.  A frozen job
whose answer could not thaw it for either reason is asked about again once the lease is held.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from nats.aio.client import Client

from revenant.agent.running.jobs import Supervisor
from revenant.common.errors import RevenantError
from revenant.common.messaging import bus
from revenant.messages import LocalJob, ReconcileReply, ReconcileRequest, subjects

log = logging.getLogger(__name__)

# A leader answers in milliseconds; a request lost while NATS re-forms its routes (a partition
# healing) should cost little, since a frozen job waits for the answer.
RECONCILE_TIMEOUT_S = 2.0
# Without frozen jobs, how long the agent keeps asking: NATS often heals as leaders change.
RECONCILE_RETRY_FOR_S = 60.0
# Between attempts: backing off to this while a job is frozen (it thaws as soon as a leader
# answers: one is elected within seconds), to MAX_RETRY_S otherwise.
FROZEN_RETRY_S = 1.0
MAX_RETRY_S = 5.0
# A frozen job whose answer could not thaw it is asked about again once the lease is held, if
# within this long (else the fence's own reconcile, or max_frozen_s, decides).
ASK_AGAIN_WITHIN_S = 30.0


@dataclass(frozen=True)
class Answer:
    """The leader's reply; how many times the node had fenced when it asked, and whether it
    held its lease then (whether it asked to thaw its frozen jobs at all)."""

    reply: ReconcileReply
    fences: int
    held: bool


def local_jobs(sup: Supervisor, ask_thaw: bool = True) -> list[LocalJob]:
    """What runs here, and what is being started or restored here (a leader asked for it, and its
    table has it on this node: a reconcile that left it out would have it evicted).  Frozen jobs
    are marked so (asking to thaw) only with ``ask_thaw``: while this node holds its lease."""
    running = [LocalJob(job=job, generation=rt.generation, frozen=ask_thaw and rt.frozen_at is not None)
               for job, rt in list(sup.jobs.items())]
    here = {lj.job for lj in running}
    return running + [LocalJob(job=job, generation=launch.generation)
                      for job, launch in list(sup.launching.items()) if job not in here]


async def ask_leader(nc: Client, sup: Supervisor, node: str, incarnation: str, clock: Callable[[], float],
                     stopping: Callable[[], bool], holds_lease: Callable[[], bool], started: bool = False,
                     reconnected: bool = False) -> Answer | None:
    """The leader's answer, asked again (backing off) while none answers: for as long as a job
    is frozen, else for up to RECONCILE_RETRY_FOR_S.  ``holds_lease``: whether this node holds
    its lease now (its frozen jobs ask to thaw only then).  ``started``: the agent has just started
    (asked even with no jobs: the leader learns that this node runs nothing an earlier agent ran);
    ``reconnected``: its connection to NATS came back (asked even with no jobs: the leader fails
    the commands it sent this node meanwhile, whose replies may be lost)."""
    deadline = clock() + RECONCILE_RETRY_FOR_S
    delay = 0.5
    while True:
        fences = sup.fences  # before the lease and the list: a fence after them voids the answer's thaws
        held = holds_lease()
        local = local_jobs(sup, ask_thaw=held)
        if not local and not (started or reconnected):
            return None
        try:
            reply = await bus.request(nc, subjects.coordinator("reconcile"),
                                      ReconcileRequest(node=node, incarnation=incarnation, jobs=local,
                                                       started=started, reconnected=reconnected),
                                      ReconcileReply, RECONCILE_TIMEOUT_S)
            return Answer(reply, fences, held)
        except RevenantError as exc:
            frozen = any(rt.frozen_at is not None for rt in list(sup.jobs.values()))
            if stopping() or (not frozen and clock() + delay >= deadline):
                log.warning("cannot reconcile: %s; the jobs are left as they are", exc)
                return None
            log.info("reconcile: no answer yet (%s); asking again in %.1f s", exc, delay)
        await asyncio.sleep(delay)
        delay = min(FROZEN_RETRY_S if frozen else MAX_RETRY_S, delay * 2)


def thaw_holds(answer: Answer, held_now: bool, fences_now: int) -> bool:
    """The rule: whether an answer's thaws may be applied now (tests/test_freeze_protocol.py
    checks it against every interleaving with a failover)."""
    return answer.held and held_now and fences_now == answer.fences


async def apply(sup: Supervisor, answer: Answer, may_thaw: bool = True) -> bool:
    """Kill what moved on, thaw what the leader let go on (each only at the generation named);
    True if a frozen job is left that this answer could not thaw, to be asked about again once
    the lease is held.  An answer can thaw only if the node held its lease when it asked, holds
    it now (``may_thaw``: a job thawed without it would be frozen again by its dead man's switch,
    and nothing would know) and has not fenced since it asked (the freezer checks that last one
    under its lock, against a fence landing now)."""
    reply = answer.reply
    try:
        sup.leader_term.take(reply.term, "a reconcile answer")
    except RevenantError as exc:
        log.warning("%s", exc)
        return any(rt.frozen_at is not None for rt in list(sup.jobs.values()))  # asked again
    valid = thaw_holds(answer, may_thaw, sup.fences)
    for lj in reply.thaw:
        if valid and sup.thaw(lj.job, lj.generation, answer.fences):
            log.warning("job %s generation %d thawed: the leader kept it here", lj.job, lj.generation)
        elif sup.fences != answer.fences:
            log.warning("job %s generation %d stays frozen: this node fenced again after asking to thaw it",
                        lj.job, lj.generation)
        elif not may_thaw:
            log.warning("job %s generation %d stays frozen until this node's lease is back", lj.job, lj.generation)
    for stale in reply.stale:
        rt = sup.jobs.get(stale.job)
        if rt is None or rt.generation != stale.generation:
            continue  # ended or replaced meanwhile: the verdict was about a copy no longer here
        reason = stale.reason or f"generation {stale.generation} is stale"
        log.warning("job %s generation %d is stale (%s): killing it", stale.job, stale.generation, reason)
        try:
            await sup.kill(stale.job, stale.generation, reason=reason)
        except RevenantError as exc:
            log.warning("reconcile: cannot kill job %s: %s", stale.job, exc)
    valid = thaw_holds(answer, may_thaw, sup.fences)
    return not valid and any(rt.frozen_at is not None for rt in list(sup.jobs.values()))


async def when_held(holds_lease: Callable[[], bool], stopping: Callable[[], bool], clock: Callable[[], float],
                    within_s: float = ASK_AGAIN_WITHIN_S, poll_s: float = 0.1) -> bool:
    """Wait until the lease is held (True), or give up after ``within_s`` or when stopping."""
    deadline = clock() + within_s
    while not stopping() and clock() < deadline:
        if holds_lease():
            return True
        await asyncio.sleep(poll_s)
    return False
