"""The bus's authentication and per-identity permissions, enforced by a real nats-server.

A server is started with the configuration ``revenant up`` writes (common/settings/security.py):
every identity connects with its own NKey, and each operation the identity must not do is
tried and must be refused by the server (a permissions violation reported to the client's
error callback, the message never delivered), while what it needs keeps working.
"""

from __future__ import annotations

import asyncio
import json
import stat

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType

from conftest import revenant_cli

from revenant.common.errors import BusError, ConfigError
from revenant.common.messaging import bus
from revenant.common.messaging.natsserver import start_nats_server, write_server_config
from revenant.common.settings import security
from revenant.messages import NodesReply, NodesRequest, decode, encode, subjects

NODES = ["node-1", "node-2"]
USERS = ["alice", "bob"]


@pytest.fixture
def secured(tmp_path):
    keyring = security.Keyring(tmp_path / "keys")
    seeds = keyring.ensure_all(security.cluster_identities(NODES, USERS))
    conf = write_server_config(tmp_path / "nats.conf", security.render_authorization(keyring.public))
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log", config_file=conf)
    try:
        yield server, seeds
    finally:
        server.stop()


class Conn:
    """A connection as ``identity`` that records the permission violations the server reports."""

    def __init__(self, nc, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def refused(self, what: str, timeout_s: float = 10.0) -> None:
        """Wait for the server's report that ``what`` (a subject) was refused."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if any("permissions violation" in e.lower() and f'"{what.lower()}"' in e.lower() for e in self.errors):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the server did not refuse {what}; errors: {self.errors}")


async def connect_as(server, seeds, identity: str) -> Conn:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(server.url, nkeys_seed=str(seeds[identity]), inbox_prefix=security.inbox_prefix(identity),
                            error_cb=on_error, allow_reconnect=False, connect_timeout=10)
    return Conn(nc, errors)


async def publish_refused(conn: Conn, subject: str, payload: bytes = b"x") -> None:
    await conn.nc.publish(subject, payload)
    await conn.refused(subject)


async def subscribe_refused(conn: Conn, subject: str) -> None:
    await conn.nc.subscribe(subject)
    await conn.refused(subject)


async def request_refused(conn: Conn, subject: str, payload: bytes = b"{}") -> None:
    """A JetStream API (or any) request the server drops: refused, and never answered."""
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await conn.nc.request(subject, payload, timeout=1.0)
    await conn.refused(subject)


async def all_refused(check, conn: Conn, forbidden: tuple[str, ...]) -> None:
    """``check`` each of ``forbidden`` at once (each waits up to a second for its refusal)."""
    await asyncio.gather(*(check(conn, subject) for subject in forbidden))


async def heard(sender: Conn, sub, subject: str, tries: int = 10):
    """A heartbeat is fire and forget (core NATS): published, flushed, and again each second until
    ``sub`` hears one, at most ``tries`` times; one that is never allowed through never arrives."""
    for attempt in range(tries):
        await sender.nc.publish(subject, b"hb")
        await sender.nc.flush()
        try:
            return await sub.next_msg(timeout=1)
        except nats.errors.TimeoutError:
            if attempt == tries - 1:
                raise


async def setup_jetstream(server, seeds) -> Conn:
    """The coordinator creates what it owns: the event stream and the buckets."""
    coord = await connect_as(server, seeds, security.COORDINATOR)
    js = coord.nc.jetstream(timeout=10)
    await bus.ensure_event_stream(js)
    for bucket, ttl in ((subjects.JOBS_BUCKET, None), (subjects.LEADER_BUCKET, 5.0),
                        (security.ARCHIVE_BUCKET, None), (subjects.LEASES_BUCKET, 5.0)):
        await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl, storage=StorageType.FILE))
    return coord


async def close_all(*conns: Conn) -> None:
    for conn in conns:
        await conn.nc.close()


async def answered(conn: Conn, subject: str, payload: bytes) -> bytes:
    """The answer to a request that is allowed.  Asked again (up to 10 s) when the server says
    there are no responders: seen once in many runs right after the answering side's subscription
    was flushed on its own connection.  A request that is not allowed is never answered."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            return (await conn.nc.request(subject, payload, timeout=10)).data
        except nats.errors.NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def serve(conn: Conn, subject: str, answer: bytes = b"ok"):
    """Answer every request on ``subject`` with ``answer``; returns the subscription."""

    async def respond(msg) -> None:
        await msg.respond(answer)

    sub = await conn.nc.subscribe(subject, cb=respond)
    await conn.nc.flush()
    return sub


@pytest.mark.unit
def test_seed_files_are_private_and_kept(tmp_path):
    keyring = security.Keyring(tmp_path / "keys")
    paths = keyring.ensure_all(security.cluster_identities(NODES, USERS))
    assert set(paths) == {"coordinator", "admin", "agent-node-1", "agent-node-2", "user-alice", "user-bob"}
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    for identity, path in paths.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, identity
        assert path.read_text().startswith("SU")
        assert keyring.public[identity].startswith("U")
        assert keyring.public[identity] == security.public_key(path.read_text())
    again = security.Keyring(tmp_path / "keys")
    again.ensure("agent-node-1")
    assert again.public["agent-node-1"] == keyring.public["agent-node-1"]
    text = security.render_authorization(keyring.public)
    assert all(f'nkey: "{key}"' in text for key in keyring.public.values())
    assert len(set(keyring.public.values())) == len(paths)


@pytest.mark.unit
def test_names_the_permissions_use_are_the_coordinators():
    from revenant.coordinator.table import job_events, store

    assert security.COORDINATOR_CONSUMER == job_events.CONSUMER
    assert security.COORDINATOR_EPOCHS_CONSUMER == job_events.EPOCHS_CONSUMER
    assert security.ARCHIVE_BUCKET == store.ARCHIVE_BUCKET


@pytest.mark.unit
def test_identity_names_are_checked():
    assert security.agent_identity("node-1") == "agent-node-1"
    assert security.inbox_prefix("user-alice") == "_INBOX_user-alice"
    for bad in ("root", "agent-", "user-a.b", "user-*", "agent->", "coordinator2"):
        with pytest.raises(ValueError):
            security.check_identity(bad)
    with pytest.raises(subjects.InvalidName):
        security.user_identity("a.b")


@pytest.mark.unit
def test_keys_for_an_existing_deployment_only_add(tmp_path):
    from revenant.cli.keys import FRAGMENT, make_keys

    first = make_keys(tmp_path / "k", ["node-1", "node-2"], ["alice"])
    again = make_keys(tmp_path / "k", [], ["bob"])
    assert sorted(again.public) == ["admin", "agent-node-1", "agent-node-2", "coordinator", "user-alice", "user-bob"]
    assert all(again.public[i] == key for i, key in first.public.items())
    block = (tmp_path / "k" / FRAGMENT).read_text()
    assert all(key in block for key in again.public.values())
    assert "revenant.user.bob.>" in block and "revenant.hb.node-2" in block
    # A client knows its identity, and so its inbox, from the file's name.
    assert security.client_credentials(str(tmp_path / "k" / "user-bob.nk")) == {
        "nkey_seed": str(tmp_path / "k" / "user-bob.nk"), "inbox_prefix": "_INBOX_user-bob"}
    assert security.client_credentials("") == {}
    with pytest.raises(ConfigError, match="name it <identity>.nk"):
        security.client_credentials(str(tmp_path / "mine.seed"))


@pytest.mark.nats
async def test_unauthenticated_and_unknown_keys_are_refused(secured, tmp_path):
    server, seeds = secured
    with pytest.raises(BusError, match="refused"):
        await bus.connect(server.url, "anonymous", endless_reconnect=False)
    stranger = tmp_path / "stranger.nk"
    security.write_private(stranger, security.new_seed())
    # Endless reconnects (an agent's) still give up at once on a key the server does not know.
    with pytest.raises(BusError, match="not one it knows"):
        await bus.connect(server.url, "stranger", nkey_seed=str(stranger), endless_reconnect=True)
    # A known identity's public key with a seed of its own does not pass for it either.
    with pytest.raises(BusError, match="cannot read"):
        await bus.connect(server.url, "nobody", nkey_seed=str(tmp_path / "missing.nk"))
    nc = await bus.connect(server.url, "admin", nkey_seed=str(seeds["admin"]),
                           inbox_prefix=security.inbox_prefix("admin"), endless_reconnect=False)
    await nc.close()


@pytest.mark.nats
async def test_agent_may_do_its_own_work_only(secured):
    server, seeds = secured
    coord = await setup_jetstream(server, seeds)
    agent = await connect_as(server, seeds, "agent-node-1")
    other = await connect_as(server, seeds, "agent-node-2")
    try:
        # Allowed: its heartbeat (seen by the coordinator), its lease, events, reconcile, replies.
        beats = await coord.nc.subscribe(subjects.HEARTBEATS_ALL)
        await coord.nc.flush()
        assert (await heard(agent, beats, subjects.heartbeat("node-1"))).subject == subjects.heartbeat("node-1")
        js = agent.nc.jetstream(timeout=10)
        await bus.ensure_event_stream(js)  # exists: the create is a no-op it may do
        leases = await js.key_value(subjects.LEASES_BUCKET)
        await leases.put("node-1", b"lease")
        await js.publish(subjects.node_event("node-1", "joined"), b"e")
        await js.publish(subjects.job_event("j-1", "started", "node-1", user=""), b"e")
        await js.publish(subjects.epoch_event("j-1", "committed", "node-1", user=""), b"e")
        await serve(coord, subjects.coordinator("reconcile"))
        assert await answered(agent, subjects.coordinator("reconcile"), b"r") == b"ok"
        # The coordinator commands it and probes it; it answers.
        await serve(agent, subjects.node_commands("node-1"), b"done")
        await serve(agent, subjects.probe("node-1"), b"pong")
        cmd = subjects.node_command("node-1", "kill_job")
        assert await answered(coord, cmd, b"k") == b"done"
        assert await answered(coord, subjects.probe("node-1"), b"p") == b"pong"
        assert agent.errors == []

        # Forbidden: another node's heartbeat, commands to any node, KV it does not own, events of
        # another node or of the cluster, requests as admin or a user.
        await all_refused(publish_refused, agent, (
            subjects.heartbeat("node-2"), subjects.node_command("node-2", "start_job"),
            subjects.node_command("node-1", "start_job"), subjects.probe("node-2"),
            f"$KV.{subjects.JOBS_BUCKET}.j-1", f"$KV.{subjects.LEASES_BUCKET}.node-2",
            f"$KV.{subjects.LEADER_BUCKET}.leader", f"$KV.{security.ARCHIVE_BUCKET}.j-1",
            subjects.node_event("node-2", "evicted"), subjects.cluster_event("alert"),
            # A job's or epoch's event as another node, or as the leader (no node): the server
            # refuses it, so the leader never hears a node speak for another's job.
            subjects.job_event("j-1", "exited", "node-2", user=""), subjects.job_event("j-1", "exited", user=""),
            subjects.epoch_event("j-1", "created", "node-2", user=""), subjects.epoch_event("j-1", "created", user=""),
            # A leader's announcement of its term (heartbeat_request.v1): a coordinator's alone.
            subjects.HEARTBEAT_REQUESTS,
            subjects.coordinator("submit"), "revenant.user.alice.submit"))
        # The lease write as the KV API makes it (a publish awaiting the stream's ack): never acked.
        with pytest.raises(nats.errors.TimeoutError):
            await (await agent.nc.jetstream(timeout=1.5).key_value(subjects.LEASES_BUCKET)).put("node-2", b"forged")
        await agent.refused(f"$KV.{subjects.LEASES_BUCKET}.node-2")
        # Nothing forged was stored: no lease for node-2, no job record.
        cjs = coord.nc.jetstream(timeout=10)
        for bucket, key in ((subjects.LEASES_BUCKET, "node-2"), (subjects.JOBS_BUCKET, "j-1")):
            with pytest.raises(nats.js.errors.NotFoundError):
                await cjs.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
        # Nor may it change, purge or delete the stream or a bucket.
        await all_refused(request_refused, agent, (
            f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.UPDATE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.DELETE.KV_{subjects.LEASES_BUCKET}",
            f"$JS.API.STREAM.PURGE.KV_{subjects.LEASES_BUCKET}",
            f"$JS.API.STREAM.CREATE.KV_{subjects.JOBS_BUCKET}",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}"))
        # It hears nothing but its own commands, probes and inbox.
        await all_refused(subscribe_refused, agent, (
            subjects.node_commands("node-2"), subjects.probe("node-2"), subjects.HEARTBEATS_ALL,
            "revenant.>", "_INBOX_coordinator.>", "_INBOX.>", subjects.coordinator("submit")))
        assert other.errors == []
    finally:
        await close_all(agent, other, coord)


@pytest.mark.nats
async def test_user_may_ask_as_itself_and_read_events_only(secured):
    server, seeds = secured
    coord = await setup_jetstream(server, seeds)
    await coord.nc.jetstream(timeout=10).publish(subjects.job_event("j-1", "started", user="alice"), b"e")
    alice = await connect_as(server, seeds, "user-alice")
    bob = await connect_as(server, seeds, "user-bob")
    try:
        await serve(coord, "revenant.user.*.*")
        assert await answered(alice, "revenant.user.alice.submit", b"s") == b"ok"
        js = alice.nc.jetstream(timeout=10)
        info = await js.stream_info(subjects.EVENTS_STREAM)
        assert info.state.messages == 1
        # Its own jobs' events (tests/test_event_scope.py: only those, and every node's and the cluster's).
        sub = await js.subscribe(subjects.user_events("alice")[0], stream=subjects.EVENTS_STREAM, manual_ack=True,
                                 config=ConsumerConfig(name="mine", deliver_policy=DeliverPolicy.ALL))
        assert (await sub.next_msg(timeout=10)).subject == subjects.job_event("j-1", "started", user="alice")
        await sub.unsubscribe()
        assert alice.errors == []

        await all_refused(publish_refused, alice, (
            subjects.node_command("node-1", "start_job"), subjects.probe("node-1"),
            subjects.heartbeat("node-1"), subjects.coordinator("submit"), "revenant.user.bob.submit",
            f"$KV.{subjects.JOBS_BUCKET}.j-1", f"$KV.{subjects.LEASES_BUCKET}.node-1",
            f"$KV.{subjects.LEADER_BUCKET}.leader", subjects.job_event("j-1", "evicted", user=""),
            subjects.node_event("node-1", "evicted"), subjects.HEARTBEAT_REQUESTS))
        await all_refused(request_refused, alice, (
            f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.UPDATE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.CREATE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.DELETE.KV_{subjects.JOBS_BUCKET}",
            f"$JS.API.STREAM.MSG.GET.KV_{subjects.JOBS_BUCKET}",
            f"$JS.API.DIRECT.GET.KV_{subjects.JOBS_BUCKET}",
            f"$JS.API.CONSUMER.DELETE.{subjects.EVENTS_STREAM}.{security.COORDINATOR_CONSUMER}",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.{security.COORDINATOR_CONSUMER}",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.EVENTS_STREAM}.{security.COORDINATOR_CONSUMER}",
            f"$JS.API.CONSUMER.MSG.NEXT.{subjects.EVENTS_STREAM}.{security.COORDINATOR_CONSUMER}",
            # A consumer on the whole stream, or on another user's events (tests/test_event_scope.py).
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.c1",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.c1.{subjects.EVENTS_ALL}",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.c1.revenant.evt.job.bob.>"))
        # A KV write is a publish the stream would ack: the ack never comes.
        await request_refused(alice, f"$KV.{subjects.JOBS_BUCKET}.j-2", b"forged")
        await all_refused(subscribe_refused, alice, (
            "_INBOX_user-bob.>", "_INBOX.>", "revenant.user.>", "revenant.user.bob.>",
            subjects.node_commands("node-1"), subjects.HEARTBEATS_ALL, subjects.EVENTS_ALL))
        assert bob.errors == []
    finally:
        await close_all(alice, bob, coord)


@pytest.mark.nats
async def test_admin_asks_the_coordinator_and_reads_events_only(secured):
    server, seeds = secured
    coord = await setup_jetstream(server, seeds)
    admin = await connect_as(server, seeds, "admin")
    try:
        await serve(coord, f"{subjects.COORDINATOR_PREFIX}.>")
        assert await answered(admin, subjects.coordinator("nodes"), b"n") == b"ok"
        js = admin.nc.jetstream(timeout=10)
        await bus.ensure_event_stream(js)  # `revenant events --follow` before any coordinator
        assert (await js.stream_info(subjects.EVENTS_STREAM)).config.name == subjects.EVENTS_STREAM
        assert admin.errors == []
        await all_refused(publish_refused, admin, (
            subjects.node_command("node-1", "kill_job"), subjects.heartbeat("node-1"),
            subjects.coordinator("reconcile"), "revenant.user.alice.submit",
            f"$KV.{subjects.JOBS_BUCKET}.j-1", f"$KV.{subjects.LEADER_BUCKET}.leader",
            subjects.job_event("j-1", "evicted", user="")))
        await all_refused(request_refused, admin, (
            f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
            f"$JS.API.STREAM.DELETE.KV_{subjects.JOBS_BUCKET}",
            f"$JS.API.CONSUMER.DELETE.{subjects.EVENTS_STREAM}.{security.COORDINATOR_CONSUMER}"))
        await all_refused(subscribe_refused, admin, (
            subjects.node_commands("node-1"), "_INBOX_coordinator.>", "revenant.>"))
    finally:
        await close_all(admin, coord)


@pytest.mark.nats
async def test_a_jobs_progress_reaches_its_user_and_admin_only(secured):
    server, seeds = secured
    agent = await connect_as(server, seeds, "agent-node-1")
    alice = await connect_as(server, seeds, "user-alice")
    bob = await connect_as(server, seeds, "user-bob")
    admin = await connect_as(server, seeds, "admin")
    try:
        hers = await alice.nc.subscribe(subjects.job_progress("7", "alice"))
        anyones = await admin.nc.subscribe(subjects.job_progress("7"))
        for conn in (alice, admin):
            await conn.nc.flush()
        await agent.nc.publish(subjects.progress("alice", "7"), b"p")
        assert (await hers.next_msg(timeout=10)).data == b"p"
        assert (await anyones.next_msg(timeout=10)).subject == subjects.progress("alice", "7")
        assert agent.errors == alice.errors == admin.errors == []
        # Bob hears neither alice's jobs nor every job's; only agents tell progress.
        await all_refused(subscribe_refused, bob, (
            subjects.progress("alice", "7"), subjects.job_progress("7"), subjects.PROGRESS_ALL))
        await all_refused(publish_refused, alice, (subjects.progress("alice", "7"),))
        await all_refused(publish_refused, admin, (subjects.progress("alice", "7"),))
    finally:
        await close_all(agent, alice, bob, admin)


@pytest.mark.nats
async def test_coordinator_owns_the_job_table(secured):
    server, seeds = secured
    coord = await setup_jetstream(server, seeds)
    try:
        js = coord.nc.jetstream(timeout=10)
        jobs = await js.key_value(subjects.JOBS_BUCKET)
        await jobs.put("j-1", b"record")
        assert (await jobs.get("j-1")).value == b"record"
        leases = await js.key_value(subjects.LEASES_BUCKET)
        await leases.put("node-1", b"lease")  # the agent's, but it reads it for failover
        assert (await js.get_last_msg(f"KV_{subjects.LEASES_BUCKET}",
                                      f"$KV.{subjects.LEASES_BUCKET}.node-1")).data == b"lease"
        assert coord.errors == []
    finally:
        await close_all(coord)


def cluster_doc(d) -> dict:
    return json.loads((d / "cluster.json").read_text())


@pytest.mark.cluster
async def test_up_runs_authenticated_and_keys_adds_a_user(make_cluster):
    cluster = make_cluster(nodes=1)
    doc = cluster_doc(cluster.dir)
    assert doc["insecure"] is False and doc["creds"] == str(cluster.dir / "keys" / "admin.nk")
    for path, mode in ((cluster.dir / "cluster.json", 0o600), (cluster.dir / "keys", 0o700),
                       (cluster.dir / "nats.conf", 0o600), *((p, 0o600) for p in (cluster.dir / "keys").iterdir())):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert {p.name for p in (cluster.dir / "keys").iterdir()} == {"admin.nk", "coordinator.nk", "agent-node-1.nk",
                                                                 "image.keys"}  # the epochs' (agent/storage/imagekeys.py)
    # Each process runs with its own identity.
    argv = {p["name"]: p["argv"] for p in doc["processes"]}
    assert argv["node-1"][argv["node-1"].index("--creds") + 1].endswith("keys/agent-node-1.nk")
    assert argv["coordinator"][argv["coordinator"].index("--creds") + 1].endswith("keys/coordinator.nk")
    assert "--config" in argv["nats-server"]
    with pytest.raises(BusError, match="refused"):
        await bus.connect(doc["nats_url"], "anonymous", endless_reconnect=False)

    # revenant keys --dir adds a user, and the running server admits it at once (a reload).
    out = revenant_cli("keys", "--dir", str(cluster.dir), "--user", "alice", check=True)
    assert "user-alice" in out.stdout and "reloaded" in out.stderr
    seed = cluster.dir / "keys" / "user-alice.nk"

    async def alice_asks() -> bytes:
        nc = await bus.connect(doc["nats_url"], "alice", endless_reconnect=False,
                               **security.client_credentials(str(seed)))
        try:
            return (await nc.request(subjects.user_request("alice", "nodes"), encode(NodesRequest()), timeout=10)).data
        finally:
            await nc.close()

    reply = None
    for _ in range(150):  # the reload is asynchronous
        try:
            reply = decode(await alice_asks())
            break
        except BusError:
            await asyncio.sleep(0.1)
    assert isinstance(reply, NodesReply) and [n.name for n in reply.nodes] == ["node-1"]
    # The CLI reaches it with cluster.json's admin credential (make_cluster passes it on).
    assert cluster.json("nodes")[0]["state"] == "alive"


@pytest.mark.cluster
def test_up_insecure_is_open_and_says_so(make_cluster):
    cluster = make_cluster(nodes=1, insecure=True)
    doc = cluster_doc(cluster.dir)
    assert doc["insecure"] is True and doc["creds"] == ""
    # No NKey at all; only the epochs' image keys, which sign checkpoints whether or not the bus is open.
    assert [p.name for p in (cluster.dir / "keys").iterdir()] == ["image.keys"]
    supervisor_log = (cluster.dir / "logs" / "supervisor.log").read_text()
    assert "INSECURE" in supervisor_log
    out = revenant_cli("nodes", "--dir", str(cluster.dir), check=True)
    assert "INSECURE" in out.stderr and "node-1" in out.stdout
    # Anyone may connect: no credential at all.
    out = revenant_cli("nodes", "--nats", doc["nats_url"], "--json", env={"REVENANT_CREDS": ""}, check=True)
    assert json.loads(out.stdout)[0]["name"] == "node-1"


@pytest.mark.nats
@pytest.mark.timeout(300)
async def test_a_reply_after_more_than_two_minutes_still_reaches_the_requester(nats_url):
    """Issue 44: nats-server expires a response grant after 2 minutes by default, so a checkpoint
    or restore that took longer committed and its reply was refused.  The real server, with the
    authorization block revenant renders: the coordinator answers an admin's request 125 s late."""
    from helpers import connect_as as connect
    subject = subjects.coordinator("slow-operation")
    coordinator = await connect(nats_url, security.COORDINATOR)
    admin = await connect(nats_url, security.ADMIN)
    try:
        async def answer(msg) -> None:
            await asyncio.sleep(125)
            await msg.respond(b"done after 125 s")
        sub = await coordinator.subscribe(subject, cb=answer)
        await coordinator.flush()
        reply = await admin.request(subject, b"checkpoint a large job", timeout=200)
        assert reply.data == b"done after 125 s"
        await sub.unsubscribe()
    finally:
        await coordinator.close()
        await admin.close()
