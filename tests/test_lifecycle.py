"""The job lifecycle core, pure: its transitions, its rules, and properties that hold for any
sequence of inputs (hypothesis); and the job service shell over an in-memory store."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.common.errors import BusError, JobNotRunning, RevenantError
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.agents import NotLeader
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import MemoryJobStore
from revenant.messages import (
    AgentJobReply,
    Capabilities,
    CriuInfo,
    EpochEvent,
    EpochInfo,
    JobEvent,
    JobGpu,
    JobRecord,
    JobSpec,
    LocalJob,
    NodeStatus,
    SubmitRequest,
)

pytestmark = pytest.mark.unit

NODES = ("node-1", "node-2", "node-3")
SPEC = JobSpec(id="7", argv=["sleep", "1000"], max_epochs=2)


def record(state: str, generation: int = 1, node: str = "node-1", epochs=(), requeue: bool = False) -> JobRecord:
    spec = JobSpec(id="7", argv=["true"], max_epochs=2, requeue=requeue)
    return JobRecord(spec=spec, state=state, generation=generation, node=node, pid=99,
                     epochs=[EpochInfo(n=n) for n in epochs])


def report(kind: str, generation: int, node: str, **kw) -> lc.AgentReport:
    return lc.AgentReport(JobEvent(job="7", kind=kind, at=5.0, node=node, generation=generation, **kw))


# ---------------------------------------------------------------------- single transitions


def test_submit_starts_generation_one_on_the_placed_node():
    d = lc.transition(None, lc.Submit(SPEC, "node-2"), 10.0)
    assert (d.record.state, d.record.node, d.record.generation, d.record.created_at) == ("pending", "node-2", 1, 10.0)
    assert d.commands == [lc.Start("node-2", SPEC, 1)] and [e.kind for e in d.events] == ["submitted"]


def test_a_start_reply_after_the_exit_event_does_not_bring_the_job_back():
    rec = lc.transition(record("pending"), report("exited", 1, "node-1", exit_code=0), 1.0).record
    assert rec.state == "completed"
    late = lc.transition(rec, lc.Launched(1, 4242, "/out"), 2.0).record
    assert late.state == "completed" and late.output == "/out"


def test_a_refused_start_moves_to_the_next_node_with_a_new_generation():
    d = lc.transition(record("pending"), lc.LaunchFailed(1, "refused", retry_node="node-2"), 1.0)
    assert (d.record.node, d.record.generation) == ("node-2", 2)
    assert d.commands == [lc.Start("node-2", d.record.spec, 2)]
    failed = lc.transition(record("pending"), lc.LaunchFailed(1, "start on node-1 failed: x"), 1.0).record
    assert (failed.state, failed.reason) == ("failed", "start on node-1 failed: x")


def test_checkpoint_requests_are_refused_unless_running():
    with pytest.raises(lc.JobBusy):
        lc.transition(record("checkpointing"), lc.CheckpointAsked(stop=False), 1.0)
    with pytest.raises(JobNotRunning, match="job 7 is vacated, not running"):
        lc.transition(record("vacated"), lc.CheckpointAsked(stop=True), 1.0)
    d = lc.transition(record("running", 3), lc.CheckpointAsked(stop=True), 1.0)
    assert d.record.state == "checkpointing" and d.commands == [lc.Checkpoint("node-1", "7", 3, True)]


def test_a_vacate_reply_keeps_the_newest_epochs_by_the_shared_retention_rule():
    rec = record("checkpointing", epochs=[1, 2])
    d = lc.transition(rec, lc.Checkpointed(1, True, EpochInfo(n=3)), 9.0)
    assert ([e.n for e in d.record.epochs], d.record.state, d.record.node) == ([2, 3], "vacated", "")
    assert d.record.last_checkpoint_at == 9.0
    assert [e.n for e in rec.epochs] == [1, 2]  # the input record is never mutated


def test_a_move_is_a_vacate_that_leaves_the_job_to_failover():
    d = lc.transition(record("running", 3), lc.CheckpointAsked(stop=True, force=True, evict="moved off sick node-1",
                                                               cause="health", reasons=("memory 97% >= 95%",)), 1.0)
    assert d.commands == [lc.Checkpoint("node-1", "7", 3, True, False, True, "moved off sick node-1", "health",
                                        ("memory 97% >= 95%",))]
    moved = lc.transition(d.record, lc.Checkpointed(3, True, EpochInfo(n=4), evicted=True), 2.0)
    # Restoring on its old node's name until failover places it (a new leader redoes it from there).
    assert (moved.outcome, moved.record.state, moved.record.node, moved.record.pid) == ("evicted", "restoring",
                                                                                        "node-1", 0)
    assert [e.n for e in moved.record.epochs] == [4] and moved.record.last_checkpoint_at == 2.0
    # The agent's "evicted" report after the reply changes nothing more; a plain checkpoint never evicts.
    assert lc.transition(moved.record, report("evicted", 3, "node-1", epoch=4), 3.0).outcome == "evicted"
    plain = lc.transition(record("running", 3), lc.CheckpointAsked(stop=False, evict="x"), 1.0)
    assert plain.commands[0].evict == ""
    failed = lc.transition(d.record, lc.CheckpointFailed(3, "criu: boom"), 2.0).record
    assert (failed.state, failed.node) == ("running", "node-1")  # a failed move leaves the job where it was


def test_a_job_that_blocks_its_checkpoints_is_told_once_and_cleared_by_the_next_epoch():
    why = "checkpoint of 1 refused: the job holds an io_uring instance (process 7 fd 3)"
    asked = lc.transition(record("running", 2), lc.CheckpointAsked(stop=False, scheduled=True), 1.0).record
    first = lc.transition(asked, lc.CheckpointFailed(2, why, blocking=True), 2.0)
    assert first.record.state == "running" and first.record.blocking == why
    assert [(e.kind, e.fields["reason"]) for e in first.events] == [("not_checkpointable", why)]
    again = lc.transition(first.record, lc.CheckpointFailed(2, why, blocking=True), 3.0)
    assert again.events == []  # published the first time only
    other = lc.transition(first.record, lc.CheckpointFailed(2, "criu: boom"), 4.0).record
    assert other.blocking == why and other.last_checkpoint_error == "criu: boom"  # what blocks is still held
    done = lc.transition(lc.transition(other, lc.CheckpointAsked(stop=False), 5.0).record,
                         lc.Checkpointed(2, False, EpochInfo(n=1)), 6.0).record
    assert done.blocking == "" and done.last_checkpoint_error == ""


def test_reports_of_another_generation_or_node_change_nothing():
    rec = record("running", 2, "node-1")
    for inp in (report("exited", 1, "node-1", exit_code=0), report("exited", 2, "node-2", exit_code=0),
                report("evicted", 1, "node-1"), report("vacated", 2, "node-3", epoch=4)):
        assert not lc.transition(rec, inp, 1.0).changed


def test_an_eviction_hands_the_job_to_failover_with_its_reported_epoch():
    d = lc.transition(record("running", 2, epochs=[1]), report("evicted", 2, "node-1", epoch=2, reason="drain"), 1.0)
    assert d.outcome == "evicted" and d.record.state == "restoring" and [e.n for e in d.record.epochs] == [1, 2]
    assert not lc.transition(record("completed", 2), report("evicted", 2, "node-1"), 1.0).changed


def test_a_killed_report_does_not_end_a_launch_or_restore_in_flight():
    assert not lc.transition(record("restoring", 3), report("killed", 3, "node-1", exit_code=137), 1.0).changed
    assert not lc.transition(record("pending"), report("killed", 1, "node-1", exit_code=137), 1.0).changed
    rec = lc.transition(record("running"), report("killed", 1, "node-1", exit_code=137), 1.0).record
    assert (rec.state, rec.reason, rec.exit_code) == ("failed", "killed", 137)


def test_the_recovery_choice():
    # Running elsewhere already (a user restarted it): nothing to do.
    assert not lc.transition(record("running", node="node-2"), lc.Recover("node-1", "node-3"), 1.0).changed
    # No epoch, no --requeue: failed, with the reason.
    d = lc.transition(record("running"), lc.Recover("node-1", "node-2"), 1.0)
    assert d.outcome == "failed" and "no checkpoint" in d.record.reason
    # An epoch: restored on the target, one generation on.
    d = lc.transition(record("running", 4, epochs=[1]), lc.Recover("node-1", "node-2"), 1.0)
    assert d.record.state == "restoring" and d.commands == [lc.Restore("node-2", d.record.spec, 5)]
    # --requeue without an epoch: started afresh.
    d = lc.transition(record("running", requeue=True), lc.Recover("node-1", "node-2"), 1.0)
    assert d.record.state == "pending" and d.commands == [lc.Start("node-2", d.record.spec, 2, fresh=True)]
    # A half-done attempt on a third node (a dead leader's) is killed first.
    d = lc.transition(record("restoring", 3, node="node-3", epochs=[1]), lc.Recover("", "node-2"), 1.0)
    assert d.commands[0] == lc.Kill("node-3", "7", 3) and d.commands[1] == lc.Restore("node-2", d.record.spec, 4)


def test_restart_needs_a_stopped_job_with_an_epoch():
    with pytest.raises(lc.BadState):
        lc.transition(record("running", epochs=[1]), lc.RestartAsked("node-2"), 1.0)
    with pytest.raises(lc.NoEpoch):
        lc.transition(record("vacated"), lc.RestartAsked("node-2"), 1.0)
    d = lc.transition(record("vacated", 2, node="", epochs=[1]), lc.RestartAsked("node-2"), 1.0)
    back = lc.transition(d.record, lc.RestartFailed(3, "no", "vacated", ""), 2.0).record
    assert (back.state, back.node, back.generation) == ("vacated", "", 3)


def test_a_restart_announces_what_it_listens_on_and_which_connections_it_kept_or_closed():
    epoch = EpochInfo(n=1, listening=["tcp 0.0.0.0:80"], connections=["10.0.0.1:80 -> 10.0.0.9:5000",
                                                                         "10.0.0.1:80 -> 10.0.0.9:5001"])
    asked = lc.transition(record("vacated", 2, node="", epochs=[1]), lc.RestartAsked("node-1"), 1.0).record
    kept = ("10.0.0.1:80 -> 10.0.0.9:5001",)
    d = lc.transition(asked, lc.Restored(3, 42, epoch, announce=True, kept=kept), 2.0)
    [event] = d.events
    assert event.kind == "restored" and event.fields["listening"] == ["tcp 0.0.0.0:80"]
    assert event.fields["kept"] == list(kept) and event.fields["closed"] == ["10.0.0.1:80 -> 10.0.0.9:5000"]
    elsewhere = lc.transition(asked, lc.Restored(3, 42, epoch, announce=True), 2.0).events[0]
    assert elsewhere.fields["kept"] == [] and elsewhere.fields["closed"] == epoch.connections
    assert lc.transition(asked, lc.Restored(3, 42, epoch), 2.0).events == []  # a failover announces its own


def test_a_restore_of_a_delta_keeps_the_storage_its_conversion_reported():
    """The agent's reply does not count a delta's storage (it would wait for every delta to be
    resolved): the table keeps what it knew; a plain epoch's reply counts its own."""
    asked = lc.transition(record("vacated", 2, node="", epochs=[1, 2]), lc.RestartAsked("node-1", epoch=1), 1.0).record
    asked.epochs = [EpochInfo(n=1, own_bytes=5, packed_bytes=4, newer_bytes=90, incremental=True), EpochInfo(n=2)]
    told = EpochInfo(n=1, bytes=100, incremental=True, freeze_s=0.5)
    one = lc.transition(asked, lc.Restored(3, 42, told), 2.0).record.epochs[0]
    assert (one.bytes, one.freeze_s, one.own_bytes, one.packed_bytes, one.newer_bytes) == (100, 0.5, 5, 4, 90)
    plain = EpochInfo(n=1, bytes=100, own_bytes=100, plain_bytes=100)
    assert lc.transition(asked, lc.Restored(3, 42, plain), 2.0).record.epochs[0] == plain


def test_a_submit_chooses_what_a_move_does_to_its_connections():
    from revenant.common.settings.config import CheckpointConfig
    from revenant.common.settings.limits import BadRequest, check_submit
    assert CheckpointConfig().policy(SubmitRequest(argv=["x"])).connections == "keep"
    assert CheckpointConfig(connections="close").policy(SubmitRequest(argv=["x"])).connections == "close"
    assert CheckpointConfig().policy(SubmitRequest(argv=["x"], connections="close")).connections == "close"
    with pytest.raises(BadRequest, match="--connections must be one of keep, close, got 'sometimes'"):
        check_submit(SubmitRequest(argv=["x"], connections="sometimes"))


@pytest.mark.parametrize("state", ["pending", "running", "checkpointing", "restoring", "vacated"])
def test_a_cancel_ends_the_job_first_then_kills_its_copy(state):
    rec = record(state, 3, node="" if state == "vacated" else "node-2", epochs=(1, 2))
    d = lc.transition(rec, lc.CancelAsked("cancelled by user alice", 15, 10.0), 5.0)
    assert (d.record.state, d.record.reason, d.record.pid, d.record.generation) == (
        "cancelled", "cancelled by user alice", 0, 3)
    assert [e.n for e in d.record.epochs] == [1, 2]  # kept for a restart, until purged
    kill = lc.Kill("node-2", "7", 3, "cancelled by user alice", 15, 10.0)
    assert d.commands == ([] if state == "vacated" else [kill])
    assert [(e.kind, e.fields["reason"]) for e in d.events] == [("cancelled", "cancelled by user alice")]
    # Whatever comes late changes nothing: a restore's or a start's reply, the copy's exit, a failover.
    for late in (lc.Restored(3, 42), lc.Launched(3, 42), report("exited", 3, "node-2", exit_code=0),
                 report("killed", 3, "node-2"), report("evicted", 3, "node-2"), lc.Recover("node-2", "node-1"),
                 lc.RecoveryAttemptFailed(3, "no"), lc.CheckpointFailed(3)):
        after = lc.transition(d.record, late, 6.0).record or d.record
        assert (after.state, after.generation) == ("cancelled", 3), late
    # A frozen copy asking to thaw is told to die, as is any copy its node still runs.
    assert lc.transition(d.record, lc.ThawAsked("node-2", 3), 6.0).outcome == "kill"
    assert [s.reason for s in lc.stale_local_jobs("node-2", [LocalJob(job="7", generation=3)], {"7": d.record})] == [
        "the job was cancelled"]
    # Its epochs take it back, as a failed job's do.
    again = lc.transition(d.record, lc.RestartAsked("node-1"), 7.0)
    assert (again.record.state, again.record.generation, again.commands) == (
        "restoring", 4, [lc.Restore("node-1", d.record.spec, 4)])
    back = lc.transition(again.record, lc.RestartFailed(4, "no", "cancelled", ""), 8.0).record
    assert back.state == "cancelled"


def test_cancelling_an_ended_job_says_so_and_changes_nothing():
    for state, said in (("completed", "job 7 has already ended (completed); nothing to cancel"),
                        ("failed", "job 7 has already ended (failed); nothing to cancel"),
                        ("cancelled", "job 7 is already cancelled; nothing to cancel")):
        with pytest.raises(lc.BadState) as refused:
            lc.transition(record(state), lc.CancelAsked(), 1.0)
        assert str(refused.value) == said


def test_moved_on_and_stale_local_jobs():
    assert lc.moved_on(record("running", 3), record("running", 2))
    assert lc.moved_on(record("completed", 2), record("running", 2))
    assert not lc.moved_on(record("running", 2), record("failed", 2))
    jobs = {"7": record("running", 3, "node-2")}
    stale = lc.stale_local_jobs("node-1", [LocalJob(job="7", generation=2), LocalJob(job="8", generation=1)], jobs)
    assert [(s.job, s.generation) for s in stale] == [("7", 2)] and "generation 3 on node-2" in stale[0].reason
    assert lc.stale_local_jobs("node-2", [LocalJob(job="7", generation=3)], jobs) == []


# ---------------------------------------------------------------------- properties

generations = st.integers(min_value=0, max_value=12)
nodes = st.sampled_from(NODES)
maybe_epoch = st.one_of(st.none(), st.integers(min_value=1, max_value=9).map(lambda n: EpochInfo(n=n)))
inputs = st.one_of(
    st.builds(lc.Launched, generations, st.integers(1, 100)),
    st.builds(lc.LaunchFailed, generations, st.just("refused"), st.one_of(st.none(), nodes)),
    st.builds(lc.CheckpointAsked, st.booleans(), st.booleans(), st.booleans(), st.sampled_from(["", "moved"])),
    st.builds(lc.Checkpointed, generations, st.booleans(), maybe_epoch),
    # A move's reply: the job is left restoring, for failover.
    st.builds(lambda g, epoch: lc.Checkpointed(g, True, epoch, evicted=True), generations, maybe_epoch),
    # An agent's full listing, which replaces the table's (through retention).
    st.builds(lambda g, stop, epoch, listed, size: lc.Checkpointed(g, stop, epoch, (), tuple(
        EpochInfo(n=n, own_bytes=n) for n in sorted(listed)), size), generations, st.booleans(), maybe_epoch,
        st.sets(st.integers(1, 9), max_size=4), st.integers(0, 100)),
    st.builds(lc.CheckpointFailed, generations),
    st.builds(lc.RestartAsked, nodes),
    st.builds(lc.RestartAsked, nodes, st.integers(0, 9)),
    st.builds(lc.Restored, generations, st.integers(1, 100), maybe_epoch),
    st.builds(lc.CancelAsked, st.just("cancelled by admin"), st.sampled_from([0, 15]), st.sampled_from([0.0, 5.0])),
    st.builds(lc.RestartFailed, generations, st.just("no"), st.sampled_from(["vacated", "failed", "cancelled"]),
              st.sampled_from(["", *NODES])),
    st.builds(lambda kind, g, n, code, epoch: report(kind, g, n, exit_code=code, epoch=epoch),
              st.sampled_from(["exited", "killed", "vacated", "evicted", "started"]), generations, nodes,
              st.sampled_from([0, 1, None]), st.one_of(st.none(), st.integers(1, 9))),
    st.builds(lc.Recover, st.sampled_from(["", *NODES]), nodes, st.sampled_from(["", "drained"]),
              st.one_of(st.none(), st.integers(0, 3))),
    st.builds(lc.ThawAsked, nodes, generations),
    st.builds(lc.RecoveryAttemptFailed, generations, st.just("no")),
    st.builds(lc.RecoveryFailed, st.just("gave up")),
    st.builds(lc.Purged),
)
ALLOWED = {(frm, to) for frm, _, to in lc.TRANSITIONS}


@settings(max_examples=examples(1000), deadline=None)
@given(st.lists(inputs, max_size=40), st.booleans())
def test_any_sequence_of_inputs_keeps_the_job_on_one_node_at_one_generation(sequence, requeue):
    spec = JobSpec(id="7", argv=["true"], max_epochs=2, requeue=requeue)
    d = lc.transition(None, lc.Submit(spec, "node-1"), 0.0)
    rec = d.record
    launched = [(c.node, c.generation) for c in d.commands]
    for now, inp in enumerate(sequence, start=1):
        try:
            d = lc.transition(rec, inp, float(now))
        except RevenantError:
            continue  # an operator's request the state refuses: nothing changes
        new = d.record or rec
        # The generation never goes back.
        assert new.generation >= rec.generation
        # An ended job stays ended; only an operator's restart takes a failed one back.
        if rec.state == "completed":
            assert new.state == "completed"
        if rec.state in ("failed", "cancelled") and new.state != rec.state:
            assert isinstance(inp, lc.RestartAsked) and rec.epochs
        # Every state change is one the documented table lists.
        if new.state != rec.state:
            assert (rec.state, new.state) in ALLOWED, (rec.state, new.state, inp)
        for cmd in d.commands:
            if isinstance(cmd, (lc.Start, lc.Restore)):
                # A launch is always of the record's own generation, on its own node, and newer than
                # every launch before it: the table names one copy.
                assert (cmd.node, cmd.generation) == (new.node, new.generation)
                assert all(cmd.generation > g for _, g in launched)
                launched.append((cmd.node, cmd.generation))
            if isinstance(cmd, lc.Kill):  # a stale copy's, or (a cancel) the record's own
                assert cmd.generation < new.generation or (new.state == "cancelled" and cmd.node == rec.node)
        # Never live on two nodes: every copy ever launched but the record's own is stale, and its
        # agent is told to kill it when it asks.
        for node, generation in launched:
            if (node, generation) != (new.node, new.generation) or new.state == "cancelled":
                assert lc.stale_local_jobs(node, [LocalJob(job="7", generation=generation)], {"7": new})
        if new.state in ("running", "checkpointing"):
            assert new.node
        assert len(new.epochs) <= max(1, spec.max_epochs)
        rec = new


def test_the_documented_state_table_covers_every_state():
    states = {s.value for s in lc.State}
    assert {to for _, _, to in lc.TRANSITIONS} | {"pending"} >= states - {"(new)"}
    assert {frm for frm, _, _ in lc.TRANSITIONS} - {"(new)"} <= states


# ---------------------------------------------------------------------- the shell, on an in-memory store


class Lease:
    def __init__(self) -> None:
        self.leads, self.is_fresh, self.stepped_down = True, True, []

    def fresh(self) -> bool:
        return self.is_fresh

    async def holds(self) -> bool:
        return self.leads

    def step_down(self, why: str) -> None:
        self.stepped_down.append(why)


class Agents:
    """Agents that answer at once; ``refuse`` maps a node to the error it answers with."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, int]] = []
        self.refuse: dict[str, RevenantError] = {}
        self.may_act = lambda: True

    async def carry_out(self, cmd, timeout_s: float) -> AgentJobReply:
        verb = type(cmd).__name__.lower()
        self.sent.append((cmd.node, verb, cmd.generation))
        if cmd.node in self.refuse:
            raise self.refuse[cmd.node]
        epoch = EpochInfo(n=1, bytes=10) if verb in ("restore", "checkpoint") else None
        return AgentJobReply(job="1", generation=cmd.generation, node=cmd.node, pid=4242, output="/out", epoch=epoch)

    async def send(self, node, verb, msg, timeout_s):
        return AgentJobReply(job="1", generation=0, node=node)

    async def abandon(self, node: str, job: str, generation: int, why: str) -> None:
        self.sent.append((node, "abandon", generation))


class Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def emit(self, subject: str, msg) -> None:
        self.kinds.append(msg.kind)


def shell() -> tuple[JobService, MemoryJobStore, Agents, Lease]:
    store, agents, lease = MemoryJobStore(), Agents(), Lease()
    working = Capabilities(criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True))
    nodes = [NodeStatus(name=n, state="alive", capabilities=working) for n in NODES[:2]]
    service = JobService(store, agents, CoordinatorConfig(), Events(), lambda: nodes, lease, wall=lambda: 50.0)
    return service, store, agents, lease


async def test_a_job_from_submit_to_vacate_to_restart_through_the_shell():
    jobs, store, agents, _ = shell()
    await jobs.open()
    rec = await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    assert (rec.state, rec.generation, rec.pid) == ("running", 1, 4242)
    rec, _ = await jobs.checkpoint("1", stop=True)
    assert rec.state == "vacated" and [e.n for e in rec.epochs] == [1]
    rec, _ = await jobs.restart("1", "node-2")
    assert (rec.state, rec.node, rec.generation) == ("running", "node-2", 2)
    assert jobs.events.kinds == ["submitted", "restored"]
    # What the store holds is what the service holds.
    assert (await MemoryJobStore.load(store))["1"] == jobs.get("1")


async def test_a_failed_recovery_attempt_leaves_the_job_for_the_next_attempt():
    jobs, store, agents, _ = shell()
    await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    await jobs.checkpoint("1", stop=False)
    agents.refuse["node-2"] = RevenantError("restore failed")
    with pytest.raises(RevenantError):
        await jobs.recover("1", "node-1")
    rec = jobs.get("1")
    assert (rec.state, rec.node, rec.generation) == ("restoring", "", 2)
    assert ("node-2", "abandon", 2) in agents.sent
    del agents.refuse["node-2"]
    kind, rec, epoch, _ = await jobs.recover("1", "node-1")
    assert (kind, rec.state, rec.node, rec.generation, epoch) == ("restored", "running", "node-2", 3, 1)


async def test_a_conflicting_write_is_resolved_by_who_leads():
    jobs, store, agents, lease = shell()
    await jobs.submit(SubmitRequest(argv=["true"]))
    # A deposed leader's late write that did not move the job on: this leader's record stands.
    theirs = jobs.get("1").__copy__()
    theirs.state = "checkpointing"
    store.write_behind_my_back(theirs)
    await jobs.checkpoint("1", stop=False)
    assert (await store.load())["1"].state == "running"
    # One that moved the job on is taken as the truth.
    moved = jobs.get("1").__copy__()
    moved.generation, moved.node = 5, "node-3"
    store.write_behind_my_back(moved)
    with pytest.raises(BusError, match="moved on by another coordinator"):
        await jobs.checkpoint("1", stop=False)
    assert (jobs.get("1").generation, jobs.get("1").node) == (5, "node-3")
    # The store says another leads: step down, write nothing.
    lease.leads = False
    store.write_behind_my_back(jobs.get("1").__copy__())
    with pytest.raises(NotLeader):
        await jobs.checkpoint("1", stop=False)
    assert lease.stepped_down


async def test_a_leader_whose_lease_is_stale_writes_nothing():
    jobs, store, agents, lease = shell()
    lease.is_fresh = False
    with pytest.raises(NotLeader):
        await jobs.submit(SubmitRequest(argv=["true"]))
    assert store.records == {}


async def test_concurrent_inputs_to_one_job_are_applied_one_at_a_time():
    jobs, store, agents, _ = shell()
    await jobs.submit(SubmitRequest(argv=["true"]))
    results = await asyncio.gather(jobs.checkpoint("1", stop=False), jobs.checkpoint("1", stop=False),
                                   return_exceptions=True)
    assert sum(isinstance(r, tuple) for r in results) >= 1
    assert all(isinstance(r, (tuple, lc.JobBusy)) for r in results)


def test_the_architecture_document_shows_the_lifecycle_table():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- lifecycle-table -->", 1)[1].split("<!-- /lifecycle-table -->", 1)[0]
    rows = [tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
            for line in table.strip().splitlines()[2:]]
    assert rows == list(lc.TRANSITIONS), "regenerate the table in docs/architecture.md from lifecycle.TRANSITIONS"


async def test_requests_for_an_unknown_job_say_so():
    from revenant.common.errors import UnknownJob

    jobs, _, _, _ = shell()
    for request in (jobs.checkpoint("999", stop=False), jobs.restart("999"), jobs.purge("999"),
                    jobs.recover("999", "node-1")):
        with pytest.raises(UnknownJob, match="unknown job 999"):
            await request
    assert not await jobs.apply_event(JobEvent(job="999", kind="exited", at=1.0, node="node-1", generation=1))


async def test_a_conflict_nobody_could_settle_is_settled_by_the_next_write():
    """The store could not say who leads: nothing is written, and the next write still meets the
    other coordinator's record (compare-and-set) instead of overwriting it."""
    jobs, store, agents, lease = shell()
    await jobs.submit(SubmitRequest(argv=["true"]))
    moved = jobs.get("1").__copy__()
    moved.generation, moved.node = 5, "node-3"
    store.write_behind_my_back(moved)
    lease.leads = None
    with pytest.raises(BusError, match="could not be read"):
        await jobs.checkpoint("1", stop=False)
    lease.leads = True
    with pytest.raises(BusError, match="moved on by another coordinator"):
        await jobs.checkpoint("1", stop=False)
    assert (await store.load())["1"].generation == 5 and jobs.get("1").node == "node-3"


def test_a_periodic_checkpoint_is_due_a_full_interval_after_the_last_one_or_the_last_failure():
    from revenant.coordinator.table.periodic import due

    rec = record("running")
    rec.spec.checkpoint_interval_s, rec.last_checkpoint_at = 60, 100.0
    assert due([rec], {"node-1"}, set(), {}, 159.0) == []
    assert due([rec], {"node-1"}, set(), {}, 160.0) == ["7"]
    assert due([rec], {"node-1"}, {"7"}, {}, 160.0) == []          # one in flight already
    assert due([rec], {"node-2"}, set(), {}, 160.0) == []          # its node is not alive
    assert due([rec], {"node-1"}, set(), {"7": 150.0}, 160.0) == []  # failed at 150: again at 210
    assert due([rec], {"node-1"}, set(), {"7": 150.0}, 210.0) == ["7"]


def test_the_listing_drops_what_the_agents_retention_deleted():
    """Corrupt epochs are deleted first, so the agent's retention is not always "the oldest":
    the table follows what it reports."""
    rec = record("checkpointing", epochs=[2, 3])
    d = lc.transition(rec, lc.Checkpointed(1, False, EpochInfo(n=4), pruned=(3,)), 9.0)
    assert [e.n for e in d.record.epochs] == [2, 4]


async def test_a_freshly_started_agent_loses_the_running_jobs_it_does_not_list():
    jobs, _, _, _ = shell()
    await jobs.submit(SubmitRequest(argv=["true"]))
    await jobs.submit(SubmitRequest(argv=["true"], node="node-1"))
    on_1 = jobs.jobs_on("node-1")
    assert on_1
    assert jobs.lost_on("node-1", []) == on_1
    assert jobs.lost_on("node-1", [LocalJob(job=j, generation=1) for j in on_1]) == []
    assert jobs.lost_on("node-3", []) == []


H200 = JobGpu(index=0, uuid="GPU-a", name="NVIDIA H200", memory_bytes=1 << 30)


def committed(n: int, gpus=(), driver: str = "", listed=(), stop: bool = False) -> lc.Checkpointed:
    return lc.Checkpointed(1, stop, EpochInfo(n=n, gpus=list(gpus), gpu_driver=driver),
                           epochs=tuple(EpochInfo(n=m) for m in listed))


def test_the_job_holds_the_gpus_of_its_newest_checkpoint():
    rec = record("checkpointing", epochs=[1])
    d = lc.transition(rec, committed(2, [H200], "570.86.10"), 9.0)
    assert (d.record.gpus, d.record.gpu_driver) == ([H200], "570.86.10")
    assert rec.gpus == [] and lc.gpus_of(d.record) == ([H200], "570.86.10")
    # An epoch taken once the job let go of its GPU: it holds none.
    cleared = lc.transition(d.record, committed(3, [], "570.86.10"), 9.0).record
    assert (cleared.gpus, cleared.gpu_driver) == ([], "")


def test_a_restart_from_an_older_epoch_needs_that_epochs_gpus():
    rec = record("vacated", epochs=[])
    rec.epochs = [EpochInfo(n=1, gpus=[H200], gpu_driver="570.86.10"), EpochInfo(n=2)]
    assert lc.gpus_of(rec, 1) == ([H200], "570.86.10")
    assert lc.gpus_of(rec, 2) == ([], "")


def test_a_drains_epoch_known_only_from_its_event_brings_its_gpus():
    rec = record("running", epochs=[1])
    ev = report("evicted", 1, "node-1", epoch=2, reason="drained", gpus=[H200], gpu_driver="570.86.10")
    new = lc.transition(rec, ev, 9.0).record
    assert (new.gpus, new.gpu_driver) == ([H200], "570.86.10") and new.epochs[-1].gpus == [H200]
    older = lc.transition(record("running", epochs=[3]), report("vacated", 1, "node-1", epoch=2, gpus=[H200]), 9.0)
    assert older.record is None or older.record.gpus == []  # not the newest: the job's GPUs stay


async def test_a_cancel_through_the_shell_kills_once_and_sends_the_kill_again_when_asked_again():
    from revenant.coordinator.table.requests import JobControl, cancel_input
    from revenant.messages import JobRequest

    jobs, store, agents, _ = shell()
    await jobs.open()
    rec = await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    control = JobControl(jobs)
    asked = cancel_input(JobRequest(job="1", signal="TERM", grace_s=5), "admin")
    done, notes = await control.cancel(rec.spec.id, asked)
    assert (done.state, done.reason, notes) == ("cancelled", "cancelled by admin", [])
    assert agents.sent[-1] == (rec.node, "kill", 1) and jobs.jobs["1"].state == "cancelled"
    # Its kill may never have arrived (a leader gone, a node that did not answer): asked again, it
    # is sent again, and the answer still says the job had ended.
    with pytest.raises(lc.BadState, match="job 1 is already cancelled; nothing to cancel"):
        await control.cancel("1", cancel_input(JobRequest(job="1"), "admin"))
    assert agents.sent[-1] == (rec.node, "abandon", 1)
    with pytest.raises(lc.BadState, match="only a running job can be signalled"):
        await control.signal("1", JobRequest(job="1", signal="USR1"))
    with pytest.raises(RevenantError, match="--grace needs a --signal"):
        cancel_input(JobRequest(job="1", grace_s=3), "admin")
