"""Signals to a running job on an operator's word: ``revenant signal`` (to the job's own program,
or every process of it) and the first, gentle part of ``revenant cancel`` (a signal to every
process, then SIGKILL after a grace period, which the supervisor sends).

The namespace's init (revenant-init) is never signalled: it is a shell whose default answer to
most signals is to die, which would take the whole namespace with it at once, grace or not.  It
ends by itself when the program does.  Nor are its passing helpers (its ``sleep`` between two
looks at the dead man's switch): the job's processes are the program and what it started."""

from __future__ import annotations

import asyncio
import os

from revenant.agent.processes.procs import job_processes, program_pid
from revenant.agent.running.runtime import JobRuntime
from revenant.common.errors import JobNotRunning, RevenantError


def _send(pids: list[int], signum: int) -> list[int]:
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
        sent.append(pid)
    return sent


def signal_job(rt: JobRuntime, signum: int, every: bool, node: str) -> list[int]:
    """Deliver ``signum`` to ``rt``'s program, or (``every``) to every process below its init;
    the pids it reached.  A job whose program has ended (its init about to) is not running.  A
    job being checkpointed is refused (``busy``): the dump would save the signal pending in the
    epoch, and a restart from it would deliver it again."""
    if rt.lock.locked():
        raise RevenantError(f"job {rt.spec.id} is being checkpointed on {node}; signal it once that ends",
                            code="busy", retriable=True)
    pids = job_processes(rt.pid) if every else [p for p in [program_pid(rt.pid)] if p]
    sent = _send(pids, signum)
    if not sent:
        raise JobNotRunning(f"job {rt.spec.id} has no program running on {node} to signal")
    return sent


async def ask_to_end(rt: JobRuntime, signum: int, grace_s: float, reason: str) -> bool:
    """Send ``signum`` to every process of ``rt`` below its init and give it ``grace_s`` to end;
    whether it did (either way its end is reported killed, for ``reason``).  No grace for a job
    frozen by its node's fence (it would have to be let go on first, without the leader's word),
    nor for one being checkpointed (the dump would save the signal in the epoch, for a restart to
    deliver again; killed at once, the dump fails whole instead): the caller kills it as it is."""
    rt.killing, rt.kill_reason = True, rt.kill_reason or reason
    if rt.frozen_at is not None or rt.lock.locked() or not grace_s:
        return False
    _send(job_processes(rt.pid), signum)
    try:
        await asyncio.wait_for(rt.exited.wait(), grace_s)
    except asyncio.TimeoutError:
        return False
    return True


async def program_started(rt: JobRuntime, within_s: float = 2.0) -> None:
    """Wait (up to ``within_s``) for the init to have forked the job's program, so that the start's
    reply names its pid (the scratch's mounts come first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not program_pid(rt.pid) and not rt.exited.is_set() and loop.time() < deadline:
        await asyncio.sleep(0.005)
