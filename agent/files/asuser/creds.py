"""Work done at a restore with the job's user's credentials, never root's: a thread of the agent's
own whose credentials alone are the user's, so every path it resolves, checks and creates is
resolved, checked and created as that user (nothing the user could not do themselves).

glibc's ``setresuid`` and friends change every thread's credentials; the raw system calls change
only the caller's.  The thread checks that no capability is left in effect, is waited for
``WAIT_S`` at most (a user's FUSE directory may never answer: a descriptor it returns later is
closed, never handed on), and ends.  A thread's change of effective uid makes the whole process
undumpable (the kernel's ``set_dumpable``): :func:`as_user` sets it back.
"""

from __future__ import annotations

import ctypes
import os
import platform
import pwd
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_SYSCALLS = {"x86_64": (117, 119, 116), "aarch64": (147, 149, 159)}  # setresuid, setresgid, setgroups
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4
WAIT_S = 30.0  # how long one piece of work may take (a bind on a hung filesystem never returns)


def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _become(uid: int, gid: int, groups: list[int]) -> None:
    """This thread only: the user's groups, effective gid and uid (the saved ones stay root's, so
    a thread could come back; this one never does: it ends), and no capability in effect."""
    setresuid, setresgid, setgroups = _SYSCALLS[platform.machine()]
    arr = (ctypes.c_uint * max(len(groups), 1))(*groups)
    _check(_libc.syscall(setgroups, len(groups), arr), "setgroups")
    _check(_libc.syscall(setresgid, -1, gid, -1), "setresgid")
    _check(_libc.syscall(setresuid, -1, uid, -1), "setresuid")
    with open("/proc/thread-self/status") as f:  # the kernel drops them with the uid, unless securebits keep them
        if any(line.startswith("CapEff:") and int(line.split()[1], 16) for line in f):
            raise OSError(0, "capabilities still in effect with the user's uid (securebits?): not made")


class _Work:
    """``work`` in a thread of its own as the user; waited ``WAIT_S`` at most."""

    def __init__(self, uid: int, gid: int, groups: list[int], work: Callable[[], int]) -> None:
        self.lock = threading.Lock()
        self.result: int | BaseException | None = None
        self.abandoned = False
        self.thread = threading.Thread(target=self._run, args=(uid, gid, groups, work), name="as-user", daemon=True)

    def _run(self, uid: int, gid: int, groups: list[int], work: Callable[[], int]) -> None:
        try:
            _become(uid, gid, groups)
            got: int | BaseException = work()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            got = exc
        with self.lock:
            if self.abandoned and isinstance(got, int):
                os.close(got)
            self.result = got

    def wait(self) -> int | BaseException | None:
        self.thread.start()
        self.thread.join(WAIT_S)
        with self.lock:
            self.abandoned = self.result is None
            return self.result


def as_user(jobs: list[tuple[str, int, int, Callable[[], int]]]) -> list[int]:
    """Blocking: each of ``jobs`` ((what, uid, gid, work): ``work`` returns a descriptor) done in a
    thread with the credentials of ``uid``; the descriptors, in order.  Raises OSError naming
    ``what`` failed (the descriptors already made are closed)."""
    fds: list[int] = []
    dumpable = _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)
    try:
        for what, uid, gid, work in jobs:
            if uid == 0:
                raise OSError(0, f"{what}: root's is never made here")
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                raise OSError(0, f"{what}: its user (uid {uid}) is unknown on this node") from None
            got = _Work(uid, gid, os.getgrouplist(name, gid), work).wait()
            if got is None:
                raise OSError(0, f"{what}: not made within {WAIT_S:.0f} s")
            if isinstance(got, BaseException):
                why = got.strerror if isinstance(got, OSError) and got.strerror else str(got)
                raise OSError(getattr(got, "errno", 0) or 0, f"{what}: {why}")
            fds.append(got)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if dumpable > 0:  # the agent's core dumps and /proc files are as they were
            _libc.prctl(_PR_SET_DUMPABLE, dumpable, 0, 0, 0)
    return fds
