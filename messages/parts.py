"""The untagged values that messages carry: node capabilities and health, job specs,
records and epochs, a node's lease, an agent's view of its jobs (see types.py for the rules)."""

from __future__ import annotations

from typing import Literal

import msgspec

HealthState = Literal["GREEN", "YELLOW", "RED"]
JobState = Literal["pending", "running", "checkpointing", "vacated", "restoring", "completed", "failed",
                   "cancelled"]
# restore_completed: every page of a lazily restored job is in (agent/lazyrestore/lazy.py).
JobEventKind = Literal["submitted", "started", "exited", "vacated", "restored", "purged", "killed", "restoring",
                       "requeued", "failed", "evicted", "restore_completed", "migrated", "migration_failed",
                       "migration_skipped", "not_checkpointable", "cancelled", "signalled"]
# What a job's sick node does to it (JobSpec.on_sick; "" in a record from before: the cluster's default).
OnSick = Literal["checkpoint", "migrate", "none", ""]
ON_SICK = ("checkpoint", "migrate", "none")
CONNECTIONS = ("keep", "close")
PACK_COMPRESSION = ("none", "zstd", "lz4")
# skipped: a scheduled checkpoint not taken (the node over a load threshold); degraded: a
# pre-dump that could not run (once per job); forced: a scheduled one taken despite the load;
# converted: an older epoch turned into a delta against the job's packs.
EpochEventKind = Literal["created", "failed", "pruned", "skipped", "degraded", "forced", "converted"]
NodeState = Literal["alive", "suspect", "dead", "left"]
NodeEventKind = Literal["joined", "suspect", "dead", "recovered", "left", "fenced"]


class _Body(msgspec.Struct, kw_only=True):
    """A nested, untagged value (only ever found inside a tagged message)."""


class CriuInfo(_Body):
    """What the agent found out about its criu binary."""

    path: str | None = None
    version: str | None = None
    ok: bool = False
    # `criu check` failed or criu is missing: criu's own last error line.
    error: str | None = None
    # `criu check --feature NAME` results, e.g. {"mem_dirty_track": False}, and the socket probe's
    # (agent/network/netprobe.py): inet_sockets, tcp_established, ext_unix_sk.
    features: dict[str, bool] = {}
    # The socket probe failed: why (criu's line), or None.  Jobs with sockets cannot be checkpointed.
    network_error: str | None = None


class GpuInfo(_Body):
    index: int
    name: str = ""
    uuid: str = ""
    memory_total_bytes: int = 0
    driver_version: str = ""


class Capabilities(_Body):
    hostname: str = ""
    # Where clients reach this node's jobs: the agent's advertise_address, else its own address
    # on the route to the NATS server ("" if neither is known).
    address: str = ""
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
    # How the agent checkpoints a job's GPU state: "driver_api" (libcuda's checkpoint calls),
    # "binary" (the cuda-checkpoint program) or "none" (a job holding a GPU cannot be checkpointed).
    gpu_checkpoint: str = "none"
    # Why "none" (no driver, too old a driver, turned off), or a note on the mechanism found.
    gpu_checkpoint_why: str = ""
    # The CUDA driver API version (cuDriverGetVersion: 12080 for CUDA 12.8); 0: unknown.
    cuda_version: int = 0
    # A restore here can move a job to other GPUs (by UUID) than it was checkpointed on.
    gpu_remap: bool = False
    # Restores here start the job before its pages are back (criu lazy-pages; config restore_mode).
    lazy_restore: bool = False


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


# Every HealthFinding.code an agent reports (the proactive tables name some of them).
FINDING_CODES = ("memory", "storage_low", "loop_lag", "criu", "nats", "checkpoint_failures", "pending_ops",
                 "gpu_temperature", "gpu_ecc", "gpu_remap_failed", "gpu_remap_pending", "gpu_xid", "gpu_xid_app",
                 "gpu_unreadable")


class HealthFinding(_Body):
    """One entry of ``reasons`` in machine-readable form: its state and the probe's code.

    Codes: ``memory``, ``storage_low`` (free space on the shared storage), ``loop_lag``,
    ``criu``, ``nats``, ``checkpoint_failures``, ``pending_ops``; per GPU ``gpu_temperature``,
    ``gpu_ecc``, ``gpu_remap_failed``, ``gpu_remap_pending``, ``gpu_xid`` (a critical XID),
    ``gpu_xid_app`` (an application's XID), ``gpu_unreadable``."""

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
    # What its jobs not ended asked for (the leader's count; placement's room is capabilities
    # less this), and how many they are: filled in by the leader in nodes_reply.v1.
    allocated: JobResources = msgspec.field(default_factory=lambda: JobResources())
    jobs: int = 0


class CheckpointPolicy(_Body):
    """How a job's checkpoints are taken and stored: the cluster's ``[checkpoint]`` defaults with
    the submit's overrides, fixed at submit (docs/configuration.md gives the ranges)."""

    # Epochs stored as deltas against the job's packs (reverse incremental: the newest stays plain).
    incremental: bool = False
    # Every full_every-th epoch starts a segment: an epoch references only its segment's packs.
    full_every: int = 10
    # An incremental job's packs compressed with this ("none", "zstd", "lz4"); never the newest epoch's images.
    pack_compression: Literal["none", "zstd", "lz4"] = "none"
    # A criu pre-dump pre_dump_delay_s before the final dump (needs dirty-memory tracking).
    pre_dump: bool = False
    pre_dump_delay_s: float = 5.0
    # Skip a scheduled checkpoint while the node is over a threshold (fractions, 0 to 1).
    load_aware: bool = False
    load_threshold_cpu: float = 0.95
    load_threshold_io: float = 0.50
    load_threshold_memory: float = 0.85
    # The job's TCP connections on a move (docs/cli.md, "Jobs that use the network"): "keep" (a
    # vacate holds them silent a while, and a restore on the same node meanwhile brings them back
    # intact; elsewhere they come back closed) or "close" (every restore closes them, and a
    # vacate lets them go at once: their peers see a reset).  A create keeps them either way.
    connections: Literal["keep", "close"] = "keep"


class JobResources(_Body):
    """What a job asked for: its submit's, else the cluster's ``[resources]`` defaults, fixed at
    submit.  Placement reserves it on the job's node; the node's cgroup for the job limits it
    (0: nothing reserved, no limit)."""

    cpus: float = 0.0
    memory_bytes: int = 0
    gpus: int = 0
    # The memory limit of a job that reserves none (``memory_bytes`` 0): the cluster's
    # ``[resources] memory_limit``, never reserved (0: none).  A reservation is its own limit.
    memory_limit_bytes: int = 0
    # The most processes (and threads) the job may have at once: ``[resources] pids`` (0: the node's
    # ``job_pids_max`` alone; a node applies the smaller of the two).
    pids: int = 0

    def memory_cap(self) -> int:
        """The memory the job may use at most (0: no limit)."""
        return self.memory_bytes or self.memory_limit_bytes


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
    # The Unix user the job belongs to (and runs as), set by the coordinator at submit from who
    # asked; "" for a record stored before jobs had users.
    user: str = ""
    # The job's effective checkpoint policy (the defaults for a record from before policies).
    policy: CheckpointPolicy = msgspec.field(default_factory=CheckpointPolicy)
    # What a sick node does to it, decided at submit (docs/configuration.md, "Proactive moves").
    on_sick: OnSick = ""
    # The submit's request id ("": none given), by which a repeat of it finds this job.
    request_id: str = ""
    # What it asked for (a record from before: nothing).
    resources: JobResources = msgspec.field(default_factory=JobResources)


class EpochFile(_Body):
    """A file of the job's own that an epoch covers: open for writing at the dump."""

    path: str
    size: int = 0
    # The epoch holds a copy of it (put back from it on restore).
    copied: bool = False
    # Why it holds none ("" if it does): append-only (cut back on restore), or too big to copy.
    not_copied: str = ""


# An EpochInfo lists at most this many of its files (those not copied first); files_total counts all.
MAX_EPOCH_FILES = 32


ResourceVerdict = Literal["carried", "closed_on_move", "blocking"]


class JobResource(_Body):
    """One thing a running job holds, and what a checkpoint or a move does to it (revenant check)."""

    kind: str  # socket, connection, file, gpu, descriptor
    what: str  # "tcp 0.0.0.0:6379", "127.0.0.1:41234 -> 127.0.0.1:5432", a path, ...
    verdict: ResourceVerdict
    reason: str = ""


class JobGpu(_Body):
    """A GPU a job held when its epoch was checkpointed (a restore needs one of the same model)."""

    index: int
    uuid: str
    name: str
    # Device memory the job held on it at the checkpoint.
    memory_bytes: int = 0


class EpochInfo(_Body):
    n: int
    bytes: int = 0
    # The job's output at the dump, in bytes: a restore from this epoch cuts the output back to
    # it (0: not reported, an epoch from before the field, or an empty output).
    output_bytes: int = 0
    created_at: float = 0.0
    freeze_s: float = 0.0
    duration_s: float = 0.0
    node: str = ""
    generation: int = 0
    files: list[EpochFile] = []
    files_total: int = 0
    files_copied: int = 0
    # Why the working directory's later changes are not moved aside on restore ("" if they are).
    workdir_note: str = ""
    # The working directory's snapshot: its regular files, the bytes this epoch stored for them
    # (whole copies, and the new pages of packed files with their digests) and the bytes of those
    # unchanged since the previous epoch, whose copy or pages it shares (0 files: none).
    workdir_files: int = 0
    workdir_copied: int = 0
    workdir_linked: int = 0
    # Bytes on disk only this epoch holds (0: not reported); ``bytes`` is its images' full size.
    own_bytes: int = 0
    # Stored as a delta against the job's packs (it is rebuilt from them to be restored).
    incremental: bool = False
    # Where its images' pages are (bytes of page data; all 0: not reported): its own plain images,
    # the job's packs, or a newer epoch's plain images that hold the same pages (`revenant job storage`).
    plain_bytes: int = 0
    packed_bytes: int = 0
    newer_bytes: int = 0
    # A GPU job's GPUs at this epoch and the driver it ran under (a restore needs fitting GPUs).
    gpus: list[JobGpu] = []
    gpu_driver: str = ""
    # The job's internet sockets at this epoch: what it listened on ("tcp 0.0.0.0:6379"), and its
    # established TCP connections ("local -> peer"), which a restore of this epoch closes.
    listening: list[str] = []
    connections: list[str] = []


class JobRecord(_Body):
    """One row of the job table (JetStream KV ``revenant_jobs``)."""

    spec: JobSpec
    state: JobState = "pending"
    node: str = ""
    # The address of that node as its agent advertises it (Capabilities.address): filled in by
    # the leader when it shows the record; clients reach the job's listening ports there.
    address: str = ""
    # What in the job blocks its checkpoints (the latest refusal's line, agent/pipeline/blockers.py and the
    # like); "" once one commits.  Its first refusal is published as a not_checkpointable event.
    blocking: str = ""
    # The host pid of the namespace's init (revenant-init, what criu dumps), and of the job's own
    # program, the init's child (0: not known: not running, or a record from before).
    pid: int = 0
    program_pid: int = 0
    generation: int = 0
    # The epoch this generation was restored from (0: started, not restored): its output_bytes is
    # where the job's output was cut back to (revenant logs -f marks it).
    restored_from: int = 0
    epochs: list[EpochInfo] = []
    output: str = ""
    exit_code: int | None = None
    reason: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    last_checkpoint_at: float = 0.0
    # Why the job's latest checkpoint failed (criu's own error line, and where its log is kept
    # under the job's directory); "" once one commits.
    last_checkpoint_error: str = ""
    # The job's whole checkpoint storage on disk, data shared between epochs counted once
    # (0: not reported yet).
    storage_bytes: int = 0
    # Bumped each time the leader lets a frozen copy of the job thaw (its node's lease had
    # lapsed): a failover decided before that is void.
    fence_token: int = 0
    # The GPUs the job held at its newest committed epoch, and the driver version it ran under
    # ([] and "": it holds none); a restore goes only to a node that can take them (common/gpufit.py).
    gpus: list[JobGpu] = []
    gpu_driver: str = ""
    # The UUIDs of the GPUs placement gave this generation on its node (its CUDA_VISIBLE_DEVICES),
    # one per GPU the job asked for; no other job on the node is given them meanwhile.
    assigned_gpus: list[str] = []


class LeaseValue(_Body):
    """A node's lease (JetStream KV ``revenant_leases``, key ``<node>``): the agent renews it,
    the coordinator reads it before restoring that node's jobs elsewhere."""

    node: str
    incarnation: str
    seq: int
    # The holder's wall clock, for operators; nobody decides on it.
    at: float


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
