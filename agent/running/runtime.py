"""What the supervisor (agent/running/jobs.py) knows of each job on this node: one running
(:class:`JobRuntime`) or coming up (:class:`Launch`).  Its own module, so that the parts that act
on running jobs (agent/running/freezing.py) can name them without importing the supervisor."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.common.settings.resources import size_text
from revenant.messages import JobGpu, JobSpec


@dataclass
class JobRuntime:
    spec: JobSpec
    generation: int
    pid: int  # host pid of the namespace's init: the root criu dumps
    files: JobFiles
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A vacate is under way: the job's exit is reported when it ends (see _report_exit).
    vacating: bool = False
    # The vacate (or drain) committed this epoch, holding these GPUs under this driver, then stopped the job.
    stopped_at_epoch: int | None = None
    stopped_gpus: tuple[list[JobGpu], str] = ([], "")
    killing: bool = False
    kill_reason: str = ""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    # Stopped by its node (a drain, a fence), not by a user or itself: to be restored elsewhere.
    evicted: bool = False
    # When its node's self-fence froze it (SIGSTOP; clock time), or None: running.
    frozen_at: float | None = None
    # Its cgroup (agent/processes/cgroups.py JobCgroup; None: it has none), and the processes the
    # OOM killer killed in it, counted when the job ended.
    cgroup: Any = None
    oom_kills: int = 0


@dataclass
class Launch:
    """A start or restore in progress: the job is not running yet, but will be."""

    generation: int
    superseded: str = ""  # why its result must not live (a newer generation, or a kill)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The new job's dead man's switch, reset with the running jobs' while it comes up.
    stamp: Path | None = None


def oom_note(rt: JobRuntime) -> str:
    """Why an ended job's processes died, if the OOM killer did it in its cgroup ("" if not)."""
    if not rt.oom_kills:
        return ""
    res, limit = rt.spec.resources, ""
    if res.memory_bytes:
        limit = f" (its --mem is {size_text(res.memory_bytes)})"
    elif res.memory_limit_bytes:
        limit = f" (its memory limit is {size_text(res.memory_limit_bytes)}, the cluster's for a job without --mem)"
    return f"the kernel's OOM killer killed {rt.oom_kills} of its processes in its cgroup{limit}"


class StaleTerm(RevenantError):
    code = "stale_term"


class LeaderTerm:
    """The newest leader term whose word this node has heard (subjects.TERM_HEADER): a command
    or reconcile answer from an older term comes from a coordinator deposed since, late, and is
    refused.  0 (a coordinator from before terms) is taken as it is."""

    def __init__(self) -> None:
        self.newest = 0
        self._lock = threading.Lock()  # the liveness thread hears a new leader's announcement

    def take(self, term: int, what: str) -> None:
        with self._lock:
            if term and term < self.newest:
                raise StaleTerm(f"{what} from leader term {term} refused: this node has heard from term "
                                f"{self.newest} since (a deposed coordinator's, late)")
            self.newest = max(self.newest, term)

    def heard(self, term: int) -> None:
        """A new leader announced its term (heartbeat_request.v1): older terms' commands are refused from now."""
        with self._lock:
            self.newest = max(self.newest, term)
