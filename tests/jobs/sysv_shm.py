"""A job that holds System V IPC objects: a shared-memory segment and a semaphore set, made with
shmget/shmat and semget/semop from libc (ctypes), under the key it is given.

The segment holds a step counter (its first 8 bytes) and, after it, a deterministic pattern drawn
from the key.  Each step it takes the semaphore set's lock (semaphore 0, a binary semaphore, with
SEM_UNDO), checks the whole pattern, adds 1 to the counter in the segment and to semaphore 1 (a
second count the kernel keeps), and prints one flushed line::

    step N sem N pattern OK

A pattern that changed, or a semaphore out of step with the segment, prints ``step N BAD ...``
and exits 3.  After STEPS steps it removes both objects and prints ``done``.

    python sysv_shm.py KEY [STEPS [INTERVAL [SIZE_KIB]]]
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time

IPC_CREAT, IPC_EXCL, IPC_RMID = 0o1000, 0o2000, 0
GETVAL, SETVAL = 12, 16
SEM_UNDO = 0x1000
HEADER = 64  # the counter lives in the first 8 bytes; the pattern starts here


class SemBuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
libc.shmdt.argtypes = [ctypes.c_void_p]
libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
libc.semget.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
libc.semop.argtypes = [ctypes.c_int, ctypes.POINTER(SemBuf), ctypes.c_size_t]


def check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def pattern(key: int, size: int) -> bytes:
    """``size`` bytes that only this key gives."""
    out = bytearray()
    block = 0
    while len(out) < size:
        out += hashlib.sha256(f"{key}:{block}".encode()).digest()
        block += 1
    return bytes(out[:size])


def semop(semid: int, num: int, op: int, flags: int = 0) -> None:
    buf = SemBuf(num, op, flags)
    check(libc.semop(semid, ctypes.byref(buf), 1), "semop")


def main() -> int:
    key = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    size = (int(sys.argv[4]) if len(sys.argv) > 4 else 256) * 1024
    expected = pattern(key, size - HEADER)

    shmid = check(libc.shmget(key, size, IPC_CREAT | IPC_EXCL | 0o600), "shmget")
    addr = libc.shmat(shmid, None, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        check(-1, "shmat")
    semid = check(libc.semget(key, 2, IPC_CREAT | IPC_EXCL | 0o600), "semget")
    check(libc.semctl(semid, 0, SETVAL, ctypes.c_int(1)), "semctl SETVAL")  # the lock, free
    check(libc.semctl(semid, 1, SETVAL, ctypes.c_int(0)), "semctl SETVAL")  # the second count
    counter = ctypes.c_uint64.from_address(addr)
    counter.value = 0
    ctypes.memmove(addr + HEADER, expected, len(expected))
    print(f"holding shm key {key} id {shmid} size {size} and sem id {semid}", flush=True)

    for _ in range(steps):
        semop(semid, 0, -1, SEM_UNDO)
        intact = ctypes.string_at(addr + HEADER, len(expected)) == expected
        counter.value += 1
        semop(semid, 1, 1)
        n, sem = counter.value, check(libc.semctl(semid, 1, GETVAL), "semctl GETVAL")
        semop(semid, 0, 1, SEM_UNDO)
        if not intact or sem != n:
            print(f"step {n} BAD sem {sem} pattern {'OK' if intact else 'CHANGED'}", flush=True)
            return 3
        print(f"step {n} sem {sem} pattern OK", flush=True)
        time.sleep(interval)

    check(libc.shmdt(ctypes.c_void_p(addr)), "shmdt")
    check(libc.shmctl(shmid, IPC_RMID, None), "shmctl IPC_RMID")
    check(libc.semctl(semid, 0, IPC_RMID), "semctl IPC_RMID")
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
