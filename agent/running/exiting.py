"""What the supervisor (agent/running/jobs.py) does when a job's process ends: its exit is
classified (a vacate's stop, a fence's kill, its own end, the OOM killer in its cgroup), reported
as an event, and its cgroup removed."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from typing import TYPE_CHECKING, Callable

from revenant.agent.processes import procs
from revenant.agent.processes.exits import JobEnd
from revenant.agent.running.runtime import JobRuntime, oom_note

if TYPE_CHECKING:  # the supervisor's parts these methods use
    from revenant.agent.checkpointing.policy import PolicyRunner
    from revenant.agent.processes.cgroups import NodeCgroups
    from revenant.agent.processes.exits import ExitClassifier

log = logging.getLogger(__name__)


class JobExits:
    """The supervisor's exit path (a part of :class:`revenant.agent.running.jobs.Supervisor`)."""

    jobs: dict[str, JobRuntime]
    policies: PolicyRunner
    exits: ExitClassifier
    cgroups: NodeCgroups
    _watchers: set[asyncio.Task[None]]
    _event: Callable[..., None]  # (rt, kind, **fields): publish a job event

    def _watch(self, rt: JobRuntime, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        async def watch() -> None:
            code = await procs.wait_pid(pid)
            if popen is not None:
                popen.returncode = code  # reaped here: Popen must not think it still runs
            self._exited(rt, code)

        task = asyncio.create_task(watch(), name=f"watch-{rt.spec.id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _exited(self, rt: JobRuntime, code: int) -> None:
        rt.exit_code = code
        if rt.cgroup is not None:
            rt.oom_kills = rt.cgroup.oom_kills()
            self.cgroups.retire(rt.cgroup)
        rt.exited.set()
        if self.jobs.get(rt.spec.id) is rt:
            del self.jobs[rt.spec.id]
            self.policies.forget(rt.spec.id)
        if not rt.vacating:
            self._report_exit(rt)  # else the vacate reports it when it ends, however it ends

    def _report_exit(self, rt: JobRuntime) -> None:
        verdict = self.exits.classify(JobEnd(code=rt.exit_code, killing=rt.killing, evicted=rt.evicted,
                                             reason=rt.kill_reason, stopped_at_epoch=rt.stopped_at_epoch))
        if verdict.epoch is not None:
            log.info("job %s %s at epoch %d", rt.spec.id, verdict.kind, verdict.epoch)
        else:
            log.info("job %s %s with status %d%s", rt.spec.id, verdict.kind, verdict.exit_code,
                     f" ({verdict.reason})" if verdict.reason else "")
        gpus, driver = rt.stopped_gpus if verdict.epoch is not None else ([], "")
        reason = "; ".join(filter(None, [verdict.reason, oom_note(rt) if verdict.exit_code else ""]))
        self._event(rt, verdict.kind, exit_code=verdict.exit_code, epoch=verdict.epoch, reason=reason,
                    gpus=gpus, gpu_driver=driver)
