"""``revenant check``: what in a running job a checkpoint or a move carries, closes, or cannot
carry, read from /proc and the kernel without touching the job (it is not frozen)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from revenant.agent import blockers, netstate
from revenant.agent.steps import Step
from revenant.common.errors import RevenantError
from revenant.messages import AgentJobReply, CheckJob, JobResource, subjects

if TYPE_CHECKING:
    from revenant.agent.jobs import Supervisor


def inspect(root: int, steps: list[Step]) -> list[JobResource]:
    """Blocking (a worker thread): every resource of the job (its init ``root``) that a checkpoint
    or a move treats specially, blocking ones first."""
    out = [JobResource(kind="descriptor" if "unix" not in what else "socket", what=what.split(": criu")[0],
                       verdict="blocking", reason="criu cannot carry it: a checkpoint is refused before the job "
                                                  "is frozen")
           for what in blockers.blockers(root)]
    listening, connections = netstate.sockets(root)
    out += [JobResource(kind="socket", what=f"listening {s}", verdict="carried",
                        reason="bound again to it by a restore, on whichever node") for s in listening]
    out += [JobResource(kind="connection", what=c, verdict="closed_on_move",
                        reason="kept by a checkpoint that leaves the job running; a restore brings it back closed")
            for c in connections]
    for step in steps:
        out += step.inspect(root)
    order = {"blocking": 0, "closed_on_move": 1, "carried": 2}
    return sorted(out, key=lambda r: order[r.verdict])


async def check(sup: Supervisor, cmd: CheckJob) -> AgentJobReply:
    """The node command ``check``: the running job's resources (agent/agent.py)."""
    subjects.check_name(cmd.job, "job id")
    rt = sup.jobs.get(cmd.job)
    if rt is None or rt.generation != cmd.generation:
        raise RevenantError(f"job {cmd.job} generation {cmd.generation} does not run on {sup.node}",
                            code="not_running")
    steps = sup.engine.steps if sup.engine is not None else []
    found = await asyncio.to_thread(inspect, rt.pid, steps)
    return AgentJobReply(job=cmd.job, generation=cmd.generation, node=sup.node, resources=found)
