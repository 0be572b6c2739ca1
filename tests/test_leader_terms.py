"""Leader terms: every command to an agent carries its leader's term, and an agent refuses one
from a term older than the newest it has heard (a deposed leader's, late)."""

import pytest

from helpers import connect_as
from revenant.agent.running.runtime import LeaderTerm, StaleTerm
from revenant.common.settings import security
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.agents import AgentClient
from revenant.messages import AgentJobReply, JobSpec, StartJob, decode_as, encode, subjects


@pytest.mark.unit
def test_a_node_takes_commands_from_the_newest_leader_term_it_has_heard():
    term = LeaderTerm()
    term.take(0, "a command")  # a coordinator from before terms
    term.take(12, "a command")
    term.take(12, "a command")
    term.take(0, "a command")
    with pytest.raises(StaleTerm, match="the kill command from leader term 9 refused: this node has heard from term 12"):
        term.take(9, "the kill command")
    term.take(30, "a command")
    assert term.newest == 30


@pytest.mark.nats
async def test_a_leaders_commands_carry_its_term(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # the leader's AgentClient
    node = await connect_as(nats_url, security.agent_identity("node-1"), "node-1")  # and the agent it commands
    seen: list[str | None] = []

    async def agent(msg):
        seen.append((msg.headers or {}).get(subjects.TERM_HEADER))
        spec = decode_as(msg.data, StartJob).spec
        await msg.respond(encode(AgentJobReply(job=spec.id, generation=1, node="node-1")))

    await node.subscribe(subjects.node_command("node-1", "start"), cb=agent)
    await node.flush()
    term = {"now": 41}
    client = AgentClient(nc, lambda: True, term=lambda: term["now"])
    spec = JobSpec(id="1", argv=["true"])
    await client.carry_out(lc.Start("node-1", spec, 1), 5)
    term["now"] = 0  # not leading: no term is sent
    await client.carry_out(lc.Start("node-1", spec, 1), 5)
    assert seen == ["41", None]
    await nc.close()
    await node.close()


@pytest.mark.unit
def test_an_event_that_names_another_node_than_its_subjects_is_ignored_and_counted():
    import asyncio
    from types import SimpleNamespace

    from revenant.coordinator.table.job_events import JobEventConsumer
    from revenant.messages import EpochEvent, JobEvent

    applied, refused = [], []

    class Jobs:
        async def apply_event(self, ev):
            applied.append((ev.job, ev.node))
            return False

        async def apply_converted(self, ev):
            applied.append(("converted", ev.node))

    consumer = JobEventConsumer(None, Jobs(), lambda *a: None, refused=lambda: refused.append(1))

    def msg(subject, event):
        return SimpleNamespace(subject=subject, data=encode(event))

    exited = JobEvent(job="7", kind="exited", at=1.0, node="node-1", generation=1, exit_code=0)
    converted = EpochEvent(job="7", kind="converted", at=1.0, node="node-1", n=2)

    async def main():
        # node-2's credential may publish only on subjects ending with node-2: naming node-1 there is refused.
        assert await consumer._apply(msg(subjects.job_event("7", "exited", "node-2", user=""), exited))
        assert await consumer._apply(msg(subjects.epoch_event("7", "converted", "node-2", user=""), converted))
        assert applied == [] and len(refused) == 2
        assert await consumer._apply(msg(subjects.job_event("7", "exited", "node-1", user=""), exited))
        assert await consumer._apply(msg(subjects.epoch_event("7", "converted", "node-1", user=""), converted))
        assert await consumer._apply(msg(subjects.job_event("7", "exited", user=""), exited))  # the leader's own
        assert applied == [("7", "node-1"), ("converted", "node-1"), ("7", "node-1")] and len(refused) == 2

    asyncio.run(main())
    assert subjects.event_node("revenant.evt.job.alice.7.exited.node-2") == "node-2"
    assert subjects.event_node("revenant.evt.job.alice.7.exited") is None
    assert subjects.event_node("revenant.evt.node.node-1.joined") is None
