"""Typed configuration: TOML file, then environment, then command-line flags.

Each section is a msgspec Struct.  Unknown keys are errors, names carry their
units, and environment overrides are ``REVENANT_<SECTION>_<FIELD>``, for
example ``REVENANT_COORDINATOR_NODE_TIMEOUT_S=5``.  docs/configuration.md lists
every key; tests/test_config.py checks that the two agree.  A section may hold
another as a field (``SECTIONS``): that one is read from its own ``[table]`` of
the same file, never from the holder's.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

# [checkpoint] lives in its own module; imported from here as well (GUIDE_NAMES too).
from revenant.common.settings.checkpoint_config import (GUIDE_NAMES, CheckpointConfig, bare_guide_values,  # noqa: F401
                                               guide_spellings, yes_no)
from revenant.common.errors import ConfigError
from revenant.common.settings.resources import ResourcesConfig, check_per_user, tmpfs_size
from revenant.common.settings.thresholds import AnomalySettings, GpuThresholds, HealthThresholds
from revenant.messages import FINDING_CODES, SubmitRequest

C = TypeVar("C", bound=msgspec.Struct)

# A job's dead man's switch fires this much later than its agent's fence (agent/running/launcher.py).
SWITCH_SKEW_S = 0.1


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node: str = ""
    nats_url: str = "nats://127.0.0.1:4222"
    # The NKey seed (or JWT .creds) file the agent authenticates with, as agent-<node>
    # (docs/security.md); empty: none, for a bus that asks for none.
    nats_creds: str = ""
    # The address this node's jobs are reached at, published in its capabilities and with each
    # job started or restored here; empty: the agent's own address on its route to NATS.
    advertise_address: str = ""
    # Replicas of the streams and buckets this process creates: 0 picks 3 where the NATS cluster
    # has three servers or more, else 1 (docs/configuration.md).
    nats_replicas: int = 0
    storage: str = "/var/lib/revenant"
    # Heartbeats: one every interval, +/- jitter (a fraction of the interval).
    heartbeat_interval_s: float = 1.0
    heartbeat_jitter: float = 0.1
    # At least every this many heartbeats one carries health and capabilities in full (the
    # others only when the verdict or capabilities change); 1: every heartbeat full.
    heartbeat_full_every: int = 10
    # criu binary; empty means $REVENANT_CRIU, then PATH.
    criu_path: str = ""
    criu_check_timeout_s: float = 30.0
    # Node-local directory criu dumps into before the images move to shared storage
    # (for storage that is slow to write while the job is frozen, e.g. NFS).
    # Empty: criu dumps straight into the epoch on the shared storage.
    staging_dir: str = ""
    # criu dumps and restores that may run at once on this node.
    checkpoint_concurrency: int = 2
    # Limit on one criu dump or restore.
    criu_timeout_s: float = 3600.0
    # A vacated job's TCP connections are held, silent, this long on its node (agent/network/netlock.py):
    # a restore there meanwhile brings them back intact.  0: let them go at once (peers see a reset).
    connection_hold_s: float = 60.0
    # The nft binary that removes such a hold (Debian package nftables); without one, a vacate's
    # connections are not held.
    nft_path: str = "nft"
    # A file the job rewrites in place (open for writing without O_APPEND) is copied into the epoch
    # while the job is frozen: a reflink where the filesystem clones, else a copy only up to this size.
    file_snapshot_max_bytes: int = 64 * 1024**2
    # The job's working directory is listed at each dump (so a restore can move aside what appeared
    # after it) unless it holds more entries than this.
    workdir_scan_max_entries: int = 20_000
    # Every regular file of the working directory goes into each epoch as it was at the dump
    # (agent/files/workdir.py); what one epoch copies (files changed since the previous one) is bounded
    # by this: over it the checkpoint fails, naming the largest files.  0: no snapshot (a restore
    # then moves aside whatever changed after the epoch).
    workdir_snapshot_max_bytes: int = 4 * 1024**3
    # The longest the job stays frozen for its files (the copies, the listing): past it the dump
    # fails and the job resumes.
    file_snapshot_timeout_s: float = 120.0
    # NATS client: short pings so a dead server is noticed fast.
    ping_interval_s: float = 2.0
    max_outstanding_pings: int = 2
    reconnect_wait_s: float = 0.5
    # The liveness connection (heartbeats, probes, the lease) pings faster: a server cut off
    # without a reset (a partition) is left for another within 1 to 1.5 s, before the
    # coordinator's node_timeout_s (2.5 s) can call the node dead.
    liveness_ping_interval_s: float = 0.5
    liveness_max_outstanding_pings: int = 1
    # ... and gives up on a server that does not answer a connect within this (one cut off):
    # the next is tried at once.
    liveness_connect_timeout_s: float = 1.0
    # The event loop counts a stall when a wake-up is this late.
    loop_stall_threshold_s: float = 0.25
    # Health thresholds (docs/observability.md gives the reasoning).
    memory_yellow_percent: float = 85.0
    memory_red_percent: float = 95.0
    storage_yellow_free_bytes: int = 2 * 1024**3
    storage_red_free_bytes: int = 256 * 1024**2
    loop_lag_red_s: float = 2.0
    checkpoint_failures_yellow: int = 1
    checkpoint_failures_red: int = 3
    pending_ops_yellow: int = 8
    pending_ops_red: int = 32
    gpu_temperature_yellow_c: float = 85.0
    gpu_temperature_red_c: float = 90.0
    gpu_ecc_uncorrected_red: int = 1
    gpu_xid_hold_s: float = 300.0
    # CUDA checkpoints (agent/gpus/cuda.py): auto (the driver API where libcuda has it, else the
    # cuda-checkpoint binary), driver_api, binary or off; where each is found; how long a lock
    # waits for work already submitted to the GPU before the checkpoint fails.
    gpu_checkpoint: Literal["auto", "driver_api", "binary", "off"] = "auto"
    gpu_libcuda: str = "libcuda.so.1"
    gpu_cuda_checkpoint: str = "cuda-checkpoint"
    gpu_lock_timeout_s: float = 10.0
    # Restores (failover, drain, restart): lazy starts the job before its memory is back and
    # fetches the pages on demand and in the background (criu lazy-pages, userfaultfd); eager
    # copies every page first; auto is lazy where criu has the uffd features.
    restore_mode: Literal["auto", "eager", "lazy"] = "auto"
    # 3-sigma anomaly events over a sliding window of heartbeat readings.
    anomaly_window: int = 60
    anomaly_sigmas: float = 3.0
    anomaly_min_samples: int = 30
    anomaly_cooldown_s: float = 300.0
    # HTTP endpoints (/metrics, /health, /ready, /live); port 0 picks a free one, -1 turns them off.
    http_host: str = "127.0.0.1"
    http_port: int = 9750
    # /live fails once the event loop has not woken up for this long.
    live_stuck_after_s: float = 5.0
    # Leases: renewed every lease_renew_s; unrenewed for fence_timeout_s (shorter than
    # the lease), the agent freezes its own jobs (SIGSTOP) before anyone can restore them
    # elsewhere; they thaw only on the leader's word once the lease is back.
    lease_ttl_s: float = 1.7
    lease_renew_s: float = 0.35
    fence_timeout_s: float = 1.2
    # A job frozen this long without the leader's answer is killed (the memory it pins
    # matters) and restored from its last epoch elsewhere.
    max_frozen_s: float = 600.0
    # On SIGTERM: how long running work may take to finish before it is cancelled.
    shutdown_grace_s: float = 3.0
    # On SIGTERM the agent drains: it checkpoints and stops every job, which the coordinator
    # restores elsewhere.  A job not checkpointed within this budget is killed and restored
    # from its last epoch instead (0: no checkpoint, kill at once).
    drain_timeout_s: float = 15.0
    # Each job's own /tmp and /dev/shm: tmpfs mounts in a mount namespace of its own, which criu
    # dumps into every epoch and restores wherever the job lands.  Sizes as tmpfs takes them: bytes,
    # "512M", "1G", or a percentage of memory.  false: jobs share the host's /tmp and /dev/shm.
    job_private_scratch: bool = True
    job_tmp_size: str | int = "1G"
    job_shm_size: str | int = "1G"
    # A job whose user is root (uid 0 on this node; or no user: a record from before jobs had
    # users) is refused unless this is true.
    allow_root_jobs: bool = False
    # A cgroup per job (memory, cpu, pids: agent/processes/cgroups.py) with its --mem and --cpus as
    # limits and this many processes at most (0: no limit); false: jobs share the agent's.
    job_cgroups: bool = True
    job_pids_max: int = 65536
    # "mac": every epoch is signed with the cluster's image keys (a file of mode 0600 that `revenant keys`
    # writes; agent/storage/imagekeys.py) and none unsigned is restored; "crc32": CRC-32 only, no keys.
    image_integrity: Literal["mac", "crc32"] = "mac"
    image_keys: str = "/etc/revenant/image.keys"
    # "aead": every epoch's images are encrypted with a data key per job, wrapped by the image keys (needs "mac").
    image_encryption: Literal["none", "aead"] = "none"

    def __post_init__(self) -> None:
        _positive(self, "lease_ttl_s", "lease_renew_s", "fence_timeout_s")
        if self.lease_renew_s > self.lease_ttl_s / 3:
            raise ValueError("lease_renew_s must be at most lease_ttl_s / 3")
        if self.fence_timeout_s + SWITCH_SKEW_S >= self.lease_ttl_s:
            raise ValueError(f"fence_timeout_s must be shorter than lease_ttl_s by more than {SWITCH_SKEW_S} s "
                             "(the jobs' dead man's switches fire that much later)")
        if not self.max_frozen_s > self.fence_timeout_s:
            raise ValueError("max_frozen_s must be longer than fence_timeout_s")
        _positive(self, "heartbeat_interval_s", "criu_check_timeout_s", "ping_interval_s", "checkpoint_concurrency",
                  "liveness_ping_interval_s", "liveness_max_outstanding_pings", "liveness_connect_timeout_s",
                  "criu_timeout_s", "workdir_scan_max_entries", "file_snapshot_timeout_s",
                  "reconnect_wait_s", "loop_stall_threshold_s", "shutdown_grace_s", "gpu_lock_timeout_s")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be 0 or more")
        if not 0 <= self.connection_hold_s <= 86400:
            raise ValueError("connection_hold_s must be 0 to 86400 (0: a vacate lets its connections go at once)")
        if self.file_snapshot_max_bytes < 0:
            raise ValueError("file_snapshot_max_bytes must be 0 or more (0: copy only by reflink)")
        if self.workdir_snapshot_max_bytes < 0:
            raise ValueError("workdir_snapshot_max_bytes must be 0 or more (0: no snapshot of the working directory)")
        if not 1 <= self.heartbeat_full_every <= 60:
            raise ValueError("heartbeat_full_every must be 1 to 60 (1: every heartbeat carries its health in full; "
                             "more leaves a coordinator that starts without a node's health for that many heartbeats)")
        if not 0 <= self.heartbeat_jitter < 1:
            raise ValueError("heartbeat_jitter must be in [0, 1)")
        _port(self.http_port)
        _replicas(self.nats_replicas)
        # Build the derived values once, so inconsistent ones fail here as a config error.
        self.health_thresholds()
        self.anomaly_settings()
        tmpfs_size("job_tmp_size", self.job_tmp_size)
        tmpfs_size("job_shm_size", self.job_shm_size)

    def job_scratch(self) -> dict[str, str]:
        """A job's private tmpfs mounts, mountpoint -> size (tmpfs's ``size=``); empty: none."""
        if not self.job_private_scratch:
            return {}
        return {"/tmp": tmpfs_size("job_tmp_size", self.job_tmp_size),
                "/dev/shm": tmpfs_size("job_shm_size", self.job_shm_size)}

    def health_thresholds(self) -> HealthThresholds:
        return HealthThresholds(
            memory_yellow_percent=self.memory_yellow_percent, memory_red_percent=self.memory_red_percent,
            storage_yellow_free_bytes=self.storage_yellow_free_bytes,
            storage_red_free_bytes=self.storage_red_free_bytes,
            loop_lag_yellow_s=self.loop_stall_threshold_s, loop_lag_red_s=self.loop_lag_red_s,
            checkpoint_failures_yellow=self.checkpoint_failures_yellow,
            checkpoint_failures_red=self.checkpoint_failures_red,
            pending_ops_yellow=self.pending_ops_yellow, pending_ops_red=self.pending_ops_red,
            gpu=GpuThresholds(temperature_yellow_c=self.gpu_temperature_yellow_c,
                              temperature_red_c=self.gpu_temperature_red_c,
                              ecc_uncorrected_red=self.gpu_ecc_uncorrected_red, xid_hold_s=self.gpu_xid_hold_s),
        )

    def anomaly_settings(self) -> AnomalySettings:
        return AnomalySettings(window=self.anomaly_window, sigmas=self.anomaly_sigmas,
                               min_samples=self.anomaly_min_samples, cooldown_s=self.anomaly_cooldown_s)


# Health finding codes that predict a node's failure (docs/configuration.md says why each): YELLOW or
# worse for one of the first asks for a fresh epoch, RED for one of the second moves the job.
CHECKPOINT_REASONS = ("memory", "storage_low", "gpu_temperature", "gpu_ecc", "gpu_remap_failed",
                      "gpu_remap_pending", "gpu_xid", "gpu_unreadable")
MIGRATE_REASONS = ("memory", "storage_low", "gpu_ecc", "gpu_remap_failed", "gpu_xid", "gpu_unreadable",
                   "checkpoint_failures")
ANOMALY_METRICS = ("memory_percent", "gpu*.temperature_c")  # fnmatch patterns of anomaly.v1's metric


class CoordinatorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Sections of their own that this one holds: read from their own [table].
    SECTIONS: ClassVar[dict[str, type[msgspec.Struct]]] = {"checkpoint": CheckpointConfig,
                                                           "resources": ResourcesConfig}

    nats_url: str = "nats://127.0.0.1:4222"
    # The NKey seed (or JWT .creds) file of the coordinator identity (docs/security.md).
    nats_creds: str = ""
    # Replicas of the streams and buckets: 0 picks 3 on a NATS cluster of three servers or more, else 1.
    nats_replicas: int = 0
    name: str = ""
    # NATS client pings: a coordinator whose server is cut off without a reset (a partition)
    # leaves it for another in 2 to 3 s; while it is gone there is no leader.
    ping_interval_s: float = 1.0
    max_outstanding_pings: int = 2
    # Failure detection (Slurm's SlurmdTimeout -> node_timeout_s).  A node is suspect after suspect_timeout_s
    # of silence (or sooner, when phi-accrual says its heartbeats are overdue) and dead once
    # node_timeout_s has passed and a direct probe has failed.
    suspect_timeout_s: float = 1.6
    node_timeout_s: float = 2.5
    phi_suspect: float = 8.0
    probe_timeout_s: float = 0.4
    probe_interval_s: float = 0.4
    tick_interval_s: float = 0.1
    # If the coordinator's own loop stalls or it loses NATS for this long, every node gets a fresh grace period.
    self_stall_grace_s: float = 0.5
    # Dead and left nodes are dropped from the table after this long.
    forget_after_s: float = 3600.0
    event_publish_timeout_s: float = 2.0
    # Slurm's BatchStartTimeout -> start_timeout_s: how long an agent may take to launch a job.
    start_timeout_s: float = 10.0
    # Limit on one checkpoint or restore, as seen by the coordinator.
    checkpoint_timeout_s: float = 3600.0
    # HTTP endpoints (/metrics, /health, /ready, /live); port 0 picks a free one, -1 turns them off.
    http_host: str = "127.0.0.1"
    http_port: int = 9751
    live_stuck_after_s: float = 5.0
    # A revenant_node_health_state series per node in /metrics (off for very large clusters: the
    # counts by state and by health stay).
    node_metrics: bool = True
    # Failover: a dead node's jobs are restored once its lease (the agents' lease_ttl_s) is unrenewed for ttl + margin.
    lease_ttl_s: float = 1.7
    lease_margin_s: float = 0.2
    # Slurm's requeue_timeout -> requeue_timeout_s: how long to keep trying to
    # restore or requeue a dead node's job (no usable node, restore failing) before it fails.
    requeue_timeout_s: float = 30.0
    # Storm protection: more than this fraction of nodes silent at once pauses failover.
    failover_pause_fraction: float = 0.3
    # Restores started per second across the cluster, and at most this many at once.
    restore_rate_per_s: float = 5.0
    max_concurrent_restores: int = 4
    # Standby coordinators: the leader holds a KV lease of this length.
    leader_lease_s: float = 3.0
    # A finished job's record leaves the live table (to the archive, where `show job` still
    # finds it) once it has not changed for this long.
    job_retention_s: float = 7 * 24 * 3600.0
    # The [checkpoint] and [resources] sections: every job's defaults, filled in at submit.
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)
    # Proactive moves (docs/configuration.md): what a sick node does to a scheduled job without --on-sick.
    on_sick: Literal["checkpoint", "migrate", "none"] = "checkpoint"
    proactive_checkpoint_reasons: list[str] = msgspec.field(default_factory=lambda: list(CHECKPOINT_REASONS))
    proactive_migrate_reasons: list[str] = msgspec.field(default_factory=lambda: list(MIGRATE_REASONS))
    proactive_anomaly_metrics: list[str] = msgspec.field(default_factory=lambda: list(ANOMALY_METRICS))
    # Findings held this long act; one action of a kind per job per cooldown; a sick fraction pauses moves.
    proactive_hold_s: float = 2.0
    proactive_cooldown_s: float = 300.0
    proactive_pause_fraction: float = 0.3
    # Per-user limits on submits (coordinator/table/userlimits.py; root's jobs have none), 0: no limit.
    # The jobs a user may have that are not finished ...
    max_jobs_per_user: int = 1000
    # ... and a token bucket per user: this many submits a second, up to the burst at once.
    submit_rate_per_user: float = 10.0
    submit_burst_per_user: int = 50
    # ... and what a user's unfinished jobs may hold at once, summed: memory (each job's --mem, else
    # its [resources] memory_limit; "": no cap), CPUs and GPUs (0: no cap).
    max_memory_per_user: str = "1T"
    max_cpus_per_user: float = 0.0
    max_gpus_per_user: int = 0

    def on_sick_for(self, req: SubmitRequest) -> str:
        """A job's policy on a sick node: the submit's, else the default for a job with a schedule."""
        return req.on_sick or (self.on_sick if req.checkpoint_interval_s else "none")

    def __post_init__(self) -> None:
        if not (0 < self.proactive_pause_fraction <= 1 and self.proactive_hold_s >= 0 <= self.proactive_cooldown_s):
            raise ValueError("proactive_pause_fraction must be in (0, 1], proactive_hold_s and _cooldown_s >= 0")
        if unknown := set(self.proactive_checkpoint_reasons + self.proactive_migrate_reasons) - set(FINDING_CODES):
            raise ValueError(f"unknown finding code {sorted(unknown)[0]!r} in proactive_*_reasons: known are "
                             f"{', '.join(FINDING_CODES)}")
        _positive(self, "lease_ttl_s", "lease_margin_s", "requeue_timeout_s", "restore_rate_per_s",
                  "max_concurrent_restores", "leader_lease_s", "job_retention_s")
        if not 0 < self.failover_pause_fraction <= 1:
            raise ValueError("failover_pause_fraction must be in (0, 1]")
        _positive(self, "ping_interval_s", "max_outstanding_pings")
        _positive(self, "start_timeout_s", "checkpoint_timeout_s", "suspect_timeout_s", "node_timeout_s", "phi_suspect", "probe_timeout_s",
                  "probe_interval_s", "tick_interval_s", "self_stall_grace_s", "forget_after_s",
                  "event_publish_timeout_s")
        if self.node_timeout_s < self.suspect_timeout_s:
            raise ValueError("node_timeout_s must be at least suspect_timeout_s")
        if self.tick_interval_s >= self.self_stall_grace_s:
            raise ValueError("tick_interval_s must be shorter than self_stall_grace_s, "
                             "or every tick would count as a stall and no node would ever be declared dead")
        _port(self.http_port)
        _replicas(self.nats_replicas)
        check_per_user(self)


def _port(port: int) -> None:
    if not -1 <= port <= 65535:
        raise ValueError(f"http_port must be -1 (off), 0 (any) or a port number, got {port}")


def _replicas(n: int) -> None:
    if not 0 <= n <= 5:  # JetStream keeps at most 5 replicas of a stream
        raise ValueError(f"nats_replicas must be 0 (auto) or from 1 to 5, got {n}")


def _positive(cfg: msgspec.Struct, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)!r}")


def _env_overrides(section: str, cls: type[msgspec.Struct], environ: dict[str, str]) -> dict[str, Any]:
    prefix = f"REVENANT_{section.upper()}_"
    fields = set(cls.__struct_fields__)
    # A list from the environment: comma-separated.
    lists = {f.name for f in msgspec.structs.fields(cls) if str(f.type).startswith("list")}
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):].lower()
        if name not in fields:
            raise ConfigError(f"unknown setting {key} (no field {name!r} in [{section}])")
        out[name] = [v.strip() for v in value.split(",") if v.strip()] if name in lists else value
    return out


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    try:
        return tomllib.loads(bare_guide_values(text))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def _build(cls: type[C], section: str, doc: dict[str, Any], path: Any, overrides: dict[str, Any] | None,
           environ: dict[str, str]) -> C:
    values: dict[str, Any] = {}
    section_values = doc.get(section, {})
    if not isinstance(section_values, dict):
        raise ConfigError(f"config file {path}: [{section}] must be a table")
    values.update(guide_spellings(section, section_values, doc) if cls is CheckpointConfig else section_values)
    values.update(_env_overrides(section, cls, environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for name, sub in getattr(cls, "SECTIONS", {}).items():
        if name in values:
            raise ConfigError(f"[{section}] {name}: these settings go in a [{name}] section of their own")
        values[name] = _build(sub, name, doc, path, None, environ)
    try:
        return msgspec.convert(yes_no(cls, values) if cls is CheckpointConfig else values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"[{section}] {exc}") from None


def load_config(
    cls: type[C],
    section: str,
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> C:
    """Build a config from the ``[section]`` of a TOML file, the environment and overrides (and
    the sections it holds, from their own tables and environment variables)."""
    doc = _read(path) if path is not None else {}
    return _build(cls, section, doc, path, overrides, dict(os.environ if environ is None else environ))
