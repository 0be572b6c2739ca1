"""``revenant up --netns``: each process of a local cluster in a network namespace of its own.

Every nats-server, coordinator and agent gets a namespace (``rv-<tag>-<name>``, ``tag`` from
the cluster's directory), an address on a /24 of its own and a veth pair to one bridge in the
host's namespace, which holds ``.1``: the CLI, the tests and a browser reach every process
through it.  Jobs run in their node's namespace, so a job restored on another node answers
at that node's address, and a link between two namespaces can be cut (tests/netcluster's
nemesis) without touching the rest.  Processes enter their namespace through ``nsenter
--net``, which ``exec``s them: the pid, the mount namespace (the shared storage, /tmp) and
the argv that restarts them are the ones ``up`` records.

Addresses: nats-servers .11 up, coordinators .21 up, nodes .101 up.  ``sweep`` removes what a
crashed run left: namespaces of this naming with no process in them, and their bridge.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from revenant.common.errors import RevenantError
from revenant.common.settings.cluster import NetLayout, NetMember

NETNS_DIR = Path("/run/netns")
PREFIX = "rv-"
FIRST = {"nats-server": 11, "coordinator": 21, "node": 101}
MAX_NODES = 150
MAX_OF = {"nats-server": FIRST["coordinator"] - FIRST["nats-server"],  # 10, 80: each role's addresses
          "coordinator": FIRST["node"] - FIRST["coordinator"], "node": MAX_NODES}


def tag_of(root: Path) -> str:
    return hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:6]


def _first(name: str) -> tuple[int, int]:
    """The first address of ``name``'s role, and ``name``'s index in it (from 0)."""
    role, _, index = name.rpartition("-")
    if role in FIRST and index.isdigit():
        return FIRST[role], int(index) - 1
    return FIRST[name], 0  # "nats-server" or "coordinator" alone: the first of its role


def plan(root: Path, names: list[str], taken: list[ipaddress.IPv4Network] | None = None) -> NetLayout:
    """The namespaces, addresses and bridge for ``names``, on a /24 that no route of the host's
    (``taken``: read from ``ip route`` if not given) covers, tried from one the directory picks,
    so two clusters at once get two."""
    for role, most in MAX_OF.items():
        if sum(1 for n in names if n == role or n.startswith(role + "-")) > most:
            raise RevenantError(f"--netns takes at most {most} {role}s")
    tag = tag_of(root)
    taken = _host_networks() if taken is None else taken
    seed = int(tag, 16)
    for k in range(256):
        prefix = f"10.{200 + (seed + k) % 50}.{(seed >> 8) % 256}"
        net = ipaddress.ip_network(f"{prefix}.0/24")
        if not any(net.overlaps(t) for t in taken):
            break
    else:
        raise RevenantError("--netns: no free /24 in 10.200.0.0 to 10.249.255.255 on this host")
    members = {}
    for name in names:
        first, index = _first(name)
        members[name] = NetMember(netns=f"{PREFIX}{tag}-{name}", address=f"{prefix}.{first + index}")
    return NetLayout(bridge=f"rv{tag}br", prefix=prefix, host_address=f"{prefix}.1", members=members)


def _host_networks() -> list[ipaddress.IPv4Network]:
    out = _ip(["-j", "-4", "route", "show", "table", "all"], check=False)
    nets = []
    try:
        routes = json.loads(out or "[]")
    except ValueError:
        raise RevenantError("--netns: ip -j route printed no JSON (iproute2 too old?)") from None
    for route in routes:
        dst = route.get("dst", "")
        if dst and dst != "default" and ":" not in dst:
            try:
                nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
            except ValueError:
                pass
    return nets


def _ip(args: list[str], *, check: bool = True, stdin: str | None = None) -> str:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        proc = subprocess.run([ip, *args], input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise RevenantError("--netns needs the ip command (Debian package iproute2)") from None
    except subprocess.TimeoutExpired:
        raise RevenantError(f"--netns: ip {' '.join(args[:3])}: no answer within 30 s") from None
    if check and proc.returncode != 0:
        # ip -batch ends with "Command failed -:N": the line before says why.
        lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("Command failed")]
        line = (lines or proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RevenantError(f"--netns: ip {' '.join(args[:3])}: {line}")
    return proc.stdout


def check() -> None:
    """Refuse, in one line, where namespaces cannot be made."""
    if os.geteuid() != 0:
        raise RevenantError("--netns needs root (it makes network namespaces, a bridge and veth pairs)")
    if shutil.which("nsenter") is None:
        raise RevenantError("--netns needs nsenter (Debian package util-linux)")
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _ip(["netns", "add", probe])
    except RevenantError as exc:
        raise RevenantError(f"--netns: this machine cannot make a network namespace ({exc})") from None
    _ip(["netns", "del", probe], check=False)


def create(layout: NetLayout) -> None:
    """Make ``layout``'s bridge, namespaces and links (what an earlier run left is removed first)."""
    check()
    remove(layout)
    batch = [f"link add {layout.bridge} type bridge", f"addr add {layout.host_address}/24 dev {layout.bridge}",
             f"link set {layout.bridge} up"]
    for i, member in enumerate(layout.members.values()):
        veth = f"{layout.bridge[:-2]}{i:02d}"
        batch += [f"netns add {member.netns}", f"link add {veth} type veth peer name eth0 netns {member.netns}",
                  f"link set {veth} master {layout.bridge} up"]
    try:
        _ip(["-batch", "-"], stdin="\n".join(batch) + "\n")
        for member in layout.members.values():
            _ip(["-n", member.netns, "-batch", "-"], stdin=f"addr add {member.address}/24 dev eth0\n"
                "link set eth0 up\nlink set lo up\n")
    except BaseException:
        remove(layout)
        raise


def remove(layout: NetLayout) -> None:
    """Remove ``layout``'s namespaces and bridge (a veth goes with its namespace); idempotent."""
    for member in layout.members.values():
        if (NETNS_DIR / member.netns).exists():
            _ip(["netns", "del", member.netns], check=False)
    _ip(["link", "del", layout.bridge], check=False)


def wrap(layout: NetLayout, name: str) -> list[str]:
    """The prefix that runs a command in ``name``'s namespace (``nsenter`` ``exec``s it)."""
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    return [nsenter, f"--net={NETNS_DIR / layout.members[name].netns}", "--"]


def namespace_inodes(layout: NetLayout) -> dict[int, str]:
    """Each member's namespace by its inode (what /proc/<pid>/ns/net names): whose is a process."""
    found = {}
    for name, member in layout.members.items():
        try:
            found[(NETNS_DIR / member.netns).stat().st_ino] = name
        except OSError:
            pass
    return found


def sweep(min_age_s: float = 60.0) -> list[str]:
    """Remove namespaces of this naming that no process uses and that are older than
    ``min_age_s`` (a cluster being made has none yet), and bridges whose namespaces are all
    gone: what a killed run left.  Returns what it removed."""
    removed = []
    try:
        entries = list(NETNS_DIR.iterdir())
    except OSError:
        entries = []
    for path in entries:
        if not path.name.startswith(PREFIX) or path.name.startswith(f"{PREFIX}probe-"):
            continue
        try:
            if time.time() - path.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        if not _ip(["netns", "pids", path.name], check=False).strip():
            _ip(["netns", "del", path.name], check=False)
            removed.append(path.name)
    left = {p.name.split("-")[1] for p in NETNS_DIR.glob(f"{PREFIX}*")} if NETNS_DIR.is_dir() else set()
    for link in json.loads(_ip(["-j", "link", "show", "type", "bridge"], check=False) or "[]"):
        name = link.get("ifname", "")
        if name.startswith("rv") and name.endswith("br") and len(name) == 10 and name[2:8] not in left:
            _ip(["link", "del", name], check=False)
            removed.append(name)
    return removed
