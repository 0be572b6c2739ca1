"""A job's checkpoint policy end to end in the coordinator, pure: the [checkpoint] defaults and a
submit's overrides become the job's effective policy, the submit's overrides are checked, the
agent's fresh listing replaces the table's, a skipped checkpoint is no failure, and a restart may
name a kept epoch.  The job service runs over an in-memory store with agents that answer at once."""

from __future__ import annotations

import json

import pytest
from helpers import HeldLease

from revenant.cli.jobview import _print_job, job_view, policy_line
from revenant.common.errors import CheckpointSkipped, RemoteError, RevenantError
from revenant.common.settings.config import CheckpointConfig, CoordinatorConfig
from revenant.common.settings.limits import BadRequest, check_submit
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import MemoryJobStore
from revenant.messages import (
    AgentJobReply,
    Capabilities,
    CheckpointPolicy,
    CriuInfo,
    EpochInfo,
    JobRecord,
    JobSpec,
    NodeStatus,
    SubmitRequest,
)

pytestmark = pytest.mark.unit


class Agents:
    """Agents that answer at once: each command is kept; ``checkpoint_reply`` and ``error`` say
    what a checkpoint answers."""

    def __init__(self) -> None:
        self.commands: list[lc.Command] = []
        self.error: RevenantError | None = None
        self.checkpoint_reply: dict = {}

    async def carry_out(self, cmd, timeout_s: float) -> AgentJobReply:
        self.commands.append(cmd)
        if isinstance(cmd, lc.Checkpoint):
            if self.error is not None:
                raise self.error
            fields = {"epoch": EpochInfo(n=1, bytes=10), **self.checkpoint_reply}
            return AgentJobReply(job=cmd.job, generation=cmd.generation, node=cmd.node, **fields)
        epoch = EpochInfo(n=cmd.epoch or 1, bytes=10) if isinstance(cmd, lc.Restore) else None
        return AgentJobReply(job="1", generation=cmd.generation, node=cmd.node, pid=4242, epoch=epoch)

    async def abandon(self, node: str, job: str, generation: int, why: str) -> None:
        pass


class Events:
    def emit(self, subject: str, msg) -> None:
        pass


def service(section: CheckpointConfig | None = None) -> tuple[JobService, Agents]:
    agents = Agents()
    working = Capabilities(criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True))
    nodes = [NodeStatus(name=n, state="alive", capabilities=working) for n in ("node-1", "node-2")]
    config = CoordinatorConfig(checkpoint=section or CheckpointConfig())
    return JobService(MemoryJobStore(), agents, config, Events(), lambda: nodes, HeldLease(), wall=lambda: 50.0), agents


# ---------------------------------------------------------------------- the effective policy


async def test_a_job_gets_the_clusters_defaults_with_its_own_overrides():
    jobs, agents = service(CheckpointConfig(max_epochs=3, incremental=True, full_every=6, load_aware=True,
                                            load_threshold_io=0.4))
    plain = await jobs.submit(SubmitRequest(argv=["true"]))
    assert plain.spec.max_epochs == 3
    assert plain.spec.policy == CheckpointPolicy(incremental=True, full_every=6, load_aware=True,
                                                 load_threshold_io=0.4)
    own = await jobs.submit(SubmitRequest(argv=["true"], max_epochs=1, incremental=False, pre_dump=True,
                                          pre_dump_delay_s=0.0, full_every=2))
    assert own.spec.max_epochs == 1
    assert own.spec.policy == CheckpointPolicy(incremental=False, full_every=2, pre_dump=True,
                                               pre_dump_delay_s=0.0, load_aware=True, load_threshold_io=0.4)
    # The agent is told the effective policy with the spec it starts.
    assert [c.spec.policy for c in agents.commands] == [plain.spec.policy, own.spec.policy]


@pytest.mark.parametrize("request_, message", [
    (SubmitRequest(argv=["true"], full_every=0), "--full-every must be a whole number from 1 to 1000, got 0"),
    (SubmitRequest(argv=["true"], full_every=True), "--full-every must be a whole number from 1 to 1000, got True"),
    (SubmitRequest(argv=["true"], pre_dump_delay_s=-0.5), "--pre-dump-delay must be a number from 0 to 3600, got -0.5"),
    (SubmitRequest(argv=["true"], pre_dump_delay_s=float("inf")), "--pre-dump-delay must be a number from 0 to 3600"),
    (SubmitRequest(argv=["true"], max_epochs=101), "--max-epochs must be at most 100, got 101"),
])
async def test_a_submits_overrides_out_of_range_are_refused_before_anything_starts(request_, message):
    with pytest.raises(BadRequest) as refused:
        check_submit(request_)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    jobs, agents = service()
    with pytest.raises(BadRequest, match="must be"):
        await jobs.submit(request_)
    assert jobs.jobs == {} and agents.commands == []


def test_a_submit_within_every_range_passes():
    check_submit(SubmitRequest(argv=["true"], full_every=1000, pre_dump_delay_s=3600.0, max_epochs=100,
                               incremental=True, pre_dump=True, load_aware=False))
    check_submit(SubmitRequest(argv=["true"], full_every=1, pre_dump_delay_s=0))


# ---------------------------------------------------------------------- checkpoints


async def test_the_agents_listing_replaces_the_tables_through_the_retention_rule():
    jobs, agents = service(CheckpointConfig(max_epochs=2))
    await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    await jobs.checkpoint("1", stop=False)
    assert [e.n for e in jobs.get("1").epochs] == [1] and jobs.get("1").storage_bytes == 0
    # Epoch 1 became a delta after epoch 2 committed; the agent says so with its whole listing,
    # and one more epoch than the job keeps (the table still keeps only max_epochs).
    listing = [EpochInfo(n=1, bytes=10, own_bytes=1, incremental=True), EpochInfo(n=3, bytes=10, own_bytes=2,
                                                                                   incremental=True)]
    agents.checkpoint_reply = {"epoch": EpochInfo(n=4, bytes=10, own_bytes=10), "epochs": listing,
                               "storage_bytes": 13}
    rec, _ = await jobs.checkpoint("1", stop=False)
    assert [(e.n, e.own_bytes, e.incremental) for e in rec.epochs] == [(3, 2, True), (4, 10, False)]
    assert rec.storage_bytes == 13 and rec.state == "running" and rec.last_checkpoint_at == 50.0
    # A reply without a listing (an older agent) keeps the old rule and the last known storage.
    agents.checkpoint_reply = {"epoch": EpochInfo(n=5, bytes=10)}
    rec, _ = await jobs.checkpoint("1", stop=False)
    assert [e.n for e in rec.epochs] == [4, 5] and rec.storage_bytes == 13


def test_a_listing_is_taken_in_epoch_order_and_never_loses_the_new_epoch():
    rec = JobRecord(spec=JobSpec(id="7", argv=["true"], max_epochs=3), state="checkpointing", node="node-1",
                    generation=1, epochs=[EpochInfo(n=1)])
    d = lc.transition(rec, lc.Checkpointed(1, False, EpochInfo(n=9), (), (EpochInfo(n=8), EpochInfo(n=2)), 7), 1.0)
    assert [e.n for e in d.record.epochs] == [2, 8, 9] and d.record.storage_bytes == 7


async def test_a_skipped_checkpoint_leaves_the_job_running_with_nothing_failed():
    jobs, agents = service()
    await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    before = jobs.get("1")
    agents.error = RemoteError("node-1 is over its cpu threshold (0.97 > 0.95)", code="checkpoint_skipped")
    with pytest.raises(CheckpointSkipped, match="cpu threshold") as skipped:
        await jobs.checkpoint("1", stop=False, scheduled=True)
    assert skipped.value.code == "checkpoint_skipped"
    rec = jobs.get("1")
    assert (rec.state, rec.reason, rec.epochs, rec.exit_code) == ("running", "", [], None)
    assert rec.last_checkpoint_at == before.last_checkpoint_at
    assert agents.commands[-1] == lc.Checkpoint("node-1", "1", 1, False, scheduled=True, force=False)
    # And the next one goes ahead.
    agents.error = None
    rec, _ = await jobs.checkpoint("1", stop=False, scheduled=True, force=True)
    assert rec.state == "running" and [e.n for e in rec.epochs] == [1]
    assert agents.commands[-1] == lc.Checkpoint("node-1", "1", 1, False, scheduled=True, force=True)


# ---------------------------------------------------------------------- restart --epoch


async def _vacated(jobs: JobService, agents: Agents) -> None:
    await jobs.submit(SubmitRequest(argv=["sleep", "100"], max_epochs=3))
    for n in (2, 3):
        agents.checkpoint_reply = {"epoch": EpochInfo(n=n, bytes=10)}
        await jobs.checkpoint("1", stop=n == 3)


async def test_a_restart_from_a_kept_epoch_tells_the_agent_which():
    jobs, agents = service()
    await _vacated(jobs, agents)
    rec, _ = await jobs.restart("1", epoch=2)
    assert agents.commands[-1] == lc.Restore(rec.node, rec.spec, 2, epoch=2)
    assert rec.state == "running"


async def test_a_restart_from_an_epoch_not_kept_is_refused_naming_the_kept_ones():
    jobs, agents = service()
    await _vacated(jobs, agents)
    sent = len(agents.commands)
    with pytest.raises(lc.NoEpoch) as refused:
        await jobs.restart("1", epoch=7)
    assert str(refused.value) == "job 1 has no epoch 7; it keeps epochs 2, 3"
    assert len(agents.commands) == sent and jobs.get("1").state == "vacated"
    one = JobRecord(spec=JobSpec(id="4", argv=["true"]), state="failed", epochs=[EpochInfo(n=5)])
    with pytest.raises(lc.NoEpoch, match="^job 4 has no epoch 1; it keeps epoch 5$"):
        lc.check_restart(one, 1)
    lc.check_restart(one, 5)
    lc.check_restart(one)  # 0: the newest restorable


# ---------------------------------------------------------------------- show job


def _shown_record() -> JobRecord:
    spec = JobSpec(id="7", argv=["python3", "train.py"], name="train", max_epochs=2,
                   policy=CheckpointPolicy(incremental=True, full_every=5, load_aware=True))
    return JobRecord(spec=spec, state="running", node="node-1", generation=1, storage_bytes=3 * 1024**2,
                     epochs=[EpochInfo(n=1, bytes=2 * 1024**2, own_bytes=1024**2 // 2, incremental=True),
                             EpochInfo(n=2, bytes=2 * 1024**2, own_bytes=2 * 1024**2)])


def test_show_job_json_has_the_effective_policy_storage_and_own_bytes(capsys):
    _print_job(_shown_record(), as_json=True)
    view = json.loads(capsys.readouterr().out)
    assert view["policy"] == {"incremental": True, "full_every": 5, "pre_dump": False, "pre_dump_delay_s": 5.0,
                              "load_aware": True, "load_threshold_cpu": 0.95, "load_threshold_io": 0.5,
                              "load_threshold_memory": 0.85, "connections": "keep", "pack_compression": "none"}
    assert view["storage_bytes"] == 3 * 1024**2
    assert [(e["n"], e["own_bytes"], e["incremental"]) for e in view["epochs"]] == \
        [(1, 1024**2 // 2, True), (2, 2 * 1024**2, False)]
    assert job_view(_shown_record()) == view


def test_show_job_text_has_a_policy_line_storage_and_each_epochs_own_bytes(capsys):
    _print_job(_shown_record(), as_json=False)
    rows = {line[:12].strip(): line[13:] for line in capsys.readouterr().out.splitlines()}
    assert rows["policy"] == ("incremental, full every 5, no pre-dump, load-aware (cpu 0.95, io 0.5, memory 0.85), "
                              "connections keep")
    assert rows["storage"] == "3.0 MiB on disk (data shared between epochs counted once)"
    assert rows["epochs"].startswith("#1 2.0 MiB (512.0 KiB own, incremental) at ")
    assert ", #2 2.0 MiB (2.0 MiB own) at " in rows["epochs"]
    assert policy_line(CheckpointPolicy(pre_dump=True, pre_dump_delay_s=2.5, connections="close")) == \
        "full epochs, pre-dump 2.5 s before, not load-aware, connections close"


def test_show_job_text_of_a_record_from_before_policies(capsys):
    rec = JobRecord(spec=JobSpec(id="3", argv=["true"]), state="vacated", epochs=[EpochInfo(n=1, bytes=10)])
    _print_job(rec, as_json=False)
    out = capsys.readouterr().out
    assert "storage      not reported" in out and "#1 10 B at " in out and "own" not in out


def test_the_new_epoch_events_print_on_one_line_with_their_reason():
    from revenant.cli.events import format_event
    from revenant.messages import EpochEvent

    skipped = EpochEvent(job="7", kind="skipped", at=0.0, node="node-1", reason="cpu 0.97 > 0.95")
    line, obj = format_event("revenant.evt.epoch.7.skipped", 3, skipped)
    assert line.endswith("job 7 checkpoint skipped on node-1: cpu 0.97 > 0.95") and obj["reason"] == "cpu 0.97 > 0.95"
    converted = EpochEvent(job="7", kind="converted", at=0.0, node="node-1", n=4, bytes=2048)
    line, _ = format_event("revenant.evt.epoch.7.converted", 4, converted)
    assert line.endswith("job 7 checkpoint converted epoch 4 on node-1: now a delta of 2.0 KiB")


@pytest.mark.unit
def test_the_job_record_keeps_the_latest_checkpoint_failure_until_one_commits(capsys):
    rec = JobRecord(spec=JobSpec(id="5", argv=["true"]), state="checkpointing", node="node-1", generation=2)
    why = "criu dump failed: Error (criu/sk-inet.c:1): Unsupported socket option (criu log: /s/jobs/5/criu-logs/x.log)"
    failed = lc.transition(rec, lc.CheckpointFailed(2, why), 1.0).record
    assert failed is not None and failed.state == "running" and failed.last_checkpoint_error == why
    _print_job(failed, as_json=False)
    assert "criu-logs/x.log" in capsys.readouterr().out  # show job points to the kept log
    # A skip (no error) leaves the last failure as it was; a committed epoch clears it.
    assert lc.transition(failed, lc.CheckpointFailed(2), 2.0).record is None
    ok = lc.transition(failed, lc.Checkpointed(2, False, EpochInfo(n=1)), 3.0).record
    assert ok is not None and ok.last_checkpoint_error == ""


@pytest.mark.unit
def test_a_converted_epoch_updates_the_listing_after_the_checkpoint_replied():
    from revenant.messages import EpochEvent

    rec = JobRecord(spec=JobSpec(id="6", argv=["true"], max_epochs=3), state="running", node="node-1",
                    generation=1, storage_bytes=300, epochs=[EpochInfo(n=1, bytes=100, own_bytes=100),
                                                             EpochInfo(n=2, bytes=100, own_bytes=100)])
    ev = EpochEvent(job="6", kind="converted", at=1.0, n=1, bytes=3, storage_bytes=203)
    new = lc.transition(rec, lc.EpochConverted(ev), 2.0).record
    assert new is not None and new.storage_bytes == 203
    assert [(e.n, e.own_bytes, e.incremental) for e in new.epochs] == [(1, 3, True), (2, 100, False)]
    # Told twice (a redelivery), or about an epoch the listing no longer has: nothing changes.
    assert lc.transition(new, lc.EpochConverted(ev), 3.0).record is None
    gone = EpochEvent(job="6", kind="converted", at=1.0, n=9, bytes=3)
    assert lc.transition(new, lc.EpochConverted(gone), 3.0).record is None
