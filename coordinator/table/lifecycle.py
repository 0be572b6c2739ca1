"""The job lifecycle, free of I/O: states, and one transition function.

``transition(record, input, now)`` returns a :class:`Decision`: the record to
write (None: nothing changes), the commands to send to agents, and the events
to publish.  The shell (:mod:`revenant.coordinator.table.jobs`) feeds it inputs under
the job's lock, writes the record, and carries out the commands; an agent's
reply comes back as the next input.  Nothing here reads a clock, a store or
the bus, so every rule is tested with plain values (tests/test_lifecycle.py).

The rules that keep a job from running twice live here:

* every launch (start or restore) carries a new generation, and the record
  names the one node allowed to run it; an agent kills any older generation
  it finds (it asks the leader through :func:`stale_local_jobs`);
* a reply or an agent's report about an older generation, or from another
  node, changes nothing;
* an ended job stays ended (only an operator's ``restart`` takes a failed job with a checkpoint back).
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping

import msgspec

from revenant.common import retention
from revenant.common.errors import JobNotRunning
from revenant.coordinator.table.epoch_rules import epoch_converted, with_reported_epoch
from revenant.coordinator.table.job_inputs import (  # the lifecycle's vocabulary, used as lifecycle.X
    AgentReport, BadState, CancelAsked, CheckpointAsked, CheckpointFailed, Checkpointed, Command, Decision, Emit,
    EpochConverted, JobBusy, Kill, Launched, NoEpoch, LaunchFailed, Placed, Purged, Recover, RecoveryAttemptFailed,
    RecoveryFailed, RestartAsked, RestartFailed, Restore, Restored, Start, Checkpoint, Submit, ThawAsked, Waiting,
    Input, TRANSITIONS,
)
from revenant.common.settings.resources import Usage
from revenant.messages import EpochInfo, JobGpu, JobRecord, LocalJob, StaleJob


class State(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    VACATED = "vacated"
    RESTORING = "restoring"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A job in one of these states may have a copy on its node (or one on the way).
ACTIVE = frozenset({State.PENDING, State.RUNNING, State.CHECKPOINTING, State.RESTORING})
ENDED = frozenset({State.COMPLETED, State.FAILED, State.CANCELLED})
# An ended job an operator may restart from one of its epochs.
RESTARTABLE = frozenset({State.VACATED, State.FAILED, State.CANCELLED})


# ---------------------------------------------------------------------- the transition function


def transition(rec: JobRecord | None, inp: Input, now: float) -> Decision:
    """What ``inp`` does to the job ``rec`` at wall time ``now``.  Never mutates ``rec``.
    Raises a :class:`RevenantError` for an operator's request the job's state refuses."""
    if isinstance(inp, Submit):
        return _submit(inp, now)
    if rec is None:
        return Decision()
    handler = _HANDLERS[type(inp)]
    return handler(rec, inp, now)


def _copy(rec: JobRecord, **changes: Any) -> JobRecord:
    changes.setdefault("epochs", list(rec.epochs))
    return msgspec.structs.replace(rec, **changes)


def _submit(inp: Submit, now: float) -> Decision:
    if not inp.node:  # no room anywhere now: it waits, launched by no one (generation 0)
        rec = JobRecord(spec=inp.spec, state=State.PENDING, generation=0, created_at=now, reason=inp.waiting)
        return Decision(rec, [], [Emit("submitted", {"reason": inp.waiting})])
    rec = JobRecord(spec=inp.spec, state=State.PENDING, node=inp.node, generation=1, created_at=now,
                    assigned_gpus=list(inp.gpus))
    return Decision(rec, [Start(inp.node, inp.spec, 1, gpus=inp.gpus)], [Emit("submitted")])


def queued(rec: JobRecord) -> bool:
    """A submitted job waiting for room on some node: never launched, no node."""
    return rec.state == State.PENDING and rec.generation == 0


def _placed(rec: JobRecord, inp: Placed, now: float) -> Decision:
    if not queued(rec):
        return Decision()
    new = _copy(rec, node=inp.node, generation=1, assigned_gpus=list(inp.gpus), reason="")
    return Decision(new, [Start(inp.node, rec.spec, 1, gpus=inp.gpus)])


def _waiting(rec: JobRecord, inp: Waiting, now: float) -> Decision:
    if rec.reason == inp.reason or rec.state not in ACTIVE:
        return Decision()
    return Decision(_copy(rec, reason=inp.reason))


def _launched(rec: JobRecord, inp: Launched, now: float) -> Decision:
    if rec.generation != inp.generation:
        return Decision()
    if rec.state == State.PENDING:
        return Decision(_copy(rec, state=State.RUNNING, pid=inp.pid, program_pid=inp.program_pid,
                              last_checkpoint_at=now, output=inp.output, restored_from=0))
    return Decision(_copy(rec, output=inp.output))  # it already exited (the event came first)


def _launch_failed(rec: JobRecord, inp: LaunchFailed, now: float) -> Decision:
    if rec.state != State.PENDING or rec.generation != inp.generation:
        return Decision()
    if inp.retry_node is None:
        return Decision(_copy(rec, state=State.FAILED, reason=inp.reason))
    generation = rec.generation + 1
    new = _copy(rec, node=inp.retry_node, generation=generation, assigned_gpus=list(inp.retry_gpus))
    return Decision(new, [Start(inp.retry_node, rec.spec, generation, gpus=inp.retry_gpus)])


def _checkpoint_asked(rec: JobRecord, inp: CheckpointAsked, now: float) -> Decision:
    if rec.state == State.CHECKPOINTING:
        raise JobBusy(f"job {rec.spec.id} already has a checkpoint in progress")
    if rec.state != State.RUNNING:
        raise JobNotRunning(f"job {rec.spec.id} is {rec.state}, not running")
    return Decision(_copy(rec, state=State.CHECKPOINTING),
                    [Checkpoint(rec.node, rec.spec.id, rec.generation, inp.stop, inp.scheduled, inp.force,
                                inp.evict if inp.stop else "", inp.cause, inp.reasons)])


def _checkpointed(rec: JobRecord, inp: Checkpointed, now: float) -> Decision:
    new = _copy(rec)
    if inp.epochs:  # the agent's own listing, fresh (own bytes change as epochs become deltas)
        fresh = {e.n: e for e in inp.epochs}
        if inp.epoch is not None:
            fresh.setdefault(inp.epoch.n, inp.epoch)
        new.epochs = keep_epochs(sorted(fresh.values(), key=lambda e: e.n), rec.spec.max_epochs)
    elif inp.epoch is not None:
        listed = [e for e in rec.epochs if e.n != inp.epoch.n and e.n not in inp.pruned]
        new.epochs = keep_epochs(listed + [inp.epoch], rec.spec.max_epochs)
    if inp.epoch is not None:
        new.last_checkpoint_at, new.last_checkpoint_error, new.blocking = now, "", ""
        if all(e.n <= inp.epoch.n for e in new.epochs):  # the newest: its GPUs (none: it let go of them)
            new.gpus, new.gpu_driver = list(inp.epoch.gpus), inp.epoch.gpu_driver if inp.epoch.gpus else ""
    if inp.storage_bytes:
        new.storage_bytes = inp.storage_bytes
    if rec.generation == inp.generation and rec.state == State.CHECKPOINTING:
        if inp.stop and inp.evicted:  # a move: failover restores it elsewhere, as after a drain
            new.state, new.pid = State.RESTORING, 0
            return Decision(new, outcome="evicted")
        if inp.stop:
            new.state, new.node, new.pid = State.VACATED, "", 0
        else:
            new.state = State.RUNNING
    return Decision(new)


def _checkpoint_failed(rec: JobRecord, inp: CheckpointFailed, now: float) -> Decision:
    error, blocking = inp.error or rec.last_checkpoint_error, inp.error if inp.blocking else rec.blocking
    events = [Emit("not_checkpointable", {"reason": inp.error})] if inp.blocking and not rec.blocking else []
    mine = {"state": State.RUNNING} if rec.state == State.CHECKPOINTING and rec.generation == inp.generation else {}
    new = _copy(rec, last_checkpoint_error=error, blocking=blocking, **mine)
    return Decision(new if mine or new != rec else None, events=events)


def _cancel_asked(rec: JobRecord, inp: CancelAsked, now: float) -> Decision:
    """Ended at once, whatever it was doing: the record says cancelled before any copy is told,
    so no failover restores it, and a copy that outlives the kill is stale wherever it runs."""
    if rec.state in ENDED:
        ended = "is already cancelled" if rec.state == State.CANCELLED else f"has already ended ({rec.state})"
        raise BadState(f"job {rec.spec.id} {ended}; nothing to cancel")
    new = _copy(rec, state=State.CANCELLED, pid=0, program_pid=0, reason=inp.reason)
    kill = [Kill(rec.node, rec.spec.id, rec.generation, inp.reason, inp.signal, inp.grace_s)] if rec.node else []
    if rec.state == State.VACATED:
        kill = []  # no copy anywhere: its epochs stay for a restart
    return Decision(new, kill, [Emit("cancelled", {"reason": inp.reason})])


def check_restart(rec: JobRecord, epoch: int = 0) -> None:
    """Refuse a restart the job's state does not allow (before a node is chosen for it), or one
    from an ``epoch`` (0: the newest restorable) the job does not keep."""
    if rec.state not in RESTARTABLE:
        raise BadState(f"job {rec.spec.id} is {rec.state}; only a vacated, failed or cancelled job can be restarted")
    if not rec.epochs:
        raise NoEpoch(f"job {rec.spec.id} has no checkpoint to restart from")
    if epoch and all(e.n != epoch for e in rec.epochs):
        kept = ", ".join(str(e.n) for e in rec.epochs)
        raise NoEpoch(f"job {rec.spec.id} has no epoch {epoch}; it keeps epoch{'s' * (len(rec.epochs) > 1)} {kept}")


def gpus_of(rec: JobRecord, epoch: int = 0) -> tuple[list[JobGpu], str]:
    """The GPUs (and driver) a restore of ``rec`` from ``epoch`` (0: the newest) needs."""
    chosen = next((e for e in rec.epochs if e.n == epoch), None) if epoch else None
    return (list(chosen.gpus), chosen.gpu_driver) if chosen is not None else (list(rec.gpus), rec.gpu_driver)


def _restart_asked(rec: JobRecord, inp: RestartAsked, now: float) -> Decision:
    check_restart(rec, inp.epoch)
    generation = rec.generation + 1
    new = _copy(rec, generation=generation, state=State.RESTORING, node=inp.target, pid=0, program_pid=0, reason="",
                exit_code=None, assigned_gpus=list(inp.gpus))
    return Decision(new, [Restore(inp.target, rec.spec, generation, epoch=inp.epoch, gpus=inp.gpus)])


def _restored(rec: JobRecord, inp: Restored, now: float) -> Decision:
    if rec.generation != inp.generation or rec.state not in (State.RESTORING, State.PENDING) or not rec.node:
        return Decision()  # not the attempt the record names (one given up on has no node)
    new = _copy(rec, state=State.RUNNING, pid=inp.pid, program_pid=inp.program_pid, last_checkpoint_at=now,
                output=inp.output or rec.output)
    new.restored_from = inp.epoch.n if inp.epoch is not None else 0  # none: a requeue's fresh start
    if inp.epoch is not None:  # a restore's reply describes its epoch in full (an event only numbers it)
        new.epochs = [_described(e, inp.epoch) if e.n == inp.epoch.n else e for e in rec.epochs]
    if not inp.announce:
        return Decision(new)
    e = inp.epoch or EpochInfo(n=0)
    return Decision(new, events=[Emit("restored", {
        "pid": inp.pid, "epoch": inp.epoch.n if inp.epoch else None, "listening": list(e.listening),
        "reason": inp.announce if isinstance(inp.announce, str) else "", "kept": list(inp.kept),
        "closed": [c for c in e.connections if c not in inp.kept]})])


def _described(known: EpochInfo, told: EpochInfo) -> EpochInfo:
    """A restore's reply on its epoch, but for the storage a delta's leaves uncounted (own bytes 0):
    what the table knew of that (its conversion's report)."""
    if told.own_bytes or not known.own_bytes:
        return told
    return msgspec.structs.replace(told, own_bytes=known.own_bytes, plain_bytes=known.plain_bytes,
                                   packed_bytes=known.packed_bytes, newer_bytes=known.newer_bytes)


def _restart_failed(rec: JobRecord, inp: RestartFailed, now: float) -> Decision:
    if rec.state != State.RESTORING or rec.generation != inp.generation:
        return Decision()
    return Decision(_copy(rec, state=inp.previous_state, node=inp.previous_node, reason=inp.reason))


def _agent_report(rec: JobRecord, inp: AgentReport, now: float) -> Decision:
    ev = inp.event
    if ev.kind not in ("exited", "killed", "vacated", "evicted"):
        return Decision()
    if rec.generation != ev.generation or rec.node != ev.node:
        return Decision()  # a stale copy's report
    if ev.kind == "vacated":
        # Normally the vacate's reply says so first; this covers a lost reply (or leader).
        if rec.state not in (State.RUNNING, State.CHECKPOINTING):
            return Decision()
        return Decision(_copy(with_reported_epoch(rec, ev), state=State.VACATED, node="", pid=0))
    if ev.kind == "evicted":
        # Its node stopped it (a drain, a fence): it goes on elsewhere, from its newest epoch.
        # Saved as restoring: should this leader die first, its successor redoes it.
        if rec.state not in ACTIVE:
            return Decision()
        return Decision(_copy(with_reported_epoch(rec, ev), state=State.RESTORING, pid=0, reason=ev.reason),
                        outcome="evicted")
    if rec.state not in ACTIVE:
        return Decision()
    if ev.kind == "killed" and rec.state in (State.PENDING, State.RESTORING):
        return Decision()  # an attempt this coordinator abandoned (or superseded): its retry goes on
    code = ev.exit_code if ev.exit_code is not None else -1
    ok = code == 0 and ev.kind == "exited"
    new = _copy(rec, exit_code=code, state=State.COMPLETED if ok else State.FAILED, pid=0)
    if not ok:
        new.reason = ev.reason or ("killed" if ev.kind == "killed" else f"exited with status {code}")
    return Decision(new)


def _recover(rec: JobRecord, inp: Recover, now: float) -> Decision:
    """The recovery choice: nothing (it ended, was vacated, or runs elsewhere), fail it (no
    checkpoint, no --requeue), restore it from its newest epoch, or start it afresh."""
    if not needs_recovery(rec, inp.dead):
        return Decision()
    if inp.fence_token is not None and inp.fence_token != rec.fence_token:
        return Decision()  # a frozen copy was let thaw after this failover began: it keeps the job
    # A launch the old leader left (no dead node) barely ran: start it again, requeue or not.
    relaunch = not inp.dead and rec.state == State.PENDING
    if not rec.epochs and not rec.spec.requeue and not relaunch:
        lost = f"node {inp.dead} stopped it ({inp.evicted})" if inp.evicted else f"node {inp.dead} died"
        reason = f"{lost} and the job has no checkpoint (submit with --requeue to rerun it)"
        return Decision(_copy(rec, state=State.FAILED, pid=0, reason=reason), outcome="failed")
    generation = rec.generation + 1
    new = _copy(rec, generation=generation, node=inp.target, pid=0, reason="", exit_code=None,
                state=State.RESTORING if rec.epochs else State.PENDING, assigned_gpus=list(inp.gpus))
    commands: list[Command] = []
    if rec.node not in (inp.dead, inp.target, ""):
        # A half-finished earlier attempt (say, of a coordinator that died) must not live on.
        commands.append(Kill(rec.node, rec.spec.id, rec.generation))
    commands.append(Restore(inp.target, rec.spec, generation, gpus=inp.gpus) if rec.epochs
                    else Start(inp.target, rec.spec, generation, fresh=True, gpus=inp.gpus))
    return Decision(new, commands)


def needs_recovery(rec: JobRecord, dead: str) -> bool:
    """Whether a job lost with node ``dead`` still needs recovering (not ended, vacated or
    already running elsewhere)."""
    return rec.state in ACTIVE and not queued(rec) and not (rec.state == State.RUNNING and rec.node not in (dead, ""))


def _thaw_asked(rec: JobRecord, inp: ThawAsked, now: float) -> Decision:
    """A frozen copy may go on only if the record still names it (same node, same generation)
    and the job runs; the token it bumps voids any failover that began before.  Anything else
    (moved on, vacated, ended, given up on) and the copy is killed."""
    if (rec.node, rec.generation) == (inp.node, inp.generation) and rec.state in (State.RUNNING,
                                                                                   State.CHECKPOINTING):
        return Decision(_copy(rec, fence_token=rec.fence_token + 1), outcome="thaw")
    return Decision(outcome="kill")


def _recovery_attempt_failed(rec: JobRecord, inp: RecoveryAttemptFailed, now: float) -> Decision:
    if rec.generation != inp.generation or rec.state not in (State.RESTORING, State.PENDING):
        return Decision()
    return Decision(_copy(rec, state=State.RESTORING, node="", reason=inp.reason))


def _recovery_failed(rec: JobRecord, inp: RecoveryFailed, now: float) -> Decision:
    if rec.state not in ACTIVE:
        return Decision()
    return Decision(_copy(rec, state=State.FAILED, node="", pid=0, reason=inp.reason))


def _purged(rec: JobRecord, inp: Purged, now: float) -> Decision:
    if rec.state not in ENDED:
        return Decision()
    return Decision(_copy(rec, epochs=[]), events=[Emit("purged")])


_HANDLERS: dict[type, Any] = {
    Launched: _launched, LaunchFailed: _launch_failed, CheckpointAsked: _checkpoint_asked,
    Checkpointed: _checkpointed, CheckpointFailed: _checkpoint_failed, RestartAsked: _restart_asked,
    Restored: _restored, RestartFailed: _restart_failed, AgentReport: _agent_report, Recover: _recover,
    CancelAsked: _cancel_asked, ThawAsked: _thaw_asked, EpochConverted: epoch_converted, Placed: _placed,
    RecoveryAttemptFailed: _recovery_attempt_failed, RecoveryFailed: _recovery_failed, Purged: _purged,
    Waiting: _waiting,
}


def check_purge(rec: JobRecord) -> None:
    if rec.state not in ENDED:
        raise BadState(f"job {rec.spec.id} is {rec.state}; only a finished job can be purged")


# ---------------------------------------------------------------------- rules beside the transitions


def keep_epochs(epochs: list[EpochInfo], max_epochs: int) -> list[EpochInfo]:
    """The epochs the table lists for a job: the same retention rule as the agent's."""
    return retention.kept(epochs, max_epochs)


def moved_on(stored: JobRecord, mine: JobRecord) -> bool:
    """Whether ``stored`` is ahead of ``mine``: a newer generation, or the same one ended.  A
    leader that finds its write conflicting with such a record takes it as the truth."""
    return stored.generation > mine.generation or (
        stored.generation == mine.generation and stored.state in ENDED and mine.state not in ENDED)


def takeover_plan(inherited: Mapping[str, tuple[str, int, str]], jobs: Mapping[str, JobRecord],
                  alive: set[str], recovering: Iterable[str] = ()) -> list[tuple[str, str | None]]:
    """The jobs a new leader must recover, as (job, dead node or "") pairs; (job, None) for a
    checkpoint on a live node whose reply went to the old leader.

    ``inherited`` is each job's (state, generation, node) when this leader loaded
    the table.  Only a job this leader has not touched since is the old
    leader's unfinished business: a restart, launch or failover this leader
    started itself has moved the job on (a new generation or state) and is in
    flight, and redoing it would race it onto a second node.
    """
    busy = set(recovering)
    out: list[tuple[str, str | None]] = []
    for job, rec in jobs.items():
        if job not in inherited or job in busy or rec.state not in ACTIVE or queued(rec):
            continue  # (a waiting job is the scheduler's: coordinator/table/queue.py)
        if (rec.state, rec.generation, rec.node) != inherited[job]:
            continue
        if rec.state in (State.RESTORING, State.PENDING):
            # A restore or launch the old leader started may or may not have finished:
            # do it again (the node kills any older generation it runs).
            out.append((job, ""))
        elif rec.node not in alive:
            out.append((job, rec.node))
        elif rec.state == State.CHECKPOINTING:
            out.append((job, None))
    return out


def stale_local_jobs(node: str, local: Iterable[LocalJob], jobs: Mapping[str, JobRecord]) -> list[StaleJob]:
    """The jobs an agent on ``node`` runs that it must kill: the table has moved them to a newer
    generation or another node.  A job the table does not know is left alone."""
    out = []
    for lj in local:
        rec = jobs.get(lj.job)
        if rec is None:
            continue
        # Only an older generation, or this one moved to another node: a newer generation than
        # the table knows is a copy this leader has not heard of yet, never to be killed on its word.
        if rec.state == State.CANCELLED and lj.generation <= rec.generation:
            out.append(StaleJob(job=lj.job, generation=lj.generation, reason="the job was cancelled"))
        elif lj.generation < rec.generation or (lj.generation == rec.generation and rec.node != node):
            out.append(StaleJob(job=lj.job, generation=lj.generation,
                                reason=f"superseded by generation {rec.generation} on {rec.node or 'no node'}"))
    return out


def usage(jobs: Iterable[JobRecord]) -> dict[str, Usage]:
    """What each node's unfinished jobs asked for, and the GPUs they were given there."""
    out: dict[str, Usage] = {}
    for rec in jobs:
        if rec.node and rec.state in ACTIVE:
            out.setdefault(rec.node, Usage()).add(rec.spec.resources, rec.assigned_gpus)
    return out


def jobs_per_node(jobs: Iterable[JobRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in jobs:
        if rec.node and rec.state in ACTIVE:
            out[rec.node] = out.get(rec.node, 0) + 1
    return out
