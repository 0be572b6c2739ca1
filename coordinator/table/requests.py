"""Who asks the coordinator, and which jobs they may see and act on.

Every client request arrives on one of two subjects (messages/subjects.py):

- ``revenant.coord.<verb>``: admin (root, operators; and agents, for ``reconcile``), who
  sees and acts on every job and may submit on any user's behalf;
- ``revenant.user.<user>.<verb>``: the Unix user ``<user>``, who sees and acts on the jobs
  whose ``spec.user`` is theirs, and submits as themself only.

Who asks is read from the subject alone, never from a field of the request: in the
authenticated mode the server lets identity ``user-<user>`` publish on its own subjects only,
so the name is the server's word; in the insecure mode it is the client's own claim.

Another user's job answers exactly like a job that does not exist (``unknown job N``), so
that no one learns which ids are taken.  A record stored before jobs had users
(``spec.user == ""``) is shown to admin only: the agent runs such a job as root, and root's
jobs are admin's.

:func:`requester_of`, :func:`may_see`, :func:`visible` and :func:`submit_user` are the rules,
pure; :class:`ClientRequests` answers the job verbs with them, and holds a submit to its user's
limits (coordinator/table/userlimits.py) once it is not a repeat.  :class:`JobControl` does what
a cancel, a signal and a checkpoint that waits for another do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import msgspec

from revenant.common.errors import RevenantError, UnknownJob
from revenant.common.settings.limits import MAX_GRACE_S, BadRequest, check_range, parse_signal, signal_name
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.paging import JobPages, shown
from revenant.coordinator.table.placement import node_address
from revenant.coordinator.table.userlimits import UserLimits
from revenant.messages import (
    CheckJob,
    JobRecord,
    JobReply,
    JobRequest,
    JobsRequest,
    Message,
    SignalJob,
    SubmitRequest,
    decode_as,
    subjects,
)

log = logging.getLogger(__name__)

# The longest a checkpoint or vacate waits for one already in progress (JobRequest.wait_s).
MAX_WAIT_S = 7 * 86400.0
# The user an admin's job runs as when the submit names none.
ROOT_USER = "root"
# The verbs served to users on revenant.user.<user>.<verb> (``reconcile`` is the agents').
USER_VERBS = ("nodes", "submit", "jobs", "job", "checkpoint", "vacate", "restart", "purge", "failover", "check",
              "cancel", "signal")


class Forbidden(RevenantError):
    code = "forbidden"


@dataclasses.dataclass(frozen=True)
class Requester:
    """Who asks: the Unix user ``user``, or admin (``user`` empty)."""

    user: str = ""

    @property
    def admin(self) -> bool:
        return not self.user

    def __str__(self) -> str:
        return "admin" if self.admin else f"user {self.user}"


ADMIN = Requester()


def requester_of(subject: str) -> Requester:
    """Who asks on ``subject``: admin on ``revenant.coord.<verb>``, ``<user>`` on
    ``revenant.user.<user>.<verb>``.  Root asks as admin only: a job recorded as root's
    runs as root, so no user subject may ask for one."""
    user = subjects.user_from_request(subject)
    if user == ROOT_USER:
        raise Forbidden(f"root asks as admin, on {subjects.COORDINATOR_PREFIX}.<verb>, not on {subject}")
    if user is not None:
        return Requester(user)
    if subject.startswith(subjects.COORDINATOR_PREFIX + ".") and subject.count(".") == 2:
        return ADMIN
    raise Forbidden(f"{subject} is not a request subject")


def may_see(asker: Requester, rec: JobRecord) -> bool:
    """Admin sees every job; a user their own (never one from before jobs had users)."""
    return asker.admin or (bool(rec.spec.user) and rec.spec.user == asker.user)


def visible(asker: Requester, job: str, rec: JobRecord | None) -> JobRecord:
    """``rec`` if ``asker`` may see it; else the very error a job that does not exist gives."""
    if rec is None or not may_see(asker, rec):
        raise UnknownJob(f"unknown job {job}")
    return rec


def submit_user(asker: Requester, req: SubmitRequest) -> str:
    """The user a submit's job is recorded as (and runs as): the asking user; admin's choice
    (``req.user``), root when admin names none.  A user naming someone else is refused."""
    if asker.admin:
        return subjects.check_name(req.user, "user name") if req.user else ROOT_USER
    if req.user and req.user != asker.user:
        raise Forbidden(f"user {asker.user} may not submit as {req.user}: only admin (root) submits "
                        "on another user's behalf (revenant submit --user)")
    return asker.user


def check_admin(asker: Requester, what: str) -> None:
    if not asker.admin:
        raise Forbidden(f"{what} is for admin (root) only; {asker} asked")


class ClientRequests:
    """Answers clients' job verbs (submit, jobs, job, checkpoint, vacate, restart, purge) for
    whoever asks, with the rules above.  The coordinator acting on its own (failover,
    periodic checkpoints, archiving, drains) goes to the :class:`JobService` directly."""

    VERBS = ("submit", "jobs", "job", "checkpoint", "vacate", "restart", "purge", "check", "cancel", "signal")

    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs
        self.control = JobControl(jobs)
        self._pages = JobPages()
        # Submits with a request id under way, by (user, request id): a repeat waits for the first.
        self._submitting: dict[tuple[str, str], asyncio.Event] = {}
        # A submit under way whose job is in the table already is told by its request id.
        self.limits = UserLimits.of(jobs.config, made=jobs.made_by)

    async def answer(self, verb: str, data: bytes, asker: Requester) -> Message:
        jobs = self.jobs
        if verb == "submit":
            req_s = decode_as(data, SubmitRequest)
            return JobReply(job=await self.submit(req_s, submit_user(asker, req_s)))
        if verb == "jobs":
            req_j = decode_as(data, JobsRequest)
            keep = None if asker.admin else (lambda rec: may_see(asker, rec))
            return self._pages.page(jobs.jobs, req_j.after, req_j.limit, keep=keep)
        req = decode_as(data, JobRequest)
        subjects.check_name(req.job, "job id")
        if verb == "job":
            rec = jobs.jobs.get(req.job)
            archived = rec is None and (rec := await jobs.store.load_archived(req.job)) is not None
            notes = ["archived: finished more than job_retention_s ago, so `revenant jobs` no longer lists it"]
            return JobReply(job=self._placed(shown(visible(asker, req.job, rec))), notes=notes if archived else [])
        if verb == "check":  # what in the running job will not survive a checkpoint or a move
            rec = visible(asker, req.job, jobs.jobs.get(req.job))
            if rec.state != "running" or not rec.node:
                raise RevenantError(f"job {req.job} is {rec.state}; only a running job can be checked",
                                    code="bad_state")
            found = await jobs.agents.send(rec.node, "check", CheckJob(job=req.job, generation=rec.generation),
                                           jobs.config.start_timeout_s)
            return JobReply(job=self._placed(rec), resources=found.resources)
        if verb not in ("checkpoint", "vacate", "restart", "purge", "cancel", "signal"):
            raise RevenantError(f"unknown request {verb!r}", code="unknown_command")
        if not asker.admin:  # the user never changes: checked once, before acting
            visible(asker, req.job, jobs.jobs.get(req.job) or await jobs.store.load_archived(req.job))
        stats: dict[str, float] = {}  # criu's, of the dump or restore
        if verb in ("checkpoint", "vacate"):
            check_range("--wait", req.wait_s, 0.0, MAX_WAIT_S)
            rec, notes = await self.control.checkpoint(req.job, req.wait_s, stop=verb == "vacate", cause="operator",
                                                       stats=stats)
        elif verb == "cancel":
            ask = cancel_input(req, str(asker))  # a bad signal is refused before the job is looked up
            if req.job not in jobs.jobs and await jobs.store.load_archived(req.job) is not None:
                raise lc.BadState(f"job {req.job} has already ended and been archived; nothing to cancel")
            rec, notes = await self.control.cancel(req.job, ask)
        elif verb == "signal":
            rec, notes = await self.control.signal(req.job, req)
        elif verb == "restart":
            rec, notes = await jobs.restart(req.job, req.node, req.epoch, stats=stats)
        else:
            rec, notes = await jobs.purge(req.job)
        return JobReply(job=self._placed(rec), notes=notes, stats=stats)

    def _placed(self, rec: JobRecord) -> JobRecord:
        """``rec`` with its node's address, where clients reach its listening ports."""
        return msgspec.structs.replace(rec, address=node_address(self.jobs.nodes(), rec.node))

    async def submit(self, req: SubmitRequest, user: str) -> JobRecord:
        """A submit; one with a request id that already made a job (its reply was lost, or a
        leader changed, and the client asked again) is answered with that job, never a second.
        Only a submit that is not such a repeat meets its user's limits: a repeat is never
        refused, and takes no token."""
        ask = self.jobs.config.resources.ask(req)  # what the job would hold, for the per-user totals
        if not req.request_id:
            with self.limits.admitting(user, self.jobs.jobs, ask=ask):
                return await self.jobs.submit(req, user=user, ask=ask)
        key = (user, req.request_id)
        while (first := self._submitting.get(key)) is not None:
            await first.wait()  # the same submit is under way: its job is the answer
        made = self.jobs.made_by(user, req.request_id)
        if made is not None:
            if (made.spec.argv, made.spec.workdir, made.spec.env) != (req.argv, req.workdir, req.env):
                raise RevenantError(f"request id {req.request_id} already made job {made.spec.id}, which runs "
                                    f"another command", code="request_id_reused")
            if made.state == "failed" and not made.pid:  # it never started: as the first answer said
                raise RevenantError(f"job {made.spec.id} could not start: {made.reason}", code="start_failed")
            log.info("job %s: its submit %s came again: answered with the job", made.spec.id, req.request_id)
            return made
        self._submitting[key] = done = asyncio.Event()
        try:
            with self.limits.admitting(user, self.jobs.jobs, req.request_id, ask):
                return await self.jobs.submit(req, user=user, ask=ask)
        finally:
            del self._submitting[key]
            done.set()


# ---------------------------------------------------------------------- cancel, signal, a checkpoint that waits


# Between two looks at a job whose checkpoint is in progress (the table's own state: no request).
BUSY_POLL_S = 0.05
# Once the table says the job runs, but its node is still busy with it (a drain, a conversion).
NODE_BUSY_POLL_S = 0.25
# Beyond a cancel's grace, how long its node has to kill the job and answer.
KILL_TIMEOUT_S = 15.0


def cancel_input(req: JobRequest, who: str) -> lc.CancelAsked:
    """The lifecycle's input for a cancel request: its signal parsed, its grace in range."""
    check_range("--grace", req.grace_s, 0.0, MAX_GRACE_S)
    signum = parse_signal(req.signal) if req.signal else 0
    if req.grace_s and not signum:
        raise BadRequest("--grace needs a --signal to send first (without one the job is killed at once)")
    return lc.CancelAsked(reason=f"cancelled by {who}", signal=signum, grace_s=req.grace_s)


class JobControl:
    """What an operator (or a job's user) does to a job beside the checkpoint verbs: cancel it, signal
    it, and checkpoints that wait for one already in progress.  A shell over the
    :class:`~revenant.coordinator.table.jobs.JobService`, as that one is over the lifecycle.

    A cancel is recorded before any copy is told: the record says *cancelled* (an ended state that
    failover never restores) and only then is the node's copy killed, with the cancel's signal and
    grace first.  Whatever happens to that kill, no copy survives the record: a start or restore of
    the job still in flight is superseded on its node (a late one is refused there), a frozen copy
    asking to thaw is told to die (``lifecycle._thaw_asked``), and a node that reconciles finds it
    stale (``lifecycle.stale_local_jobs``).  A checkpoint the cancel cuts short fails whole; its
    epoch is never listed (epochs commit by a rename, agent/storage/epochs.py), and the epochs before
    stay for ``checkpoint restart`` until the job is purged."""

    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs

    async def cancel(self, job: str, ask: lc.CancelAsked) -> tuple[JobRecord, list[str]]:
        """End ``job`` without a checkpoint (see the module's docstring); the notes say what its
        node did."""
        try:
            decision = await self.jobs.step(job, ask)
        except lc.BadState:
            rec = self.jobs.get(job)
            if rec.state == lc.State.CANCELLED and rec.node:  # its kill may never have arrived: again
                await self.jobs.agents.abandon(rec.node, job, rec.generation, rec.reason or ask.reason)
            raise
        notes: list[str] = []
        for kill in decision.commands:
            try:
                await self.jobs.agents.carry_out(kill, kill.grace_s + KILL_TIMEOUT_S)
            except RevenantError as exc:
                if exc.code in ("not_running", "stale_generation"):
                    continue  # it ended, or never came up: nothing of it runs there
                log.warning("job %s: cancelled, but node %s did not confirm the kill: %s", job, kill.node, exc)
                notes.append(f"node {kill.node} did not confirm the kill ({exc}); cancel again to send it again "
                             f"(a copy left frozen there is killed when it asks to go on)")
        return self.jobs.get(job), notes

    async def signal(self, job: str, req: JobRequest) -> tuple[JobRecord, list[str]]:
        """Deliver ``req.signal`` to the job's program (``req.all``: every process of the job)."""
        signum = parse_signal(req.signal)
        rec = self.jobs.get(job)
        if rec.state == lc.State.CHECKPOINTING:  # the dump would save it, for a restart to deliver again
            raise lc.JobBusy(f"job {job} is being checkpointed; signal it once that ends")
        if rec.state != lc.State.RUNNING or not rec.node:
            raise lc.BadState(f"job {job} is {rec.state}; only a running job can be signalled")
        reply = await self.jobs.agents.send(rec.node, "signal", SignalJob(job=job, generation=rec.generation,
                                                                          signal=signum, all=req.all),
                                            self.jobs.config.start_timeout_s)
        name, pids = signal_name(signum), ", ".join(str(p) for p in reply.signalled[:20])
        whom = (f"{len(reply.signalled)} process(es) of the job (pid {pids}{', ...' * (len(reply.signalled) > 20)})"
                if req.all else f"its program, pid {pids}")
        self.jobs.event(rec, "signalled", reason=f"{name} to {whom}")
        return self.jobs.get(job), [f"{name} sent to {whom} on {rec.node}"]

    async def checkpoint(self, job: str, wait_s: float, **kw) -> tuple[JobRecord, list[str]]:
        """:meth:`JobService.checkpoint`, after one already in progress (the table's, or its node's)
        for up to ``wait_s``; then this one is taken."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self.jobs.checkpoint(job, **kw)
            except RevenantError as exc:
                if exc.code != lc.JobBusy.code or time.monotonic() >= deadline:
                    raise
                table_busy = isinstance(exc, lc.JobBusy)
                await asyncio.sleep(min(BUSY_POLL_S if table_busy else NODE_BUSY_POLL_S,
                                        max(0.0, deadline - time.monotonic())))
