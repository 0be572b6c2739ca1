"""What bench/checkpoint.py's rounds share: its constants, the copies and checksums of a raw
criu's images (the baseline), criu's statistics, the sweep of what a killed run left, and the
prefault of the machine's memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

from revenant.agent.running.launcher import INIT_NAME, INIT_SCRIPT

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workloads" / "hold_memory.py"
BIN = Path(sys.executable).parent
PYTHON = sys.executable
NODE = "node-1"
MiB = 1 << 20
GiB = 1 << 30
WALL_GOAL = 1.10
GOAL_SIZE_MIB = 2048
CHUNK = 8 * MiB

WALL_INCLUDES = {
    "raw": "criu dump (process start to exit, into a directory on the storage filesystem) "
           "+ fsync of every image file + fsync of the directory",
    "revenant": "`revenant checkpoint create` from exec to exit: CLI start-up, NATS request, coordinator, "
                "agent, criu dump straight into the epoch on the storage (or into staging and a copy, "
                "with staging_dir), CRC-32 of every image overlapped with its fsync, manifest, rename, "
                "directory fsync, reply",
}


# ---------------------------------------------------------------------- small helpers

LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork must not dlopen


def die_with_parent() -> None:
    """preexec_fn: the raw workload's unshare dies with the benchmark (as the agent's does with the agent)."""
    LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rounded(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def image_names(d: Path) -> list[str]:
    """The files revenant keeps in an epoch: criu's images and stats-dump (not criu's log)."""
    names = sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix == ".img")
    return names + [n for n in ("stats-dump",) if (d / n).is_file()]


def image_bytes(d: Path) -> int:
    return sum((d / n).stat().st_size for n in image_names(d))


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sendfile_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        offset, remaining = 0, os.fstat(fin.fileno()).st_size
        while remaining > 0:
            n = os.sendfile(fout.fileno(), fin.fileno(), offset, min(remaining, 1 << 30))
            if n == 0:
                break
            offset += n
            remaining -= n
        os.fsync(fout.fileno())


def sha256_mmap(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            for off in range(0, len(m), CHUNK):
                h.update(view[off:off + CHUNK])
            view.release()
    return h.hexdigest()


_STAT_RE = re.compile(r"^([A-Za-z][A-Za-z ]+):\s*(\d+)(?:\s*(us))?", re.M)


def parse_criu_stats(output: str) -> dict[str, float]:
    """``--display-stats`` lines as {name: value}; times in seconds."""
    stats: dict[str, float] = {}
    if "Displaying dump stats" not in output:
        return stats
    for name, value, unit in _STAT_RE.findall(output.split("Displaying dump stats", 1)[1]):
        key = name.strip().lower().replace(" ", "_")
        stats[key + ("_s" if unit else "")] = int(value) / 1e6 if unit else int(value)
    return stats


def foreign_criu() -> list[int]:
    """criu processes on this machine that are not ours (other users' dumps skew a benchmark)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
        except psutil.Error:
            continue
        if any(os.path.basename(a) == "criu" for a in cmd[:4]) and any(a in ("dump", "restore", "pre-dump")
                                                                        for a in cmd[:8]):
            pids.append(p.pid)
    return pids


def init_args(out: Path, stamp: Path) -> list[str]:
    """The arguments revenant's init script takes before the job's argv, by the names it gives them.

    ``out`` is the output file; ``stamp`` and ``fence_ms`` are the dead man's
    switch (if the agent stops touching the stamp for fence_ms, the init freezes the job).
    With no agent on the raw side, the fence is set beyond any run.
    """
    first = INIT_SCRIPT.split("\n", 1)[0]
    names = {name: int(i) for name, i in re.findall(r"(\w+)=\$(\d+)", first)}
    shift = re.search(r"\bshift(?:\s+(\d+))?", first)
    count = (int(shift.group(1) or 1)) if shift else 0
    known = {"out": str(out), "stamp": str(stamp), "fence_ms": str(10**9), "max_frozen_ms": str(10**9)}
    args: list[str | None] = [None] * count
    for name, i in names.items():
        if name not in known or not 1 <= i <= count:
            raise BenchError(f"revenant's init script takes ${i} as {name!r}, unknown to this benchmark: "
                             "update init_args() in bench/checkpoint_parts.py")
        args[i - 1] = known[name]
    if None in args:
        raise BenchError("cannot tell what revenant's init script expects before the job's argv: "
                         "update init_args() in bench/checkpoint_parts.py")
    return [a for a in args if a is not None]


# ---------------------------------------------------------------------- the benchmark


def sweep(base: Path, workload: Path) -> None:
    """Kill anything of a bench's still alive: ``workload`` by path, in ``base``, or an init naming ``base``."""
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            mine = (str(workload) in cmd and p.info["cwd"] == str(base)) or (INIT_NAME in cmd and str(base) in cmd)
            if mine and p.pid != os.getpid():
                print(f"warning: killing leftover {p.pid}: {cmd[:120]}", file=sys.stderr)
                p.kill()
        except psutil.Error:
            continue


def last_error(logfile: Path, output: str) -> str:
    try:
        text = logfile.read_text(errors="replace")
    except OSError:
        text = ""
    lines = [ln for ln in (text + "\n" + output).splitlines() if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return (lines[-1] if lines else (output.strip().splitlines() or ["no output"])[-1])[:300]


def prefault(gib: float) -> dict:
    """Touch (and free) gib GiB of fresh memory once, so that no measured run pays the VM's first touch."""
    if gib <= 0:
        return {"gib": 0}
    code = ("import mmap,sys,time\n"
            "n=int(float(sys.argv[1])*(1<<30))//(64<<20)*(64<<20)\n"
            "m=mmap.mmap(-1,n); c=b'\\x5a'*(64<<20); t=time.monotonic()\n"
            "for o in range(0,n,64<<20): m[o:o+(64<<20)]=c\n"
            "print(time.monotonic()-t)\n")
    done = subprocess.run([PYTHON, "-c", code, str(gib)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"gib": gib, "error": done.stderr.strip()[-300:]}
    secs = float(done.stdout.strip())
    return {"gib": gib, "seconds": round(secs, 3), "gib_per_s": round(gib / secs, 2) if secs else None}


# ---------------------------------------------------------------------- summary and report
