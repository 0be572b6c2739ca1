"""A user's job listening on a unix socket in the user's own directory (PostgreSQL's
``.s.PGSQL.5432`` in its data directory, a tmux-like server's in ``$HOME``): the socket made
again at a restore by the user, never by root.

criu binds a unix socket again at its path as root, and first unlinks whatever socket file is
there (criu/sk-unix.c ``unlink_sk``), following links: in a directory the user can change, a swap
at the right moment has root do both wherever the user points (agent/files/remade.py).  For a
listening socket of a process that is not root's, revenant instead:

* at the dump (the job frozen), records the socket from criu's own image (``files.img``): its
  inode, path, owner, mode, group, backlog and blocking mode (:func:`planned`); a socket that
  does not listen, was deleted, or has a connection of the job's own waiting to be accepted is
  still refused, and so is any other socket the images name at that path;
* at the restore, makes the socket with the job's user's credentials (:func:`make`,
  agent/files/asuser/creds.py), bound, its mode and group set,
  listening; hands it to criu (``--inherit-fd``), which takes it as the job's socket and skips
  its bind;
* gives criu images whose ``files.img`` names no path for it (:func:`shadow`): with no name, criu
  neither unlinks nor binds anything there.  The other images are the epoch's own, linked.

A connection the job accepted from one of its own processes keeps its listener's name (what
``getsockname`` says on it), and criu would unlink that name too: it goes from the images as
well, and criu joins the connection to its peer as before; after a restore ``getsockname`` on it
says nothing.  One from outside the job is refused before the dump (agent/pipeline/blockers.py).

What criu would also have set again for a listening socket and does not for an inherited one:
its owner for signals (``F_SETOWN``) and its socket options (buffer sizes, ``SO_PASSCRED``).
"""

from __future__ import annotations

import functools
import os
import socket
import stat
import struct
from pathlib import Path

import msgspec

from revenant.agent.files.asuser import creds
from revenant.agent.pipeline.criuproto import HEADER, entries, fields
from revenant.agent.storage.epochs import USER_SOCKETS  # in an epoch: a list of UserSocket, signed

FILES = "files.img"
_UNIXSK, _USK = 5, 16  # fd_types.UNIXSK; file_entry.usk (images/fdinfo.proto)
# unix_sk_entry (images/sk-unix.proto): ino, type, state, flags, backlog, peer, name, file_perms, deleted
_INO, _TYPE, _STATE, _FLAGS, _BACKLOG, _PEER, _NAME, _PERMS, _NAME_DIR, _DELETED = 2, 3, 4, 5, 7, 8, 11, 13, 14, 15
_LISTEN = 10
_TYPES = {socket.SOCK_STREAM: "stream", socket.SOCK_SEQPACKET: "seqpacket"}


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


class UserSockets(msgspec.Struct, kw_only=True):
    """What an epoch's restore takes from the job's user rather than root (``user-sockets.json``)."""

    make: list[UserSocket] = []  # listening: made by the user
    # Connected to a peer of the job's and named where a user may change things (an accepted
    # connection keeps its listener's name): criu joins it to its peer; the name goes from the images.
    nameless: list[int] = []


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


def _name(sk: dict[int, int | bytes]) -> str:
    """The path a unix_sk_entry is bound to ("" if none, or abstract)."""
    raw = sk.get(_NAME)
    name = raw.rstrip(b"\0") if isinstance(raw, bytes) else b""
    if not name or name.startswith(b"\0"):
        return ""
    text = os.fsdecode(name)
    folder = sk.get(_NAME_DIR)
    return os.path.join(os.fsdecode(folder), text) if isinstance(folder, bytes) and not text.startswith("/") else text


def planned(images: Path, wanted: dict[int, tuple[str, int, int]]) -> tuple[UserSockets, str]:
    """The sockets ``wanted`` ({inode: (path, uid, gid)}: every socket of a user's process bound
    where a user may change things) as the dump in ``images`` recorded them, or why one of
    them cannot be restored without root making it there ("" if all can)."""
    try:
        sockets = _unix_sockets(images)
    except (OSError, IndexError, ValueError) as exc:
        return UserSockets(), f"cannot read the dump's {FILES}: {exc}"
    out = UserSockets()
    for ino, (path, uid, gid) in sorted(wanted.items()):
        sk = sockets.get(ino)
        what = f"the job holds a unix socket bound to {path}"
        if sk is None:
            return UserSockets(), f"{what}, which criu did not dump"
        if sk.get(_DELETED):
            return UserSockets(), f"{what}, deleted since (criu would bind it again there as root)"
        kind, state, peer = sk.get(_TYPE), sk.get(_STATE), sk.get(_PEER)
        if kind in _TYPES and state == _LISTEN:
            if any(other.get(_PEER) == ino for other in sockets.values()):
                return UserSockets(), (f"a connection to the job's socket {path} was waiting to be accepted at the "
                                       "dump (criu could not carry it to a socket the job's user makes); the next "
                                       "checkpoint may not")
            perms = sk.get(_PERMS)
            perm = dict(fields(perms)) if isinstance(perms, bytes) else {}
            flags, backlog = int(sk.get(_FLAGS, 0)), int(sk.get(_BACKLOG, 0))  # type: ignore[arg-type]
            out.make.append(UserSocket(ino=ino, path=path, uid=uid, gid=gid, mode=int(perm.get(1, 0o755)) & 0o7777,
                                       group=int(perm.get(3, gid)), type=int(kind),  # type: ignore[arg-type]
                                       backlog=backlog, nonblock=bool(flags & os.O_NONBLOCK)))
        elif peer and peer in sockets:
            out.nameless.append(ino)
        else:
            return UserSockets(), f"{what} that does not listen (criu would bind it again there as root)"
    made = {m.path for m in out.make}
    for ino, sk in sockets.items():  # what the agent did not see held, criu would make by name
        if ino not in wanted and (name := _name(sk)) in made:
            return UserSockets(), f"the job holds another unix socket bound to {name}, which criu would bind as root"
    return out, ""


def read(epoch_dir: Path) -> UserSockets:
    """The epoch's sockets taken from the job's user (none for an epoch without them); raises
    msgspec.DecodeError if the file is malformed."""
    try:
        data = (epoch_dir / USER_SOCKETS).read_bytes()
    except FileNotFoundError:
        return UserSockets()
    return msgspec.json.decode(data, type=UserSockets)


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


def _nameless(entry: bytes, inos: set[int], done: set[int], named: set[str]) -> bytes:
    """A file_entry, its unix socket's name (and deleted mark) gone if the socket is one of
    ``inos`` (added to ``done``); the name of any other, in ``named``."""
    top = list(fields(entry))
    usk = dict(top).get(_USK)
    if dict(top).get(1) != _UNIXSK or not isinstance(usk, bytes):
        return entry
    sk = list(fields(usk))
    ino = dict(sk).get(_INO)
    if ino not in inos:
        named.add(_name(dict(sk)))
        return entry
    done.add(int(ino))  # type: ignore[arg-type]
    # Every field of these messages is a varint or length-delimited (no fixed-width ones).
    usk = b"".join(_field(n, b"" if n == _NAME else v) for n, v in sk if n != _DELETED)
    return b"".join(_field(n, usk if n == _USK else v) for n, v in top)


def shadow(src: Path, dest: Path, taken: UserSockets) -> None:
    """``dest`` (new): the images of ``src`` for criu, ``files.img`` rewritten without the names
    of the sockets ``taken`` from the user, every other image linked.  Raises ValueError if one
    of them is not in the images, or another socket there is named where one is made."""
    inos = {sk.ino for sk in taken.make} | set(taken.nameless)
    dest.mkdir(mode=0o700)
    for name in os.listdir(src):
        if name != FILES:
            os.symlink(src / name, dest / name)
    data = (src / FILES).read_bytes()
    out = bytearray(data[:HEADER])
    done: set[int] = set()
    named: set[str] = set()
    for entry in entries(data):
        entry = _nameless(entry, inos, done, named)
        out += struct.pack("=I", len(entry)) + entry
    if done != inos:
        raise ValueError(f"its images hold no unix socket {min(inos - done)}")
    for sk in taken.make:
        if sk.path in named:
            raise ValueError(f"its images hold another unix socket bound to {sk.path}")
    fd = os.open(dest / FILES, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(out)


# ------------------------------------------------------------------ made as the user

def _made(sk: UserSocket) -> int:
    """As the user (agent/files/asuser/creds.py): the socket bound at its path (a stale socket file
    there removed first, as criu would), its mode and group set, listening."""
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
    return creds.as_user([(sk.path, sk.uid, sk.gid, functools.partial(_made, sk)) for sk in sockets])


def inherit_args(sockets: list[UserSocket], fds: list[int]) -> list[str]:
    """criu restore's arguments that hand it each socket as the job's own."""
    return [arg for sk, fd in zip(sockets, fds) for arg in ("--inherit-fd", f"fd[{fd}]:socket:[{sk.ino}]")]
