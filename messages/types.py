"""Every message that crosses the bus.

Rules (see docs/protocol.md):

* A top-level message is a msgspec Struct tagged ``"<kind>.v<N>"`` in the field
  ``type``.  It is encoded as a MessagePack map keyed by field name.
* A new field always gets a default, so an older sender stays readable.
* Unknown fields are ignored, so a newer sender stays readable.
* A breaking change is a new tag (``heartbeat.v2``), never an edit of v1.
* Times are float seconds: ``*_at`` Unix wall-clock times, ``*_s`` durations.  Sizes: ``*_bytes``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from revenant.messages.agentcmds import (  # noqa: F401  (part of this module's names: see __all__)
    AgentJobReply,
    CheckJob,
    CheckpointJob,
    KillJob,
    Progress,
    PurgeJob,
    ReconcileReply,
    ReconcileRequest,
    RestoreJob,
    SignalJob,
    StartJob,
)
from revenant.messages.base import Message
from revenant.messages.parts import (  # noqa: F401  (part of this module's names: see __all__)
    Capabilities,
    CheckpointPolicy,
    CriuInfo,
    EpochEventKind,
    EpochFile,
    EpochInfo,
    JobResource,
    JobResources,
    ResourceVerdict,
    FINDING_CODES,
    GpuHealth,
    GpuInfo,
    GpuProcess,
    HealthFinding,
    HealthState,
    HealthSummary,
    JobEventKind,
    JobGpu,
    JobRecord,
    JobSpec,
    JobState,
    LeaseValue,
    LocalJob,
    NodeEventKind,
    NodeState,
    NodeStatus,
    ON_SICK,
    CONNECTIONS,
    PACK_COMPRESSION,
    OnSick,
    StaleJob,
)




# ------------------------------------------------------------------------ messages


class Heartbeat(Message, tag="heartbeat.v2", omit_defaults=True):
    """Published by every agent on ``revenant.hb.<node>`` each interval.

    ``capabilities`` and ``health`` are None ("as in my last heartbeat that had them") in most
    heartbeats: an agent sends them when its verdict (state, reasons, findings) or its
    capabilities change, in its first heartbeats and after a reconnect, and at least every
    ``heartbeat_full_every`` heartbeats (the readings).  Fields at their defaults are left out
    of the map (a reader fills them in), so a heartbeat is then about 120 bytes, which is what
    lets one coordinator hear 100,000 nodes a second (docs/performance.md)."""

    node: str
    seq: int
    sent_at: float
    # Random per agent start: a new incarnation means the agent restarted.
    incarnation: str
    pid: int = 0
    interval_s: float = 1.0
    capabilities: Capabilities | None = None
    health: HealthSummary | None = None
    # The agent is shutting down cleanly: this is its last heartbeat.
    leaving: bool = False


class HeartbeatV1(Message, tag="heartbeat.v1"):
    """What agents before ``heartbeat.v2`` send: every heartbeat full.  Still read, so that
    coordinators can be upgraded before their agents."""

    node: str
    seq: int
    sent_at: float
    incarnation: str
    pid: int = 0
    interval_s: float = 1.0
    capabilities: Capabilities = msgspec.field(default_factory=Capabilities)
    health: HealthSummary = msgspec.field(default_factory=HealthSummary)
    leaving: bool = False


class HeartbeatRequest(Message, tag="heartbeat_request.v1"):
    """Published by a coordinator on ``revenant.nodes.full_heartbeat`` when it starts and when its
    heartbeat connection comes back: every agent makes its next heartbeat full."""

    sender: str
    sent_at: float
    # A leader's, as it takes office: its term (subjects.TERM_HEADER), which every agent then
    # holds as the newest it has heard; 0: a coordinator starting, or from before terms.
    term: int = 0


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
    # Checkpoints kept; None: the cluster's default ([checkpoint] max_epochs).
    max_epochs: int | None = None
    requeue: bool = False
    # The user the job is for: admin may name anyone ("": root); a user only themself.
    user: str = ""
    # Overrides of the cluster's [checkpoint] defaults for this job; None: the default.
    incremental: bool | None = None
    full_every: int | None = None
    pre_dump: bool | None = None
    pre_dump_delay_s: float | None = None
    load_aware: bool | None = None
    connections: str | None = None  # "keep" or "close" (CheckpointPolicy.connections)
    pack_compression: str | None = None  # "none", "zstd" or "lz4" (CheckpointPolicy.pack_compression)
    # What a sick node does to it: "checkpoint", "migrate" or "none" ("": the cluster's default).
    on_sick: str = ""
    # The client's key for this submit ("": none): a repeat with the same key from the same user
    # (a reply lost, a leader changed) is answered with the job the first made, not a second one.
    request_id: str = ""
    # What the job needs on its node; None: the cluster's [resources] default.
    cpus: float | None = None
    memory_bytes: int | None = None
    gpus: int | None = None


class JobRequest(Message, tag="job_request.v1"):
    """Names a job for show / checkpoint / vacate / restart / purge / cancel / signal."""

    job: str
    node: str = ""
    # restart only: restore exactly this kept epoch (0: the newest that can be restored).
    epoch: int = 0
    # cancel: the signal sent first ("": none, SIGKILL at once) and the seconds it has to end before
    # SIGKILL; signal: the signal, to the job's program, or to every process of the job with ``all``.
    # Names as kill(1) takes them: TERM, SIGTERM or a number.
    signal: str = ""
    grace_s: float = 0.0
    all: bool = False
    # checkpoint / vacate: how long to wait for a checkpoint already in progress (0: not at all).
    wait_s: float = 0.0


class JobsRequest(Message, tag="jobs_request.v1"):
    """A page of the live job table in id order (a whole table would not fit one message)."""

    # The page starts after this job id ("": at the start): a cursor, so that archives and purges shift nothing.
    after: str = ""
    limit: int = 1000


class JobReply(Message, tag="job_reply.v1"):
    job: JobRecord
    notes: list[str] = []  # for people, e.g. "epoch 3 failed verification; restored from epoch 2"
    # checkpoint / vacate / restart: criu's own statistics of the dump or restore (AgentJobReply's).
    stats: dict[str, float] = {}
    # check: what the running job holds, and what a checkpoint or a move does to each.
    resources: list[JobResource] = []


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


# -- events (JetStream, revenant.evt.job.<job>.<kind>[.<node>] / revenant.evt.epoch.<job>.<kind>.<node>)


class JobEvent(Message, tag="job_event.v1"):
    job: str
    kind: JobEventKind
    at: float
    node: str = ""
    # started / restored / migrated: the node's address (Capabilities.address), where clients find it.
    address: str = ""
    generation: int = 0
    pid: int = 0
    exit_code: int | None = None
    epoch: int | None = None
    reason: str = ""
    # Failover: seconds from the dead node's last heartbeat to this event; the node the job was lost with.
    since_last_heartbeat_s: float | None = None
    from_node: str = ""
    # vacated / evicted: the GPUs the job held at ``epoch`` and their driver (EpochInfo's).
    gpus: list[JobGpu] = []
    gpu_driver: str = ""
    # restore_completed (a lazy restore's last page is in): seconds from the restore's start, page bytes fetched.
    duration_s: float = 0.0
    bytes: int = 0
    # migrated / migration_failed / migration_skipped: "health" and the sick node's findings.
    cause: str = ""
    reasons: list[str] = []
    # restored: what the job listens on again (its epoch's sockets), and the connections the
    # restore closed ("local -> peer"), which the job sees reset at their next use.
    listening: list[str] = []
    closed: list[str] = []
    # restored: the connections that came back intact instead (a restore on the node that had
    # held them since the vacate).
    kept: list[str] = []


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
    # Why: for "skipped" and "forced" the metric, its value and its threshold; "degraded": why no pre-dump.
    reason: str = ""
    # For "converted": the job's whole checkpoint storage afterwards (shared data once), and where each
    # kept epoch's pages are now: {epoch: [plain, packed, newer] bytes} (EpochInfo.plain_bytes, ...).
    storage_bytes: int = 0
    placement: dict[int, list[int]] = {}
    # For "created": the GPUs the job held at this epoch ([]: none), and the node's driver version.
    gpus: list[JobGpu] = []
    gpu_driver: str = ""
    # For "created" and "failed": why it was taken (CheckpointJob.cause, or "drain") and its reasons.
    cause: str = ""
    reasons: list[str] = []


class ClusterEvent(Message, tag="cluster_event.v1"):
    """A cluster-wide event on ``revenant.evt.cluster.<kind>``: failover (or proactive moves) paused
    or resumed, a coordinator became the leader or stepped down."""

    kind: Literal["failover_paused", "failover_resumed", "leader_elected", "leader_stepped_down",
                  "proactive_paused", "proactive_resumed"]
    at: float
    silent: int = 0
    total: int = 0
    reason: str = ""
    # leader_elected / leader_stepped_down: the coordinator's name.
    coordinator: str = ""


class ErrorReply(Message, tag="error.v1"):
    """The reply to any request that could not be served."""

    code: str
    message: str
    retriable: bool = False


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Heartbeat, HeartbeatV1, HeartbeatRequest, Probe, ProbeReply, NodeEvent, NodesRequest, NodesReply, SubmitRequest, JobRequest,
    JobsRequest, JobReply, JobsReply, FailoverRequest, FailoverReply, StartJob, CheckpointJob, RestoreJob,
    KillJob, SignalJob, PurgeJob, CheckJob, AgentJobReply, Progress, JobEvent, EpochEvent, AnomalyEvent, ClusterEvent,
    ReconcileRequest, ReconcileReply, ErrorReply,
)

__all__ = [
    "FINDING_CODES", "ON_SICK", "CONNECTIONS", "PACK_COMPRESSION", "OnSick",
    "AgentJobReply", "AnomalyEvent", "Capabilities", "CheckJob", "CheckpointJob", "CheckpointPolicy", "ClusterEvent",
    "CriuInfo", "EpochEvent", "EpochEventKind", "EpochFile", "EpochInfo", "ErrorReply", "FailoverReply",
    "FailoverRequest", "GpuHealth", "GpuInfo", "GpuProcess", "HealthFinding", "HealthState", "HealthSummary",
    "Heartbeat", "HeartbeatRequest", "HeartbeatV1", "JobEvent", "JobEventKind", "JobGpu", "JobRecord", "JobReply", "JobRequest", "JobResource", "JobResources",
    "JobSpec",
    "JobState", "JobsReply", "JobsRequest", "KillJob", "LeaseValue", "LocalJob", "Message", "NodeEvent",
    "NodeEventKind", "NodeState", "NodeStatus", "NodesReply", "NodesRequest", "Probe", "ProbeReply",
    "Progress", "PurgeJob", "ReconcileReply", "ReconcileRequest", "RestoreJob", "SignalJob", "StaleJob", "StartJob",
    "ResourceVerdict", "SubmitRequest",
]
