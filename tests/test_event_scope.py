"""Events reach only those who may see them (docs/security.md): a user reads its own jobs' and
epochs' events and every node's and the cluster's, never another user's; admin reads all.  The
server enforces it: a user may create a consumer on the event stream only with one filter named
in the create request's subject, among its own (common/settings/security.py), and the server
refuses a request whose subject and consumer disagree.  Checked through the client library's
EventStream, which ``revenant events`` reads, against a real nats-server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from revenant.client.events import EventStream
from revenant.messages import ClusterEvent, EpochEvent, JobEvent, NodeEvent, encode, subjects
from test_security_bus import close_all, connect_as, request_refused, secured, setup_jetstream  # noqa: F401

EVENTS = [
    (subjects.job_event("a1", "started", "node-1", user="alice"), JobEvent(job="a1", kind="started", at=1.0)),
    (subjects.job_event("b1", "started", "node-1", user="bob"), JobEvent(job="b1", kind="started", at=2.0)),
    (subjects.node_event("node-1", "joined"), NodeEvent(node="node-1", kind="joined", at=3.0)),
    (subjects.epoch_event("b1", "created", "node-1", user="bob"), EpochEvent(job="b1", kind="created", at=4.0)),
    (subjects.epoch_event("a1", "created", "node-1", user="alice"), EpochEvent(job="a1", kind="created", at=5.0)),
    (subjects.job_event("a1", "restored", user="alice"), JobEvent(job="a1", kind="restored", at=6.0)),
    (subjects.cluster_event("failover_paused"), ClusterEvent(kind="failover_paused", at=7.0)),
    (subjects.job_event("r1", "started", user=""), JobEvent(job="r1", kind="started", at=8.0)),
]


async def read_all(conn, user: str | None, jobs=None) -> list[tuple[int, str]]:
    reader = SimpleNamespace(nc=conn.nc, timeout_s=3.0, user=user)
    return [(ev.seq, ev.subject) async for ev in EventStream(reader, None, jobs, None, follow=False)]


@pytest.mark.nats
async def test_a_user_reads_its_own_jobs_events_and_the_cluster_s_never_another_user_s(secured):  # noqa: F811
    server, seeds = secured
    coord = await setup_jetstream(server, seeds)
    alice, bob, admin = [await connect_as(server, seeds, who) for who in ("user-alice", "user-bob", "admin")]
    try:
        js = coord.nc.jetstream(timeout=10)
        for subject, event in EVENTS:
            await js.publish(subject, encode(event))
        everything = [(i + 1, subject) for i, (subject, _) in enumerate(EVENTS)]
        # In the stream's order, merged from one consumer per filter.
        assert await read_all(alice, "alice") == [everything[i] for i in (0, 2, 4, 5, 6)]
        assert await read_all(bob, "bob") == [everything[i] for i in (1, 2, 3, 6)]
        assert await read_all(admin, None) == everything
        assert await read_all(alice, "alice", ["a1"]) == [everything[i] for i in (0, 4, 5)]
        assert await read_all(admin, None, ["b1"]) == [everything[i] for i in (1, 3)]
        assert alice.errors == bob.errors == admin.errors == []

        # Asking as bob with alice's credential: the server refuses the consumers.
        with pytest.raises(Exception):
            await read_all(alice, "bob")
        assert any("permissions violation" in e and ".revenant.evt.job.bob.>" in e for e in alice.errors), alice.errors
        # A create request whose subject names alice's filter but whose consumer reads bob's:
        # the server answers with an error and creates nothing.
        config = {"name": "sly", "filter_subject": subjects.user_events("bob")[0], "deliver_subject": "_INBOX_user-alice.x",
                  "ack_policy": "none"}
        msg = await alice.nc.request(
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.sly.{subjects.user_events('alice')[0]}",
            json.dumps({"stream_name": subjects.EVENTS_STREAM, "config": config}).encode(), timeout=10)
        answer = json.loads(msg.data)
        assert "error" in answer and "consumer_info" not in answer.get("type", ""), answer
        info = await coord.nc.jetstream(timeout=10).consumers_info(subjects.EVENTS_STREAM)
        assert "sly" not in [c.name for c in info]
        # Nor a consumer with several filters, or none.
        await request_refused(alice, f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}")
    finally:
        await close_all(alice, bob, admin, coord)


@pytest.mark.unit
def test_a_job_event_carries_its_user_and_a_reader_s_filters_follow():
    assert subjects.job_event("7", "exited", "node-2", user="alice") == "revenant.evt.job.alice.7.exited.node-2"
    assert subjects.epoch_event("7", "created", "n1", user="") == "revenant.evt.epoch.root.7.created.n1"
    assert subjects.event_node(subjects.job_event("7", "exited", "node-2", user="alice")) == "node-2"
    assert subjects.event_node(subjects.job_event("7", "exited", user="alice")) is None
    assert subjects.user_events("alice") == ["revenant.evt.job.alice.>", "revenant.evt.epoch.alice.>",
                                             "revenant.evt.node.>", "revenant.evt.cluster.>"]
    assert subjects.user_events(None) == [subjects.EVENTS_ALL]
    assert subjects.user_events(None, "7") == ["revenant.evt.job.*.7.>", "revenant.evt.epoch.*.7.>"]
    assert subjects.user_events("alice", "7") == ["revenant.evt.job.alice.7.>", "revenant.evt.epoch.alice.7.>"]
