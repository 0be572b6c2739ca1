"""A job's internet sockets, from /proc while it is frozen at a dump: what it listens on and the
TCP connections it holds.  Its clients need to find it after a move (the node and the ports:
``show job``, the ``restored`` event), and a restore closes every connection (criu's
``--tcp-close``): the event names each one's peer."""

from __future__ import annotations

import socket
import struct

from revenant.agent.jobprocs import job_fds

_LISTEN, _ESTABLISHED = "0A", "01"
_TABLES = (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6), ("udp", socket.AF_INET), ("udp6", socket.AF_INET6))
# Enough for an operator to read: each list is cut there.
MAX_LISTED = 64


def _address(hexaddr: str, family: int) -> str:
    """``0100007F:1F90`` as ``127.0.0.1:8080``; IPv6 as ``[::1]:8080`` (the kernel prints each
    32-bit word of the address in host order)."""
    addr, port = hexaddr.split(":")
    raw = b"".join(struct.pack("=I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))
    ip = socket.inet_ntop(family, raw)
    return f"[{ip}]:{int(port, 16)}" if family == socket.AF_INET6 else f"{ip}:{int(port, 16)}"


def _inodes(root: int) -> set[str]:
    return {target[len("socket:["):-1] for _, _, target in job_fds(root) if target.startswith("socket:[")}


def sockets(root: int) -> tuple[list[str], list[str]]:
    """(listening, connections): ``"tcp 0.0.0.0:6379"``, ``"udp [::1]:10000"`` for each socket the
    job listens or is bound on, and ``"127.0.0.1:41234 -> 127.0.0.1:5432"`` for each established
    TCP connection, each list sorted and at most MAX_LISTED long."""
    mine = _inodes(root)
    if not mine:
        return [], []  # no socket: no /proc/net table read while the job is frozen
    listening, connections = set(), set()
    for table, family in _TABLES:
        try:
            with open(f"/proc/{root}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[9] not in mine:
                continue
            local, remote, state = fields[1], fields[2], fields[3]
            proto = table.rstrip("6")
            if (proto == "tcp" and state == _LISTEN) or (proto == "udp" and not remote.strip("0:")):
                listening.add(f"{proto} {_address(local, family)}")
            elif proto == "tcp" and state == _ESTABLISHED:
                connections.add(f"{_address(local, family)} -> {_address(remote, family)}")
    return sorted(listening)[:MAX_LISTED], sorted(connections)[:MAX_LISTED]
