"""Copy files as they were at a moment, after that moment, without letting anyone change them first.

A job's working directory goes into its epoch as it was at the dump (agent/files/workdir.py), but
copying a large file while the job is frozen lengthens the freeze.  On a filesystem without reflinks
(ext4), this gate lets the copy happen after the job resumes:

* while the job is frozen, :meth:`CowGate.arm` opens each file to be copied (read-only, through
  a descriptor the caller made without following links) and marks its inode with fanotify's
  ``FAN_OPEN_PERM``: from then on, any open of it, by any process, waits for the gate's answer;
* after the job resumes, :meth:`CowGate.run` copies each file from the descriptor it holds, in
  the background; an open of a file not yet copied has that file copied first, then allowed:
  whoever opens it (to write it, say) can change it only once its copy is done;
* a file is changed without an open only by ``truncate(2)`` on its path, or through a mapping
  or descriptor taken before the dump (the caller copies the files the job holds while it is
  frozen; a process outside the job writing the job's files is not the job's consistency): the
  copy is checked against the inode's size afterwards, and one that changed is reported (the
  epoch then fails: never a copy that is not the dump's).  Its times are no guide: a rename,
  chmod or utime (git "freshens" existing objects) changes them and not a byte.

If the agent dies meanwhile, its fanotify group goes with it and the kernel lets every waiting
open through.  fanotify's permission events need CAP_SYS_ADMIN and a kernel with
CONFIG_FANOTIFY_ACCESS_PERMISSIONS (Debian's have it; :func:`available` says why not).
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from dataclasses import dataclass
from typing import Callable

FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_CONTENT = 0x1, 0x2, 0x4
FAN_MARK_ADD = 0x1
FAN_OPEN_PERM = 0x10000
FAN_ALLOW = 0x1
_EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_RESPONSE = struct.Struct("=iI")  # struct fanotify_response
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]


def available() -> str:
    """Why files cannot be gated here ("" if they can): fanotify's permission events need
    CAP_SYS_ADMIN and CONFIG_FANOTIFY_ACCESS_PERMISSIONS."""
    fd = _libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY)
    if fd < 0:
        return f"fanotify's permission events are not available: {os.strerror(ctypes.get_errno())}"
    os.close(fd)
    return ""


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


@dataclass
class _File:
    src: int  # our read-only descriptor of it
    dest: str
    size: int  # when armed
    done: bool = False  # copied (or failed): set under the gate's lock (an Event each costs the freeze 12 µs)
    error: str = ""
    name: str = ""  # what messages call it


class CowGate:
    """Files copied as they were when the gate was armed (see the module docstring)."""

    def __init__(self, copy: Callable[[int, str], None]) -> None:
        # copy(src_fd, dest): the copy itself (a plain copy, or one into packs).
        self._copy = copy
        self._fan = _check(_libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY))
        self._files: dict[tuple[int, int], _File] = {}
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._events: threading.Thread | None = None
        # Answering from the start: an open of a gated file (by the agent itself, through a second
        # link to it, or by another job's snapshot) never waits for an answer nobody gives.
        self.start()

    def arm(self, fd: int, dest: str, name: str = "", st: os.stat_result | None = None) -> bool:
        """Gate the file behind ``fd`` (a descriptor of the caller's, read-only, kept by the gate
        once this returns True; ``st``: its fstat, if the caller has it) to be copied to ``dest``;
        call while nothing can change it (the job frozen).  False: the file is gated already (a
        second link to it), the caller copies."""
        st = st if st is not None else os.fstat(fd)
        if (st.st_dev, st.st_ino) in self._files:
            return False
        _check(_libc.fanotify_mark(self._fan, FAN_MARK_ADD, FAN_OPEN_PERM, fd, None))
        self._files[(st.st_dev, st.st_ino)] = _File(fd, dest, st.st_size, name=name or dest)
        return True

    def start(self) -> None:
        """Answer opens of the gated files from now on (each copied first), while the caller
        goes on (criu writing the images, say)."""
        if self._events is None:
            self._events = threading.Thread(target=self._answer, name="cowgate", daemon=True)
            self._events.start()

    @property
    def gated(self) -> int:
        return len(self._files)

    def _copy_once(self, f: _File) -> None:
        with self._lock:
            if f.done:
                return
            try:
                self._copy(f.src, f.dest)
                # Its size only: a rename, chmod, link or utime (git "freshens" objects) is no change.
                if os.fstat(f.src).st_size != f.size:
                    f.error = f"{f.name} changed size while it was copied (truncated by path)"
            except OSError as exc:
                f.error = f"{f.name}: {exc.strerror or exc}"
            except Exception as exc:  # noqa: BLE001 - a copy that fails any way fails the epoch, never the gate
                f.error = f"{f.name}: {exc}"
            finally:
                f.done = True

    def _answer(self) -> None:
        """Answer every open of a gated file: copy it first if it is not yet, then allow."""
        poller = select.poll()
        poller.register(self._fan, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._fan in ready:
                try:
                    buf = os.read(self._fan, 4096 * _EVENT.size)
                except BlockingIOError:
                    buf = b""
                i = 0
                while i + _EVENT.size <= len(buf):
                    length, _, _, _, mask, fd, pid = _EVENT.unpack_from(buf, i)
                    i += length
                    if fd < 0:
                        continue
                    try:
                        st = os.fstat(fd)
                        f = self._files.get((st.st_dev, st.st_ino))
                        if f is not None and pid != os.getpid():
                            self._copy_once(f)
                    finally:
                        os.write(self._fan, _RESPONSE.pack(fd, FAN_ALLOW))
                        os.close(fd)
            if self._wake_r in ready:
                return

    def run(self) -> list[str]:
        """Copy every gated file (opens of them answered meanwhile); the errors, one per file."""
        self.start()
        try:
            for f in list(self._files.values()):
                self._copy_once(f)
        finally:
            self.close()
        return [f.error for f in self._files.values() if f.error]

    def close(self) -> None:
        """Let every open through from now on (the marks go with the group), and let go; once."""
        with self._closing:
            if self._fan < 0:
                return
            self._close()

    def _close(self) -> None:
        os.write(self._wake_w, b"x")
        if self._events is not None:
            self._events.join()
        os.close(self._fan)  # pending permission events are allowed by the kernel
        self._fan = -1
        for f in self._files.values():
            os.close(f.src)
        os.close(self._wake_r)
        os.close(self._wake_w)
