"""What criu makes again by path, as root, when it restores a job, rather than merely opening it;
and where that is safe.

criu binds a unix socket again at its name (from the directory it was bound in), then sets its
owner and mode by path; it opens a named FIFO by path; it writes a file the job held after
deleting it (a "ghost", a deleted working directory included) again beside its old path, making
missing directories, and sets its owner and mode by path.  All of it follows links.  In a
directory that someone other than root could change, a swap at the right moment would have root
make those wherever that user points (a socket chowned to the user in /etc, a directory made
the user's).  And a descriptor in flight in a unix socket's queue (SCM_RIGHTS) is opened again
by criu by path too, where no check after the restore sees it.

So the dump, while the job is frozen, refuses a job holding any of them in a directory that is
not root's alone (:func:`refusal`): every directory from ``/`` to it must be root's and writable
by no one else; only the job's private ``/tmp`` and ``/dev/shm`` are exempt (nobody else reaches
them while criu restores, as root, into the job's own mount namespace).  It refuses a job with
descriptors in flight outright.  The paths go into the epoch (REMADE), and the restoring node
checks them again before criu runs (:func:`recheck`): its directories are its own.  Exceptions,
taken from the user instead of root: a listening socket of a user's process there is made again
by that user (agent/files/asuser/sockets.py), and a FIFO or deleted file it holds open there is
opened or made by that user and handed to criu (agent/files/asuser/files.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec

from revenant.agent.files import beneath
from revenant.agent.files.asuser import sockets as usersockets
from revenant.agent.pipeline import criuproto
from revenant.agent.processes.jobprocs import PSEUDO, copy_fd, external_id, fd_info, job_pids, private_devs
from revenant.agent.storage.epochs import REMADE
from revenant.messages import JobResource

# In an epoch (REMADE): [what, path] for each thing criu makes again by path, as the dump found them.
# criu's image of the unix sockets' queued packets (criu/image-desc.c).
SK_QUEUES = "sk-queues.img"
# Names the kernel gives what no directory holds (memfd_create, SysV shared memory): criu dumps
# and makes them again by their own means, never at a path.
UNNAMED = ("/memfd:", "/SYSV")
_DELETED = " (deleted)"
SOCKET = "a unix socket bound to"
FIFO, DELETED, MAPPED = "a named FIFO,", "a deleted file,", "a mapped deleted file,"
_SIOCUNIXFILE = 0x89E0  # an O_PATH descriptor of the file a unix socket is bound to (Linux 6.0)


def deleted_path(path: str) -> str | None:
    """The path of a file held deleted, or None (not deleted, or a kernel interface's: /proc,
    /sys, /dev, but for /dev/shm, a filesystem like any other)."""
    if not path.startswith("/") or not path.endswith(_DELETED) or path.startswith(UNNAMED):
        return None
    if path.startswith(PSEUDO) and not path.startswith("/dev/shm/"):
        return None
    return path[: -len(_DELETED)]


class Unreadable(OSError):
    """A socket of the job's that the agent could not inspect: as good as unsafe."""


def _socket_file(pidfd: int, fd: int) -> str | None:
    """The path criu binds the socket ``fd`` of the process to again at a restore, or None: not a
    unix socket, unbound, or abstract.  The kernel says where the socket's file is (SIOCUNIXFILE:
    /proc/net/unix shows a relative name as bound, and cannot tell a file named ``@x`` from an
    abstract socket); criu binds it again at the name it was bound to (getsockname) when that is
    absolute, links on its way followed, and from the file's own directory when it is relative."""
    try:
        mine = copy_fd(pidfd, fd)
    except OSError as exc:
        raise Unreadable(exc.errno, f"cannot inspect the job's socket (descriptor {fd})") from None
    try:
        with socket.socket(fileno=os.dup(mine)) as sk:
            if sk.family != socket.AF_UNIX:
                return None
            name = sk.getsockname()
        if not name or not isinstance(name, str) or name.startswith("\0"):
            return None  # unbound, or abstract
        try:
            opath = fcntl.ioctl(mine, _SIOCUNIXFILE)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise Unreadable(exc.errno, f"cannot inspect the job's socket bound to {name!r}") from None
            return name if name.startswith("/") else None
        try:
            real = os.readlink(f"/proc/self/fd/{opath}").removesuffix(_DELETED)
        finally:
            os.close(opath)
        return name if name.startswith("/") else real
    finally:
        os.close(mine)


def _in_process(pid: int, found: list[tuple[str, str, int]], inos: dict[tuple[int, str], set[int | str]]) -> None:
    for name in ("cwd", "root", "exe"):
        try:
            gone = deleted_path(os.readlink(f"/proc/{pid}/{name}"))
        except OSError:
            continue
        if gone is not None:
            found.append((f"a deleted {'program' if name == 'exe' else 'directory'},", gone, pid))
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
                if target.startswith("socket:["):  # only a unix socket is bound to a file
                    unix = os.getxattr(path, "system.sockprotoname").startswith(b"UNIX")
                elif (gone := deleted_path(target)) is not None:
                    found.append((DELETED, gone, pid))
                    inos.setdefault((pid, gone), set()).add(_ext(pid, fd, path))
                    continue
                elif not (target.startswith("/") and stat.S_ISFIFO(os.stat(path).st_mode)):
                    continue
            except OSError:
                continue
            if not target.startswith("socket:["):
                found.append((FIFO, target, pid))
                inos.setdefault((pid, target), set()).add(_ext(pid, fd, path))
            elif unix and (bound := _socket_file(pidfd, int(fd))) is not None:
                found.append((SOCKET, bound, pid))
                inos.setdefault((pid, bound), set()).add(int(target[len("socket:["):-1]))
    finally:
        os.close(pidfd)
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                gone = deleted_path(fields[5].rstrip("\n")) if len(fields) == 6 else None
                if gone is not None:
                    found.append((MAPPED, gone, pid))
    except OSError:
        pass


def _ext(pid: int, fd: str, path: str) -> str:
    """criu's external name for the file a descriptor holds (agent/files/asuser/files.py), or ""."""
    try:
        return external_id(fd_info(pid, fd)[0], os.stat(path).st_ino)
    except (OSError, ValueError):
        return ""


def made_again_by_path(root: int, inos: dict[tuple[int, str], set[int | str]] | None = None) -> list[tuple[str, str, int]]:
    """(what, path, pid) for each thing the job holds that criu makes again by path (module
    docstring); paths as the holder's mount namespace sees them (``/proc/<pid>/root`` reaches them).
    ``inos``: filled with the sockets' inodes, and the FIFOs' and deleted files' criu names, by
    (pid, path)."""
    found: list[tuple[str, str, int]] = []
    for pid in job_pids(root):
        _in_process(pid, found, {} if inos is None else inos)
    return found


def _packet(entry: bytes) -> tuple[bool, int]:
    """An sk_packet_entry (protobuf): whether it has ``scm`` (field 4), and its ``length`` (field 2)."""
    scm, length = False, 0
    for number, value in criuproto.fields(entry):
        if number == 2 and isinstance(value, int):
            length = value
        scm = scm or number == 4
    return scm, length


def queued_descriptors(images: Path) -> int:
    """How many of the dump's queued packets carry descriptors (criu's sk-queues image: two
    magics, then per packet a u32 size, its sk_packet_entry, and its data)."""
    try:
        data = (images / SK_QUEUES).read_bytes()
    except FileNotFoundError:
        return 0
    n, i = 0, 8
    try:
        while i + 4 <= len(data):
            (size,) = struct.unpack_from("<I", data, i)
            scm, length = _packet(data[i + 4:i + 4 + size])
            n += scm
            i += 4 + size + length
    except (IndexError, ValueError, struct.error):
        return max(n, 1)  # unreadable: as if it carried some
    return n


def _why(what: str, path: str, where: str) -> str:
    return (f"the job holds {what} {path}, and {where} can be changed by a user other than root: "
            "criu would make it again there as root at a restore; keep it in a root-owned directory, "
            "the job's own /tmp, or (a socket) the abstract namespace")


def refusal(root: int, images: Path, carried: frozenset[str] = frozenset()
            ) -> tuple[str, list[list[str]], usersockets.UserSockets]:
    """Why the job (its init ``root``, frozen, its dump in ``images``) cannot be restored safely
    ("" if it can), the paths to check again at the restore ([what, path] each), and the sockets
    of a user's processes in a directory others than root may change that the restore takes
    from that user instead (listening: made by the user; connected within the job: nameless for
    criu; agent/files/asuser/sockets.py).  ``carried``: the FIFOs and deleted files criu dumped
    as external, which the restore takes from the user (agent/files/asuser/files.py)."""
    n = queued_descriptors(images)
    none = usersockets.UserSockets()
    if n:
        return (f"the job has descriptors in flight in a unix socket's queue ({n} message(s) carrying "
                "SCM_RIGHTS): criu would open them again as root, by path, at a restore"), [], none
    private = private_devs(root)
    recheck: list[list[str]] = []
    inos: dict[tuple[int, str], set[int | str]] = {}
    users: dict[int, tuple[str, int, int]] = {}
    try:
        found = made_again_by_path(root, inos)
    except Unreadable as exc:
        return f"{exc.strerror}: {os.strerror(exc.errno) if exc.errno else 'unknown error'}", [], none
    for what, path, pid, where in _judged(found, private):
        if where is not None and what in (FIFO, DELETED) and inos.get((pid, path), {""}) <= carried \
                and _users(pid) is not None:
            continue  # every descriptor of the process's there: the user's at the restore
        if where is not None and what == SOCKET and (ids := _users(pid)) is not None:
            for ino in inos.get((pid, path), ()):  # every socket of the process bound there, by inode
                assert isinstance(ino, int)
                if users.setdefault(ino, (path, *ids)) != (path, *ids):
                    return f"the job's socket bound to {path} is held by processes of different users", [], none
        elif where is not None:
            return _why(what, path, where), [], none
        elif not _on(path, pid, private):
            recheck.append([what, path])
    sockets, why = usersockets.planned(images, users) if users else (none, "")
    return why, ([] if why else recheck), sockets


def _users(pid: int) -> tuple[int, int] | None:
    """(uid, gid) of ``pid`` if it is not root's (its sockets can be made by it), else None."""
    try:
        uid, gid = usersockets.holder_ids(pid)
    except (OSError, ValueError):
        return None
    return (uid, gid) if uid > 0 and gid >= 0 else None


def _judged(found: list[tuple[str, str, int]], private: set[int]) -> Iterator[tuple[str, str, int, str | None]]:
    """(what, path, pid, where) for each of ``found`` whose holder is still there: ``where`` the
    directory on the path's way that someone other than root could change, as the holder sees it,
    or None if none."""
    for what, path, pid in found:
        try:
            root_fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # gone since: it holds nothing any more
        try:
            where = beneath.changeable(os.path.normpath(path), root_fd, private)
        except OSError as exc:
            where = f"{path} ({exc.strerror or exc})"
        finally:
            os.close(root_fd)
        yield what, path, pid, where


def inspect(root: int) -> list[JobResource]:
    """revenant check: each thing the running job holds that criu makes again by path, and
    whether a checkpoint would be refused for it."""
    private = private_devs(root)
    out = []
    try:
        found = made_again_by_path(root)
    except Unreadable as exc:
        return [JobResource(kind="socket", what=exc.strerror or "a socket", verdict="blocking",
                            reason="the agent cannot inspect it")]
    for what, path, pid, where in _judged(found, private):
        kind = "socket" if "socket" in what else "file"
        if where is not None and what == SOCKET and _users(pid) is not None:
            out.append(JobResource(kind=kind, what=f"{what} {path}", verdict="carried",
                                   reason="made again at its path by the job's user at the restore, if it listens "
                                          "(agent/files/asuser/sockets.py)"))
        elif where is not None and what in (FIFO, DELETED) and _users(pid) is not None:
            out.append(JobResource(kind=kind, what=f"{what.rstrip(',')} {path}", verdict="carried",
                                   reason="opened (a FIFO) or made unnamed (a deleted file) by the job's user at the "
                                          "restore (agent/files/asuser/files.py)"))
        elif where is not None:
            out.append(JobResource(kind=kind, what=f"{what.rstrip(',')} {path}", verdict="blocking",
                                   reason=f"{where} can be changed by a user other than root: criu would make it "
                                          "again there as root at a restore"))
        else:
            out.append(JobResource(kind=kind, what=f"{what.rstrip(',')} {path}", verdict="carried",
                                   reason="made again at its path by the restore"))
    return out


def _on(path: str, pid: int, private: set[int]) -> bool:
    """Whether ``path``'s directory is on one of the job's private filesystems."""
    try:
        return os.stat(f"/proc/{pid}/root{os.path.dirname(path)}").st_dev in private
    except OSError:
        return False


def recheck_epoch(epoch_dir: Path, user: str) -> str:
    """:func:`recheck` of an epoch's REMADE, and its queued descriptors again.  An epoch from
    before REMADE was checked for none of it: a ``user``'s (not root's) is refused."""
    n = queued_descriptors(epoch_dir)
    if n:
        return f"its epoch has descriptors in flight in a unix socket's queue ({n} message(s) carrying SCM_RIGHTS)"
    try:
        paths = msgspec.json.decode((epoch_dir / REMADE).read_bytes(), type=list[list[str]])
    except FileNotFoundError:
        if user and user != "root":
            return (f"epoch {epoch_dir.name} was taken before revenant checked what criu makes again by path "
                    "(no remade.json): a user's job needs a newer epoch")
        return ""
    except (OSError, msgspec.DecodeError) as exc:
        return f"epoch {epoch_dir.name}: unreadable {REMADE}: {exc}"
    return recheck(paths)


def recheck(paths: list[list[str]]) -> str:
    """On the restoring node, before criu runs: why one of the epoch's REMADE paths is not safe
    here ("" if none): each directory must exist, root's alone, here too."""
    root_fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for what, path in paths:
            try:
                where = beneath.changeable(os.path.normpath(path), root_fd)
            except OSError as exc:
                where = f"{path} ({exc.strerror or exc})"
            if where is not None:
                return _why(what, path, where).replace("the job holds", "the job held")
    finally:
        os.close(root_fd)
    return ""
