"""A user's job holding a named FIFO, or a file it deleted, in a directory the user can change (a
FIFO a pipeline made in its project directory, a temporary file unlinked once opened): handed to
criu at a restore by the user, never opened or written again at its path by root.

criu opens a FIFO by its path as root at a restore, and writes a deleted file's content again
beside its old path (a "ghost"), making missing directories, all as root and following links:
in a directory the user can change, a swap at the right moment has root open or write wherever
the user points (agent/files/remade.py).  For such a file held through a descriptor by a process
that is not root's, revenant instead:

* before the dump (the job runs), finds them (:func:`held`) and has criu dump each as an
  *external* file (``--external file[mnt_id:inode]``): criu records its descriptors' flags and
  positions, and a FIFO's queued data, and neither its path nor (a deleted file's) its content;
* while the job is frozen, keeps those criu did dump so (:func:`dumped`), and copies a deleted
  file's content into the epoch, up to its size at the dump and to file_snapshot_max_bytes
  (:func:`taken`); the list goes into the epoch (``user-files.json``), signed with the images;
* at the restore, as the user (agent/files/asuser/creds.py): opens the FIFO at its path (made
  again if it is gone), checked readable or writable as the job's descriptors need, or makes an
  unnamed file (``O_TMPFILE``) in the deleted file's directory with its content and mode, and
  hands each to criu (``--inherit-fd fd[N]:file[mnt_id:inode]``), which opens it again through
  ``/proc/self/fd`` with the job's flags, at the job's positions.

A deleted file the job maps (rather than holds open) is still refused, and so is one held by
processes of different users: criu's own way for those writes as root.  After the restore,
``/proc/PID/fd`` names a deleted file ``#INODE (deleted)`` in its directory: the name it had is
gone with it.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import msgspec

from revenant.agent.files import beneath, remade
from revenant.agent.files.asuser import creds, sockets
from revenant.agent.pipeline.criuproto import entries, fields
from revenant.agent.processes.jobprocs import external_id, fd_info, job_pids, private_devs
from revenant.agent.storage.epochs import FILES_DIR, USER_FILES, EpochError
from revenant.agent.storage.fileio import copy_bytes

_REG, _REG_ENTRY, _NAME, _EXT = 1, 3, 6, 9  # fd_types.REG; file_entry.reg; reg_file_entry.name, .ext
FIFO, DELETED = "fifo", "deleted"


class UserFile(msgspec.Struct, frozen=True, kw_only=True):
    ext: str  # criu's name for it at the dump: file[mnt_id:inode], in hex
    kind: str  # FIFO or DELETED
    path: str  # as its holder saw it (a deleted file's: where it was)
    uid: int  # its holder's: made again with these credentials
    gid: int
    mode: int  # st_mode at the dump (criu checks it at the restore)
    access: int  # os.R_OK | os.W_OK, as the job's descriptors of it need
    copy: str = ""  # a deleted file's content, in the epoch
    size: int = 0


@dataclass
class Held:
    """One of them before the dump, and a descriptor of the job's that holds it."""

    file: UserFile
    pid: int
    fd: int


def _access(flags: int) -> int:
    mode = flags & os.O_ACCMODE
    return {os.O_WRONLY: os.W_OK, os.O_RDWR: os.R_OK | os.W_OK}.get(mode, os.R_OK)


def _in_process(pid: int, uid: int, gid: int, private: set[int], out: dict[str, Held], mixed: set[str]) -> None:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        root_fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(link)
                if not target.startswith("/"):
                    continue
                st = os.stat(link)
                gone = remade.deleted_path(target)
                if gone is not None and stat.S_ISREG(st.st_mode):
                    kind, path = DELETED, gone
                elif gone is None and stat.S_ISFIFO(st.st_mode):
                    kind, path = FIFO, target
                else:
                    continue
                try:
                    if beneath.changeable(os.path.normpath(path), root_fd, private) is None:
                        continue  # root's alone: criu's own way is safe (remade.py)
                except OSError:
                    pass  # its directory is gone, or unreadable: as the user, never as root
                mnt, flags = fd_info(pid, fd)
            except OSError:
                continue  # closed since: criu will not see it either
            ext = external_id(mnt, st.st_ino)
            was = out.get(ext)
            if was is not None and (was.file.uid, was.file.gid) != (uid, gid):
                mixed.add(ext)
            elif was is not None:
                was.file = msgspec.structs.replace(was.file, access=was.file.access | _access(flags))
            else:
                out[ext] = Held(UserFile(ext=ext, kind=kind, path=path, uid=uid, gid=gid, mode=st.st_mode,
                                         access=_access(flags)), pid, int(fd))
    finally:
        os.close(root_fd)


def held(root: int) -> dict[str, Held]:
    """Before the dump: each FIFO and deleted file that a process of the job (its init ``root``)
    that is not root's holds through a descriptor, in a directory someone other than root could
    change, by criu's external name for it.  One opened after this is dumped by criu's own way,
    and the dump refuses it (remade.py); one held by processes of different users is left out."""
    private = private_devs(root)
    out: dict[str, Held] = {}
    mixed: set[str] = set()
    for pid in job_pids(root):
        try:
            uid, gid = sockets.holder_ids(pid)
        except (OSError, ValueError):
            continue
        if uid > 0 and gid >= 0:
            _in_process(pid, uid, gid, private, out, mixed)
    for ext in mixed:
        del out[ext]
    return out


def external_args(files: dict[str, Held]) -> list[str]:
    """criu dump's arguments that make each of ``files`` external."""
    return [arg for ext in sorted(files) for arg in ("--external", ext)]


def dumped(images: Path) -> set[str]:
    """The names of the files criu's dump in ``images`` recorded as external."""
    out: set[str] = set()
    for entry in entries((images / sockets.FILES).read_bytes()):
        top = dict(fields(entry))
        reg = top.get(_REG_ENTRY)
        if top.get(1) == _REG and isinstance(reg, bytes):
            rfe = dict(fields(reg))
            if rfe.get(_EXT) and isinstance(rfe.get(_NAME), bytes):
                out.add(rfe[_NAME].decode(errors="replace"))  # type: ignore[union-attr]
    return out


def taken(files: dict[str, Held], carried: set[str], epoch_tmp: Path, max_bytes: int) -> list[UserFile]:
    """While the job is frozen: ``files`` that criu dumped as external (``carried``), a deleted
    one's content copied into the epoch up to its size now.  Raises EpochError if a deleted file
    is over ``max_bytes``, or its descriptor holds another file now."""
    out: list[UserFile] = []
    for i, ext in enumerate(sorted(carried)):
        h = files[ext]
        if h.file.kind == DELETED:
            src = os.open(f"/proc/{h.pid}/fd/{h.fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(src)
                if external_id(fd_info(h.pid, h.fd)[0], st.st_ino) != ext:
                    raise EpochError(f"the job's deleted file {h.file.path} was closed while it was checkpointed; "
                                     "the next checkpoint may not")
                if st.st_size > max_bytes:
                    raise EpochError(f"the job holds a deleted file {h.file.path} of {st.st_size} bytes, over "
                                     f"file_snapshot_max_bytes ({max_bytes})")
                name = f"{FILES_DIR}/deleted-{i}"
                (epoch_tmp / FILES_DIR).mkdir(mode=0o700, exist_ok=True)
                dst = os.open(epoch_tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    copy_bytes(src, dst, st.st_size)
                finally:
                    os.close(dst)
                out.append(msgspec.structs.replace(h.file, copy=name, size=st.st_size, mode=st.st_mode))
            finally:
                os.close(src)
        else:
            out.append(h.file)
    return out


def read(epoch_dir: Path) -> list[UserFile]:
    """The epoch's files taken from the job's user (none for an epoch without them); raises
    msgspec.DecodeError if the list is malformed."""
    try:
        data = (epoch_dir / USER_FILES).read_bytes()
    except FileNotFoundError:
        return []
    return msgspec.json.decode(data, type=list[UserFile])


# ------------------------------------------------------------------ made as the user

def _fifo(f: UserFile) -> int:
    """As the user: the FIFO at its path (made if gone), readable or writable as the job needs."""
    try:
        os.lstat(f.path)
    except FileNotFoundError:
        os.mkfifo(f.path, 0o600)
        os.chmod(f.path, stat.S_IMODE(f.mode))
    fd = os.open(f.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(0, "is not a FIFO now")
        if not os.access(f"/proc/self/fd/{fd}", f.access, effective_ids=True):
            raise PermissionError(13, "Permission denied (to the job's user)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _deleted(f: UserFile, src: int, fallback: str) -> int:
    """As the user: an unnamed file in the deleted file's directory (or ``fallback``, where that
    is gone too), with its content and mode."""
    flags = os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(os.path.dirname(f.path), flags, 0o600)
    except (FileNotFoundError, NotADirectoryError):
        if not fallback:
            raise
        fd = os.open(fallback, flags, 0o600)
    try:
        copy_bytes(src, fd, f.size)
        os.fchmod(fd, stat.S_IMODE(f.mode))
        return fd
    except BaseException:
        os.close(fd)
        raise


def make(files: list[UserFile], epoch_dir: Path, workdir: str) -> list[int]:
    """Blocking: each of ``files`` opened or made by its user; our descriptors of them, to hand to
    criu.  Raises OSError naming the file that could not be (those made are closed)."""
    sources: list[int] = []
    try:
        work = []
        for f in files:
            if f.kind == FIFO:
                work.append((f"the FIFO {f.path}", f.uid, f.gid, functools.partial(_fifo, f)))
            elif f.kind == DELETED and f.copy.startswith(f"{FILES_DIR}/") and "/.." not in f.copy:
                sources.append(os.open(epoch_dir / f.copy, os.O_RDONLY | os.O_CLOEXEC))
                work.append((f"the deleted file {f.path}", f.uid, f.gid,
                             functools.partial(_deleted, f, sources[-1], workdir)))
            else:
                raise OSError(0, f"{f.path}: unknown kind {f.kind!r} or copy {f.copy!r}")
        return creds.as_user(work)
    finally:
        for fd in sources:
            os.close(fd)


def inherit_args(files: list[UserFile], fds: list[int]) -> list[str]:
    """criu restore's arguments that hand it each file as the one it dumped as external."""
    return [arg for f, fd in zip(files, fds) for arg in ("--inherit-fd", f"fd[{fd}]:{f.ext}")]
