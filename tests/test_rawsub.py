"""The coordinator's heartbeat subscriber (common/rawsub.py) against a real nats-server: what
nats-py publishes arrives whole and in order, whatever the socket's reads cut; a restarted
server is found again; a credential is signed as the server asks; a refusal is one line."""

from __future__ import annotations

import asyncio

import nats
import pytest

from revenant.common import security
from revenant.common.errors import BusError
from revenant.common.natsserver import start_nats_server, write_server_config
from revenant.common.rawsub import RawSubscriber

pytestmark = pytest.mark.nats


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_messages_arrive_whole_and_in_order(nats_url):
    got: list[tuple[bytes, bytes]] = []
    sub = RawSubscriber(nats_url, "test", "t.*", lambda s, d: got.append((s, d)))
    await sub.start()
    try:
        assert sub.connected
        nc = await nats.connect(nats_url)
        payloads = [bytes([i % 251]) * (i * 37 % 5000) for i in range(2000)] + [b"\r\nMSG x 1 3\r\n" * 9000]
        for i, p in enumerate(payloads):
            await nc.publish(f"t.n{i % 7}", p)
        await nc.publish("other", b"not mine")
        await nc.flush()
        await until(lambda: len(got) == len(payloads))
        assert [d for _, d in got] == payloads  # an empty payload, a 117 KiB one, protocol-like bytes
        assert [s for s, _ in got[:8]] == [f"t.n{i % 7}".encode() for i in range(8)]
        await nc.close()
    finally:
        await sub.close()
    assert not sub.connected


async def test_a_restarted_server_is_found_again(tmp_path):
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log")
    port = server.port
    got: list[bytes] = []
    back = asyncio.Event()

    async def on_reconnect() -> None:
        back.set()

    sub = RawSubscriber(server.url, "test", "t.>", lambda s, d: got.append(d), ping_interval_s=0.2,
                        reconnect_wait_s=0.1, on_reconnect=on_reconnect)
    await sub.start()
    try:
        server.stop()
        await until(lambda: not sub.connected)
        server = start_nats_server(tmp_path / "nats", port=port, log_file=tmp_path / "nats2.log")
        await asyncio.wait_for(back.wait(), 10)
        assert sub.connected and sub.reconnects == 1
        nc = await nats.connect(server.url)
        await nc.publish("t.a", b"after")
        await nc.flush()
        await until(lambda: got == [b"after"])
        await nc.close()
    finally:
        await sub.close()
        server.stop()


async def test_a_bus_that_is_not_there_is_one_line():
    sub = RawSubscriber("nats://127.0.0.1:1,nats://127.0.0.1:2", "test", "t.*", lambda s, d: None,
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
        sub = RawSubscriber(server.url, "test", "revenant.hb.*", lambda s, d: got.append(d),
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
        for creds in (None, str(keyring.ensure("agent-stranger"))):
            refused = RawSubscriber(server.url, "test", "revenant.hb.*", lambda s, d: None, creds=creds)
            with pytest.raises(BusError) as err:
                await refused.start()
            assert "authorization violation" in str(err.value).lower() and "\n" not in str(err.value)
    finally:
        server.stop()
