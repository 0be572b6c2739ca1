"""The socket probe (agent/network/netprobe.py): with this node's criu, a process holding a UDP socket, a
listening TCP socket, an established loopback pair and a unix datagram socket connected outside
comes back from a dump and restore working; with a criu that cannot (4.1 on Linux >= 6.16, here
a stand-in saying what it said there), each feature is reported, with criu's own line."""

from __future__ import annotations

from pathlib import Path

import pytest

from revenant.agent.network import netprobe
from revenant.agent.pipeline.criu import inspect_criu, locate_criu
from revenant.messages import CriuInfo



SO_PASSCRED = "Error (criu/sockets.c:628): sockets: Can't get 1:16 opt: Operation not supported"


@pytest.mark.criu
async def test_this_nodes_criu_carries_every_kind_of_socket(tmp_path):
    info = await inspect_criu(locate_criu())
    assert info.ok, info.error
    found, why = await netprobe.probe(info.path, netprobe.network_lock(info.features), tmp_path)
    assert why == "" and found == dict.fromkeys(netprobe.FEATURES, True)
    assert list(tmp_path.iterdir()) == []  # its scratch cleaned up


@pytest.mark.criu
async def test_a_criu_that_cannot_dump_sockets_is_named_with_its_own_line(tmp_path):
    fake = tmp_path / "criu"
    fake.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{SO_PASSCRED}\nDumping FAILED.\nEOF\nexit 1\n")
    fake.chmod(0o755)
    scratch = tmp_path / "scratch"
    info = CriuInfo(path=str(fake), version="4.1.1", ok=True, features={})
    await netprobe.inspect(info, scratch, timeout_s=10)
    assert {f: info.features[f] for f in netprobe.FEATURES} == dict.fromkeys(netprobe.FEATURES, False)
    assert info.network_error == f"inet_sockets: {SO_PASSCRED}"
    assert list(Path(scratch).iterdir()) == []
