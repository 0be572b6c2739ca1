"""Checkpoint images are private: they hold the whole memory of a job, its secrets included.

Every directory of an epoch (the job's ``epochs/``, each ``<N>/`` and ``.tmp-*``, their
``files/``, node-local staging) belongs to the agent's user (root) with mode 0700, and every
file in it 0600, whatever the umask and whoever wrote it (criu, a copy from staging, the
snapshot of the job's own files).  The job's own directory may belong to the job's user: the
images are out of that user's reach all the same, because ``epochs/`` inside it is root's 0700.
A user who owns the job's directory can replace ``epochs/`` by a directory or link of their own;
:func:`private_dir` refuses to use one that is not a real directory of the agent's user.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from revenant.agent.storage.fileio import fsync_path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# criu's umask while it dumps (agent/procs.run): its images are created 0600 from the start.
DUMP_UMASK = 0o077


def _own(path: Path, st: os.stat_result, mode: int) -> None:
    uid, gid = os.geteuid(), os.getegid()
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.lchown(path, uid, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def private_dir(path: Path) -> Path:
    """``path`` as a private directory: created 0700 if missing (its parent must exist), else
    checked to be a real directory of the agent's user (never a link) and set to 0700."""
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, "refusing to keep checkpoint images in what is not a directory "
                              f"of uid {os.geteuid()}", str(path))
    _own(path, st, PRIVATE_DIR)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: a private (0600) file under a unique temporary
    name (``.<name>.<rnd>.tmp``), fsynced, renamed over ``path``, the directory fsynced."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent, directory=True)


def trusted(path: Path) -> bool:
    """Whether ``path`` is missing or a real directory of the agent's user that no one else may
    write (images are never restored from a directory the job's user could have put there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def make_private(tree: Path) -> None:
    """Every directory under ``tree`` (itself included) 0700, every file 0600, all the agent's
    user's; links are never followed (an epoch holds none)."""
    for root, dirs, files in os.walk(tree):
        _own(Path(root), os.lstat(root), PRIVATE_DIR)
        for name in files:
            path = Path(root) / name
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                _own(path, st, PRIVATE_FILE)
