"""Who changed a gated file: a fanotify notification group that reports each write or truncate of
a marked inode with the pid that made it (agent/files/gate/group.py uses it).

An open of a gated file waits for its copy (the permission group), but a file changes without an
open too: through a descriptor opened before the gate marked it (another job rewriting its own
state in a shared project directory), or by ``truncate(2)`` on its path.  A change by the job
itself fails its epoch; one by another process only makes the file not the job's to keep.  Only
this event says which.

fanotify reports truncates (an attribute change, with no path) only to a group that reports file
identifiers (``FAN_REPORT_FID``), and such a group cannot take permission events, hence a second
group.  It never blocks anyone: notification events only.  Its events name a file by handle, which
:meth:`Changes.mark` takes for each file it marks.
"""

from __future__ import annotations

import ctypes
import os
import struct

FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_NOTIF, FAN_REPORT_FID = 0x1, 0x2, 0x0, 0x200
FAN_MARK_ADD, FAN_MARK_REMOVE, FAN_MARK_DONT_FOLLOW = 0x1, 0x2, 0x4
FAN_MODIFY, FAN_Q_OVERFLOW = 0x2, 0x4000
FAN_EVENT_INFO_TYPE_FID = 1
AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128
_EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_INFO = struct.Struct("=BBH8sIi")  # fanotify_event_info_header, fsid, file_handle's bytes and type

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
_libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_int), ctypes.c_int]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]

Handle = tuple[int, bytes]  # (handle type, handle): a file, as its events name it


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]


def handle(fd: int, name: str = "") -> Handle:
    """The handle of the file behind ``fd`` (or of its entry ``name``, a link not followed), as a
    change event of it names it."""
    h = _FileHandle(handle_bytes=MAX_HANDLE_SZ)
    mount = ctypes.c_int()
    if _libc.name_to_handle_at(fd, os.fsencode(name), ctypes.byref(h), ctypes.byref(mount),
                               0 if name else AT_EMPTY_PATH) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return h.handle_type, bytes(h.f_handle[:h.handle_bytes])


class Changes:
    """The group: :meth:`mark` a file, :meth:`read` who changed marked files since."""

    def __init__(self) -> None:
        fd = _libc.fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FID | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify (FAN_REPORT_FID): {os.strerror(err)}")
        self.fd = fd

    def mark(self, fd: int) -> Handle:
        """Report the changes of the file behind ``fd`` from now on; its handle."""
        h = handle(fd)
        self._mark(FAN_MARK_ADD, fd)
        return h

    def mark_at(self, dirfd: int, name: str) -> Handle:
        """Report the changes of the file ``name`` in the directory ``dirfd`` (a link is not
        followed) from now on; its handle."""
        h = handle(dirfd, name)
        self._mark(FAN_MARK_ADD | FAN_MARK_DONT_FOLLOW, dirfd, name)
        return h

    def unmark(self, fd: int) -> None:
        try:
            self._mark(FAN_MARK_REMOVE, fd)
        except OSError:
            pass  # never marked, or the group is closed

    def unmark_handle(self, mount_fd: int, h: Handle) -> None:
        """No more changes of the file ``h`` on the filesystem of ``mount_fd`` (gone: nothing to do)."""
        fh = _FileHandle(handle_bytes=len(h[1]), handle_type=h[0])
        ctypes.memmove(fh.f_handle, h[1], len(h[1]))
        # Not O_PATH: fanotify_mark takes no such descriptor (the handle names a regular file).
        fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(fh), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if fd >= 0:
            try:
                self.unmark(fd)
            finally:
                os.close(fd)

    def _mark(self, how: int, fd: int, name: str | None = None) -> None:
        path = None if name is None else os.fsencode(name)
        if _libc.fanotify_mark(self.fd, how, FAN_MODIFY, fd, path) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def read(self) -> tuple[list[tuple[Handle, int]], bool]:
        """The changes pending: (file, pid) each, and whether some were lost (the queue overflowed)."""
        changes: list[tuple[Handle, int]] = []
        lost = False
        while True:
            try:
                buf = os.read(self.fd, 64 * 1024)
            except (BlockingIOError, InterruptedError):
                return changes, lost
            if not buf:
                return changes, lost
            i = 0
            while i + _EVENT.size <= len(buf):
                length, _, _, meta, mask, _, pid = _EVENT.unpack_from(buf, i)
                if mask & FAN_Q_OVERFLOW:
                    lost = True
                elif i + meta + _INFO.size <= i + length:
                    kind, _, _, _, size, htype = _INFO.unpack_from(buf, i + meta)
                    if kind == FAN_EVENT_INFO_TYPE_FID:
                        at = i + meta + _INFO.size
                        changes.append(((htype, bytes(buf[at:at + size])), pid))
                i += max(length, _EVENT.size)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
