"""The job lifecycle's vocabulary: the inputs it takes, the commands to agents and the events
it gives back, and the :class:`Decision` that carries them (see :mod:`.lifecycle`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from revenant.common.errors import BadState, JobBusy, NoEpoch  # noqa: F401 (the lifecycle's refusals, as lifecycle.X)
from revenant.messages import EpochEvent, EpochInfo, JobEvent, JobRecord, JobSpec

__all__ = [
    "AgentReport",
    "BadState",
    "JobBusy",
    "NoEpoch",
    "CancelAsked",
    "EpochConverted",
    "Checkpoint",
    "CheckpointAsked",
    "CheckpointFailed",
    "Checkpointed",
    "Command",
    "Decision",
    "Emit",
    "Input",
    "Kill",
    "LaunchFailed",
    "Launched",
    "Placed",
    "Purged",
    "Recover",
    "RecoveryAttemptFailed",
    "RecoveryFailed",
    "RestartAsked",
    "RestartFailed",
    "Restore",
    "Restored",
    "Start",
    "Submit",
    "ThawAsked",
    "Waiting",
    "TRANSITIONS",
]


# ---------------------------------------------------------------------- commands to agents


@dataclass(frozen=True)
class Start:
    node: str
    spec: JobSpec
    generation: int
    fresh: bool = False
    # The UUIDs of the node's GPUs the job is given (JobRecord.assigned_gpus).
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Restore:
    node: str
    spec: JobSpec
    generation: int
    # Why the job's working directory must be left as it is (the shell fills it in: another job
    # works there), or "".
    leave_workdir: str = ""
    # 0: the newest epoch that can be restored; N: exactly epoch N (an operator's restart --epoch).
    epoch: int = 0
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    node: str
    job: str
    generation: int
    stop: bool
    # A periodic checkpoint (its node may skip it under load); force: take it whatever the load.
    scheduled: bool = False
    force: bool = False
    # With stop, a move: the node evicts the job for this reason (CheckpointJob.evict).
    evict: str = ""
    cause: str = ""
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kill:
    node: str
    job: str
    generation: int
    reason: str = ""
    # A cancel's: this signal to the job's processes first, SIGKILL after grace_s (0: SIGKILL at once).
    signal: int = 0
    grace_s: float = 0.0


Command = Start | Restore | Checkpoint | Kill


# ---------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Submit:
    """A new job, for ``node`` with ``gpus`` there; with no node, it waits (pending, generation 0:
    :func:`lifecycle.queued`) for room, and ``waiting`` says why it has none."""
    spec: JobSpec
    node: str
    gpus: tuple[str, ...] = ()
    waiting: str = ""


@dataclass(frozen=True)
class Placed:
    """A waiting job's node (and GPUs there) is found: it starts."""
    node: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Waiting:
    """Why a waiting job (or a restore failover holds for room) has no node yet, when that changes."""
    reason: str


@dataclass(frozen=True)
class Launched:
    """A start's reply: the job runs with ``pid`` (its init), its program with ``program_pid``."""
    generation: int
    pid: int
    output: str = ""
    program_pid: int = 0


@dataclass(frozen=True)
class LaunchFailed:
    """A start got no good reply.  ``retry_node``: the shell found another node to try."""
    generation: int
    reason: str
    retry_node: str | None = None
    retry_gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointAsked:
    stop: bool
    scheduled: bool = False
    force: bool = False
    # A move (stop, and restored elsewhere by failover): why the node stops it.
    evict: str = ""
    # Why it is taken ("schedule", "operator", "health") and the findings that asked for it.
    cause: str = ""
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Checkpointed:
    generation: int
    stop: bool
    epoch: EpochInfo | None
    # What the agent's retention deleted (corrupt epochs first): dropped from the listing.
    pruned: tuple[int, ...] = ()
    # Every epoch the job keeps, as the agent now describes them: when given, they replace the
    # listing (through the retention rule).  storage_bytes: the job's storage (0: not reported).
    epochs: tuple[EpochInfo, ...] = ()
    storage_bytes: int = 0
    # A move's: the job goes on elsewhere (restoring, handed to failover), not vacated.
    evicted: bool = False


@dataclass(frozen=True)
class CheckpointFailed:
    """The checkpoint failed, or its reply went to a leader that is gone: the job runs on."""
    generation: int
    # Why (the agent's error: criu's own line and where its log is kept); "" if nothing failed.
    error: str = ""
    # The job holds what criu cannot carry (the agent's not_checkpointable): its doing, not the node's.
    blocking: bool = False


@dataclass(frozen=True)
class CancelAsked:
    """An operator (or the job's user) ends the job without a checkpoint; ``signal`` first, then
    SIGKILL after ``grace_s`` (0 and 0: SIGKILL at once)."""
    reason: str = "cancelled"
    signal: int = 0
    grace_s: float = 0.0


@dataclass(frozen=True)
class RestartAsked:
    target: str
    # 0: the newest restorable epoch; N: exactly this kept epoch.
    epoch: int = 0
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Restored:
    """A restore's (or a recovery's start's) reply.  ``announce``: publish a ``restored`` event
    (an operator's restart; failover publishes its own), with this reason if a string."""
    generation: int
    pid: int
    epoch: EpochInfo | None = None
    output: str = ""
    announce: bool | str = False
    # The epoch's connections the restore brought back intact (the others came back closed).
    kept: tuple[str, ...] = ()
    program_pid: int = 0


@dataclass(frozen=True)
class RestartFailed:
    generation: int
    reason: str
    previous_state: str
    previous_node: str


@dataclass(frozen=True)
class AgentReport:
    event: JobEvent


@dataclass(frozen=True)
class EpochConverted:
    """An agent turned one of the job's older epochs into a delta, after the checkpoint's reply."""
    event: EpochEvent


@dataclass(frozen=True)
class Recover:
    """The job's node is gone (``dead``; "" when a new leader takes over a half-done launch or
    restore) or stopped it (``evicted``: its reason); ``target`` is where placement puts it.
    ``fence_token``: the record's token when the failover began (before its lease wait); if
    a frozen copy was let thaw since, the failover is void."""
    dead: str
    target: str
    evicted: str = ""
    fence_token: int | None = None
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class ThawAsked:
    """An agent whose lease is back asks whether its frozen copy (``generation``) may go on."""
    node: str
    generation: int


@dataclass(frozen=True)
class RecoveryAttemptFailed:
    generation: int
    reason: str


@dataclass(frozen=True)
class RecoveryFailed:
    reason: str


@dataclass(frozen=True)
class Purged:
    pass


Input = (Submit | Launched | LaunchFailed | CheckpointAsked | Checkpointed | CheckpointFailed | RestartAsked
         | Restored | RestartFailed | AgentReport | EpochConverted | Recover | ThawAsked | RecoveryAttemptFailed
         | RecoveryFailed | Purged | CancelAsked | Placed | Waiting)


@dataclass(frozen=True)
class Emit:
    """A job event to publish: its kind and fields beyond job, node and generation."""
    kind: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Decision:
    record: JobRecord | None = None
    commands: list[Command] = field(default_factory=list)
    events: list[Emit] = field(default_factory=list)
    # "failed": a recovery found nothing to restore from; "evicted": an agent's report hands the
    # job to failover; "thaw" / "kill": the answer to a frozen copy's ThawAsked.  None otherwise.
    outcome: str | None = None

    @property
    def changed(self) -> bool:
        return self.record is not None


# (from, input, to) for every transition the core can make; docs/architecture.md shows this
# table, and tests/test_lifecycle.py checks both against what transition() does.
TRANSITIONS: tuple[tuple[str, str, str], ...] = (
    ("(new)", "submit", "pending"),
    ("(new)", "submit, no room", "pending"),
    ("pending", "room found", "pending"),
    ("pending", "start reply", "running"),
    ("pending", "start failed, another node", "pending"),
    ("pending", "start failed", "failed"),
    ("running", "checkpoint / vacate", "checkpointing"),
    ("checkpointing", "checkpoint reply", "running"),
    ("checkpointing", "checkpoint failed", "running"),
    ("checkpointing", "vacate reply", "vacated"),
    ("checkpointing", "move reply", "restoring"),
    ("running", "agent: vacated", "vacated"),
    ("checkpointing", "agent: vacated", "vacated"),
    ("vacated", "restart", "restoring"),
    ("failed", "restart (with an epoch)", "restoring"),
    ("restoring", "restore reply", "running"),
    ("restoring", "restart failed", "vacated"),
    ("restoring", "restart failed", "failed"),
    ("running", "agent: exited 0", "completed"),
    ("running", "agent: exited non-zero / killed", "failed"),
    ("checkpointing", "agent: exited 0", "completed"),
    ("checkpointing", "agent: exited non-zero / killed", "failed"),
    ("pending", "agent: exited 0", "completed"),
    ("pending", "agent: exited non-zero", "failed"),
    ("restoring", "agent: exited 0", "completed"),
    ("restoring", "agent: exited non-zero", "failed"),
    ("pending", "agent: evicted", "restoring"),
    ("running", "agent: evicted", "restoring"),
    ("checkpointing", "agent: evicted", "restoring"),
    ("restoring", "agent: evicted", "restoring"),
    ("pending", "node lost, an epoch", "restoring"),
    ("running", "node lost, an epoch", "restoring"),
    ("checkpointing", "node lost, an epoch", "restoring"),
    ("restoring", "node lost, an epoch", "restoring"),
    ("pending", "node lost, no epoch, --requeue", "pending"),
    ("running", "node lost, no epoch, --requeue", "pending"),
    ("checkpointing", "node lost, no epoch, --requeue", "pending"),
    ("restoring", "node lost, no epoch, --requeue", "pending"),
    ("running", "node lost, no epoch", "failed"),
    ("checkpointing", "node lost, no epoch", "failed"),
    ("pending", "node lost, no epoch", "failed"),
    ("restoring", "node lost, no epoch", "failed"),
    ("pending", "recovery attempt failed", "restoring"),
    ("restoring", "recovery attempt failed", "restoring"),
    ("pending", "recovery gave up", "failed"),
    ("running", "recovery gave up", "failed"),
    ("checkpointing", "recovery gave up", "failed"),
    ("restoring", "recovery gave up", "failed"),
    ("pending", "cancel", "cancelled"),
    ("running", "cancel", "cancelled"),
    ("checkpointing", "cancel", "cancelled"),
    ("restoring", "cancel", "cancelled"),
    ("vacated", "cancel", "cancelled"),
    ("cancelled", "restart (with an epoch)", "restoring"),
    ("restoring", "restart failed", "cancelled"),
)
