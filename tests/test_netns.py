"""`revenant up --netns`'s plan (cli/cluster/netns.py), pure: names, addresses, a subnet clear of the
host's routes; and the one-line refusal where namespaces cannot be made."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from revenant.cli.cluster import netns
from revenant.common.errors import RevenantError

pytestmark = pytest.mark.unit

NAMES = ["nats-server-1", "nats-server-2", "nats-server-3", "coordinator", "coordinator-2", "node-1", "node-12"]


def test_each_role_has_its_own_range_of_addresses():
    layout = netns.plan(Path("/tmp/c"), NAMES, taken=[])
    last = {name: int(m.address.rsplit(".", 1)[1]) for name, m in layout.members.items()}
    assert last == {"nats-server-1": 11, "nats-server-2": 12, "nats-server-3": 13, "coordinator": 21,
                    "coordinator-2": 22, "node-1": 101, "node-12": 112}
    assert layout.host_address == f"{layout.prefix}.1"
    assert all(m.netns.startswith(f"rv-{netns.tag_of(Path('/tmp/c'))}-") for m in layout.members.values())
    assert len(layout.bridge) <= 15  # an interface name's limit


def test_a_lone_server_and_coordinator_take_the_first_address():
    layout = netns.plan(Path("/tmp/c"), ["nats-server", "coordinator", "node-1"], taken=[])
    assert [m.address.rsplit(".", 1)[1] for m in layout.members.values()] == ["11", "21", "101"]


def test_the_subnet_avoids_every_route_of_the_host():
    first = netns.plan(Path("/tmp/c"), NAMES, taken=[])
    net = ipaddress.ip_network(f"{first.prefix}.0/24")
    second = netns.plan(Path("/tmp/c"), NAMES, taken=[net])
    assert second.prefix != first.prefix
    everything = [ipaddress.ip_network("10.0.0.0/8")]
    with pytest.raises(RevenantError, match="no free /24"):
        netns.plan(Path("/tmp/c"), NAMES, taken=everything)


def test_two_directories_get_two_subnets():
    assert netns.plan(Path("/tmp/a"), NAMES, taken=[]).prefix != netns.plan(Path("/tmp/b"), NAMES, taken=[]).prefix


def test_too_many_nodes_are_refused():
    with pytest.raises(RevenantError, match="at most 150 nodes"):
        netns.plan(Path("/tmp/c"), [f"node-{i}" for i in range(1, 152)], taken=[])
    with pytest.raises(RevenantError, match="at most 10 nats-servers"):
        netns.plan(Path("/tmp/c"), [f"nats-server-{i}" for i in range(1, 12)], taken=[])
    with pytest.raises(RevenantError, match="at most 80 coordinators"):
        netns.plan(Path("/tmp/c"), [f"coordinator-{i}" for i in range(1, 82)], taken=[])
    assert netns.plan(Path("/tmp/c"), [f"nats-server-{i}" for i in range(1, 11)], taken=[]).members[
        "nats-server-10"].address.endswith(".20")


def test_ips_own_error_line_is_given_not_its_closing_one(monkeypatch):
    import subprocess

    failed = subprocess.CompletedProcess([], 1, "", "RTNETLINK answers: File exists\nCommand failed -:5\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RevenantError, match="ip -batch -: RTNETLINK answers: File exists$"):
        netns._ip(["-batch", "-"], stdin="")


def test_namespaces_need_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(RevenantError, match="^--netns needs root"):
        netns.check()
