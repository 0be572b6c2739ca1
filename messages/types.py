"""Every message that crosses the bus.

Rules (see docs/protocol.md):

* A top-level message is a msgspec Struct tagged ``"<kind>.v<N>"`` in the field
  ``type``.  It is encoded as a MessagePack map keyed by field name.
* A new field always gets a default, so an older sender stays readable.
* Unknown fields are ignored, so a newer sender stays readable.
* A breaking change is a new tag (``heartbeat.v2``), never an edit of v1.
* Times are float seconds: ``*_at`` fields are Unix wall-clock times, ``*_s``
  fields are durations.  Sizes are ``*_bytes``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

HealthState = Literal["GREEN", "YELLOW", "RED"]
JobState = Literal["pending", "running", "checkpointing", "vacated", "restoring", "completed", "failed"]
JobEventKind = Literal["submitted", "started", "exited", "vacated", "restored", "purged", "killed", "restoring",
                       "requeued", "failed", "evicted"]
EpochEventKind = Literal["created", "failed", "pruned"]
NodeState = Literal["alive", "suspect", "dead", "left"]
NodeEventKind = Literal["joined", "suspect", "dead", "recovered", "left", "fenced"]


class _Body(msgspec.Struct, kw_only=True):
    """A nested, untagged value (only ever found inside a tagged message)."""


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every tagged top-level message."""


# --------------------------------------------------------------------------- parts


class CriuInfo(_Body):
    """What the agent found out about its criu binary."""

    path: str | None = None
    version: str | None = None
    ok: bool = False
    # `criu check` failed or criu is missing: criu's own last error line.
    error: str | None = None
    # `criu check --feature NAME` results, e.g. {"mem_dirty_track": False}.
    features: dict[str, bool] = {}


class GpuInfo(_Body):
    index: int
    name: str = ""
    uuid: str = ""
    memory_total_bytes: int = 0
    driver_version: str = ""


class Capabilities(_Body):
    hostname: str = ""
    kernel: str = ""
    cpus: int = 0
    memory_total_bytes: int = 0
    revenant_version: str = ""
    criu: CriuInfo = msgspec.field(default_factory=CriuInfo)
    # Where this agent serves /metrics, /health, /ready and /live ("" when off).
    metrics_url: str = ""
    # "none" when NVML has no driver or no device; that is normal, not an error.
    gpu: str = "none"
    gpus: list[GpuInfo] = []


class GpuProcess(_Body):
    pid: int
    used_memory_bytes: int = 0
    # The revenant job this pid belongs to, when it is one.
    job: str = ""


class GpuHealth(_Body):
    """One GPU's readings from NVML, as of the heartbeat."""

    index: int
    uuid: str = ""
    name: str = ""
    temperature_c: float = 0.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    utilization_percent: float = 0.0
    power_w: float = 0.0
    ecc_uncorrected_volatile: int = 0
    remapped_rows_pending: int = 0
    remapped_rows_failed: int = 0
    # XID codes seen since the previous heartbeat.
    xids: list[int] = []
    processes: list[GpuProcess] = []


class HealthFinding(_Body):
    """One entry of ``reasons`` in machine-readable form: its state and the probe's code.

    Codes: ``memory``, ``storage_low`` (free space on the shared storage), ``loop_lag``,
    ``criu``, ``nats``, ``checkpoint_failures``, ``pending_ops``, ``gpu``."""

    state: HealthState
    code: str


class HealthSummary(_Body):
    state: HealthState = "GREEN"
    reasons: list[str] = []
    # One per entry of ``reasons``, same order.  A reason added without one (an older agent,
    # or a RED set by hand) leaves the lists of different lengths: read as "not known".
    findings: list[HealthFinding] = []
    loop_lag_s: float = 0.0
    loop_stalls: int = 0
    memory_percent: float = 0.0
    storage_free_bytes: int = 0
    criu_ok: bool = True
    nats_connected: bool = True
    checkpoint_failures: int = 0
    pending_ops: int = 0
    gpus: list[GpuHealth] = []


class NodeStatus(_Body):
    """One row of the coordinator's membership table."""

    name: str
    state: NodeState
    health: HealthState = "GREEN"
    reasons: list[str] = []
    # The reasons' codes, as the node's heartbeat gave them (see HealthSummary.findings).
    findings: list[HealthFinding] = []
    pid: int = 0
    incarnation: str = ""
    seq: int = 0
    last_heartbeat_age_s: float | None = None
    phi: float = 0.0
    state_since_age_s: float = 0.0
    capabilities: Capabilities = msgspec.field(default_factory=Capabilities)
    # The GPU readings from the node's latest heartbeat.
    gpus: list[GpuHealth] = []


class JobSpec(_Body):
    """What to run; fixed at submit time."""

    id: str
    argv: list[str]
    name: str = ""
    workdir: str = "/"
    env: dict[str, str] = {}
    # Periodic checkpoint interval; None means manual checkpoints only.
    checkpoint_interval_s: float | None = None
    max_epochs: int = 1
    requeue: bool = False


class EpochInfo(_Body):
    n: int
    bytes: int = 0
    created_at: float = 0.0
    freeze_s: float = 0.0
    duration_s: float = 0.0
    node: str = ""
    generation: int = 0


class JobRecord(_Body):
    """One row of the job table (JetStream KV ``revenant_jobs``)."""

    spec: JobSpec
    state: JobState = "pending"
    node: str = ""
    pid: int = 0
    generation: int = 0
    epochs: list[EpochInfo] = []
    output: str = ""
    exit_code: int | None = None
    reason: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    last_checkpoint_at: float = 0.0
    # Bumped each time the leader lets a frozen copy of the job thaw (its node's lease had
    # lapsed): a failover decided before that is void.
    fence_token: int = 0


class LeaseValue(_Body):
    """A node's lease (JetStream KV ``revenant_leases``, key ``<node>``): the agent renews it,
    the coordinator reads it before restoring that node's jobs elsewhere."""

    node: str
    incarnation: str
    seq: int
    # The holder's wall clock, for operators; nobody decides on it.
    at: float


# ------------------------------------------------------------------------ messages


class Heartbeat(Message, tag="heartbeat.v1"):
    """Published by every agent on ``revenant.hb.<node>`` each interval."""

    node: str
    seq: int
    sent_at: float
    # Random per agent start: a new incarnation means the agent restarted.
    incarnation: str
    pid: int = 0
    interval_s: float = 1.0
    capabilities: Capabilities = msgspec.field(default_factory=Capabilities)
    health: HealthSummary = msgspec.field(default_factory=HealthSummary)
    # The agent is shutting down cleanly: this is its last heartbeat.
    leaving: bool = False


class Probe(Message, tag="probe.v1"):
    """A direct liveness probe, sent by the coordinator to a silent node."""

    sent_at: float
    sender: str = ""


class ProbeReply(Message, tag="probe_reply.v1"):
    node: str
    incarnation: str
    seq: int
    sent_at: float
    health: HealthSummary = msgspec.field(default_factory=HealthSummary)


class NodeEvent(Message, tag="node_event.v1"):
    """A membership change, on the JetStream stream at ``revenant.evt.node.<node>.<kind>``."""

    node: str
    kind: NodeEventKind
    at: float
    incarnation: str = ""
    # Seconds between the node's last heartbeat and this event.
    silence_s: float = 0.0
    reason: str = ""


class NodesRequest(Message, tag="nodes_request.v1"):
    """A page of the node table, in name order (a whole table would not fit one message)."""

    offset: int = 0
    limit: int = 200


class NodesReply(Message, tag="nodes_reply.v1"):
    nodes: list[NodeStatus] = []
    coordinator: str = ""
    coordinator_metrics_url: str = ""
    # Nodes in the whole table; ``offset`` is where this page starts.
    total: int = 0
    offset: int = 0


class AnomalyEvent(Message, tag="anomaly.v1"):
    """A probe reading above mean + 3 sigma of its sliding window (revenant.evt.node.<node>.anomaly)."""

    node: str
    metric: str
    value: float
    mean: float
    std: float
    at: float


# -- client -> coordinator (revenant.coord.<verb>)


class SubmitRequest(Message, tag="submit.v1"):
    argv: list[str]
    name: str = ""
    node: str = ""
    workdir: str = "/"
    env: dict[str, str] = {}
    checkpoint_interval_s: float | None = None
    max_epochs: int = 1
    requeue: bool = False


class JobRequest(Message, tag="job_request.v1"):
    """Names a job for show / checkpoint / vacate / restart / purge."""

    job: str
    node: str = ""


class JobsRequest(Message, tag="jobs_request.v1"):
    """A page of the live job table in id order (a whole table would not fit one message)."""

    # The page starts after this job id ("": at the start).  A cursor rather than an offset,
    # so that jobs archived or purged between two pages shift nothing.
    after: str = ""
    limit: int = 1000


class JobReply(Message, tag="job_reply.v1"):
    job: JobRecord
    # Human-readable notes, e.g. "epoch 3 failed verification; restored from epoch 2".
    notes: list[str] = []


class JobsReply(Message, tag="jobs_reply.v1"):
    # As many as fit one message (up to the request's limit).
    jobs: list[JobRecord] = []
    # Jobs in the live table; ``more``: jobs follow this page (ask again after its last id).
    total: int = 0
    more: bool = False


class FailoverRequest(Message, tag="failover_request.v1"):
    """An operator's word on automatic failover (``revenant failover``)."""

    action: Literal["status", "pause", "resume"] = "status"


class FailoverReply(Message, tag="failover_reply.v1"):
    paused: bool
    # Paused by an operator (held until resumed), rather than by the storm guard.
    held: bool = False
    # An operator resumed during this storm: it is let through until the silence ends.
    storm_acknowledged: bool = False
    silent: int = 0
    total: int = 0
    recovering: int = 0
    reason: str = ""


# -- coordinator -> agent (revenant.node.<node>.cmd.<verb>)


class StartJob(Message, tag="start_job.v1"):
    spec: JobSpec
    generation: int
    # A requeue: discard the output of the earlier run and start clean.
    fresh: bool = False


class CheckpointJob(Message, tag="checkpoint_job.v1"):
    job: str
    generation: int
    # Vacate: stop the job once the checkpoint has committed.
    stop: bool = False


class RestoreJob(Message, tag="restore_job.v1"):
    spec: JobSpec
    generation: int


class KillJob(Message, tag="kill_job.v1"):
    job: str
    generation: int
    reason: str = ""


class PurgeJob(Message, tag="purge_job.v1"):
    job: str


class AgentJobReply(Message, tag="agent_job_reply.v1"):
    job: str
    generation: int
    node: str
    pid: int = 0
    output: str = ""
    epoch: EpochInfo | None = None
    freed_bytes: int = 0
    notes: list[str] = []
    # Epochs retention deleted after this checkpoint (corrupt ones go first, so not always the
    # oldest): the job table drops them from its listing.
    pruned: list[int] = []


# -- events (JetStream, revenant.evt.job.<job>.<kind> / revenant.evt.epoch.<job>.<kind>)


class JobEvent(Message, tag="job_event.v1"):
    job: str
    kind: JobEventKind
    at: float
    node: str = ""
    generation: int = 0
    pid: int = 0
    exit_code: int | None = None
    epoch: int | None = None
    reason: str = ""
    # Failover: seconds from the dead node's last heartbeat to this event.
    since_last_heartbeat_s: float | None = None
    # Failover: the node the job was lost with.
    from_node: str = ""


class EpochEvent(Message, tag="epoch_event.v1"):
    job: str
    kind: EpochEventKind
    at: float
    n: int = 0
    node: str = ""
    generation: int = 0
    bytes: int = 0
    freeze_s: float = 0.0
    duration_s: float = 0.0
    # For "failed": criu's own error line (or the step that failed).
    error: str = ""


class ClusterEvent(Message, tag="cluster_event.v1"):
    """A cluster-wide event on ``revenant.evt.cluster.<kind>``: failover paused or resumed, a
    coordinator became the leader or stepped down."""

    kind: Literal["failover_paused", "failover_resumed", "leader_elected", "leader_stepped_down"]
    at: float
    silent: int = 0
    total: int = 0
    reason: str = ""
    # leader_elected / leader_stepped_down: the coordinator's name.
    coordinator: str = ""


class LocalJob(_Body):
    """A job as an agent runs it: which generation, and whether it is frozen (its node's lease
    lapsed, and it waits for the leader's word to go on)."""

    job: str
    generation: int
    frozen: bool = False


class StaleJob(_Body):
    job: str
    generation: int
    reason: str = ""


class ReconcileRequest(Message, tag="reconcile_request.v1"):
    """An agent, after a reconnect or a self-fence, asks the leader which of its jobs it may keep."""

    node: str
    incarnation: str = ""
    jobs: list[LocalJob] = []
    # The agent has just started: it runs nothing an earlier agent of its node ran, so a job
    # the table has running there was lost with that agent (and is restored elsewhere).
    started: bool = False


class ReconcileReply(Message, tag="reconcile_reply.v1"):
    """The jobs (at the generation the agent runs) that moved on or belong to another node now:
    the agent kills them.  A job the leader does not know is left alone."""

    stale: list[StaleJob] = []
    # Frozen jobs the agent may thaw: still theirs, at the same generation, and no failover of
    # them can now go ahead (the leader recorded the thaw first).
    thaw: list[LocalJob] = []


class ErrorReply(Message, tag="error.v1"):
    """The reply to any request that could not be served."""

    code: str
    message: str
    retriable: bool = False


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Heartbeat,
    Probe,
    ProbeReply,
    NodeEvent,
    NodesRequest,
    NodesReply,
    SubmitRequest,
    JobRequest,
    JobsRequest,
    JobReply,
    JobsReply,
    FailoverRequest,
    FailoverReply,
    StartJob,
    CheckpointJob,
    RestoreJob,
    KillJob,
    PurgeJob,
    AgentJobReply,
    JobEvent,
    EpochEvent,
    AnomalyEvent,
    ClusterEvent,
    ReconcileRequest,
    ReconcileReply,
    ErrorReply,
)

__all__ = [
    "AgentJobReply",
    "AnomalyEvent",
    "CheckpointJob",
    "EpochEvent",
    "EpochEventKind",
    "EpochInfo",
    "FailoverReply",
    "FailoverRequest",
    "JobEvent",
    "JobEventKind",
    "JobRecord",
    "JobReply",
    "JobRequest",
    "JobSpec",
    "JobState",
    "JobsReply",
    "JobsRequest",
    "KillJob",
    "LocalJob",
    "LeaseValue",
    "PurgeJob",
    "ReconcileReply",
    "ReconcileRequest",
    "RestoreJob",
    "StaleJob",
    "StartJob",
    "SubmitRequest",
    "Capabilities",
    "ClusterEvent",
    "CriuInfo",
    "ErrorReply",
    "GpuHealth",
    "GpuInfo",
    "GpuProcess",
    "HealthFinding",
    "HealthState",
    "HealthSummary",
    "Heartbeat",
    "Message",
    "NodeEvent",
    "NodeEventKind",
    "NodeState",
    "NodeStatus",
    "NodesReply",
    "NodesRequest",
    "Probe",
    "ProbeReply",
]
