"""Which directories of a working directory changed since it was listed, told by the kernel
(inotify), so that the freeze need not look at the others.

The listing before the freeze (agent/files/workdir_scan.py) watches each directory it enters,
before it reads its entries: a create, unlink or rename in it, or the directory itself moved or
removed, then queues an event naming it.  While the job is frozen the snapshot reads what is
queued (:meth:`DirWatch.dirty`): a directory that had none has the entries the listing read, and
is taken as it is without a system call; one that had some is listed again.  Events are queued
in the system call that made the change, so every change the job made before it was frozen is
there when it is read.

One inotify instance for the agent, its watches shared by every job (two jobs in one directory
watch one inode once; inotify gives the same watch back), at most ``MAX_WATCHES`` of them.  A
change is stamped with a sequence number as it is read, and each listing remembers the number it
started at, so that one job's reading never hides a change from another's.  An overflowing queue
marks everything changed from then on.  Only local filesystems (where every change is made through
this kernel); elsewhere, and wherever inotify cannot be had, the freeze looks at each directory
as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading

log = logging.getLogger(__name__)

_IN_MODIFY_DIR = 0x100 | 0x200 | 0x40 | 0x80  # IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
_IN_SELF = 0x400 | 0x800  # IN_DELETE_SELF | IN_MOVE_SELF
_IN_ONLYDIR = 0x01000000
_IN_Q_OVERFLOW, _IN_IGNORED = 0x4000, 0x8000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("=iIII")  # wd, mask, cookie, len
MAX_WATCHES = 50_000  # of the host's fs.inotify.max_user_watches, shared by every root process
# statfs f_type of filesystems whose every change is made through this kernel.
LOCAL = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0x794C7630, 0xF2F52010, 0x2FC12FC1})

_libc = ctypes.CDLL(None, use_errno=True)


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_long * 15)]


def local(fd: int) -> bool:
    """Whether the directory ``fd`` is on a local filesystem (see LOCAL)."""
    buf = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) in LOCAL


class DirWatch:
    """The agent's one inotify instance (:func:`shared`)."""

    def __init__(self) -> None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        self._lock = threading.Lock()
        self._seq = 0  # bumped as events are read
        self._changed: dict[int, int] = {}  # watch -> the sequence number of its last change
        self._overflow = -1  # events lost from this number on
        self.watches = 0

    def mark(self) -> int:
        """A listing's start: what it later asks :meth:`dirty` since."""
        with self._lock:
            self._drain()
            self._seq += 1
            return self._seq

    def add(self, dir_fd: int) -> int:
        """Watch the directory ``dir_fd`` (before its entries are read); its watch, or -1 if it
        cannot be watched (then it is looked at during the freeze)."""
        if self.watches >= MAX_WATCHES:
            return -1
        wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(),
                                     _IN_MODIFY_DIR | _IN_SELF | _IN_ONLYDIR)
        if wd < 0:
            return -1
        with self._lock:
            if wd not in self._changed:
                self._changed[wd] = 0
                self.watches += 1
        return wd

    def dirty(self, since: int) -> set[int] | None:
        """The watches changed since the listing that began at ``since``; None if events were
        lost since (every directory must be looked at)."""
        with self._lock:
            self._drain()
            if self._overflow >= since:
                return None
            return {wd for wd, at in self._changed.items() if at >= since}

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self._overflow = self._seq
                return
            self._seq += 1
            at, i = self._seq, 0
            while i + _EVENT.size <= len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, i)
                i += _EVENT.size + size
                if mask & _IN_Q_OVERFLOW:
                    self._overflow = at
                elif mask & _IN_IGNORED:  # its directory is gone: a new one may get the number
                    if self._changed.pop(wd, None) is not None:
                        self.watches -= 1
                elif wd in self._changed:
                    self._changed[wd] = at


_shared: DirWatch | None = None
_failed = False
_shared_lock = threading.Lock()


def shared() -> DirWatch | None:
    """The agent's watch, made on first use; None where inotify cannot be had."""
    global _shared, _failed
    with _shared_lock:
        if _shared is None and not _failed:
            try:
                _shared = DirWatch()
            except OSError as exc:
                _failed = True
                log.warning("directory changes cannot be watched (%s): the freeze looks at every directory", exc)
        return _shared
