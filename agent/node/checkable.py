"""``revenant check``: what in a running job a checkpoint or a move carries, closes, or cannot
carry, read from /proc and the kernel without touching the job (it is not frozen)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from revenant.agent.network import netstate
from revenant.agent.pipeline import blockers
from revenant.agent.pipeline.steps import Step
from revenant.common.errors import RevenantError
from revenant.messages import AgentJobReply, CheckJob, JobResource, subjects

if TYPE_CHECKING:
    from revenant.agent.running.jobs import Supervisor

# Checks read a running job's files' metadata, which a file a user serves (FUSE) could stall for
# ever: they get threads of their own, one check per job at a time, and an answer within a minute.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="revenant-check")
_RUNNING: set[str] = set()
CHECK_TIMEOUT_S = 60.0


def _guarded(what: str, read: Callable[[], list[JobResource]]) -> list[JobResource]:
    try:
        return read()
    except OSError as exc:
        return [JobResource(kind="descriptor", what=what, verdict="blocking",
                            reason=f"could not be inspected: {exc.strerror or exc}")]


def inspect(root: int, steps: list[Step]) -> list[JobResource]:
    """Blocking (a worker thread): every resource of the job (its init ``root``) that a checkpoint
    or a move treats specially, blocking ones first."""
    out = _guarded("its descriptors and unix sockets", lambda: [
        JobResource(kind="descriptor" if "unix" not in what else "socket", what=what.split(": criu")[0],
                    verdict="blocking", reason="criu cannot carry it: a checkpoint is refused before the job is frozen")
        for what in blockers.blockers(root)])
    out += _guarded("its internet sockets", lambda: _sockets(root))
    for step in steps:
        out += _guarded(f"what its {step.name} step checks", lambda: step.inspect(root))
    order = {"blocking": 0, "closed_on_move": 1, "carried": 2}
    return sorted(out, key=lambda r: order[r.verdict])


def _sockets(root: int) -> list[JobResource]:
    listening, connections = netstate.sockets(root)
    return [JobResource(kind="socket", what=f"listening {s}", verdict="carried",
                        reason="bound again to it by a restore, on whichever node") for s in listening] + \
        [JobResource(kind="connection", what=c, verdict="closed_on_move",
                     reason="untouched by a checkpoint that leaves the job running; a restore brings it back closed "
                            "(intact only on a restart on the node that vacated the job: --connections keep)")
         for c in connections]


async def check(sup: Supervisor, cmd: CheckJob) -> AgentJobReply:
    """The node command ``check``: the running job's resources (agent/node/agent.py)."""
    subjects.check_name(cmd.job, "job id")
    rt = sup.jobs.get(cmd.job)
    if rt is None or rt.generation != cmd.generation:
        raise RevenantError(f"job {cmd.job} generation {cmd.generation} does not run on {sup.node}",
                            code="not_running")
    if cmd.job in _RUNNING:
        raise RevenantError(f"a check of job {cmd.job} is still running on {sup.node}", code="busy", retriable=True)
    steps = sup.engine.steps if sup.engine is not None else []
    _RUNNING.add(cmd.job)
    try:
        found = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_POOL, inspect, rt.pid, steps),
                                       CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RevenantError(f"the check of job {cmd.job} got no answer within {CHECK_TIMEOUT_S:g} s: a file it "
                            "holds does not answer (a user's FUSE file?)", code="timeout") from None
    finally:
        _RUNNING.discard(cmd.job)
    return AgentJobReply(job=cmd.job, generation=cmd.generation, node=sup.node, resources=found)
