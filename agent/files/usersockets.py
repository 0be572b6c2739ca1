"""A user's job listening on a unix socket in the user's own directory (PostgreSQL's
``.s.PGSQL.5432`` in its data directory, a tmux-like server's in ``$HOME``): the socket made
again at a restore by the user, never by root.

criu binds a unix socket again at its path as root, and first unlinks whatever socket file is
there (criu/sk-unix.c ``unlink_sk``), following links: in a directory the user can change, a swap
at the right moment has root do both wherever the user points (agent/files/remade.py).  For a
listening socket of a process that is not root's, revenant instead:

* at the dump (the job frozen), records the socket from criu's own image (``files.img``): its
  inode, path, owner, mode, group, backlog and blocking mode (:func:`planned`); a socket that
  does not listen, was deleted, or has a connection waiting to be accepted is still refused;
* at the restore, makes the socket with the job's user's credentials (:func:`make`: a thread of
  the agent's own, its credentials the user's, so every path is resolved, checked and created as
  that user: nothing the user could not do themselves), bound, its mode and group set,
  listening; hands it to criu (``--inherit-fd``), which takes it as the job's socket and skips
  its bind;
* gives criu images whose ``files.img`` names no path for it (:func:`shadow`): with no name, criu
  neither unlinks nor binds anything there.  The other images are the epoch's own, linked.

What criu would also have set again for such a socket and does not for an inherited one: its
owner for signals (``F_SETOWN``) and its socket options (buffer sizes, ``SO_PASSCRED``).
Connections already accepted are the job's own sockets and come back as before.
"""

from __future__ import annotations

import ctypes
import os
import platform
import pwd
import socket
import stat
import struct
import threading
from pathlib import Path

import msgspec

from revenant.agent.pipeline.criuproto import HEADER, entries, fields
from revenant.agent.storage.epochs import USER_SOCKETS  # in an epoch: a list of UserSocket, signed

FILES = "files.img"
_UNIXSK, _USK = 5, 16  # fd_types.UNIXSK; file_entry.usk (images/fdinfo.proto)
# unix_sk_entry (images/sk-unix.proto): ino, type, state, flags, backlog, peer, name, file_perms, deleted
_INO, _TYPE, _STATE, _FLAGS, _BACKLOG, _PEER, _NAME, _PERMS, _DELETED = 2, 3, 4, 5, 7, 8, 11, 13, 15
_LISTEN = 10
_TYPES = {socket.SOCK_STREAM: "stream", socket.SOCK_SEQPACKET: "seqpacket"}
# Raw system calls: glibc's setresuid and friends change every thread's credentials; the
# system calls themselves only the caller's.
_SYSCALLS = {"x86_64": (117, 119, 116), "aarch64": (147, 149, 159)}  # setresuid, setresgid, setgroups
_libc = ctypes.CDLL(None, use_errno=True)


class UserSocket(msgspec.Struct, frozen=True):
    ino: int  # as the dump's images name it
    path: str
    uid: int  # the process that held it: made again with its credentials
    gid: int
    mode: int  # the socket file's permission bits
    group: int  # the socket file's group
    type: int  # socket.SOCK_STREAM or SOCK_SEQPACKET
    backlog: int
    nonblock: bool


def holder_ids(pid: int) -> tuple[int, int]:
    """The effective uid and gid of process ``pid``; raises OSError if it is gone."""
    uid = gid = -1
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                uid = int(line.split()[2])
            elif line.startswith("Gid:"):
                gid = int(line.split()[2])
    return uid, gid


def _unix_sockets(images: Path) -> dict[int, dict[int, int | bytes]]:
    """Each unix socket of a dump (its unix_sk_entry's fields) by inode."""
    found: dict[int, dict[int, int | bytes]] = {}
    for entry in entries((images / FILES).read_bytes()):
        top = dict(fields(entry))
        usk = top.get(_USK)
        if top.get(1) == _UNIXSK and isinstance(usk, bytes):
            sk = dict(fields(usk))
            if isinstance(sk.get(_INO), int):
                found[int(sk[_INO])] = sk
    return found


def planned(images: Path, wanted: dict[int, tuple[str, int, int]]) -> tuple[list[UserSocket], str]:
    """The sockets ``wanted`` ({inode: (path, uid, gid)}) as the dump in ``images`` recorded
    them, or why one of them cannot be made again by its user ("" if all can)."""
    try:
        sockets = _unix_sockets(images)
    except (OSError, IndexError, ValueError) as exc:
        return [], f"cannot read the dump's {FILES}: {exc}"
    out = []
    for ino, (path, uid, gid) in sorted(wanted.items()):
        sk = sockets.get(ino)
        what = f"the job holds a unix socket bound to {path}"
        if sk is None:
            return [], f"{what}, which criu did not dump"
        kind, state = sk.get(_TYPE), sk.get(_STATE)
        if kind not in _TYPES or state != _LISTEN:
            return [], f"{what} that does not listen"
        if sk.get(_DELETED):
            return [], f"{what}, deleted since"
        if any(other.get(_PEER) == ino for other in sockets.values()):
            return [], (f"a connection to the job's socket {path} was waiting to be accepted at the dump "
                        "(criu could not carry it to a socket the job's user makes); the next checkpoint may not")
        perms = sk.get(_PERMS)
        perm = dict(fields(perms)) if isinstance(perms, bytes) else {}
        flags, backlog = sk.get(_FLAGS, 0), sk.get(_BACKLOG, 0)
        out.append(UserSocket(ino=ino, path=path, uid=uid, gid=gid, mode=int(perm.get(1, 0o755)) & 0o7777,
                              group=int(perm.get(3, gid)), type=int(kind), backlog=int(backlog),  # type: ignore[arg-type]
                              nonblock=bool(int(flags) & os.O_NONBLOCK)))  # type: ignore[arg-type]
    return out, ""


def read(epoch_dir: Path) -> list[UserSocket]:
    """The epoch's sockets made by their user (none for an epoch without them); raises
    msgspec.DecodeError if the list is malformed."""
    try:
        data = (epoch_dir / USER_SOCKETS).read_bytes()
    except FileNotFoundError:
        return []
    return msgspec.json.decode(data, type=list[UserSocket])


# ------------------------------------------------------------------ criu's images, without their names

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _nameless(entry: bytes, inos: set[int]) -> bytes:
    """A file_entry, its unix socket's name (and deleted mark) gone if the socket is one of ``inos``."""
    top = list(fields(entry))
    usk = dict(top).get(_USK)
    if dict(top).get(1) != _UNIXSK or not isinstance(usk, bytes):
        return entry
    sk = list(fields(usk))
    if dict(sk).get(_INO) not in inos:
        return entry
    # Every field of these messages is a varint or length-delimited (no fixed-width ones).
    usk = b"".join(_field(n, b"" if n == _NAME else v) for n, v in sk if n != _DELETED)
    return b"".join(_field(n, usk if n == _USK else v) for n, v in top)


def shadow(src: Path, dest: Path, inos: set[int]) -> None:
    """``dest`` (new): the images of ``src`` for criu, ``files.img`` rewritten without the names
    of the sockets ``inos``, every other image linked."""
    dest.mkdir(mode=0o700)
    for name in os.listdir(src):
        if name != FILES:
            os.symlink(src / name, dest / name)
    data = (src / FILES).read_bytes()
    out = bytearray(data[:HEADER])
    for entry in entries(data):
        entry = _nameless(entry, inos)
        out += struct.pack("=I", len(entry)) + entry
    fd = os.open(dest / FILES, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(out)


# ------------------------------------------------------------------ made as the user

def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _become(uid: int, gid: int, groups: list[int]) -> None:
    """This thread only: the user's groups, effective gid and uid (the saved ones stay root's, so
    a thread could come back; this one never does: it ends)."""
    setresuid, setresgid, setgroups = _SYSCALLS[platform.machine()]
    arr = (ctypes.c_uint * max(len(groups), 1))(*groups)
    _check(_libc.syscall(setgroups, len(groups), arr), "setgroups")
    _check(_libc.syscall(setresgid, -1, gid, -1), "setresgid")
    _check(_libc.syscall(setresuid, -1, uid, -1), "setresuid")


def _made(sk: UserSocket, groups: list[int]) -> int:
    """In a thread of its own with the user's credentials: the socket bound at its path (a stale
    socket file there removed first, as criu would), its mode and group set, listening."""
    _become(sk.uid, sk.gid, groups)
    try:
        if stat.S_ISSOCK(os.lstat(sk.path).st_mode):
            os.unlink(sk.path)
    except FileNotFoundError:
        pass
    made = socket.socket(socket.AF_UNIX, sk.type)
    try:
        made.bind(sk.path)
        os.chmod(sk.path, sk.mode)  # as the user: wherever the path leads, the user's own doing
        if sk.group != sk.gid:
            os.chown(sk.path, -1, sk.group, follow_symlinks=False)
        made.listen(sk.backlog)
        made.setblocking(not sk.nonblock)
        return made.detach()
    except BaseException:
        made.close()
        raise


def make(sockets: list[UserSocket]) -> list[int]:
    """Blocking: each socket made by its user (:func:`_made`); our descriptors of them, to hand to
    criu.  Raises OSError naming the socket that could not be made (those made are closed)."""
    fds: list[int] = []
    try:
        for sk in sockets:
            if sk.uid == 0:
                raise OSError(0, f"{sk.path}: a socket of root's is never made here")
            try:
                name = pwd.getpwuid(sk.uid).pw_name
            except KeyError:
                raise OSError(0, f"{sk.path}: its user (uid {sk.uid}) is unknown on this node") from None
            groups = os.getgrouplist(name, sk.gid)
            result: list[int | BaseException] = []

            def run(sk: UserSocket = sk) -> None:
                try:
                    result.append(_made(sk, groups))
                except BaseException as exc:  # noqa: BLE001 - reported by the caller
                    result.append(exc)
            t = threading.Thread(target=run, name="user-socket", daemon=True)
            t.start()
            t.join()
            got = result[0]
            if isinstance(got, BaseException):
                why = got.strerror if isinstance(got, OSError) and got.strerror else str(got)
                raise OSError(getattr(got, "errno", 0) or 0, f"{sk.path}: {why}")
            fds.append(got)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def inherit_args(sockets: list[UserSocket], fds: list[int]) -> list[str]:
    """criu restore's arguments that hand it each socket as the job's own."""
    return [arg for sk, fd in zip(sockets, fds) for arg in ("--inherit-fd", f"fd[{fd}]:socket:[{sk.ino}]")]
