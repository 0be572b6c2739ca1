"""The agent's side of the protocol: what the coordinator commands a node
(``revenant.node.<node>.cmd.<verb>``) and the agent's replies, a dump's or restore's progress,
and an agent's reconcile with the leader.  The rules of messages/types.py hold here too."""

from __future__ import annotations

from revenant.messages.base import Message
from revenant.messages.parts import EpochInfo, JobResource, JobSpec, LocalJob, StaleJob


# -- coordinator -> agent (revenant.node.<node>.cmd.<verb>)


class StartJob(Message, tag="start_job.v1"):
    spec: JobSpec
    generation: int
    # A requeue: discard the output of the earlier run and start clean.
    fresh: bool = False
    # The UUIDs of the node's GPUs the job is given (its CUDA_VISIBLE_DEVICES); []: none asked.
    gpus: list[str] = []


class CheckpointJob(Message, tag="checkpoint_job.v1"):
    job: str
    generation: int
    # Vacate: stop the job once the checkpoint has committed.
    stop: bool = False
    # A periodic checkpoint: only these may be skipped while the node is over a load threshold.
    scheduled: bool = False
    # Take it even over a load threshold.
    force: bool = False
    # With stop: the node stops the job for this reason and reports it "evicted" (a proactive
    # move: the coordinator restores it on another node), not "vacated".
    evict: str = ""
    # Why the checkpoint is taken ("schedule", "operator", "health"; "drain" is the agent's own)
    # and, for "health", the node's findings that asked for it: the epoch event carries both.
    cause: str = ""
    reasons: list[str] = []


class RestoreJob(Message, tag="restore_job.v1"):
    spec: JobSpec
    generation: int
    # Why the job's working directory must be left as it is (other jobs work in it), or "".
    leave_workdir: str = ""
    # 0: the newest epoch that can be restored; N: exactly epoch N, with no fallback.
    epoch: int = 0
    # The node's GPUs the job is given: the epoch's GPUs are restored onto these ([]: none asked).
    gpus: list[str] = []


class KillJob(Message, tag="kill_job.v1"):
    job: str
    generation: int
    reason: str = ""
    # A cancel's: this signal (a number) to every process of the job first, then SIGKILL after
    # ``grace_s`` if it has not ended (0: SIGKILL at once).
    signal: int = 0
    grace_s: float = 0.0


class SignalJob(Message, tag="signal_job.v1"):
    """Deliver ``signal`` (a number) to the job's own program, or (``all``) every process of it."""

    job: str
    generation: int
    signal: int
    all: bool = False


class PurgeJob(Message, tag="purge_job.v1"):
    job: str


class CheckJob(Message, tag="check_job.v1"):
    """What in the running job will not survive a checkpoint or a move (``revenant check``)."""

    job: str
    generation: int


class AgentJobReply(Message, tag="agent_job_reply.v1"):
    job: str
    generation: int
    node: str
    pid: int = 0
    # The job's own program (the init's child; 0: not known); signal: the processes signalled.
    program_pid: int = 0
    signalled: list[int] = []
    output: str = ""
    epoch: EpochInfo | None = None
    freed_bytes: int = 0
    notes: list[str] = []
    # Epochs retention deleted after this checkpoint (corrupt ones go first, so not always the
    # oldest): the job table drops them from its listing.
    pruned: list[int] = []
    # The job's whole checkpoint storage on disk, shared data counted once (0: not reported).
    storage_bytes: int = 0
    # Fresh infos of every epoch the job keeps, oldest first: when not empty, the job table's
    # listing is replaced by them (own bytes change as older epochs become deltas).
    epochs: list[EpochInfo] = []
    # criu's own statistics of this dump or restore (agent/pipeline/criustats.py: times in seconds, pages
    # counted); {}: none reported.
    stats: dict[str, float] = {}
    # check: what the job holds, each with what a checkpoint or a move does to it.
    resources: list[JobResource] = []
    # restore: the epoch's connections that came back intact ("local -> peer": restored on the
    # node whose lock held them since the vacate that took the epoch); the others came back closed.
    kept: list[str] = []


class Progress(Message, tag="progress.v1"):
    """How far a dump or restore has come: about twice a second while it runs, on core NATS at
    ``revenant.progress.<user>.<job>``, for whoever watches.  Best effort: one lost changes nothing."""

    job: str
    # "dump" (criu writing the images), "commit" (checksums and sync), "restore" (criu reading them).
    op: str
    node: str = ""
    # Written (dump, commit) or read (restore) so far; the whole, estimated (0: unknown).
    bytes: int = 0
    total_bytes: int = 0
    # Since the operation started, on the agent's clock.
    elapsed_s: float = 0.0


class ReconcileRequest(Message, tag="reconcile_request.v1"):
    """An agent, after a reconnect or a self-fence, asks the leader which of its jobs it may keep."""

    node: str
    incarnation: str = ""
    jobs: list[LocalJob] = []
    # The agent has just started: it runs nothing an earlier agent of its node ran, so a job
    # the table has running there was lost with that agent (and is restored elsewhere).
    started: bool = False
    # Its connection to NATS broke and came back: what it was asked or answered meanwhile may be lost.
    reconnected: bool = False


class ReconcileReply(Message, tag="reconcile_reply.v1"):
    """The jobs (at the generation the agent runs) that moved on or belong to another node now:
    the agent kills them.  A job the leader does not know is left alone."""

    stale: list[StaleJob] = []
    # Frozen jobs the agent may thaw: still theirs, at the same generation, and no failover of
    # them can now go ahead (the leader recorded the thaw first).
    thaw: list[LocalJob] = []
    # The answering leader's term (subjects.TERM_HEADER); 0: a coordinator from before terms.
    term: int = 0
