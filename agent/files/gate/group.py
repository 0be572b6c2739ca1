"""The agent's one fanotify group for its file gate (agent/files/gate/cowgate.py says what the gate
is for): the group, its answering thread (it looks and answers, never copies nor opens a file),
its copier thread, and its keeper process (agent/files/gate/keeper.py), with the bounded waits and
the fail-open the module above describes."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from revenant.agent.files.gate import changes as gatechanges
from revenant.agent.files.gate import keeper as gatekeeper


class Batch(Protocol):
    """One checkpoint's files (agent/files/gate/cowgate.py CowGate): how to copy, who is the job."""

    copy_fn: Callable[[int, str, int], None]

    def holds(self, pid: int) -> bool: ...

log = logging.getLogger(__name__)

FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_CONTENT = 0x1, 0x2, 0x4
FAN_MARK_ADD, FAN_MARK_REMOVE = 0x1, 0x2
FAN_OPEN_PERM = 0x10000
FAN_ALLOW = gatekeeper.FAN_ALLOW
_EVENT, _RESPONSE = gatekeeper.EVENT, gatekeeper.RESPONSE  # fanotify_event_metadata, fanotify_response
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]

# How long an open of a file not yet copied waits for its copy: a process of the job (whose
# writes the copy must precede), anyone else (then let through: the copy proves itself).
JOB_WAIT_S = 60.0
OUTSIDER_WAIT_S = 0.5
ANSWER_NICE = -10  # the answering thread's niceness (Linux's are per thread)
# How often the answering thread beats while files are gated (well within the keeper's STALE_S).
BEAT_MS = 100
# Files gated at once by the whole agent (one descriptor each): past it, the caller copies now.
MAX_GATED = 512


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


@dataclass(eq=False)
class File:
    src: int  # our read-only descriptor of it
    key: tuple[int, int]  # its (device, inode)
    dest: str
    size: int  # at the dump: what is copied, and what it must still be once copied
    ctime_ns: int  # at the dump: what it must still be if an open went through before the copy ended
    name: str
    batch: Batch
    answered: int  # the keeper's count when it was armed: more once copied, an open may have gone through
    done: bool = False  # copied, failed or let go: set under the gate's lock
    early: bool = False  # an open was let through before its copy ended, or another process changed it
    job_wrote: bool = False  # a process of the job changed it before its copy was settled (an event said so)
    error: str = ""
    # Changed by another process (let through before its copy ended): its copy is not the dump's,
    # and the epoch keeps it by identity only (agent/files/workdir_taken.py), the job's consistency
    # untouched (the job's own opens waited for the copy).
    unkept: bool = False
    waiters: list[tuple[int, float]] = field(default_factory=list)  # (event fd, deadline) waiting for it
    handle: gatechanges.Handle | None = None  # as its change events name it (None: not watched)
    copying: threading.Lock = field(default_factory=threading.Lock)  # one copy of it at a time


class Group:
    """The agent's one gate (see the module): its fanotify group, answering thread, copier and keeper."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._fan = _check(_libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY))
        self._lock = threading.Lock()  # the tables below; never held through a copy or a wait
        self._files: dict[tuple[int, int], File] = {}
        self._waiting: set[File] = set()  # files with opens waiting for their copy
        self._urgent: deque[File] = deque()  # files an open waits for: the copier's work, first come
        self._work = threading.Condition(self._lock)
        self._handles: dict[gatechanges.Handle, File] = {}  # the gated files, as change events name them
        try:
            self._changes: gatechanges.Changes | None = gatechanges.Changes()
        except OSError as exc:  # then any change of size without an open fails its epoch
            log.warning("the file gate cannot tell who changes a gated file: %s", exc)
            self._changes = None
        self.broken = ""  # why it failed open: it answers nothing more, a new gate is made
        self.fault: Callable[[], None] | None = None  # tests: raised in the answering thread
        shm = os.memfd_create("revenant-gate", os.MFD_CLOEXEC)
        os.ftruncate(shm, gatekeeper.BEAT.size)
        self._page = mmap.mmap(shm, gatekeeper.BEAT.size)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        keeper_r, self._keeper_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", gatekeeper.__file__, str(self._fan), str(shm), str(keeper_r),
                 str(self.pid)],
                pass_fds=(self._fan, shm, keeper_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            os.close(keeper_r)
            os.close(shm)
        self._beat()
        self._threads = [threading.Thread(target=self._answer, name="cowgate-answer", daemon=True),
                         threading.Thread(target=self._copier, name="cowgate-copy", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ what batches call

    def answered(self) -> int:
        """Opens the keeper let through so far."""
        return gatekeeper.BEAT.unpack_from(self._page, 0)[1]

    def arm(self, batch: Batch, fd: int, dest: str, name: str, st: os.stat_result) -> bool:
        key = (st.st_dev, st.st_ino)
        with self._lock:
            if self.broken or key in self._files or len(self._files) >= MAX_GATED:
                return False
            self._beat()  # its time runs from here: the answering thread beats often from its next wake
            _check(_libc.fanotify_mark(self._fan, FAN_MARK_ADD, FAN_OPEN_PERM, fd, None))
            f = File(fd, key, dest, st.st_size, st.st_ctime_ns, name or dest, batch, self.answered())
            if self._changes is not None:
                try:
                    f.handle = self._changes.mark(fd)
                    self._handles[f.handle] = f
                except OSError:
                    pass
            # Changed since ``st`` and before its marks (the job frozen): by another process, whose
            # descriptor predates them; from the marks on, its changes come as events.
            now = os.fstat(fd)
            f.early = now.st_size != st.st_size or now.st_ctime_ns != st.st_ctime_ns
            self._files[key] = f
            self._note_gated()
        if len(self._files) == 1:
            self._wake()
        batch.files.append(f)
        return True

    def copy(self, f: File) -> None:
        """Copy ``f`` (once: a second call waits for the first), then let its waiters through."""
        with f.copying:
            if f.done:
                return
            error = ""
            try:
                f.batch.copy_fn(f.src, f.dest, f.size)
            except OSError as exc:
                error = f"{f.name}: {exc.strerror or exc}"
                try:
                    if os.fstat(f.src).st_size < f.size:  # the short copy's cause: _settle says which
                        error = ""
                except OSError:
                    pass
            except Exception as exc:  # noqa: BLE001 - a copy that fails any way fails the epoch, never the gate
                error = f"{f.name}: {exc}"
            self._settle(f, error, check=True)

    def let_go(self, f: File, error: str = "") -> None:
        """``f`` uncopied: its waiters through, its mark and descriptor gone."""
        with f.copying:
            if not f.done:
                self._settle(f, error or f.error, check=False)

    def _settle(self, f: File, error: str, check: bool) -> None:
        st = None
        if check and not error:
            try:
                st = os.fstat(f.src)  # before anyone waiting is let through: what the copy read
            except OSError as exc:
                error = f"{f.name}: {exc.strerror or exc}"
            else:
                for pause in (0.0, 0.02):  # who changed it: its writer's event may not be read yet
                    if (st.st_ctime_ns == f.ctime_ns and st.st_size == f.size) or f.job_wrote or self._early(f):
                        break
                    time.sleep(pause)
                    self._drain()
        with self._lock:
            if st is not None:
                changed = st.st_ctime_ns != f.ctime_ns or st.st_size != f.size
                if f.job_wrote and changed:  # the job's own write came before the copy: never kept wrong
                    error = (f"{f.name} changed {'size ' if st.st_size != f.size else ''}while it was copied, by the "
                             "job (truncated by path, or written through an open let go before its copy)")
                elif self._early(f) and changed:
                    f.unkept = True  # another process wrote it: not the job's to keep
                elif st.st_size != f.size:  # its size only: times change without a byte (git's utime)
                    error = f"{f.name} changed size while it was copied (truncated by path)"
            f.error, f.done = error or f.error, True
            waiters, f.waiters = f.waiters, []
            self._waiting.discard(f)
            if self._files.get(f.key) is f:
                del self._files[f.key]
                self._note_gated()
                if not self.broken:  # its later opens are nobody's business
                    _libc.fanotify_mark(self._fan, FAN_MARK_REMOVE, FAN_OPEN_PERM, f.src, None)
                    if f.handle is not None and self._changes is not None:
                        self._changes.unmark(f.src)
                if f.handle is not None and self._handles.get(f.handle) is f:
                    del self._handles[f.handle]
            os.close(f.src)
            f.src = -1
            for fd, _ in waiters:
                self._allow(fd)

    # ------------------------------------------------------------------ the threads

    def _early(self, f: File) -> bool:
        """Another process may have changed ``f`` since it was armed: it changed it (an event said
        so), or an open of it went through before its copy ended (here or by the keeper)."""
        return f.early or self.answered() != f.answered

    def _drain(self) -> None:
        """Read the changes pending now, from a thread other than the answering one."""
        if not self.broken:
            try:
                self._read_changes()
            except OSError:
                pass  # the group failed open meanwhile

    def _read_changes(self) -> None:
        """Each gated file changed by a process outside its job (the agent aside) is not the job's
        to keep; one changed by the job before its copy was settled fails its epoch."""
        if self._changes is None:
            return
        changed, _ = self._changes.read()  # lost ones: the size check decides, as without the group
        for handle, pid in changed:
            if pid == self.pid:
                continue
            with self._lock:
                f = self._handles.get(handle)
            if f is not None and not f.done:
                if f.batch.holds(pid):
                    f.job_wrote = True
                else:
                    f.early = True

    def _beat(self) -> None:
        struct.pack_into("=q", self._page, 0, time.monotonic_ns())

    def _note_gated(self) -> None:
        """The files gated now, in the page: while there are, the keeper expects beats (under the lock)."""
        struct.pack_into("=q", self._page, 16, len(self._files))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _allow(self, fd: int) -> None:
        try:
            os.write(self._fan, _RESPONSE.pack(fd, FAN_ALLOW))
        except OSError:
            pass  # the group is gone: the kernel let it through
        os.close(fd)

    def _answer(self) -> None:
        """Answer every open of a gated file: at once if it is copied (or not ours), else once its
        copy ends or its wait is up.  Looks and answers only: it never copies, never opens a file,
        never logs while the group stands (a traceback reads source files, which may be gated).
        At ANSWER_NICE: starved on busy CPUs, it would stop beating, and the keeper let the job's
        writes through before their copy (failing the epoch)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ANSWER_NICE)
        except OSError:
            pass  # without CAP_SYS_NICE: as the agent's other threads
        try:
            poller = select.poll()
            poller.register(self._fan, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            if self._changes is not None:
                poller.register(self._changes.fd, select.POLLIN)
            while True:
                with self._lock:
                    deadline = min((d for f in self._waiting for _, d in f.waiters), default=None)
                    gated = bool(self._files)
                # While files are gated it beats every BEAT_MS: the keeper answers for a thread that does not.
                timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
                if gated:
                    timeout = BEAT_MS if timeout is None else min(timeout, BEAT_MS)
                ready = {fd for fd, _ in poller.poll(timeout)}
                self._beat()
                if self.broken:
                    return  # failed open, or closed: its descriptors are gone
                if self.fault is not None:
                    self.fault()
                if self._fan in ready:
                    self._read_events()
                if self._changes is not None and self._changes.fd in ready:
                    self._read_changes()
                self._expire()
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 64)
                    except BlockingIOError:
                        pass
        except BaseException as exc:  # noqa: BLE001 - never the host's opens: fail open, then say why
            self.fail_open(f"its answering thread failed: {exc!r}")
            log.error("the file gate failed open: %r; the epochs it gated fail", exc)

    def _read_events(self) -> None:
        try:
            buf = os.read(self._fan, 256 * _EVENT.size)
        except BlockingIOError:
            return
        i = 0
        while i + _EVENT.size <= len(buf):
            length, _, _, _, _, fd, pid = _EVENT.unpack_from(buf, i)
            i += max(length, _EVENT.size)
            if fd < 0:
                continue
            f = None
            if pid != self.pid:
                try:
                    st = os.fstat(fd)
                except OSError:
                    st = None
                if st is not None:
                    with self._lock:
                        f = self._files.get((st.st_dev, st.st_ino))
                        if f is not None and not f.done:
                            wait = JOB_WAIT_S if f.batch.holds(pid) else OUTSIDER_WAIT_S
                            f.waiters.append((fd, time.monotonic() + wait))
                            self._waiting.add(f)
                            if f not in self._urgent:
                                self._urgent.append(f)
                                self._work.notify()
                            continue
            self._allow(fd)

    def _expire(self) -> None:
        """Let through every open whose wait is up: its file's copy must then prove itself."""
        now = time.monotonic()
        with self._lock:
            for f in list(self._waiting):
                late = [w for w in f.waiters if w[1] <= now]
                if not late:
                    continue
                f.early = True
                f.waiters = [w for w in f.waiters if w[1] > now]
                if not f.waiters:
                    self._waiting.discard(f)
                for fd, _ in late:
                    self._allow(fd)

    def _copier(self) -> None:
        while True:
            with self._lock:
                while not self._urgent and not self.broken:
                    self._work.wait()
                if self.broken:
                    return
                f = self._urgent.popleft()
            self.copy(f)

    # ------------------------------------------------------------------ failing open

    def fail_open(self, why: str) -> None:
        """Let every open through from now on, for good: the waiting ones answered, the keeper
        told to go, the group closed (the kernel allows what is pending); every batch fails."""
        with self._lock:
            if self.broken:
                return
            self.broken = why
            self._work.notify_all()
            for f in list(self._files.values()):
                f.error = f.error or f"{f.name}: the file gate failed ({why})"
                for fd, _ in f.waiters:
                    self._allow(fd)
                f.waiters = []
            self._waiting.clear()
            self._urgent.clear()
        for fd in (self._keeper_w, self._fan):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._changes is not None:
            self._changes.close()
        self._wake()

    def reap(self) -> None:
        """The keeper's exit status, once it went (after a failure, its pipe closed)."""
        self._keeper.poll()

    def close(self) -> None:
        """For tests and the agent's exit: fail open, and wait for the threads and the keeper."""
        self.fail_open("closed")
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        try:
            self._keeper.wait(5)
        except subprocess.TimeoutExpired:
            self._keeper.kill()
            self._keeper.wait()
