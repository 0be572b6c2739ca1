"""Kernel-side file copies and fsyncs, shared by epochs (agent/epochs.py) and the job's own
files (agent/jobfiles.py, agent/jobfiles_restore.py).  Blocking: run in a worker thread."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

# ioctl(dst, FICLONE, src): a copy-on-write clone of a whole file (btrfs, XFS, bcachefs, ...).
FICLONE = 0x40049409


def fsync_path(path: Path | str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_bytes(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes in the kernel: copy_file_range within a filesystem, sendfile across
    (tmpfs → ext4 is EXDEV); ``dst`` ends up exactly ``size`` bytes long."""
    copied = 0
    try:
        while copied < size:
            n = os.copy_file_range(src, dst, size - copied, copied, copied)
            if n == 0:
                break
            copied += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        os.lseek(dst, copied, os.SEEK_SET)  # sendfile writes at dst's position
        while copied < size:
            n = os.sendfile(dst, src, copied, size - copied)
            if n == 0:
                break
            copied += n
    if copied < size:
        raise OSError(errno.EIO, f"short copy: {copied} of {size} bytes")
    os.ftruncate(dst, size)


def reflink(src: int, dst: int) -> bool:
    """Clone ``src`` into ``dst`` copy-on-write; False where the filesystem cannot."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False
        raise
