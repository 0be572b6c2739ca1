"""The proactive shell (coordinator/recovery/sick.py) over the job service with an in-memory store and
agents that answer at once: what each action sends, and what a move that cannot go ahead leaves."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from revenant.common.errors import RevenantError
from revenant.common.serving.metrics import CoordinatorMetrics
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.recovery.failover import StormGuard
from revenant.coordinator.recovery.sick import ProactiveMoves
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import MemoryJobStore
from revenant.messages import AgentJobReply, EpochInfo, SubmitRequest

from test_lifecycle import Agents, Lease
from test_proactive_rules import CRIU, MEMORY_RED, MEMORY_YELLOW, node

pytestmark = pytest.mark.unit


class CommandAgents(Agents):
    def __init__(self) -> None:
        super().__init__()
        self.commands: list = []

    async def carry_out(self, cmd, timeout_s: float) -> AgentJobReply:
        self.commands.append(cmd)
        return await super().carry_out(cmd, timeout_s)


class Events:
    def __init__(self) -> None:
        self.msgs: list = []

    def emit(self, subject: str, msg) -> None:
        self.msgs.append(msg)

    def kinds(self) -> list[str]:
        return [m.kind for m in self.msgs]


class StubFailover:
    def __init__(self) -> None:
        self.calls: list = []
        self.moves: dict = {}
        self.storm = StormGuard(0.3)

    def moved(self, job: str, reasons) -> None:
        self.moves[job] = tuple(reasons)
        self.calls.append(("moved", job, tuple(reasons)))

    def recover_job(self, job: str, node: str, incarnation: str = "", evicted: str = "") -> None:
        self.calls.append(("recover", job, node, evicted))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def setup(nodes: list, on_sick: str = "migrate", **ask):
    # Healthy for the submit (with the nodes' own capabilities); then as given.
    table = [msgspec.structs.replace(node(n.name), capabilities=n.capabilities) for n in nodes]
    agents, events, failover, clock = CommandAgents(), Events(), StubFailover(), Clock()
    config = CoordinatorConfig(proactive_hold_s=0.0)
    jobs = JobService(MemoryJobStore(), agents, config, events, lambda: table, Lease(), wall=lambda: 50.0)
    await jobs.open()
    await jobs.submit(SubmitRequest(argv=["sleep", "100"], node="node-1", checkpoint_interval_s=300.0,
                                    on_sick=on_sick, **ask))
    table[:] = nodes
    metrics = CoordinatorMetrics()
    moves = ProactiveMoves(config, jobs, failover, events, lambda: table, metrics, clock=clock, wall=lambda: 60.0)
    return moves, jobs, agents, events, failover, table, metrics


async def run_tick(moves: ProactiveMoves) -> None:
    await asyncio.gather(*moves.tick())


def counted(metrics: CoordinatorMetrics) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for m in metrics.proactive_actions.collect()
            for s in m.samples if s.name.endswith("_total")}


async def test_a_move_vacates_with_eviction_and_hands_the_job_to_failover():
    moves, jobs, agents, events, failover, table, metrics = await setup([node("node-1", MEMORY_RED), node("node-2")])
    await run_tick(moves)
    [cmd] = [c for c in agents.commands if isinstance(c, lc.Checkpoint)]
    assert (cmd.node, cmd.stop, cmd.force, cmd.cause, cmd.reasons) == ("node-1", True, True, "health",
                                                                      ("memory 97% >= 95%",))
    assert cmd.evict == "moved off sick node node-1: memory 97% >= 95%"
    assert jobs.get("1").state == "restoring"
    assert failover.calls == [("moved", "1", ("memory 97% >= 95%",)), ("recover", "1", "node-1", cmd.evict)]
    assert counted(metrics) == {(("action", "migrate"), ("reason", "memory")): 1.0}
    # The emptied node is cordoned for placement until it is GREEN.
    assert [n.health for n in moves.cordon(table)] == ["RED", "GREEN"]
    assert await run_tick(moves) is None and len(agents.commands) == 2  # no second action


async def test_with_no_healthy_node_the_job_stays_and_an_event_says_why():
    moves, jobs, agents, events, failover, _, _ = await setup([node("node-1", MEMORY_RED),
                                                               node("node-2", ("RED", "criu", "criu unusable"))])
    await run_tick(moves)
    assert not [c for c in agents.commands if isinstance(c, lc.Checkpoint)] and failover.calls == []
    skipped = events.msgs[-1]
    assert (skipped.kind, skipped.cause, skipped.reasons) == ("migration_skipped", "health", ["memory 97% >= 95%"])
    assert "no healthy node can take it" in skipped.reason and jobs.get("1").state == "running"


async def test_a_move_waits_while_no_healthy_node_has_room_for_what_the_job_asked():
    sick, small = node("node-1", MEMORY_RED), node("node-2")
    sick.capabilities, small.capabilities = (msgspec.structs.replace(CRIU, cpus=8),
                                             msgspec.structs.replace(CRIU, cpus=2))
    moves, jobs, agents, events, failover, table, _ = await setup([sick, small], cpus=4.0)
    await run_tick(moves)
    assert not [c for c in agents.commands if isinstance(c, lc.Checkpoint)] and failover.calls == []
    skipped = events.msgs[-1]
    assert skipped.kind == "migration_skipped" and "node node-2 has 2 of 2 CPUs free" in skipped.reason, skipped
    assert jobs.get("1").state == "running"


async def test_a_move_whose_checkpoint_fails_leaves_the_job_running_where_it_was():
    moves, jobs, agents, events, failover, _, metrics = await setup([node("node-1", MEMORY_RED), node("node-2")])
    agents.refuse["node-1"] = RevenantError("criu dump failed: Error (criu/cr-dump.c:1): boom")
    await run_tick(moves)
    rec = jobs.get("1")
    assert (rec.state, rec.node, rec.generation) == ("running", "node-1", 1)
    assert events.msgs[-1].kind == "migration_failed" and "boom" in events.msgs[-1].reason
    assert failover.moves == {} and counted(metrics) == {}


async def test_a_yellow_node_gets_a_fresh_epoch_with_cause_health():
    moves, jobs, agents, _, failover, _, metrics = await setup([node("node-1", MEMORY_YELLOW), node("node-2")],
                                                               on_sick="checkpoint")
    await run_tick(moves)
    [cmd] = [c for c in agents.commands if isinstance(c, lc.Checkpoint)]
    assert (cmd.stop, cmd.force, cmd.evict, cmd.cause) == (False, True, "", "health")
    rec = jobs.get("1")
    assert rec.state == "running" and rec.epochs == [EpochInfo(n=1, bytes=10)] and failover.calls == []
    assert counted(metrics) == {(("action", "checkpoint"), ("reason", "memory")): 1.0}


async def test_many_sick_nodes_pause_moves_with_an_alert():
    nodes = [node("node-1", MEMORY_RED), node("node-2", MEMORY_RED), node("node-3")]
    moves, jobs, agents, events, failover, table, metrics = await setup(nodes)
    await run_tick(moves)
    assert "proactive_paused" in events.kinds() and moves.moves_paused
    [cmd] = [c for c in agents.commands if isinstance(c, lc.Checkpoint)]
    assert not cmd.stop and failover.calls == []  # a checkpoint, not a move
    table[1] = node("node-2")
    moves.clock.t += 1
    await run_tick(moves)
    assert events.kinds()[-1] == "proactive_resumed" and not moves.moves_paused


async def test_a_move_that_meets_a_checkpoint_in_progress_is_tried_again_next_tick():
    moves, jobs, agents, events, failover, _, _ = await setup([node("node-1", MEMORY_RED), node("node-2")])
    rec = jobs.get("1")
    jobs.jobs["1"] = lc.transition(rec, lc.CheckpointAsked(stop=False), 1.0).record  # its schedule's, say
    await run_tick(moves)  # not running: not even tried
    jobs.jobs["1"] = rec

    real = jobs.step

    async def busy_once(job, inp):
        jobs.step = real
        raise lc.JobBusy("job 1 already has a checkpoint in progress")

    jobs.step = busy_once
    await run_tick(moves)
    assert "migration_failed" not in events.kinds() and failover.moves == {}
    await run_tick(moves)  # due again at once, not a cooldown later
    assert [c[0] for c in failover.calls][-2:] == ["moved", "recover"] and jobs.get("1").state == "restoring"


async def test_a_failed_or_skipped_move_is_tried_again_after_the_retry_delay_not_a_cooldown():
    from revenant.coordinator.nodes.proactive import RETRY_S

    moves, jobs, agents, events, failover, table, _ = await setup([node("node-1", MEMORY_RED),
                                                                   node("node-2", ("RED", "criu", "criu unusable"))])
    await run_tick(moves)
    assert events.kinds().count("migration_skipped") == 1
    moves.clock.t += RETRY_S - 1
    await run_tick(moves)
    assert events.kinds().count("migration_skipped") == 1
    table[1] = node("node-2")  # a node is back
    moves.clock.t += 1
    await run_tick(moves)
    assert [c[0] for c in failover.calls] == ["moved", "recover"]


async def test_a_moved_job_whose_target_went_away_goes_back_to_its_sick_node_rather_than_failing():
    moves, jobs, agents, events, failover, table, _ = await setup([node("node-1", MEMORY_RED), node("node-2")])
    await run_tick(moves)
    assert jobs.get("1").state == "restoring"
    table[1] = node("node-2", ("RED", "criu", "criu unusable"))  # the target broke meanwhile
    kind, rec, epoch, _ = await jobs.recover("1", "node-1", evicted="moved off sick node node-1: memory")
    assert (kind, rec.state, rec.node, rec.generation) == ("restored", "running", "node-1", 2)


async def test_a_failed_tick_keeps_the_actions_in_flight_and_a_paused_failover_pauses_moves():
    moves, jobs, agents, events, failover, table, _ = await setup([node("node-1", MEMORY_RED), node("node-2")])
    failover.storm.hold()  # an operator paused failover: a move's restore would wait there, its job stopped
    [task] = moves.tick()
    await task
    [cmd] = [c for c in agents.commands if isinstance(c, lc.Checkpoint)]
    assert not cmd.stop and jobs.get("1").state == "running"  # a fresh epoch instead

    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("a bug")

    moves.rules.update = broken
    runner = asyncio.create_task(moves.run())
    await asyncio.sleep(0.05)
    assert calls and not runner.done()  # logged, and the loop goes on
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_an_anomaly_counts_only_from_its_own_nodes_subject():
    moves, *_ = await setup([node("node-1"), node("node-2")])

    class Msg:
        def __init__(self, subject, node_name):
            from revenant.messages import AnomalyEvent, encode
            self.subject = subject
            self.data = encode(AnomalyEvent(node=node_name, metric="memory_percent", value=90, mean=40, std=2, at=1.0))

    await moves.on_anomaly(Msg("revenant.evt.node.node-2.anomaly", "node-1"))
    assert moves.rules._anomalies == {}
    await moves.on_anomaly(Msg("revenant.evt.node.node-1.anomaly", "node-1"))
    assert list(moves.rules._anomalies) == ["node-1"]
