"""The engine's pipeline steps: what a step sees of a dump or a restore, and the hooks it has.

A step plugs in before and after criu without touching the engine (agent/checkpointing/engine.py): the
job's own files are one (agent/files/filestep.py); GPU suspend/resume, pre-dump and
deduplicated storage are steps of the same shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from revenant.agent.pipeline.handshake import Handshake
from revenant.agent.storage.epochs import EpochError, JobFiles, Manifest
from revenant.common.errors import RevenantError
from revenant.messages import JobResource

if TYPE_CHECKING:
    from revenant.messages import CheckpointPolicy


@dataclass
class DumpContext:
    job: str
    generation: int
    pid: int
    files: JobFiles
    # Node-local scratch: criu's log, the action script, step notes.
    workdir: Path
    stop: bool
    manifest: Manifest
    # Where the epoch's files are written while the job is frozen (the epoch's temporary
    # directory on shared storage, or node-local staging), and the job's own working directory.
    epoch_tmp: Path = Path()
    job_workdir: str = ""
    # The epoch's temporary directory on shared storage (epoch_tmp itself, unless it is staging).
    shared_tmp: Path = Path()
    # Extra lines for criu's post-dump action script (run while the job is frozen).
    post_dump_script: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # A step's own state for this dump, by step name.
    state: dict[str, Any] = field(default_factory=dict)
    # Asked when criu fails: a step's own reason for the failure (its action script's, say), or "";
    # and whether that reason is the job's own doing (manifest.JobCaused: not the node's health).
    why_failed: list[Callable[[], str]] = field(default_factory=list)
    job_caused: list[Callable[[], bool]] = field(default_factory=list)
    # The job's checkpoint policy (JobSpec.policy; None: the defaults), and arguments a step adds
    # to criu's dump command line (a pre-dump's --prev-images-dir).
    policy: CheckpointPolicy | None = None
    dump_args: list[str] = field(default_factory=list)
    # Dump the job's TCP connections whole and leave them locked (a vacate whose connections
    # this node holds for a restore here: agent/network/netlock.py); else criu records them to be closed.
    keep_connections: bool = False


@dataclass(frozen=True)
class RestoreAsk:
    """What a restore is asked for, beyond the job: the epoch (0: the newest restorable), why its
    working directory must be left as it is ("": it need not), the node's GPUs it is given (the
    epoch's are restored onto them), and criu arguments of the node's own (its cgroup's:
    agent/processes/cgroups.py)."""

    epoch: int = 0
    leave_workdir: str = ""
    gpus: tuple[str, ...] = ()
    criu_args: tuple[str, ...] = ()
    user: str = ""  # the job's: the node's restore slots are shared fairly between users


@dataclass
class RestoreContext:
    job: str
    generation: int
    files: JobFiles
    epoch_dir: Path
    workdir: Path
    manifest: Manifest
    pid: int = 0
    notes: list[str] = field(default_factory=list)
    # Why the job's working directory must be left as it is (another job uses it), or "".
    leave_workdir: str = ""
    # What each step's check_restore returned for this epoch, by step name (its plan, to carry out).
    checked: dict[str, Any] = field(default_factory=dict)
    # Where criu restores from when not epoch_dir: an epoch stored as a delta, rebuilt (agent/storage/packs.py).
    images: Path | None = None
    # A lazy restore's page server (agent/lazyrestore/lazy.py LazyPages), or None: criu restores every page first.
    lazy: Any = None
    # Restore the epoch's TCP connections intact rather than closed (agent/network/netlock.py: this
    # node has held them since the vacate that took the epoch).
    keep_connections: bool = False
    # More of criu restore's arguments (RestoreAsk.criu_args).
    criu_args: tuple[str, ...] = ()
    # Descriptors criu restore inherits (its --inherit-fd arguments, in criu_args): closed here once it ran.
    pass_fds: list[int] = field(default_factory=list)
    # A step's own state for this restore, by its own key.
    state: dict[str, Any] = field(default_factory=dict)


class Step(Protocol):
    name: str

    async def before_dump(self, ctx: DumpContext) -> None: ...
    async def after_dump(self, ctx: DumpContext) -> None: ...
    async def on_dump_failed(self, ctx: DumpContext) -> None: ...
    # Blocking, in a worker thread: raise EpochError to refuse the epoch (an older one is tried);
    # what it returns for the epoch chosen reaches before_restore as ctx.checked[name].  ``gpus``:
    # the UUIDs of the node's GPUs the restore is given (RestoreJob.gpus; empty: none named).
    def check_restore(self, manifest: Manifest, epoch_dir: Path, gpus: Sequence[str] = ()) -> Any: ...
    async def before_restore(self, ctx: RestoreContext) -> None: ...
    # criu has restored the job, whose processes are still root's (criu's post-restore action,
    # agent/pipeline/handshake.py): raise to have criu kill them instead of letting them run.
    async def before_resume(self, ctx: RestoreContext) -> None: ...
    async def after_restore(self, ctx: RestoreContext) -> None: ...
    # revenant check (blocking, in a worker thread): what of the running job (its init ``pid``)
    # this step carries, closes or cannot carry.
    def inspect(self, pid: int) -> list[JobResource]: ...


class BaseStep:
    name = "step"

    async def before_dump(self, ctx: DumpContext) -> None:
        pass

    async def after_dump(self, ctx: DumpContext) -> None:
        pass

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        pass

    def check_restore(self, manifest: Manifest, epoch_dir: Path, gpus: Sequence[str] = ()) -> Any:
        return None

    async def before_restore(self, ctx: RestoreContext) -> None:
        pass

    async def before_resume(self, ctx: RestoreContext) -> None:
        pass

    async def after_restore(self, ctx: RestoreContext) -> None:
        pass

    def inspect(self, pid: int) -> list[JobResource]:
        return []


async def check_before_resume(steps: list[Step], ctx: RestoreContext, shake: Handshake,
                              verdict: list[BaseException | None]) -> None:
    """criu's post-restore action: every step's before_resume while the restored processes are
    still criu's (root's, not yet given the job's credentials: the job's user cannot signal
    them); a refusal is the restore's error, and criu kills them before they ever run."""
    said = await shake.heard()
    try:
        ctx.pid = int(said.split()[-1])
        for step in steps:  # a step may refuse what criu made
            await step.before_resume(ctx)
    except BaseException as exc:
        verdict.append(exc if isinstance(exc, RevenantError) else
                       EpochError(f"restore of job {ctx.job} refused: its check failed: {exc}"))
        shake.answer("no")
        if isinstance(exc, asyncio.CancelledError):
            raise
        return
    verdict.append(None)
    shake.answer("ok")
