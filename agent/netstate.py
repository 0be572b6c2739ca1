"""A running job's internet sockets, asked of the sockets themselves: what it listens on and the
TCP connections it holds (``revenant check``; a vacate's held connections, agent/netlock.py).
An epoch's are read from criu's images after the dump instead (agent/criuimages.py), so that
the job is not kept frozen for them.

Each socket is asked through a copy of the job's descriptor (agent/jobprocs.py job_sockets): a
few system calls each, where /proc/net/tcp and tcp6 walk the host's whole connection hash table
(about 5 ms each on a machine with 24 GiB, whatever the job holds)."""

from __future__ import annotations

import socket

from revenant.agent.jobprocs import job_sockets

# Enough for an operator to read: each list is cut there.
MAX_LISTED = 64
# The kernel's TCP states (include/net/tcp_states.h): the first byte of TCP_INFO.
_ESTABLISHED, _CLOSE, _LISTEN = 1, 7, 10
_INET = (socket.AF_INET, socket.AF_INET6)


def _address(family: int, ip: str, port: int) -> str:
    """``127.0.0.1:8080``; IPv6 as ``[::1]:8080``."""
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def connection_text(family: int, lip: str, lport: int, rip: str, rport: int) -> str:
    """A peer of :func:`peers` as :func:`sockets` names a connection: ``local -> peer``."""
    return f"{_address(family, lip, lport)} -> {_address(family, rip, rport)}"


Peer = tuple[int, str, int, str, int]  # family, local ip, local port, peer ip, peer port


def _described(sk: socket.socket) -> tuple[str, Peer | None, bool]:
    """("tcp 0.0.0.0:6379" for a socket listening or bound to receive, else ""; its peer for a
    TCP socket criu dumps in repair mode (one with a peer, neither listening nor closed), else
    None; whether that connection is established); raises OSError."""
    family = sk.family
    local = sk.getsockname()
    try:
        remote = sk.getpeername()
    except OSError:
        remote = None
    if sk.type == socket.SOCK_STREAM:
        state = sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        if state == _LISTEN:
            return f"tcp {_address(family, local[0], local[1])}", None, False
        if remote is None or state == _CLOSE or not remote[1]:
            return "", None, False
        return "", (family, local[0], local[1], remote[0], remote[1]), state == _ESTABLISHED
    if sk.type == socket.SOCK_DGRAM and remote is None and local[1]:
        return f"udp {_address(family, local[0], local[1])}", None, False
    return "", None, False


def _survey(root: int) -> tuple[set[str], dict[Peer, bool]]:
    """What the job listens on, and each of its connections with whether it is established."""
    listening: set[str] = set()
    found: dict[Peer, bool] = {}
    for sk in job_sockets(root):
        if sk.family not in _INET:
            continue
        try:
            listens, peer, established = _described(sk)
        except OSError:
            continue
        if listens:
            listening.add(listens)
        if peer is not None:
            found[peer] = established
    return listening, found


def peers(root: int) -> list[Peer]:
    """Each TCP socket of the job that has a peer (established or closing: every one criu dumps in
    repair mode)."""
    return sorted(_survey(root)[1])


def sockets(root: int) -> tuple[list[str], list[str]]:
    """(listening, connections): ``"tcp 0.0.0.0:6379"``, ``"udp [::1]:10000"`` for each socket the
    job listens or is bound on, and ``"127.0.0.1:41234 -> 127.0.0.1:5432"`` for each established
    TCP connection, each list sorted and at most MAX_LISTED long."""
    listening, found = _survey(root)
    connections = {connection_text(*peer) for peer, established in found.items() if established}
    return sorted(listening)[:MAX_LISTED], sorted(connections)[:MAX_LISTED]
