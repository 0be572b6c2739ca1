"""Fencing by freezing, on the supervisor's jobs (agent/running/jobs.py).

Three things stop or resume a job's processes: the self-fence (from the liveness
thread: SIGSTOP every job), the leader's word after it (SIGCONT one), and a vacate
whose dump did not commit (criu left the job stopped: SIGCONT it).  One lock orders
them, so resuming after a failed vacate never thaws a job that a fence froze meanwhile.
Each fence is counted (``fences``): the leader's word to thaw answers the fence that was in
force when the agent asked, so a thaw asked for before a later fence is not applied (the
answer may have been held up by the very cut that brought that fence, and a failover that
began after the leader's answer may have restored the job elsewhere meanwhile).

A job frozen while criu dumps it, by the fence or by its dead man's switch, is stored
stopped in the image, and criu restores it stopped, wherever and whenever: nothing
would ever resume it.  :meth:`Freezer.spoiled` tells the engine so, and the engine
discards that epoch instead of committing it.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

from revenant.agent.processes.exits import ExitClassifier
from revenant.agent.processes.procs import freeze_tree, signal_tree
from revenant.agent.running.launcher import reset_stamp
from revenant.agent.running.runtime import JobRuntime

log = logging.getLogger(__name__)


class Freezer:
    def __init__(self, jobs: dict[str, JobRuntime], exits: ExitClassifier, clock: Callable[[], float]) -> None:
        self.jobs = jobs
        self.exits = exits
        self.clock = clock
        self._lock = threading.Lock()
        self.fences = 0  # freeze_all calls so far: a thaw asked for before the latest is void

    def freeze_all(self, reason: str) -> list[str]:
        """SIGSTOP every job's processes but its init's (safe from another thread); the ids."""
        frozen = []
        with self._lock:
            self.fences += 1
            for rt in list(self.jobs.values()):
                if rt.frozen_at is None:
                    rt.frozen_at = self.clock()
                freeze_tree(rt.pid)
                frozen.append(rt.spec.id)
        if frozen:
            log.error("%s: froze job(s) %s", reason, ", ".join(frozen))
        return frozen

    def thaw(self, job: str, generation: int, fences: int | None = None) -> bool:
        """SIGCONT a frozen job (the leader kept it here); False if it is not that one, frozen, or if
        its node fenced again since the leader was asked (``fences``: :attr:`fences` then)."""
        rt = self.jobs.get(job)
        if rt is None or rt.generation != generation or rt.frozen_at is None:
            return False
        reset_stamp(rt.files.stamp)  # not under the lock: storage may be slow, and the fence must not wait
        with self._lock:
            if rt.frozen_at is None or self.jobs.get(job) is not rt or fences not in (None, self.fences):
                return False
            signal_tree(rt.pid, signal.SIGCONT)
            rt.frozen_at = None
            return True

    def resume(self, rt: JobRuntime) -> None:
        """SIGCONT a job a vacate left stopped, unless its node froze it meanwhile: the self-fence,
        or its dead man's switch, which may be firing now (unreset for its whole timeout).  Then
        only the leader's word thaws it (the reconcile after the fence, or after the gap ends)."""
        with self._lock:
            if rt.frozen_at is None and not self.exits.may_have_fired_since(self.clock()):
                signal_tree(rt.pid, signal.SIGCONT)
                return
            if rt.frozen_at is None:
                rt.frozen_at = self.clock()
        log.warning("job %s stays frozen after its failed vacate: its node's lease lapsed meanwhile", rt.spec.id)

    def spoiled(self, rt: JobRuntime, since: float) -> str:
        """Why an image of ``rt`` dumped since ``since`` (this clock's time) may hold it frozen,
        or "": its node self-fenced, or its dead man's switch may have fired meanwhile."""
        if rt.frozen_at is not None:
            return f"job {rt.spec.id} was frozen during the dump (its node's lease lapsed)"
        if self.exits.may_have_fired_since(since):
            return (f"job {rt.spec.id} may have been frozen during the dump (its node's lease went "
                    f"unrenewed long enough for its dead man's switch to fire)")
        return ""
