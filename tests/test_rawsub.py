"""The coordinator's heartbeat subscriber (common/messaging/rawsub.py) against a real nats-server: what
nats-py publishes arrives whole and in order, whatever the socket's reads cut; a restarted
server is found again; a credential is signed as the server asks; a refusal is one line; a bus
reached over TLS gets its heartbeats through the client library instead."""

from __future__ import annotations

import asyncio
import subprocess
import urllib.parse

import nats
import pytest

from helpers import connect_as, creds, running
from revenant.common.errors import BusError
from revenant.common.messaging.natsserver import start_nats_cluster, start_nats_server, write_server_config
from revenant.common.messaging.handshake import plain_urls
from revenant.common.messaging.rawsub import RawSubscriber, _Connection, starting_with
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.nodes.heartbeats import ClientSubscription
from revenant.messages import Heartbeat, encode, subjects

pytestmark = pytest.mark.nats

# On the test's bus (authenticated: tests/helpers.py AuthBus) the subscriber is the coordinator's,
# which alone may hear every node's subjects: it listens, and the test publishes, as the
# coordinator, under revenant's root.
T = f"{subjects.ROOT}.t"


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_messages_arrive_whole_and_in_order(nats_url):
    got: list[tuple[bytes, bytes]] = []
    sub = RawSubscriber(nats_url, "test", f"{T}.*", got.extend, creds=creds(nats_url, security.COORDINATOR))
    await sub.start()
    try:
        assert sub.connected
        nc = await connect_as(nats_url, security.COORDINATOR)
        payloads = [bytes([i % 251]) * (i * 37 % 5000) for i in range(2000)] + [b"\r\nMSG x 1 3\r\n" * 9000]
        for i, p in enumerate(payloads):
            await nc.publish(f"{T}.n{i % 7}", p)
        await nc.publish(f"{subjects.ROOT}.other", b"not mine")
        await nc.flush()
        await until(lambda: len(got) == len(payloads))
        assert [d for _, d in got] == payloads  # an empty payload, a 117 KiB one, protocol-like bytes
        assert [s for s, _ in got[:8]] == [f"{T}.n{i % 7}".encode() for i in range(8)]
        await nc.close()
    finally:
        await sub.close()
    assert not sub.connected


async def test_a_restarted_server_is_found_again(nats_server):
    url = nats_server.url
    got: list[bytes] = []
    back = asyncio.Event()

    async def on_reconnect() -> None:
        back.set()

    sub = RawSubscriber(url, "test", f"{T}.>", lambda batch: got.extend(d for _, d in batch), ping_interval_s=0.2,
                        reconnect_wait_s=0.1, on_reconnect=on_reconnect, creds=creds(url, security.COORDINATOR))
    await sub.start()
    try:
        nats_server.kill()
        await until(lambda: not sub.connected)
        nats_server.restart()
        await asyncio.wait_for(back.wait(), 10)
        assert sub.connected and sub.reconnects == 1
        nc = await connect_as(url, security.COORDINATOR)
        await nc.publish(f"{T}.a", b"after")
        await nc.flush()
        await until(lambda: got == [b"after"])
        await nc.close()
    finally:
        await sub.close()


async def test_a_url_naming_one_server_of_a_cluster_survives_that_server(tmp_path):
    """The cluster's other servers are learnt from the server's INFO (connect_urls): when the one
    named is lost, the subscription moves to another, as the client library's connections do."""
    servers = start_nats_cluster(tmp_path / "nats", 3, log_dir=tmp_path)
    got: list[bytes] = []
    back = asyncio.Event()

    async def on_reconnect() -> None:
        back.set()

    first = servers[0]
    sub = RawSubscriber(first.url, "test", "t.>", lambda batch: got.extend(d for _, d in batch), ping_interval_s=0.2,
                        reconnect_wait_s=0.1, on_reconnect=on_reconnect)
    await sub.start()
    nc = None
    try:
        # The routes form after the servers start: the cluster's INFO comes once they have.
        await until(lambda: len(sub.servers) == 3, 20)
        assert {urllib.parse.urlsplit(u).port for u in sub.servers} == {s.port for s in servers}
        first.stop()
        await asyncio.wait_for(back.wait(), 15)
        assert sub.connected
        nc = await nats.connect(servers[2].url)
        for _ in range(150):  # until the subscription's interest has reached that server
            await nc.publish("t.a", b"after")
            await nc.flush()
            if b"after" in got:
                break
            await asyncio.sleep(0.1)
        assert b"after" in got
    finally:
        if nc is not None:
            await nc.close()
        await sub.close()
        for server in servers:
            server.stop()


async def test_a_bus_that_is_not_there_is_one_line():
    sub = RawSubscriber("nats://127.0.0.1:1,nats://127.0.0.1:2", "test", "t.*", lambda batch: None,
                        connect_timeout_s=1)
    with pytest.raises(BusError) as err:
        await sub.start()
    assert "cannot subscribe to t.*" in str(err.value) and "127.0.0.1:2" in str(err.value)
    assert "\n" not in str(err.value)


async def test_credentials_are_signed_and_refusals_are_one_line(tmp_path):
    keyring = security.Keyring(tmp_path / "keys")
    seeds = keyring.ensure_all(security.cluster_identities(["node-1"]))
    conf = write_server_config(tmp_path / "nats.conf", security.render_authorization(keyring.public))
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log", config_file=conf)
    try:
        got: list[bytes] = []
        sub = RawSubscriber(server.url, "test", "revenant.hb.*", lambda batch: got.extend(d for _, d in batch),
                            creds=str(seeds[security.COORDINATOR]))
        await sub.start()
        try:
            agent = await nats.connect(server.url, nkeys_seed=str(seeds[security.agent_identity("node-1")]))
            await agent.publish("revenant.hb.node-1", b"beat")
            await agent.flush()
            await until(lambda: got == [b"beat"])
            await agent.close()
        finally:
            await sub.close()
        for seed in (None, str(keyring.ensure("agent-stranger"))):
            refused = RawSubscriber(server.url, "test", "revenant.hb.*", lambda batch: None, creds=seed)
            with pytest.raises(BusError) as err:
                await refused.start()
            assert "authorization violation" in str(err.value).lower() and "\n" not in str(err.value)
    finally:
        server.stop()


def test_plain_urls_tell_a_bus_the_raw_subscriber_speaks():
    assert plain_urls("nats://a:4222,nats://b:4222") and plain_urls("127.0.0.1:4222")
    assert not plain_urls("nats://a:4222,tls://b:4222") and not plain_urls("tls://a:4222")


async def test_a_server_that_sends_a_broken_frame_is_left_not_looped_on():
    """A negative or absurd size, an INFO that is not JSON, an error: the connection is dropped
    with the reason, and the messages of the read before it are delivered all the same."""
    got: list[tuple[bytes, bytes]] = []
    sub = RawSubscriber("nats://127.0.0.1:1", "test", "t.*", got.extend)
    for data, why in ((b"INFO {}\r\nPONG\r\nMSG t.a 1 -100\r\nxx\r\n", "malformed MSG"),
                      (b"MSG t.a 1 " + b"9" * 5000 + b"\r\n", "malformed MSG"),
                      (b"INFO {not json\r\n", "unreadable INFO"),
                      (b"MSG t.a 1 3\r\nabc\r\n-ERR 'Permissions Violation'\r\n", "Permissions Violation")):
        conn = _Connection(sub)
        conn.transport = _Sink()
        conn.data_received(data)
        assert conn.closed.done() and conn.transport.closed
        assert why in conn.closed.result()
    assert got == [(b"t.a", b"abc")]


class _Sink:
    def __init__(self) -> None:
        self.closed = False
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


async def test_a_tls_bus_gets_its_heartbeats_through_the_client_library(tmp_path, monkeypatch):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    conf = write_server_config(tmp_path / "nats.conf", f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n')
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log", config_file=conf)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the clients trust the test's own certificate
    try:
        with pytest.raises(BusError, match="requires TLS"):  # one line, naming the problem
            await RawSubscriber(server.url, "test", "t.*", lambda batch: None).start()
        url = server.url.replace("nats://", "tls://")
        async with running(Coordinator(CoordinatorConfig(nats_url=url, http_port=0))) as coord:
            assert isinstance(coord._hb_sub, ClientSubscription)
            nc = await nats.connect(url)
            await nc.publish(subjects.heartbeat("n1"), encode(Heartbeat(node="n1", seq=1, sent_at=0, incarnation="i")))
            await nc.flush()
            await until(lambda: "n1" in coord.detector.nodes)
            await nc.close()
    finally:
        server.stop()


def test_a_second_connection_starts_on_the_first_ones_server():
    assert starting_with("nats://a:1,nats://b:2,nats://c:3", "b:2") == "nats://b:2,nats://a:1,nats://c:3"
    assert starting_with("a:1,b:2", "b:2") == "b:2,a:1"
    assert starting_with("nats://a:1", "x:9") == "nats://a:1"


async def test_a_read_delivers_its_whole_messages_however_the_bytes_are_cut():
    """Frames with and without a reply subject, a payload that looks like a frame, PINGs between
    them: the same messages in the same order whether the bytes come at once or one by one, each
    read's whole ones in one call."""
    framelike = b"MSG t.x 1 3\r\nabc"
    stream = (b"INFO {}\r\nPONG\r\nMSG t.a 1 3\r\nabc\r\nPING\r\nMSG t.b 1 r.1 16\r\n" + framelike + b"\r\n"
              b"MSG t.c 1 0\r\n\r\n+OK\r\n")
    want = [(b"t.a", b"abc"), (b"t.b", framelike), (b"t.c", b"")]
    for cut in (len(stream), 1, 7):
        calls: list[list[tuple[bytes, bytes]]] = []
        conn = _Connection(RawSubscriber("nats://127.0.0.1:1", "test", "t.*", calls.append))
        conn.transport = _Sink()
        for i in range(0, len(stream), cut):
            conn.data_received(stream[i:i + cut])
        assert [m for batch in calls for m in batch] == want and all(calls), cut
        assert conn.transport.written.count(b"PONG") == 1 and not conn.closed.done()
        assert len(calls) == 1 or cut < len(stream)  # all at once: one call


async def test_a_connection_that_breaks_oddly_is_reconnected_not_given_up(nats_url, caplog):
    """A transport that fails a write (closed under it, its connection_lost not yet called): the
    subscription reconnects; it never stops for good, which would leave a coordinator blind."""
    got: list[tuple[bytes, bytes]] = []
    sub = RawSubscriber(nats_url, "test", f"{T}.*", got.extend, ping_interval_s=0.1,
                        creds=creds(nats_url, security.COORDINATOR))
    await sub.start()
    try:
        sub._conn.transport = _Unwritable(sub._conn.transport)
        await until(lambda: sub.reconnects == 1 and sub.connected)
        nc = await connect_as(nats_url, security.COORDINATOR)
        await nc.publish(f"{T}.a", b"after")
        await nc.flush()
        await until(lambda: got == [(f"{T}.a".encode(), b"after")])
        await nc.close()
    finally:
        await sub.close()
    assert "the handler is closed" in caplog.text and "subscription lost" in caplog.text


class _Unwritable:
    def __init__(self, transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on a transport: the handler is closed")

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self._transport.close()


async def test_a_pings_round_trip_says_how_far_behind_the_reader_is():
    """A PONG comes after everything the server queued before it: a PING out for 0.6 s, or
    answered after 0.6 s, means messages wait that long (backlogged); a quick answer clears it."""
    sub = RawSubscriber("nats://127.0.0.1:1", "test", "t.*", lambda batch: None)
    conn = sub._conn = _Connection(sub)
    conn.transport = _Sink()
    assert sub.behind_s == 0.0 and not sub.backlogged
    conn.ping()
    conn.pings[0] -= 0.6  # sent 0.6 s ago, not answered yet
    assert sub.backlogged and sub.behind_s >= 0.6
    conn.data_received(b"MSG t.a 1 1\r\nx\r\nPONG\r\n")
    assert sub.lag_s >= 0.6 and sub.backlogged and not conn.pings
    conn.ping()
    conn.data_received(b"PONG\r\n")
    assert sub.lag_s < 0.5 and not sub.backlogged
    assert conn.transport.written == b"PING\r\n" * 2


async def test_a_reconnect_attempt_that_fails_oddly_is_followed_by_another(nats_url, caplog):
    sub = RawSubscriber(nats_url, "test", f"{T}.*", lambda batch: None, reconnect_wait_s=0.05,
                        creds=creds(nats_url, security.COORDINATOR))
    await sub.start()
    real, calls = sub._connect, []

    async def odd_first() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a URL that does not parse")
        await real()

    sub._connect = odd_first
    try:
        sub._conn.transport.close()
        await until(lambda: sub.reconnects == 1 and sub.connected)
    finally:
        await sub.close()
    assert len(calls) == 2 and "a URL that does not parse" in caplog.text
