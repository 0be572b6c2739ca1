"""The one exception root for revenant's runtime (the wire codec has its own,
:class:`revenant.messages.MessageError`).

Every error carries a short machine-readable ``code`` and a ``retriable`` flag;
its ``str()`` is the one line a user sees.
"""

from __future__ import annotations


class RevenantError(Exception):
    code = "error"
    retriable = False

    def __init__(self, message: str, *, code: str | None = None, retriable: bool | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if retriable is not None:
            self.retriable = retriable


class ConfigError(RevenantError):
    code = "bad_config"


class ClusterNotFound(RevenantError):
    code = "no_cluster"


class BusError(RevenantError):
    """NATS could not be reached or did not answer in time."""

    code = "bus"
    retriable = True


class NoResponders(BusError):
    code = "no_responders"


class RequestTimeout(BusError):
    code = "timeout"


class RemoteError(RevenantError):
    """The peer answered with an ``error.v1`` reply."""


class CriuError(RevenantError):
    code = "criu"


class NatsServerError(RevenantError):
    code = "nats_server"


class UnknownJob(RevenantError):
    code = "unknown_job"


class JobNotRunning(RevenantError):
    code = "not_running"


class JobBusy(RevenantError):
    """The job is being checkpointed already (the lifecycle refuses a second one meanwhile)."""

    code = "busy"
    retriable = True


class BadState(RevenantError):
    """The job's state refuses the request (a restart of a running job, a purge of one not ended)."""

    code = "bad_state"


class NoEpoch(RevenantError):
    """The job keeps no epoch to restore from (or not the one asked for)."""

    code = "no_epoch"


class StaleGeneration(RevenantError):
    """A command for a generation of a job that is not (or no longer) the one running."""

    code = "stale_generation"


class CheckpointSkipped(RevenantError):
    """A scheduled checkpoint the agent did not take: its node was over a load threshold (the
    message names the metric, its value and the threshold).  Not a failure of the job: the
    next one is tried on schedule."""

    code = "checkpoint_skipped"
    retriable = True


def described(exc: BaseException) -> str:
    """An exception in a one-line report: its message, or its type's name when it has none (a
    timeout's message is empty)."""
    return str(exc) or type(exc).__name__
