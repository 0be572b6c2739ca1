"""Kernel-side file copies, fsyncs and syncfs, shared by epochs (agent/storage/epochs.py,
agent/storage/imagesum.py) and the job's own files (agent/files/jobfiles.py, agent/files/jobfiles_restore.py).
Blocking: run in a worker thread."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import os
import platform
import re
import secrets
from pathlib import Path
from typing import Iterable

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2

# Filesystems (statfs f_type) whose syncfs(2) makes every file's data and metadata as durable as an
# fsync of each would: it writes every dirty inode back, then commits the journal or log and
# flushes the disk's cache.  On tmpfs there is nothing to flush.  Elsewhere (a FUSE daemon need not
# implement syncfs, and then it does nothing; network filesystems vary) each file is fsynced.
SYNCFS_FILESYSTEMS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0xF2F52010: "f2fs",
                      0x01021994: "tmpfs"}
# syncfs reports the filesystem's writeback errors only from Linux 5.8 on.
SYNCFS_MIN_KERNEL = (5, 8)

# ioctl(dst, FICLONE, src): a copy-on-write clone of a whole file (btrfs, XFS, bcachefs, ...).
FICLONE = 0x40049409


def fsync_path(path: Path | str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_bytes(src: int, dst: int, size: int, at: int = 0) -> None:
    """Copy ``size`` bytes in the kernel: copy_file_range within a filesystem (a clone where it
    can), sendfile across (tmpfs → ext4 is EXDEV); ``src``'s from its start, into ``dst`` from
    ``at``, which ends up exactly ``at + size`` bytes long."""
    copied = 0
    try:
        while copied < size:
            n = os.copy_file_range(src, dst, size - copied, copied, at + copied)
            if n == 0:
                break
            copied += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        os.lseek(dst, at + copied, os.SEEK_SET)  # sendfile writes at dst's position
        while copied < size:
            n = os.sendfile(dst, src, copied, size - copied)
            if n == 0:
                break
            copied += n
    if copied < size:
        raise OSError(errno.EIO, f"short copy: {copied} of {size} bytes")
    os.ftruncate(dst, at + size)


def reflink(src: int, dst: int) -> bool:
    """Clone ``src`` into ``dst`` copy-on-write; False where the filesystem cannot."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False
        raise


def fs_magic(path: Path | str) -> int:
    """The type (statfs f_type) of the filesystem ``path`` is on."""
    buf = ctypes.create_string_buffer(256)  # struct statfs, f_type (a long) first; 120 bytes on x86-64
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def kernel_at_least(version: tuple[int, ...], release: str | None = None) -> bool:
    numbers = tuple(int(n) for n in re.findall(r"\d+", (release or platform.release()).split("-")[0])[:2])
    return numbers >= version


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` back to the disk now,
    without waiting (sync_file_range WRITE): a later syncfs or fsync then finds less to write.  Best
    effort: an error here is one the durability point reports."""
    _libc.sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)


class Durable:
    """Makes a directory's files durable: one syncfs(2) of the filesystem where that is as strong as
    an fsync of each (SYNCFS_FILESYSTEMS, Linux 5.8 and later), else an fsync of every file and
    directory.  Open it before the files are written: a writeback error from then on is reported to
    its syncfs even if another process's syncfs saw it first.  Like ``sync -f``, a syncfs also waits
    for whatever else is dirty on that filesystem."""

    def __init__(self, directory: Path, kernel: str | None = None) -> None:
        self.fd: int | None = None
        if kernel_at_least(SYNCFS_MIN_KERNEL, kernel) and fs_magic(directory) in SYNCFS_FILESYSTEMS:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @property
    def how(self) -> str:
        return "fsync" if self.fd is None else "syncfs"

    def sync(self, files: Iterable[Path], directories: Iterable[Path]) -> None:
        """``files`` and the entries of ``directories`` on stable storage; raises OSError."""
        if self.fd is not None:
            if _libc.syncfs(self.fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs: {os.strerror(err)}")
            return
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(fsync_path, f) for f in files]:
                done.result()
        for d in directories:
            fsync_path(d, directory=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Durable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replace_empty(path: Path | str) -> None:
    """Replace ``path`` by a new, empty file: a new inode, not a truncate.  A stale copy of the job
    still running somewhere keeps its descriptor to the old inode, so its writes never land in the
    new file (the fence at the resource)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(tmp, "wb") as out:
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)
