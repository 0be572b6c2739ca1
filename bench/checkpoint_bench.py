"""One round of bench/checkpoint.py: the job, its checkpoint through revenant and through raw criu,
the restores, and what each cost (criu's own statistics, the image bytes, the machine's load).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from revenant.agent.pipeline import criustats
from revenant.agent.running.launcher import INIT_NAME, INIT_SCRIPT
from revenant.agent.storage.epochs import JobFiles, Manifest

# bench/ is not a package: these are this script's own directory's.
from checkpoint_parts import (BIN, CHUNK, NODE, PYTHON, WORKLOAD, die_with_parent, foreign_criu, fsync_path,
                              image_bytes, image_names, init_args, last_error, parse_criu_stats, sendfile_copy,
                              sha256_mmap, sweep)
from harness import BenchError, cluster_down, cluster_up


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
        return cluster_up(self.cluster, 1)

    def down(self) -> None:
        if self.cluster_up:
            cluster_down(self.cluster)
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
                                cwd=self.base, start_new_session=True, preexec_fn=die_with_parent)
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
                                 f"{last_error(images / 'dump.log', done.stdout)}")
            for name in image_names(images):
                fsync_path(images / name)
            fsync_path(images, directory=True)
            t2 = time.monotonic()
            if proc.poll() is not None:
                raise BenchError("the raw workload died during its dump")
        finally:
            self.stop_raw_workload(proc, init)
        stats = parse_criu_stats(done.stdout)
        run.update(wall_s=t2 - t0, criu_s=t1 - t0, fsync_s=t2 - t1, freeze_s=stats.get("frozen_time_s"),
                   bytes=image_bytes(images), criu_stats=stats, ready=ready,
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
                                     f"{last_error(directory / 'dump.log', done.stdout)}")
                return done, elapsed

            # First the agent's dump straight into the storage filesystem, then fsync: what the agent would do
            # if it skipped staging when its storage is a local disk.  Removed before the staged dump, so that
            # neither runs next to the other's images.
            direct = rundir / "direct"
            direct.mkdir()
            ddone, direct_s = agent_dump(direct)
            d1 = time.monotonic()
            for name in image_names(direct):
                fsync_path(direct / name)
            fsync_path(direct, directory=True)
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
        names = image_names(stage)
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
            files.commit(files.new_tmp(NODE),
                         Manifest(job="replica", epoch=0, generation=1, node=NODE, created_at=time.time(),
                                  criu_version="", kernel=platform.release()), staging=stage)

        # 2. the agent's copy alone (shutil.copyfileobj, 8 MiB), each file fsynced, then the directory.
        def copy_rw() -> None:
            for name in names:
                with open(stage / name, "rb") as fin, open(dst / name, "wb") as fout:
                    shutil.copyfileobj(fin, fout, CHUNK)
                    fout.flush()
                    os.fsync(fout.fileno())
            fsync_path(dst, directory=True)

        # 3. the same copy with sendfile (in the kernel, no user-space buffer), each file fsynced.
        def copy_sendfile() -> None:
            for name in names:
                sendfile_copy(stage / name, dst / name)
            fsync_path(dst, directory=True)

        # 4. SHA-256 alone, reading the staged images as the agent does.
        def sha_read() -> None:
            for name in names:
                h = hashlib.sha256()
                with open(stage / name, "rb", buffering=0) as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)

        # 5. an alternative commit: sendfile copy + fsync in one thread, SHA-256 over an mmap of the staged
        #    file in another (no user-space copies at all).
        def alt_commit() -> None:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                copying = pool.submit(copy_sendfile)
                for name in names:
                    sha256_mmap(stage / name)
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
                   bytes=image_bytes(stage), criu_log_bytes=log_bytes, copy_file_range_works=cfr_ok, ready=ready,
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
