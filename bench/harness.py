"""What the benchmarks share: their errors and waits, the CLI and a local cluster's start and stop
(``revenant up`` / ``down``), process readings (CPU time, memory, py-spy's stacks), scrapes of
/metrics, quantiles and plain-text tables, the machine they ran on and the code they ran.

bench/ is not a package: a benchmark run as ``python bench/NAME.py`` finds this module beside it.
A benchmark is a script of scenarios; what one of them needs in more than one place, or what two
of them need, lives here (or, for one family, in its own module: failover_cluster.py, the
heartbeat_*.py, checkpoint_parts.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REVENANT = str(BIN / "revenant")


class BenchError(Exception):
    pass


async def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise BenchError(f"{what} did not happen within {timeout_s:g} s")


def rv(*args: str, timeout: float = 60.0, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([REVENANT, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise BenchError(f"revenant {' '.join(args)} failed ({proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc

# The benchmarks' jobs run as their submitter, root here: their agents must allow it.
ROOT_JOBS = {"REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}


def cluster_up(directory: Path, nodes: int, *extra: str, env: dict[str, str] | None = None,
               timeout: float = 120.0) -> dict:
    """A local cluster of ``nodes`` agents in ``directory``, started as users start one (``revenant
    up``) with ``env`` (the benchmark's own environment if None), whose agents allow root jobs; its
    first node's criu (path, version), and BenchError if that agent cannot use criu."""
    rv("up", "--nodes", str(nodes), "--dir", str(directory), "--detach", *extra, timeout=timeout,
       env={**(os.environ if env is None else env), **ROOT_JOBS})
    listed = json.loads(rv("nodes", "--dir", str(directory), "--json").stdout)
    criu = listed[0]["capabilities"]["criu"] if listed else {}
    if not criu.get("ok"):
        raise BenchError(f"the agent cannot use criu: {criu}")
    return {"path": criu.get("path"), "version": criu.get("version")}


def cluster_down(directory: Path, *extra: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Stop the cluster in ``directory`` (whatever is left of it: a failed stop is a warning on stderr)."""
    done = rv("down", "--dir", str(directory), *extra, timeout=timeout, check=False)
    if done.returncode != 0:
        print(f"warning: revenant down: {(done.stderr or done.stdout).strip()}", file=sys.stderr)
    return done


def cpu_s(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return math.nan


def rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_get(url: str, timeout_s: float = 30.0) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - t0


def metric(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def top_functions(path: Path, limit: int = 20) -> dict:
    """Where the coordinator's CPU went, from py-spy's collapsed stacks (GIL-holding samples only).

    ``inclusive``: share of busy samples with the function anywhere on the stack
    (frames common to nearly every sample, like the event loop's run, are left
    out); ``self``: share with the function on top.
    """
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r" \(.*?([^/]+\.py):\d+\)$", r" (\1)", f) for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    if not total:
        return {"samples": 0, "inclusive": [], "self": []}
    share = lambda n: round(100 * n / total, 1)  # noqa: E731
    return {
        "samples": total,
        "inclusive": [{"function": f, "percent": share(n)}
                      for f, n in sorted(inclusive.items(), key=lambda kv: -kv[1]) if n < 0.97 * total][:limit],
        "self": [{"function": f, "percent": share(n)} for f, n in sorted(own.items(), key=lambda kv: -kv[1])][:limit],
    }


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between the two nearest ranks."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


PACKAGES = ("agent", "common", "coordinator", "messages", "client", "cli")


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True).stdout.strip()


def code_fingerprint(root: Path) -> str:
    """A hash of the Python sources the coordinator runs (the tree may change between sizes)."""
    h = hashlib.sha256()
    base = root / "revenant" if (root / "revenant").is_dir() else root
    for pkg in PACKAGES:
        for f in sorted((base / pkg).rglob("*.py")) if (base / pkg).is_dir() else []:
            h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def export_ref(ref: str, dest: Path) -> Path:
    """``ref``'s packages laid out as the ``revenant`` package under ``dest`` (for PYTHONPATH)."""
    pkg = dest / "revenant"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    present = set(git("ls-tree", "--name-only", ref).split())
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, *(p for p in PACKAGES if p in present)],
                             check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive.stdout, check=True)
    return dest


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    debian = Path("/etc/debian_version")
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": psutil.virtual_memory().total,
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1), "kernel": platform.release(),
            "python": platform.python_version(), "debian": debian.read_text().strip() if debian.exists() else None}


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on, and its mount point."""
    best, fstype = "", "?"
    for part in psutil.disk_partitions(all=True):
        if str(path).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fstype = part.mountpoint, part.fstype
    return f"{fstype} ({best})"


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Rows as right-aligned plain-text columns, the header first."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def write_json(path: Path, doc: object) -> None:
    """A benchmark's results as indented JSON at ``path`` (its directory made), replaced at once: a
    benchmark that writes after every run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)
