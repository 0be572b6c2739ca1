"""After a reconnect or a self-fence: which local jobs may go on, in the leader's words.

The agent lists what it runs (``frozen`` for the jobs its fence froze); the leader answers
which moved on (killed here) and which frozen ones may thaw (SIGCONT). A frozen job never
thaws without that answer: while no leader answers the agent asks again, backing off, and
:meth:`Supervisor.expire_frozen` kills a job frozen past ``max_frozen_s`` (reported
``evicted``, so that it is restored from its last epoch elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
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


def local_jobs(sup: Supervisor) -> list[LocalJob]:
    """What runs here, and what is being started or restored here (a leader asked for it, and its
    table has it on this node: a reconcile that left it out would have it evicted)."""
    running = [LocalJob(job=job, generation=rt.generation, frozen=rt.frozen_at is not None)
               for job, rt in list(sup.jobs.items())]
    here = {lj.job for lj in running}
    return running + [LocalJob(job=job, generation=launch.generation)
                      for job, launch in list(sup.launching.items()) if job not in here]


async def ask_leader(nc: Client, sup: Supervisor, node: str, incarnation: str, clock: Callable[[], float],
                     stopping: Callable[[], bool], started: bool = False,
                     reconnected: bool = False) -> ReconcileReply | None:
    """The leader's answer, asked again (backing off) while none answers: for as long as a job
    is frozen, else for up to RECONCILE_RETRY_FOR_S.  ``started``: the agent has just started
    (asked even with no jobs: the leader learns that this node runs nothing an earlier agent ran);
    ``reconnected``: its connection to NATS came back (asked even with no jobs: the leader fails
    the commands it sent this node meanwhile, whose replies may be lost)."""
    deadline = clock() + RECONCILE_RETRY_FOR_S
    delay = 0.5
    while True:
        local = local_jobs(sup)
        if not local and not (started or reconnected):
            return None
        try:
            return await bus.request(nc, subjects.coordinator("reconcile"),
                                     ReconcileRequest(node=node, incarnation=incarnation, jobs=local,
                                                      started=started, reconnected=reconnected),
                                     ReconcileReply, RECONCILE_TIMEOUT_S)
        except RevenantError as exc:
            frozen = any(lj.frozen for lj in local)
            if stopping() or (not frozen and clock() + delay >= deadline):
                log.warning("cannot reconcile: %s; the jobs are left as they are", exc)
                return None
            log.info("reconcile: no answer yet (%s); asking again in %.1f s", exc, delay)
        await asyncio.sleep(delay)
        delay = min(FROZEN_RETRY_S if frozen else MAX_RETRY_S, delay * 2)


async def apply(sup: Supervisor, reply: ReconcileReply, may_thaw: bool = True) -> None:
    """Kill what moved on, thaw what the leader let go on (each only at the generation named).
    Not ``may_thaw`` (this node's lease is not back: a reconcile after the connection came back
    may come before the lease does), thaws wait for the reconcile that the lease's return brings:
    a job thawed now would be frozen again by its dead man's switch, and nothing would know."""
    for lj in reply.thaw:
        if not may_thaw:
            log.warning("job %s generation %d stays frozen until this node's lease is back", lj.job, lj.generation)
            continue
        if sup.thaw(lj.job, lj.generation):
            log.warning("job %s generation %d thawed: the leader kept it here", lj.job, lj.generation)
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
