"""The checkpoint engine against raw criu: wall time, freeze time and image size.

For each size M (MiB) it runs, side by side and alternating, the same job
(bench/workloads/hold_memory.py: M MiB of resident, page-distinct data, then
idle) in two ways and checkpoints it once per run:

raw       the job started the way the agent starts one (``unshare --pid --fork
          --kill-child setsid /bin/sh -c <revenant's init script> ...``), then
          ``criu dump -t <namespace init> -D <dir> --leave-running --display-stats``
          straight into a directory on the same filesystem as revenant's storage,
          then an fsync of every image file and of the directory.
          wall = criu's run + the fsyncs.
revenant  ``revenant submit`` to a one-node local cluster (``revenant up``, its
          storage on the real disk), then ``revenant checkpoint create`` timed end
          to end from the shell's point of view: CLI start-up, NATS, coordinator,
          agent, criu into node-local staging (tmpfs), copy to storage with
          SHA-256 and fsync, the manifest, the rename, the reply.
phases    (unless --no-phases) where revenant's time goes, measured outside
          revenant on the same job: a dump with the agent's exact criu flags
          straight into the storage filesystem (+ fsync; then removed), the same
          dump into tmpfs staging as the agent does, then revenant's own commit
          code (``revenant.agent.storage.epochs.JobFiles.commit``) timed on those
          images, the agent's read/write copy + fsync, a sendfile copy + fsync
          and a SHA-256 of the same images, each alone, and an alternative
          commit (sendfile copy || SHA-256 over an mmap).

Freeze time is criu's "Frozen time" (``--display-stats``; for revenant, the
epoch's ``freeze_s``).  Image size is the sum of the image files (``*.img`` and
``stats-dump``; criu's log is not counted), which is what revenant's epoch
records.  Goal: revenant's wall time over raw criu's at most 1.10 at 2 GiB, and
revenant's freeze no longer than raw criu's.

    .venv/bin/python bench/checkpoint.py                          # 64, 512, 2048 MiB, 3 runs each
    .venv/bin/python bench/checkpoint.py --sizes 64 --repeat 1    # a quick look

Every measured step starts after --settle seconds with no other criu running and
idle CPUs (waiting up to --quiet-wait): this VM returns freed memory to its host
(virtio-balloon free page reporting) after about 2 s, and the first touch of
such memory is slow, so steps that ran straight after a big free would look
faster than they are.  Medians are reported; every run (warm-ups included,
flagged) goes to bench/results/checkpoint.json.  This is a benchmark, not a
timed test: on a shared or noisy machine compare the ratios within one run,
never absolute times across runs.  Everything it starts is stopped and everything it writes is
removed, also on an error or Ctrl-C; if it is killed outright, run
``revenant down --dir DIR`` on the directory it printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from revenant.agent.pipeline import criustats
from revenant.agent.running.launcher import INIT_NAME, INIT_SCRIPT
from revenant.agent.storage.epochs import JobFiles, Manifest

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workloads" / "hold_memory.py"
BIN = Path(sys.executable).parent
PYTHON = sys.executable
NODE = "node-1"
MiB = 1 << 20
GiB = 1 << 30
WALL_GOAL = 1.10
GOAL_SIZE_MIB = 2048
_CHUNK = 8 * MiB

WALL_INCLUDES = {
    "raw": "criu dump (process start to exit, into a directory on the storage filesystem) "
           "+ fsync of every image file + fsync of the directory",
    "revenant": "`revenant checkpoint create` from exec to exit: CLI start-up, NATS request, coordinator, "
                "agent, criu dump straight into the epoch on the storage (or into staging and a copy, "
                "with staging_dir), CRC-32 of every image overlapped with its fsync, manifest, rename, "
                "directory fsync, reply",
}


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------- small helpers

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork must not dlopen


def _die_with_parent() -> None:
    """preexec_fn: the raw workload's unshare dies with the benchmark (as the agent's does with the agent)."""
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _image_names(d: Path) -> list[str]:
    """The files revenant keeps in an epoch: criu's images and stats-dump (not criu's log)."""
    names = sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix == ".img")
    return names + [n for n in ("stats-dump",) if (d / n).is_file()]


def _image_bytes(d: Path) -> int:
    return sum((d / n).stat().st_size for n in _image_names(d))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sendfile_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        offset, remaining = 0, os.fstat(fin.fileno()).st_size
        while remaining > 0:
            n = os.sendfile(fout.fileno(), fin.fileno(), offset, min(remaining, 1 << 30))
            if n == 0:
                break
            offset += n
            remaining -= n
        os.fsync(fout.fileno())


def _sha256_mmap(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            for off in range(0, len(m), _CHUNK):
                h.update(view[off:off + _CHUNK])
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
                             "update init_args() in bench/checkpoint.py")
        args[i - 1] = known[name]
    if None in args:
        raise BenchError("cannot tell what revenant's init script expects before the job's argv: "
                         "update init_args() in bench/checkpoint.py")
    return [a for a in args if a is not None]


# ---------------------------------------------------------------------- the benchmark

class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.criu = args.criu
        if args.dir:
            self.base = Path(args.dir).resolve()
            self.base.mkdir(parents=True, exist_ok=True)
            self.own_base = False
        else:
            self.base = Path(tempfile.mkdtemp(prefix="revenant-bench-checkpoint-", dir="/var/tmp"))
            self.own_base = True
        self.cluster = self.base / "cluster"
        self.storage = self.cluster / "storage"
        self.raw = self.base / "raw"
        self.shm = Path(tempfile.mkdtemp(prefix="revenant-bench-checkpoint-", dir=args.staging))
        self.revenant = str(BIN / "revenant")
        self.workloads: list[tuple[subprocess.Popen[bytes], int]] = []
        self.jobs: dict[str, int] = {}  # job id -> namespace init pid, while running
        self.cluster_up = False
        self.runs: list[dict] = []
        self.seq = 0
        self.waited_for_others_s = 0.0

    # ------------------------------------------------------------------ cluster

    def cli(self, *argv: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.revenant, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise BenchError(f"revenant {' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def up(self) -> dict:
        self.cluster_up = True  # from here on, `down` runs whatever happens
        self.cli("up", "--nodes", "1", "--dir", str(self.cluster), "--detach", timeout=120)
        nodes = json.loads(self.cli("nodes", "--dir", str(self.cluster), "--json").stdout)
        criu = nodes[0]["capabilities"]["criu"] if nodes else {}
        if not criu.get("ok"):
            raise BenchError(f"the agent cannot use criu: {criu}")
        return {"path": criu.get("path"), "version": criu.get("version")}

    def down(self) -> None:
        if self.cluster_up:
            done = self.cli("down", "--dir", str(self.cluster), timeout=120, check=False)
            if done.returncode != 0:
                print(f"warning: revenant down: {done.stderr.strip()}", file=sys.stderr)
            self.cluster_up = False

    # ------------------------------------------------------------------ workloads

    def _ready_timeout(self, mib: int) -> float:
        return 60.0 + mib / 20

    @staticmethod
    def _wait_ready(out: Path, timeout_s: float, alive) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                text = out.read_text(errors="replace")
            except FileNotFoundError:
                text = ""
            for line in text.splitlines():
                if line.startswith("ready "):
                    return line
            if not alive():
                raise BenchError(f"the workload died before it was ready; its output: {text[-500:]!r}")
            time.sleep(0.1)
        raise BenchError(f"the workload was not ready within {timeout_s:g} s ({out})")

    def start_raw_workload(self, mib: int, out: Path) -> tuple[subprocess.Popen[bytes], int, str]:
        """The job exactly as the agent starts it (agent/running/jobs.py: same wrapper, same init script), without the agent."""
        out.touch()
        stamp = out.with_name("alive")
        stamp.touch()
        argv = ["unshare", "--pid", "--fork", "--kill-child", "setsid", "/bin/sh", "-c", INIT_SCRIPT, INIT_NAME,
                *init_args(out, stamp), PYTHON, str(WORKLOAD), str(mib)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=self.base, start_new_session=True, preexec_fn=_die_with_parent)
        init = 0
        deadline = time.monotonic() + 10
        while not init and time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children()
            except psutil.Error:
                children = []
            if children:
                init = children[0].pid
            elif proc.poll() is not None:
                raise BenchError(f"unshare exited with {proc.returncode} at start")
            else:
                time.sleep(0.01)
        if not init:
            proc.kill()
            proc.wait()
            raise BenchError("the workload's PID namespace did not start")
        self.workloads.append((proc, init))
        ready = self._wait_ready(out, self._ready_timeout(mib), lambda: proc.poll() is None)
        return proc, init, ready

    def stop_raw_workload(self, proc: subprocess.Popen[bytes], init: int) -> None:
        for pid in (init, proc.pid):  # the namespace dies with its init; unshare with it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            print(f"warning: unshare {proc.pid} survived SIGKILL", file=sys.stderr)
        self.workloads = [(p, i) for p, i in self.workloads if p is not proc]

    def wait_for_quiet(self, run: dict) -> None:
        """Wait (up to --quiet-wait s) until no other criu runs and the CPUs are idle; note what was seen."""
        started = time.monotonic()
        deadline = started + self.args.quiet_wait
        time.sleep(self.args.settle)
        while True:
            others = foreign_criu()
            busy = psutil.cpu_percent(interval=0.5)  # our workload only sleeps: this is everyone else
            if (not others and busy <= self.args.quiet_cpu) or time.monotonic() > deadline:
                break
        self.waited_for_others_s += time.monotonic() - started
        run.update(foreign_criu=others, cpu_busy_before_pct=busy, waited_s=round(time.monotonic() - started, 2),
                   loadavg_before=[round(x, 2) for x in os.getloadavg()])

    def _record(self, run: dict) -> dict:
        self.runs.append(run)
        return run

    def _common(self, side: str, mib: int, warmup: bool) -> dict:
        self.seq += 1
        return {"side": side, "mib": mib, "warmup": warmup, "seq": self.seq,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    # ------------------------------------------------------------------ raw criu

    def run_raw(self, mib: int, warmup: bool) -> dict:
        run = self._common("raw", mib, warmup)
        rundir = self.raw / f"run-{self.seq}"
        images = rundir / "images"
        images.mkdir(parents=True)
        proc, init, ready = self.start_raw_workload(mib, rundir / "output.log")
        try:
            self.wait_for_quiet(run)
            argv = [self.criu, "dump", "-t", str(init), "-D", str(images), "--leave-running", "--display-stats",
                    "-o", "dump.log"]
            t0 = time.monotonic()
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=self.args.criu_timeout)
            t1 = time.monotonic()
            if done.returncode != 0:
                raise BenchError(f"criu dump failed ({done.returncode}): "
                                 f"{_last_error(images / 'dump.log', done.stdout)}")
            for name in _image_names(images):
                _fsync_path(images / name)
            _fsync_path(images, directory=True)
            t2 = time.monotonic()
            if proc.poll() is not None:
                raise BenchError("the raw workload died during its dump")
        finally:
            self.stop_raw_workload(proc, init)
        stats = parse_criu_stats(done.stdout)
        run.update(wall_s=t2 - t0, criu_s=t1 - t0, fsync_s=t2 - t1, freeze_s=stats.get("frozen_time_s"),
                   bytes=_image_bytes(images), criu_stats=stats, ready=ready,
                   loadavg_after=[round(x, 2) for x in os.getloadavg()])
        shutil.rmtree(rundir, ignore_errors=True)
        return self._record(run)

    # ------------------------------------------------------------------ revenant

    def _show(self, job: str) -> dict:
        return json.loads(self.cli("show", "job", job, "--dir", str(self.cluster), "--json").stdout)

    def run_revenant(self, mib: int, warmup: bool) -> dict:
        run = self._common("revenant", mib, warmup)
        job = self.cli("submit", "--dir", str(self.cluster), "--node", NODE, "--name", f"bench-{mib}-{self.seq}",
                       "--workdir", str(self.base), "--", PYTHON, str(WORKLOAD), str(mib)).stdout.strip()
        view = self._show(job)
        self.jobs[job] = view["pid"]
        try:
            ready = self._wait_ready(Path(view["output"]), self._ready_timeout(mib),
                                     lambda: self._show(job)["state"] == "running")
            self.wait_for_quiet(run)
            t0 = time.monotonic()
            done = subprocess.run([self.revenant, "checkpoint", "create", job, "--dir", str(self.cluster), "--json"],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=self.args.criu_timeout)
            t1 = time.monotonic()
            if done.returncode != 0:
                raise BenchError(f"revenant checkpoint create {job} failed: {done.stderr.strip()}")
            run["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            reply = json.loads(done.stdout)
            epoch = reply["epochs"][-1]
            # A client round trip that does no work: CLI start-up + NATS + coordinator.
            r0 = time.monotonic()
            view = self._show(job)
            r1 = time.monotonic()
            if view["state"] != "running":
                raise BenchError(f"job {job} is {view['state']} after its checkpoint, not running")
            epoch_dir = self.storage / "jobs" / job / "epochs" / str(epoch["n"])
            manifest = json.loads((epoch_dir / "manifest.json").read_text())
            # criu's stats-dump, from the reply (criu writes the file into the agent's scratch, not the epoch).
            stats = reply.get("stats") or criustats.read(epoch_dir / criustats.DUMP_FILE)
        finally:
            self.stop_job(job)
        # The manifest on storage is written before the commit finishes, so its dump_s is the agent's criu
        # run alone (engine.py sets dump_s again after the commit, for the reply): commit = the difference.
        staged = manifest.get("dump_s")
        if staged is not None and staged < epoch["duration_s"] - 1e-3:
            run.update(agent_criu_s=staged, agent_commit_s=epoch["duration_s"] - staged)
        run.update(job=job, wall_s=t1 - t0, duration_s=epoch["duration_s"], freeze_s=epoch["freeze_s"],
                   bytes=epoch["bytes"], manifest_dump_s=manifest.get("dump_s"),
                   engine_after_freeze_s=epoch["duration_s"] - epoch["freeze_s"],
                   control_plane_s=(t1 - t0) - epoch["duration_s"], cli_roundtrip_s=r1 - r0,
                   criu_stats=stats, ready=ready)
        return self._record(run)

    def stop_job(self, job: str) -> None:
        """Kill the job (its namespace init), wait until revenant sees it gone, purge it, remove its files."""
        init = self.jobs.pop(job, 0)
        if init:
            try:
                p = psutil.Process(init)
                if INIT_NAME in p.cmdline() and str(self.storage) in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass
        deadline = time.monotonic() + 20
        while self.cluster_up and time.monotonic() < deadline:
            try:
                if self._show(job)["state"] != "running":
                    break
            except BenchError:
                break
            time.sleep(0.1)
        if self.cluster_up:
            self.cli("job", "purge", job, "--dir", str(self.cluster), check=False)
        shutil.rmtree(self.storage / "jobs" / job, ignore_errors=True)

    # ------------------------------------------------------------------ phases

    def run_phases(self, mib: int, warmup: bool) -> dict:
        """revenant's pipeline, phase by phase, with the agent's exact criu flags and its own commit code."""
        run = self._common("phases", mib, warmup)
        rundir = self.raw / f"run-{self.seq}"
        rundir.mkdir(parents=True)
        stage = self.shm / f"run-{self.seq}"
        stage.mkdir()
        out = rundir / "output.log"
        proc, init, ready = self.start_raw_workload(mib, out)
        try:
            self.wait_for_quiet(run)
            # The agent's action script (engine.OutputRollback): one stat while the job is frozen.
            script = stage / "action.sh"
            sizes = stage / "output-sizes"
            script.write_text("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\n"
                              f"stat -c '%s' '{out}' >> '{sizes}' || echo 0 >> '{sizes}'\n")
            script.chmod(0o755)

            def agent_dump(directory: Path) -> tuple[subprocess.CompletedProcess[str], float]:
                argv = [self.criu, "dump", "-t", str(init), "-D", str(directory), "-o", "dump.log", "-v4",
                        "--display-stats", "--action-script", str(script), "--leave-running"]
                t = time.monotonic()
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=self.args.criu_timeout)
                elapsed = time.monotonic() - t
                if done.returncode != 0:
                    raise BenchError(f"criu dump into {directory} failed: "
                                     f"{_last_error(directory / 'dump.log', done.stdout)}")
                return done, elapsed

            # First the agent's dump straight into the storage filesystem, then fsync: what the agent would do
            # if it skipped staging when its storage is a local disk.  Removed before the staged dump, so that
            # neither runs next to the other's images.
            direct = rundir / "direct"
            direct.mkdir()
            ddone, direct_s = agent_dump(direct)
            d1 = time.monotonic()
            for name in _image_names(direct):
                _fsync_path(direct / name)
            _fsync_path(direct, directory=True)
            d2 = time.monotonic()
            shutil.rmtree(direct)
            dstats = parse_criu_stats(ddone.stdout)
            run.update(direct_dump_s=direct_s, direct_fsync_s=d2 - d1, direct_freeze_s=dstats.get("frozen_time_s"),
                       direct_criu_stats=dstats)
            # Then the agent's dump as it is: into tmpfs staging.
            time.sleep(self.args.settle)
            done, staged_s = agent_dump(stage)
        finally:
            self.stop_raw_workload(proc, init)
        stats = parse_criu_stats(done.stdout)
        log_bytes = (stage / "dump.log").stat().st_size
        names = _image_names(stage)
        big = max(names, key=lambda n: (stage / n).stat().st_size)
        with open(stage / big, "rb") as fin, open(rundir / "probe", "wb") as fout:
            try:
                os.copy_file_range(fin.fileno(), fout.fileno(), 4096)
                cfr_ok = True
            except OSError:  # EXDEV: tmpfs -> ext4; the agent then falls back to a read/write copy
                cfr_ok = False
        (rundir / "probe").unlink()

        def timed(fn) -> float:
            # Each phase starts alike: after --settle seconds, as the agent's commit starts after criu.
            time.sleep(self.args.settle)
            t = time.monotonic()
            fn()
            return time.monotonic() - t

        # 1. revenant's own commit code on these images: copy and hash in parallel, fsync, manifest, rename.
        def commit() -> None:
            files = JobFiles(rundir / "storage", "replica")
            files.commit(stage, files.new_tmp(NODE),
                         Manifest(job="replica", epoch=0, generation=1, node=NODE, created_at=time.time(),
                                  criu_version="", kernel=platform.release()))

        # 2. the agent's copy alone (shutil.copyfileobj, 8 MiB), each file fsynced, then the directory.
        def copy_rw() -> None:
            for name in names:
                with open(stage / name, "rb") as fin, open(dst / name, "wb") as fout:
                    shutil.copyfileobj(fin, fout, _CHUNK)
                    fout.flush()
                    os.fsync(fout.fileno())
            _fsync_path(dst, directory=True)

        # 3. the same copy with sendfile (in the kernel, no user-space buffer), each file fsynced.
        def copy_sendfile() -> None:
            for name in names:
                _sendfile_copy(stage / name, dst / name)
            _fsync_path(dst, directory=True)

        # 4. SHA-256 alone, reading the staged images as the agent does.
        def sha_read() -> None:
            for name in names:
                h = hashlib.sha256()
                with open(stage / name, "rb", buffering=0) as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)

        # 5. an alternative commit: sendfile copy + fsync in one thread, SHA-256 over an mmap of the staged
        #    file in another (no user-space copies at all).
        def alt_commit() -> None:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                copying = pool.submit(copy_sendfile)
                for name in names:
                    _sha256_mmap(stage / name)
                copying.result()

        dst = rundir / "copy"
        results = {}
        for key, fn in (("commit_s", commit), ("copy_fsync_s", copy_rw), ("sendfile_fsync_s", copy_sendfile),
                        ("sha256_s", sha_read), ("alt_commit_s", alt_commit)):
            dst.mkdir()
            results[key] = timed(fn)
            shutil.rmtree(dst)
            shutil.rmtree(rundir / "storage", ignore_errors=True)
        run.update(stage_dump_s=staged_s, freeze_s=stats.get("frozen_time_s"), criu_stats=stats,
                   bytes=_image_bytes(stage), criu_log_bytes=log_bytes, copy_file_range_works=cfr_ok, ready=ready,
                   loadavg_after=[round(x, 2) for x in os.getloadavg()], **results)
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(rundir, ignore_errors=True)
        return self._record(run)

    # ------------------------------------------------------------------ clean-up

    def cleanup(self, ok: bool) -> None:
        for proc, init in list(self.workloads):
            self.stop_raw_workload(proc, init)
        for job in list(self.jobs):
            try:
                self.stop_job(job)
            except Exception as exc:  # keep cleaning
                print(f"warning: could not stop job {job}: {exc}", file=sys.stderr)
        try:
            self.down()
        finally:
            self._sweep()
            shutil.rmtree(self.shm, ignore_errors=True)
            shutil.rmtree(self.raw, ignore_errors=True)
            shutil.rmtree(self.storage / "jobs", ignore_errors=True)
            if ok and not self.args.keep:
                shutil.rmtree(self.cluster, ignore_errors=True)
                if self.own_base:
                    shutil.rmtree(self.base, ignore_errors=True)
            elif self.cluster.exists():
                print(f"cluster logs kept in {self.cluster / 'logs'}", file=sys.stderr)

    def _sweep(self) -> None:
        sweep(self.base, WORKLOAD)


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


def _last_error(logfile: Path, output: str) -> str:
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

def summarize(runs: list[dict], sizes: list[int], quiet_cpu: float = 25.0) -> list[dict]:
    out = []
    for mib in sizes:
        def pick(side: str, key: str) -> list[float]:
            return [r[key] for r in runs if r["side"] == side and r["mib"] == mib and not r["warmup"]
                    and r.get(key) is not None]

        raw_wall, rev_wall = _median(pick("raw", "wall_s")), _median(pick("revenant", "wall_s"))
        raw_freeze, rev_freeze = _median(pick("raw", "freeze_s")), _median(pick("revenant", "freeze_s"))
        ratio = rev_wall / raw_wall if raw_wall and rev_wall else None
        # Paired ratios: run i of revenant against run i of raw (they ran next to each other).
        pairs = [a / b for a, b in zip(pick("revenant", "wall_s"), pick("raw", "wall_s")) if b]
        s = {
            "mib": mib,
            "runs": len(pick("raw", "wall_s")),
            "raw_wall_s": _r(raw_wall), "raw_criu_s": _r(_median(pick("raw", "criu_s"))),
            "raw_fsync_s": _r(_median(pick("raw", "fsync_s"))),
            "revenant_wall_s": _r(rev_wall), "revenant_duration_s": _r(_median(pick("revenant", "duration_s"))),
            "revenant_engine_after_freeze_s": _r(_median(pick("revenant", "engine_after_freeze_s"))),
            "revenant_agent_criu_s": _r(_median(pick("revenant", "agent_criu_s"))),
            "revenant_agent_commit_s": _r(_median(pick("revenant", "agent_commit_s"))),
            "revenant_control_plane_s": _r(_median(pick("revenant", "control_plane_s"))),
            "cli_roundtrip_s": _r(_median(pick("revenant", "cli_roundtrip_s"))),
            "wall_ratio": _r(ratio, 3), "paired_wall_ratio_median": _r(_median(pairs), 3),
            "raw_freeze_s": _r(raw_freeze), "revenant_freeze_s": _r(rev_freeze),
            "raw_image_bytes": int(_median(pick("raw", "bytes")) or 0),
            "revenant_image_bytes": int(_median(pick("revenant", "bytes")) or 0),
            "wall_goal_met": None if ratio is None else ratio <= WALL_GOAL,
            "wall_goal_applies": mib == GOAL_SIZE_MIB,
            "freeze_goal_met": None if rev_freeze is None or raw_freeze is None else rev_freeze <= raw_freeze,
            # Measured runs that started while another criu ran or the CPUs were busy (--quiet-wait ran out).
            "noisy_runs": sum(1 for r in runs if r["mib"] == mib and not r["warmup"]
                              and (r.get("foreign_criu") or r.get("cpu_busy_before_pct", 0) > quiet_cpu)),
        }
        if pick("phases", "stage_dump_s"):
            s["phases"] = {k: _r(_median(pick("phases", k))) for k in
                           ("stage_dump_s", "freeze_s", "direct_dump_s", "direct_fsync_s", "direct_freeze_s",
                            "commit_s", "copy_fsync_s", "sendfile_fsync_s", "sha256_s", "alt_commit_s")}
            s["phases"]["criu_log_bytes"] = int(_median(pick("phases", "criu_log_bytes")) or 0)
        out.append(s)
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _yn(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def report(summary: list[dict], meta: dict) -> str:
    header = ["M MiB", "raw wall s", "rev wall s", "ratio", "raw freeze s", "rev freeze s", "raw img MiB",
              "rev img MiB", "wall <=1.10", "freeze <= raw"]
    rows = []
    for s in summary:
        rows.append([str(s["mib"]), _f(s["raw_wall_s"]), _f(s["revenant_wall_s"]), _f(s["wall_ratio"]),
                     _f(s["raw_freeze_s"], "{:.3f}"), _f(s["revenant_freeze_s"], "{:.3f}"),
                     _f(s["raw_image_bytes"] / MiB, "{:.1f}"), _f(s["revenant_image_bytes"] / MiB, "{:.1f}"),
                     _yn(s["wall_goal_met"]) + ("" if s["wall_goal_applies"] else " (n/a)"),
                     _yn(s["freeze_goal_met"])])
    lines = [_table(header, rows), ""]
    header2 = ["M MiB", "raw criu s", "raw fsync s", "rev engine s", "rev criu s", "rev commit s",
               "rev control s", "cli rtt s"]
    rows2 = [[str(s["mib"]), _f(s["raw_criu_s"]), _f(s["raw_fsync_s"]), _f(s["revenant_duration_s"]),
              _f(s["revenant_agent_criu_s"]), _f(s["revenant_agent_commit_s"]),
              _f(s["revenant_control_plane_s"]), _f(s["cli_roundtrip_s"])] for s in summary]
    lines += [_table(header2, rows2), ""]
    if any("phases" in s for s in summary):
        header3 = ["M MiB", "staged dump s", "staged freeze s", "direct dump+fsync s", "direct freeze s",
                   "commit s", "copy+fsync s", "sendfile+fsync s", "sha256 s", "alt commit s", "-v4 log MiB"]
        rows3 = [[str(s["mib"]), _f(p["stage_dump_s"]), _f(p["freeze_s"], "{:.3f}"),
                  _f(None if p["direct_dump_s"] is None else p["direct_dump_s"] + p["direct_fsync_s"]),
                  _f(p["direct_freeze_s"], "{:.3f}"), _f(p["commit_s"]),
                  _f(p["copy_fsync_s"]), _f(p["sendfile_fsync_s"]), _f(p["sha256_s"]), _f(p["alt_commit_s"]),
                  _f(p["criu_log_bytes"] / MiB, "{:.1f}")]
                 for s in summary if (p := s.get("phases"))]
        lines += [_table(header3, rows3), ""]
    noisy = sum(s["noisy_runs"] for s in summary)
    if noisy:
        lines += [f"WARNING: {noisy} measured run(s) started while another criu ran or the CPUs were busy", ""]
    lines += [
        f"medians of {meta['repeat']} run(s) per size and side (after {meta['warmup']} warm-up round(s) per size)",
        f"raw wall      = {WALL_INCLUDES['raw']}",
        f"revenant wall = {WALL_INCLUDES['revenant']}",
        "rev engine = the epoch's duration_s (agent: criu + commit); rev criu = the agent's criu run (dump_s as "
        "manifest.json records it); rev commit = engine - criu; control = rev wall - rev engine; "
        "cli rtt = one `revenant show job` (CLI start-up + NATS + coordinator, no work)",
        "phases (outside revenant): staged dump = criu with the agent's flags (-v4, action script) into tmpfs; "
        "direct = the same criu straight into the storage filesystem, + fsync; "
        "commit = revenant.agent.storage.epochs.JobFiles.commit on those images; copy+fsync (the agent's read/write copy), "
        "sendfile+fsync and sha256 each alone; alt commit = sendfile+fsync || sha256 over mmap",
        f"goals: revenant wall / raw wall <= {WALL_GOAL} at {GOAL_SIZE_MIB} MiB; revenant freeze <= raw freeze",
    ]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,512,2048", help="comma-separated MiB (default 64,512,2048)")
    p.add_argument("--repeat", type=int, default=3, help="measured runs per size and side (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per size first (default 1)")
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="skip the phase-by-phase replica of revenant's pipeline")
    p.add_argument("--prefault-gib", type=float, default=None,
                   help="touch this much fresh memory once before anything (default: 4 x the largest size, "
                        "at most what is available less 4 GiB; 0 to skip)")
    p.add_argument("--dir", help="directory on the disk for the cluster (its storage) and raw dumps "
                                 "(default: a new one under /var/tmp, removed at the end)")
    p.add_argument("--staging", default="/dev/shm", help="tmpfs for the phase replica's staging (default /dev/shm)")
    p.add_argument("--criu", default=str(BIN / "criu") if (BIN / "criu").exists() else shutil.which("criu"),
                   help="criu for the raw side (default: the venv's launcher)")
    p.add_argument("--criu-timeout", type=float, default=900.0, help="seconds for one dump (default 900)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each measurement, wait up to this long for other criu processes to finish "
                        "and the CPUs to go idle (default 120)")
    p.add_argument("--quiet-cpu", type=float, default=25.0,
                   help="'idle' for --quiet-wait: at most this %% of all CPUs busy over 0.5 s (default 25)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds to let the machine settle before each measured step (default 3; this VM hands "
                        "freed memory back to its host after about 2 s, so every step then starts alike)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    p.add_argument("--keep", action="store_true", help="keep the cluster directory (logs) at the end")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        p.error("--sizes: comma-separated whole MiB")
    if not args.sizes or min(args.sizes) < 1 or args.repeat < 1 or args.warmup < 0:
        p.error("--sizes must be positive, --repeat at least 1, --warmup not negative")
    if not args.criu:
        p.error("no criu found; pass --criu")
    return args


def preflight(args: argparse.Namespace, base: Path) -> dict:
    biggest = max(args.sizes) * MiB + 64 * MiB
    disk_free = shutil.disk_usage(base).free
    shm_free = shutil.disk_usage(args.staging).free
    avail = psutil.virtual_memory().available
    # Worst moment: one job, its staging copy in tmpfs and its committed copy in the page cache.
    if disk_free < 3 * biggest:
        raise BenchError(f"{base}: {disk_free / GiB:.1f} GiB free, need {3 * biggest / GiB:.1f}")
    if shm_free < 1.3 * biggest:
        raise BenchError(f"{args.staging}: {shm_free / GiB:.1f} GiB free, need {1.3 * biggest / GiB:.1f}")
    if avail < 3 * biggest:
        raise BenchError(f"{avail / GiB:.1f} GiB of memory available, need {3 * biggest / GiB:.1f}")
    if not WORKLOAD.is_file():
        raise BenchError(f"{WORKLOAD} is missing")
    return {"disk_free_gib": round(disk_free / GiB, 1), "shm_free_gib": round(shm_free / GiB, 1),
            "mem_available_gib": round(avail / GiB, 1)}


def _fs(path: Path) -> str:
    best, fstype = "", "?"
    for part in psutil.disk_partitions(all=True):
        if str(path).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fstype = part.mountpoint, part.fstype
    return f"{fstype} ({best})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    ok = False
    try:
        space = preflight(args, bench.base)
        crv = subprocess.run([args.criu, "--version"], capture_output=True, text=True).stdout
        criu_version = (re.search(r"Version:\s*(\S+)", crv) or re.search(r"(\S+)", crv or "?")).group(1)
        print(f"bench dir {bench.base} ({_fs(bench.base)}); staging {args.staging} ({_fs(Path(args.staging))}); "
              f"criu {criu_version}", flush=True)
        gib = args.prefault_gib
        if gib is None:
            gib = max(0.0, min(4 * max(args.sizes) / 1024, psutil.virtual_memory().available / GiB - 4))
        pre = prefault(gib)
        print(f"prefault: {pre}", flush=True)
        agent_criu = bench.up()
        print(f"cluster up in {bench.cluster} (agent's criu: {agent_criu})", flush=True)
        for mib in args.sizes:
            rounds = [True] * args.warmup + [False] * args.repeat
            for i, warmup in enumerate(rounds):
                sides = ["raw", "revenant"] if i % 2 == 0 else ["revenant", "raw"]
                if args.phases:
                    sides.append("phases")
                for side in sides:
                    run = {"raw": bench.run_raw, "revenant": bench.run_revenant, "phases": bench.run_phases}[side](
                        mib, warmup)
                    extra = (f"criu {run['criu_s']:.2f} + fsync {run['fsync_s']:.2f}" if side == "raw" else
                             f"engine {run['duration_s']:.2f} = criu {run.get('agent_criu_s', 0):.2f} + commit "
                             f"{run.get('agent_commit_s', 0):.2f}, control {run['control_plane_s']:.2f}"
                             if side == "revenant" else
                             f"staged {run['stage_dump_s']:.2f}, direct {run['direct_dump_s']:.2f}+"
                             f"{run['direct_fsync_s']:.2f} (freeze {run['direct_freeze_s'] or 0:.3f}), "
                             f"commit {run['commit_s']:.2f}, copy+fsync "
                             f"{run['copy_fsync_s']:.2f}, sendfile+fsync {run['sendfile_fsync_s']:.2f}, sha256 "
                             f"{run['sha256_s']:.2f}, alt commit {run['alt_commit_s']:.2f}")
                    wall = f"wall {run['wall_s']:6.2f} s  " if "wall_s" in run else ""
                    print(f"{mib:5d} MiB {'warm-up ' if warmup else ''}{side:<8} {wall}"
                          f"freeze {run['freeze_s'] or 0:6.3f} s  {run['bytes'] / MiB:7.1f} MiB  ({extra})"
                          + (f"  [other criu running: {run['foreign_criu']}]" if run.get("foreign_criu") else "")
                          + (f"  [CPUs {run['cpu_busy_before_pct']:.0f}% busy before]"
                             if run.get("cpu_busy_before_pct", 0) > args.quiet_cpu else ""),
                          flush=True)
        ok = True
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        ok = True  # nothing to debug: remove the cluster directory too
        return 130
    except (BenchError, subprocess.SubprocessError, OSError) as exc:
        print(f"bench/checkpoint.py: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup(ok)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    summary = summarize(bench.runs, args.sizes, args.quiet_cpu)
    meta = {
        "repeat": args.repeat, "warmup": args.warmup, "sizes_mib": args.sizes, "phases": args.phases,
        "wall_includes": WALL_INCLUDES, "goal": {"wall_ratio_max": WALL_GOAL, "at_mib": GOAL_SIZE_MIB,
                                                 "freeze": "revenant freeze_s <= raw criu frozen time"},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
                    "debian": Path("/etc/debian_version").read_text().strip()
                    if Path("/etc/debian_version").exists() else None,
                    "python": platform.python_version()},
        "criu": {"raw": args.criu, "version": criu_version, "agent": agent_criu},
        "storage": {"dir": str(bench.base), "fs": _fs(bench.base), "revenant_staging": f"/dev/shm/revenant-{NODE}",
                    "replica_staging": args.staging},
        "space_before": space, "prefault": pre,
        "waited_before_steps_s": round(bench.waited_for_others_s, 1),
        "workload": str(WORKLOAD.relative_to(REPO)),
        "command": "bench/checkpoint.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print()
    print(report(summary, meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": bench.runs}, indent=2) + "\n")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
