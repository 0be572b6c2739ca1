"""What in a running job criu cannot checkpoint, found before the job is frozen: the dump is
refused with one line that names it, and the job runs on untouched.  criu would fail on each of
them only after freezing the job, and with a line about a socket's inode, not its peer.

- a unix stream socket connected to a process outside the job (a daemon's socket, or an outside
  client of the job's own socket): criu carries unix datagram sockets to the outside
  (``--ext-unix-sk``), never stream ones.  The peer is found with sock_diag (UNIX_DIAG_PEER)
  and named by its path when it has one;
- io_uring instances and perf events, which criu does not dump.
"""

from __future__ import annotations

import os
import socket
import struct

from revenant.agent.processes.jobprocs import job_fds, job_sockets
from revenant.agent.storage.epochs import EpochError

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 0x1, 0x4
_UNIX_DIAG_NAME, _UNIX_DIAG_PEER = 0, 2
_STREAM_TYPES = (socket.SOCK_STREAM, socket.SOCK_SEQPACKET)
# Descriptors criu cannot dump, by what /proc says they lead to.
_UNDUMPABLE = {"anon_inode:[io_uring]": "an io_uring instance", "anon_inode:[perf_event]": "a perf event",
               "anon_inode:io_uring": "an io_uring instance", "anon_inode:perf_event": "a perf event"}


def unix_table(netns_pid: int) -> dict[int, tuple[int, str, int]]:
    """Every unix socket of ``netns_pid``'s network namespace: inode -> (type, name, peer inode),
    from sock_diag (name "" when unbound, "@..." when abstract; peer 0 when none)."""
    table: dict[int, tuple[int, str, int]] = {}
    fd = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY)
    try:
        if os.readlink(f"/proc/{netns_pid}/ns/net") != os.readlink("/proc/self/ns/net"):
            return table  # another namespace: only root's jobs have one; criu checks them itself
    finally:
        os.close(fd)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        req = struct.pack("=BBBBIIIII", socket.AF_UNIX, 0, 0, 0, 0xFFFFFFFF, 0,
                          _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
        nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req)
        while True:
            data = nl.recv(1 << 16)
            i = 0
            while i + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, i)
                if kind == _NLMSG_DONE:
                    return table
                if kind == _NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag refused the unix socket dump")
                _parse(data[i + 16:i + length], table)
                i += (length + 3) & ~3


def _parse(msg: bytes, table: dict[int, tuple[int, str, int]]) -> None:
    _family, kind, _state, _pad, ino = struct.unpack_from("=BBBBI", msg, 0)
    name, peer, j = "", 0, 16
    while j + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, j)
        value = msg[j + 4:j + alen]
        if atype == _UNIX_DIAG_NAME:
            name = ("@" + value[1:].decode(errors="replace")) if value[:1] == b"\0" else \
                value.rstrip(b"\0").decode(errors="replace")
        elif atype == _UNIX_DIAG_PEER and len(value) >= 4:
            (peer,) = struct.unpack_from("=I", value)
        j += (alen + 3) & ~3
    table[ino] = (kind, name, peer)


def _held(root: int) -> dict[int, str]:
    """The job's descriptors by what they lead to (their inode for sockets): inode -> holder."""
    held: dict[int, str] = {}
    for pid, fd, target in job_fds(root):
        if target.startswith("socket:["):
            held[int(target[len("socket:["):-1])] = f"process {pid} fd {fd}"
        elif target in _UNDUMPABLE:
            held[-len(held) - 1] = f"{_UNDUMPABLE[target]} (process {pid} fd {fd})"
    return held


def blockers(root: int) -> list[str]:
    """What in the job (its init ``root``, running) criu cannot checkpoint, one line each."""
    held = _held(root)
    found = [what for ino, what in held.items() if ino < 0]
    table = unix_table(root)
    for ino, holder in held.items():
        kind, name, peer = table.get(ino, (0, "", 0))
        if ino < 0 or kind not in _STREAM_TYPES or not peer or peer in held:
            continue
        peer_name = table.get(peer, (0, "", 0))[1]
        mine = f" (bound to {name})" if name else ""
        outside = (f"the socket {peer_name}" if peer_name else f"an unnamed socket (inode {peer})") + " outside the job"
        found.append(f"a unix stream connection{mine} to {outside}, {holder}: criu carries none to the outside")
    return found


class NotCheckpointable(EpochError):
    """The job holds what criu cannot carry: its own doing, never the node's failure."""

    code = "not_checkpointable"


_TCP_REPAIR = 19


def repair_off(root: int) -> int:
    """Take every TCP socket of the job (its init ``root``) out of criu's repair mode: a dump
    with ``--tcp-established`` that ends without unlocking them (a vacate's, whose commit then
    failed; a criu killed mid-dump) would leave the job's every recv and send failing with
    EPERM once it resumes.  Harmless on a socket not in repair mode.  How many it set."""
    n = 0
    for sk in job_sockets(root):
        if sk.family in (socket.AF_INET, socket.AF_INET6) and sk.type == socket.SOCK_STREAM:
            try:
                sk.setsockopt(socket.IPPROTO_TCP, _TCP_REPAIR, 0)
                n += 1
            except OSError:
                pass
    return n
