"""The coordinator's job table against a real JetStream KV: how agents' job events
change records, whatever order they arrive in relative to the replies."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers import connect_as, coordinator_config
from revenant.common.errors import BusError, RemoteError, RevenantError
from revenant.common.messaging import bus
from revenant.common.messaging.events import EventPublisher
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.leader import Leadership
from revenant.coordinator.table.agents import AgentClient, NotLeader
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import KvJobStore
from revenant.messages import AgentJobReply, Capabilities, CriuInfo, EpochInfo, JobEvent, JobRecord, JobSpec, KillJob, NodeStatus, SubmitRequest

pytestmark = pytest.mark.nats


class Term:
    """Stands in for the leader lease: whether the store says this coordinator leads."""

    def __init__(self, leads: bool = True) -> None:
        self.leads = leads
        self.stepped_down: list[str] = []

    def fresh(self) -> bool:
        return True

    async def holds(self) -> bool:
        return self.leads

    def step_down(self, why: str) -> None:
        self.stepped_down.append(why)


def service(nc, js, config: CoordinatorConfig, events: EventPublisher, term: Term) -> JobService:
    return JobService(KvJobStore(js), AgentClient(nc, term.fresh), config, events, lambda: [], term)


@pytest.fixture
async def table(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    table = service(nc, js, coordinator_config(nats_url), EventPublisher(js), Term(leads=False))
    table.nc, table.js = nc, js
    await table.open()
    yield table
    await nc.close()


async def put(table: JobService, state: str, generation: int, node: str, epochs: list[int] = ()) -> JobRecord:
    rec = JobRecord(spec=JobSpec(id="1", argv=["true"], max_epochs=2), state=state, generation=generation, node=node,
                    pid=4242, epochs=[EpochInfo(n=n) for n in epochs])
    await table.save(rec)
    return rec


def event(kind: str, generation: int, node: str, **kw) -> JobEvent:
    return JobEvent(job="1", kind=kind, at=1000.0, node=node, generation=generation, **kw)


async def test_a_vacate_whose_reply_was_lost_is_applied_from_its_event(table):
    await put(table, "checkpointing", 2, "node-1", epochs=[1])
    await table.apply_event(event("vacated", 1, "node-1", epoch=2))  # an older generation's: ignored
    assert table.get("1").state == "checkpointing"
    await table.apply_event(event("vacated", 2, "node-1", epoch=2))
    rec = table.get("1")
    assert (rec.state, rec.node, rec.pid, [e.n for e in rec.epochs]) == ("vacated", "", 0, [1, 2])
    # The reply arriving after it changes nothing: the record stays vacated.
    await table.apply_event(event("vacated", 2, "node-1", epoch=2))
    assert table.get("1").state == "vacated"


async def test_an_exit_during_a_restore_is_not_lost(table):
    await put(table, "restoring", 3, "node-2", epochs=[1])
    await table.apply_event(event("exited", 3, "node-1", exit_code=0))  # another node's copy: ignored
    assert table.get("1").state == "restoring"
    await table.apply_event(event("exited", 3, "node-2", exit_code=0))
    rec = table.get("1")
    assert (rec.state, rec.exit_code, rec.pid) == ("completed", 0, 0)


async def test_a_kill_of_an_abandoned_attempt_does_not_fail_the_job(table):
    """The coordinator kills an attempt whose reply never came, then retries: the agent's
    "killed" for that attempt must not end the job."""
    await put(table, "restoring", 3, "node-2", epochs=[1])
    await table.apply_event(event("killed", 3, "node-2", exit_code=137, reason="attempt on node-2 failed"))
    assert table.get("1").state == "restoring"
    await put(table, "pending", 1, "node-1")
    await table.apply_event(event("killed", 1, "node-1", exit_code=137))
    assert table.get("1").state == "pending"


async def test_a_checkpoint_abandoned_by_a_dead_leader_lets_the_job_run_on(table):
    await put(table, "checkpointing", 2, "node-1")
    await table.checkpoint_abandoned("1", 1)  # another generation: not ours to touch
    assert table.get("1").state == "checkpointing"
    await table.checkpoint_abandoned("1", 2)
    assert table.get("1").state == "running"
    # ... and the table in the store says so too (a later leader reads it).
    again = await another_coordinator(table)
    assert again.get("1").state == "running"


async def another_coordinator(table: JobService, term: Term | None = None) -> JobService:
    """A second coordinator's view of the same job table, as loaded from the store now."""
    other = service(table.nc, table.js, table.config, table.events, term or Term(leads=False))
    other.nc, other.js = table.nc, table.js
    await other.open()
    return other


async def test_a_deposed_leader_can_never_overwrite_its_successor(table):
    old_term = table.leader
    await put(table, "running", 1, "node-1")
    # A new leader loads the table and moves the job on.
    new_term = Term(leads=True)
    new = await another_coordinator(table, new_term)
    moved = new.get("1")
    moved.generation, moved.node = 2, "node-2"
    await new.save(moved)
    # The old one wakes from a stall and writes what it believed: refused, and it steps down.
    stale = table.get("1")
    stale.state = "failed"
    with pytest.raises(NotLeader, match="job 1 was changed in the job table by another coordinator"):
        await table.save(stale)
    assert old_term.stepped_down and not new_term.stepped_down
    check = await another_coordinator(table)
    assert (check.get("1").generation, check.get("1").node, check.get("1").state) == (2, "node-2", "running")


async def test_a_late_write_of_a_deposed_leader_does_not_depose_the_real_one(table):
    await put(table, "running", 1, "node-1")
    term = Term(leads=True)
    leader = await another_coordinator(table, term)
    # The deposed one (``table``, which wrote last) gets one write in before it notices.
    zombie = table.get("1")
    zombie.state = "failed"
    await table.save(zombie)
    mine = leader.get("1")
    mine.generation = 2
    await leader.save(mine)  # the store says this one leads: its record stands
    assert not term.stepped_down
    check = await another_coordinator(table)
    assert (check.get("1").generation, check.get("1").state) == (2, "running")


async def test_the_leader_lease_says_who_leads_now(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)
    js = nc.jetstream()
    elected: list[str] = []
    deposed: list[str] = []

    quiet: dict[str, int] = {}

    def make(name: str) -> Leadership:
        async def on_elected() -> None:
            elected.append(name)
        return Leadership(js, name, 1.5, on_elected=on_elected, on_deposed=lambda: deposed.append(name),
                          quiet_moment=lambda: quiet.__setitem__(name, quiet.get(name, 0) + 1))

    # Two coordinators given the same name still hold different terms.
    first, second = make("coordinator"), make("coordinator")
    tasks = [asyncio.create_task(first.run())]
    try:
        for _ in range(50):
            if elected:
                break
            await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(second.run()))
        quiet.clear()
        await asyncio.sleep(0.6)
        assert await first.holds() and not await second.holds()
        # The leader's renewals (every half second here) and the standby's lost campaigns are the
        # moments it offers for a pause (the coordinator's whole-heap garbage walk).
        assert quiet.get("coordinator", 0) >= 2
        tasks[0].cancel()  # the leader stops renewing; its entry expires and the standby takes over
        for _ in range(100):
            if second.leader:
                break
            await asyncio.sleep(0.05)
        assert second.leader and await second.holds()
        assert first.value != second.value
        # Terms grow cluster-wide, the bucket's making (Unix seconds) above the key's revision.
        assert second.term > first.term and first.term >> 32 == second.term >> 32
        assert abs((second.term >> 32) - time.time()) < 600
        first.leader = True  # what a stalled leader would still believe
        assert not await first.holds()
    finally:
        for t in tasks:
            t.cancel()
        await nc.close()


async def test_a_job_its_node_stopped_is_handed_to_failover_with_its_new_epoch(table):
    handed: list[tuple[str, str, str]] = []

    class Apply:
        async def apply_event(self, ev: JobEvent) -> None:
            if await table.apply_event(ev):
                handed.append((ev.job, ev.node, ev.reason))

    apply = Apply()
    await put(table, "running", 2, "node-1", epochs=[1])
    await apply.apply_event(event("evicted", 1, "node-1", epoch=2, reason="old"))  # an older generation's
    await apply.apply_event(event("evicted", 2, "node-2", epoch=2, reason="other"))  # another node's
    assert handed == []
    await apply.apply_event(event("evicted", 2, "node-1", epoch=2, reason="node node-1 is shutting down"))
    assert handed == [("1", "node-1", "node node-1 is shutting down")]
    rec = table.get("1")
    assert [e.n for e in rec.epochs] == [1, 2] and rec.state == "restoring" and rec.pid == 0
    # A finished job is not brought back by a late eviction.
    await put(table, "completed", 2, "node-1")
    await apply.apply_event(event("evicted", 2, "node-1"))
    assert len(handed) == 1


async def test_a_leader_whose_lease_is_not_fresh_does_not_act(table, nats_url):
    now = [100.0]
    lead = Leadership(table.js, "c1", 3.0, on_elected=None, on_deposed=lambda: None, clock=lambda: now[0])
    lead.leader, lead._renewed_at = True, 100.0
    now[0] = 101.9
    assert lead.fresh()
    now[0] = 102.1  # 2/3 of the lease without a renewal (a stalled loop): no more acting
    assert not lead.fresh()
    table.leader.fresh = lead.fresh
    table.agents.may_act = lead.fresh
    with pytest.raises(NotLeader, match="leader lease is not fresh"):
        await put(table, "running", 1, "node-1")
    with pytest.raises(NotLeader, match="leader lease is not fresh"):
        await table.agents.send("node-1", "kill", KillJob(job="1", generation=1), 1.0)


async def test_a_submit_refused_by_a_draining_node_starts_on_the_next(table):
    """The agents' transport is replaced here (a pure placement-and-retry rule); the drain
    itself is tested end to end in test_failover.py."""
    working = Capabilities(criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True))
    table.nodes = lambda: [NodeStatus(name=n, state="alive", capabilities=working) for n in ("node-1", "node-2")]
    calls: list[tuple[str, str, int]] = []

    async def agent(node: str, verb: str, msg, timeout_s: float) -> AgentJobReply:
        calls.append((node, verb, getattr(msg, "generation", 0)))
        if node == "node-1":
            raise RemoteError("node node-1 is shutting down; try another node", code="shutting_down")
        return AgentJobReply(job=msg.spec.id, generation=msg.generation, node=node, pid=4242, output="/out")

    table.agents.send = agent
    rec = await table.submit(SubmitRequest(argv=["true"]))
    assert (rec.state, rec.node, rec.generation, rec.pid) == ("running", "node-2", 2, 4242)
    assert calls == [("node-1", "start", 1), ("node-1", "kill", 1), ("node-2", "start", 2)]
    # Asked for that node by name: the refusal is the answer.
    calls.clear()
    with pytest.raises(RevenantError, match="could not start on node-1: node node-1 is shutting down"):
        await table.submit(SubmitRequest(argv=["true"], node="node-1"))
    assert [c[1] for c in calls] == ["start", "kill"]


async def test_what_a_deposed_leader_moved_on_is_taken_as_the_truth(table):
    """Its write slipped in before it noticed: a newer generation may be running where it says,
    so the real leader adopts that record (and its own operation fails, to be retried)."""
    await put(table, "running", 1, "node-1")
    term = Term(leads=True)
    leader = await another_coordinator(table, term)
    zombie = table.get("1")
    zombie.generation, zombie.node, zombie.state = 2, "node-3", "running"
    await table.save(zombie)
    mine = leader.get("1")
    mine.node, mine.state = "node-2", "restoring"  # its own view, now stale (still generation 1)
    with pytest.raises(BusError, match="moved on by another coordinator"):
        await leader.save(mine)
    assert (leader.get("1").generation, leader.get("1").node) == (2, "node-3") and not term.stepped_down
    check = await another_coordinator(table)
    assert (check.get("1").generation, check.get("1").node) == (2, "node-3")


async def test_an_operators_failover_hold_outlives_the_leader(table):
    from revenant.coordinator.recovery.failover import Failover

    def failover(service: JobService) -> Failover:
        return Failover(service.config, service.js, service, service.events, lambda: [], lambda node: None)

    await put(table, "running", 1, "node-1")
    reply = await failover(table).operator("pause", [])
    assert reply.paused and reply.held
    successor = await another_coordinator(table)
    assert list(successor.jobs) == ["1"]  # the hold is not a job
    after = failover(successor)
    await after.restore_hold()
    assert after.storm.held and after.storm.paused
    assert not (await after.operator("resume", [])).paused
    again = failover(await another_coordinator(table))
    await again.restore_hold()
    assert not again.storm.held


async def test_a_node_back_before_a_paused_failover_resumes_keeps_its_job(table):
    """Failover paused by a storm (many nodes silent at once: a partition) resumes because the
    nodes came back: a recovery that was waiting for the pause leaves the job where it is, its
    node being back within a detection period of the pause's end."""
    from revenant.coordinator.recovery.failover import Failover

    await put(table, "running", 1, "node-1")
    states = {"node-1": "dead"}
    fo = Failover(table.config, table.js, table, table.events,
                  lambda: [NodeStatus(name=n, state=s, incarnation="a1") for n, s in states.items()],
                  lambda node: None, node=lambda n: NodeStatus(name=n, state=states[n], incarnation="a1"))
    fo.storm.hold()  # as an operator's pause; a storm's is the same wait
    fo.recover_job("1", "node-1", "a1")  # no lease in the store: nothing to wait for but the pause
    await asyncio.sleep(0.5)
    assert "1" in fo.recovering
    fo.storm.release()
    await asyncio.sleep(0.5)  # the pause ends with the first node of a split; this one is back just after
    states["node-1"] = "alive"
    for _ in range(50):
        if "1" not in fo.recovering:
            break
        await asyncio.sleep(0.1)
    assert "1" not in fo.recovering  # dropped, not restoring (nor retrying) anywhere
    fo.cancel()
    rec = table.get("1")
    assert (rec.state, rec.node, rec.generation) == ("running", "node-1", 1)


async def test_a_node_back_that_stopped_the_job_meanwhile_does_not_keep_it(table):
    """The node came back with the same agent, but that agent reported the job stopped (evicted:
    a fence past max_frozen_s, a drain) while failover was paused: nothing is left to keep, and
    the recovery goes on when the pause ends."""
    from revenant.coordinator.recovery.failover import Failover

    await put(table, "running", 1, "node-1")
    alive = NodeStatus(name="node-1", state="alive", incarnation="a1")
    fo = Failover(table.config, table.js, table, table.events, lambda: [alive], lambda node: None,
                  node={"node-1": alive}.get)  # the coordinator's lookup, not a walk
    fo.storm.hold()
    fo.recover_job("1", "node-1", "a1")
    await asyncio.sleep(0.3)
    fo.recover_job("1", "node-1", "a1", evicted="frozen past max_frozen_s")  # the agent's report
    fo.storm.release()
    await asyncio.sleep(table.config.node_timeout_s + 1.0)
    assert "1" in fo.recovering  # still recovering (no node can take it here), not dropped
    fo.cancel()


async def test_a_node_back_with_a_restarted_agent_does_not_keep_the_job(table):
    """A node whose agent restarted during the pause lost its jobs with the old agent: the
    recovery goes on when the pause ends."""
    from revenant.coordinator.recovery.failover import Failover

    await put(table, "running", 1, "node-1")
    fo = Failover(table.config, table.js, table, table.events,
                  lambda: [NodeStatus(name="node-1", state="alive", incarnation="a2")], lambda node: None)
    fo.storm.hold()
    fo.recover_job("1", "node-1", "a1")
    await asyncio.sleep(0.3)
    fo.storm.release()
    await asyncio.sleep(table.config.node_timeout_s + 1.0)
    assert "1" in fo.recovering  # still recovering (no node can take it here), not dropped
    fo.cancel()


async def test_a_new_leader_taking_over_many_silent_nodes_at_once_pauses_first(table):
    """A leader elected during a split takes over two of four nodes' jobs at once: the storm
    guard counts them before either restore starts (not at its next tick), and pauses."""
    from revenant.coordinator.recovery.failover import Failover

    for job, node in (("1", "node-1"), ("2", "node-2")):
        await table.save(JobRecord(spec=JobSpec(id=job, argv=["true"]), state="running", generation=1, node=node,
                                   pid=4242))
    states = {"node-1": "dead", "node-2": "dead", "node-3": "alive", "node-4": "alive"}
    fo = Failover(table.config, table.js, table, table.events,
                  lambda: [NodeStatus(name=n, state=s) for n, s in states.items()], lambda node: None)
    fo.recover_job("1", "node-1")
    fo.recover_job("2", "node-2")
    await asyncio.sleep(1.0)
    assert fo.storm.paused and fo.recovering == {"1", "2"}
    assert [(table.get(j).state, table.get(j).generation) for j in ("1", "2")] == [("running", 1)] * 2
    fo.cancel()


async def test_a_table_read_empty_while_its_stream_holds_records_is_read_again(table):
    """A server just restarted may show a new reader nothing pending for a moment: the read is
    done again rather than leading on an empty table; a table whose records were all removed is
    empty at once."""
    store = table.store
    await put(table, "running", 1, "node-1")
    real, calls = store._read, []

    async def empty_once():
        calls.append(1)
        return {} if len(calls) == 1 else await real()

    store._read = empty_once
    assert list(await store.load()) == ["1"] and len(calls) == 2
    await store.remove("1")
    calls.clear()
    assert await store.load() == {} and len(calls) == 1  # deleted: nothing to wait for
