"""One configuration of bench/storage.py: the job, its epochs, what each adds to the job's storage
(counted on disk) and the restores of the newest and the oldest kept epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from revenant.agent.running.launcher import INIT_NAME

# bench/ is not a package: these are this script's own directory's.
from checkpoint_parts import foreign_criu, sweep
from harness import BenchError, cluster_down, cluster_up

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "tests" / "jobs" / "memdirty.py"
BIN = Path(sys.executable).parent
PYTHON = sys.executable
NODE = "node-1"
MiB = 1 << 20
GiB = 1 << 30
CHECK_EVERY = 10**9  # memdirty checks its pages at step 0 only (a full check of 1 GiB is ~3 s of CPU)
STEADY_FROM = 3  # epochs 1 and 2 store every page once either way; from 3 on, only the fraction
TARGETS = {
    "bytes_1pct": 0.02,  # bytes added by a 1 % epoch / a full image (issue 31; 0.05 before)
    "restore_newest": 1.05,  # incremental on / off (issue 31; 1.10 before)
    "checkpoint_wall": 1.15,
    "freeze": 1.05,
    "storage_1pct": 1.10,  # the kept epochs on disk / a full image, 1 % dirty (incremental on)
    "oldest_vs_newest": 2.0,  # oldest kept epoch's restore / the newest's (incremental on)
    "convert_s_per_gib": 2.0,  # one conversion's seconds per GiB of image
}
_STEP_RE = re.compile(r"^step (\d+) ok$")


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rounded(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def disk_usage(job_dir: Path) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of ``job_dir``'s epochs/ and packs/, as ``du`` counts
    them: files and directories, every inode once (hard links are counted once)."""
    seen: set[tuple[int, int]] = set()
    blocks = apparent = 0

    def add(path: str) -> None:
        nonlocal blocks, apparent
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # a temporary file that went meanwhile
            return
        if (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        blocks += st.st_blocks * 512
        apparent += st.st_size

    for sub in ("epochs", "packs"):
        top = job_dir / sub
        if not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            add(dirpath)
            for name in filenames:
                add(os.path.join(dirpath, name))
    return blocks, apparent


def read_steps(path: Path) -> list[int]:
    """The step numbers of the job's output, in order (a partial last line is ignored)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # only complete lines
    steps = []
    for line in lines:
        m = _STEP_RE.match(line)
        if m:
            steps.append(int(m.group(1)))
        elif line.startswith("BAD"):
            raise BenchError(f"the job found a bad page: {line}")
    return steps


# ---------------------------------------------------------------------- the event stream


class EventTail:
    """``revenant events --follow --json`` in the background: epoch events as they come."""

    def __init__(self, revenant: str, cluster: Path) -> None:
        self.proc = subprocess.Popen([revenant, "events", "--follow", "--json", "--dir", str(cluster)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, name="events", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if ".epoch." not in obj.get("subject", ""):
                continue
            obj["received"] = time.monotonic()
            with self.cond:
                self.events.append(obj)
                self.cond.notify_all()

    def wait(self, job: str, kind: str, n: int, timeout_s: float) -> dict:
        def found() -> dict | None:
            return next((e for e in self.events if e.get("job") == job and e.get("kind") == kind
                         and e.get("n") == n), None)

        deadline = time.monotonic() + timeout_s
        with self.cond:
            while (event := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    why = "the event stream ended" if self.proc.poll() is not None else f"none within {timeout_s:g} s"
                    raise BenchError(f"no {kind!r} event for epoch {n} of job {job}: {why}")
                self.cond.wait(min(left, 1.0))
        return event

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reader.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# ---------------------------------------------------------------------- the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.dir:
            self.base = Path(args.dir).resolve()
            self.base.mkdir(parents=True, exist_ok=True)
            self.own_base = False
        else:
            self.base = Path(tempfile.mkdtemp(prefix="revenant-bench-storage-", dir="/var/tmp"))
            self.own_base = True
        self.cluster = self.base / "cluster"
        self.storage = self.cluster / "storage"
        self.revenant = str(BIN / "revenant")
        self.jobs: dict[str, int] = {}  # job id -> namespace init pid, while it may run
        self.cluster_up = False
        self.events: EventTail | None = None
        self.epochs: list[dict] = []
        self.configs: list[dict] = []
        self.waited_for_others_s = 0.0

    # ------------------------------------------------------------------ cluster

    def cli(self, *argv: str, timeout: float = 600.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        at = argv.index("--") if "--" in argv else len(argv)  # options go before the job's command
        argv = (*argv[:at], "--dir", str(self.cluster), *argv[at:])
        done = subprocess.run([self.revenant, *argv], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise BenchError(f"revenant {' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def timed_cli(self, *argv: str) -> tuple[dict, float]:
        """A ``--json`` command timed from exec to exit: (its job view, seconds)."""
        t0 = time.monotonic()
        done = self.cli(*argv, "--json")
        return json.loads(done.stdout), time.monotonic() - t0

    def up(self) -> dict:
        self.cluster_up = True  # from here on, `down` runs whatever happens
        criu = cluster_up(self.cluster, 1)
        self.events = EventTail(self.revenant, self.cluster)
        return criu

    def down(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.cluster_up:
            cluster_down(self.cluster)
            self.cluster_up = False

    def show(self, job: str) -> dict:
        return json.loads(self.cli("show", "job", job, "--json").stdout)

    # ------------------------------------------------------------------ waiting

    def wait_for_quiet(self) -> dict:
        """After --settle s, wait (up to --quiet-wait s) until no other criu runs and the CPUs are idle."""
        started = time.monotonic()
        deadline = started + self.args.quiet_wait
        time.sleep(self.args.settle)  # this VM hands freed memory back after ~2 s: every step starts alike
        while True:
            others = foreign_criu()
            busy = psutil.cpu_percent(interval=0.5)
            if (not others and busy <= self.args.quiet_cpu) or time.monotonic() > deadline:
                break
        waited = time.monotonic() - started
        self.waited_for_others_s += waited - self.args.settle
        return {"foreign_criu": others, "cpu_busy_before_pct": busy, "waited_s": round(waited, 2)}

    def alive(self, job: str) -> bool:
        try:
            return psutil.Process(self.jobs[job]).status() != psutil.STATUS_ZOMBIE
        except (KeyError, psutil.Error):
            return False

    def wait_step(self, output: Path, after: int, job: str) -> int:
        """Wait until the job's output has a step after ``after``; the newest step."""
        deadline = time.monotonic() + self.args.interval * 3 + self.args.size_mib / 20 + 60
        while time.monotonic() < deadline:
            steps = read_steps(output)
            if steps and steps[-1] > after:
                return steps[-1]
            if not self.alive(job):
                raise BenchError(f"job {job} is gone; its output ends {output.read_text(errors='replace')[-300:]!r}")
            time.sleep(0.05)
        raise BenchError(f"job {job} took no step after step {after} in time ({output})")

    def wait_lines(self, output: Path, count: int, job: str) -> list[int]:
        """Wait until the job's output has more than ``count`` steps; its steps."""
        deadline = time.monotonic() + self.args.interval * 3 + 60
        while time.monotonic() < deadline:
            steps = read_steps(output)
            if len(steps) > count:
                return steps
            time.sleep(0.05)
        raise BenchError(f"job {job} wrote no step after its restore ({output})")

    def wait_conversions(self, job: str, view: dict) -> dict[int, dict]:
        """With incremental on: the ``converted`` event of every kept epoch but the newest that
        the view lists as still plain (the agent converts them after its reply)."""
        if not view["policy"].get("incremental"):
            return {}
        assert self.events is not None
        plain = [e["n"] for e in view["epochs"][:-1] if not e.get("incremental")]
        return {n: self.events.wait(job, "converted", n, self.args.convert_timeout) for n in plain}

    # ------------------------------------------------------------------ one configuration

    def submit(self, fraction: float, incremental: bool) -> tuple[str, Path]:
        name = f"storage-{fraction:g}-{'on' if incremental else 'off'}"
        job = self.cli("submit", "--node", NODE, "--name", name, "--max-epochs", str(self.args.epochs),
                       *(["--incremental", "--pack-compression", self.args.pack_compression] if incremental
                         else ["--no-incremental"]), "--workdir", str(self.base), "--",
                       PYTHON, str(WORKLOAD), str(self.args.size_mib), repr(fraction), "0",
                       repr(self.args.interval), str(CHECK_EVERY)).stdout.strip()
        view = self.show(job)
        self.jobs[job] = view["pid"]
        return job, Path(view["output"])

    def run_config(self, fraction: float, incremental: bool) -> dict:
        side = "on" if incremental else "off"
        job, output = self.submit(fraction, incremental)
        job_dir = self.storage / "jobs" / job
        cfg: dict = {"fraction": fraction, "incremental": incremental, "job": job, "epochs": [],
                     "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            t0 = time.monotonic()
            prev_step = self.wait_step(output, 0, job)  # its memory filled and checked once: ready
            cfg["ready_s"] = round(time.monotonic() - t0, 2)
            dumped_at: dict[int, tuple[int, int]] = {}  # epoch -> (newest step before, after its dump)
            for k in range(1, self.args.epochs + 1):
                before, before_app = disk_usage(job_dir)
                quiet = self.wait_for_quiet()
                step = self.wait_step(output, prev_step, job)
                view, wall = self.timed_cli("checkpoint", "create", job)
                replied = time.monotonic()
                after_step = (read_steps(output) or [0])[-1]
                e = view["epochs"][-1]
                conv = self.wait_conversions(job, view)
                usage, usage_app = disk_usage(job_dir)
                dumped_at[e["n"]] = (step, after_step)
                row = {"fraction": fraction, "incremental": incremental, "job": job, "k": k, "epoch": e["n"],
                       "step": step, "steps_since_previous": step - prev_step, "step_during_dump": after_step != step,
                       "added_bytes": usage - before, "added_apparent_bytes": usage_app - before_app,
                       "storage_after": usage, "epoch_bytes": e["bytes"], "wall_s": wall, "freeze_s": e["freeze_s"],
                       "duration_s": e["duration_s"], "reported_storage_bytes": view.get("storage_bytes"),
                       "reported": [{"n": x["n"], "bytes": x["bytes"], "own_bytes": x.get("own_bytes"),
                                     "incremental": x.get("incremental")} for x in view["epochs"]],
                       "converted": [{"n": n, "bytes": ev.get("bytes"), "seconds": ev.get("duration_s"),
                                      "event_after_reply_s": rounded(ev["received"] - replied, 3)}
                                     for n, ev in conv.items()], **quiet}
                cfg["epochs"].append(row)
                self.epochs.append(row)
                prev_step = max(step, after_step)
                conv_s = sum(c["seconds"] or 0 for c in row["converted"])
                print(f"{fraction * 100:5g}% {side:<3} epoch {e['n']}: +{row['added_bytes'] / MiB:8.1f} MiB  "
                      f"wall {wall:5.2f} s  freeze {e['freeze_s']:.3f} s  engine {e['duration_s']:.2f} s  "
                      f"steps +{row['steps_since_previous']}"
                      + (f"  converted {[c['n'] for c in row['converted']]} in {conv_s:.2f} s" if conv else "")
                      + (f"  [other criu: {quiet['foreign_criu']}]" if quiet["foreign_criu"] else "")
                      + (f"  [CPUs {quiet['cpu_busy_before_pct']:.0f}% busy]"
                         if quiet["cpu_busy_before_pct"] > self.args.quiet_cpu else ""), flush=True)
            cfg["restore"] = self.restores(job, output, dumped_at, side, fraction)
            final = self.show(job)
            cfg["final"] = {"storage_bytes": final.get("storage_bytes"), "storage_du": disk_usage(job_dir)[0],
                            "epochs": [{"n": x["n"], "bytes": x["bytes"], "own_bytes": x.get("own_bytes"),
                                        "incremental": x.get("incremental")} for x in final["epochs"]],
                            "policy": final["policy"]}
        finally:
            self.stop_job(job)
        self.configs.append(cfg)
        return cfg

    def vacate(self, job: str, output: Path, dumped_at: dict[int, tuple[int, int]]) -> dict:
        # A step first, so that no two kept epochs hold the same step: a restore is then checked
        # to have come from exactly the epoch it was asked for.
        self.wait_step(output, max(high for _, high in dumped_at.values()), job)
        steps = read_steps(output)
        view, wall = self.timed_cli("checkpoint", "vacate", job)
        self.jobs.pop(job, None)
        n = view["epochs"][-1]["n"]
        last = (read_steps(output) or [0])[-1]
        dumped_at[n] = ((steps or [0])[-1], last)
        conv = self.wait_conversions(job, view)
        return {"epoch": n, "wall_s": wall, "kept": [e["n"] for e in view["epochs"]],
                "converted": {str(k): v.get("duration_s") for k, v in conv.items()}}

    def restore_one(self, job: str, output: Path, epoch: int | None, dumped_at: dict[int, tuple[int, int]]) -> dict:
        quiet = self.wait_for_quiet()
        t0 = time.monotonic()
        argv = ["checkpoint", "restart", job] + (["--epoch", str(epoch)] if epoch is not None else [])
        view, cli_s = self.timed_cli(*argv)
        polled = 0
        while view["state"] != "running":
            if view["state"] not in ("restoring", "vacated", "pending"):
                raise BenchError(f"job {job} is {view['state']} after its restart, not running")
            polled += 1
            view = self.show(job)
        seconds = time.monotonic() - t0
        self.jobs[job] = view["pid"]
        # The restored epoch (the newest unless asked for one) had dumped the job after step low
        # (or high, if a step ended during the dump): the restore cut the output back to that
        # step, and the job must go on with the next one.
        n = epoch if epoch is not None else max(dumped_at)
        low, high = dumped_at[n]
        cut = len(read_steps(output))
        steps = self.wait_lines(output, cut, job)
        verified = low <= cut <= high and steps == list(range(1, cut + 2))
        if not verified:
            raise BenchError(f"job {job} restored from epoch {n}: output cut back to step {cut} (expected "
                             f"{low}{'' if low == high else f'..{high}'}), then steps {steps[cut:cut + 3]} "
                             f"({output})")
        return {"epoch": n, "seconds": seconds, "cli_s": cli_s, "polled": polled, "cut_to_step": cut,
                "verified": verified, **quiet}

    def restores(self, job: str, output: Path, dumped_at: dict[int, tuple[int, int]], side: str,
                 fraction: float) -> dict:
        """--restores rounds of vacate + restart (the newest epoch), then vacate + restart --epoch
        <the oldest kept>."""
        out: dict = {"newest": []}
        for _ in range(self.args.restores):
            vacated = self.vacate(job, output, dumped_at)
            out["newest"].append({**self.restore_one(job, output, None, dumped_at), "vacate": vacated})
        vacated = self.vacate(job, output, dumped_at)
        oldest = vacated["kept"][0]
        out["oldest"] = {**self.restore_one(job, output, oldest, dumped_at), "vacate": vacated}
        newest = [r["seconds"] for r in out["newest"]]
        print(f"{fraction * 100:5g}% {side:<3} restore newest {' '.join(f'{x:.2f}' for x in newest)} s "
              f"(epochs {[r['epoch'] for r in out['newest']]}), oldest kept (epoch {oldest}) "
              f"{out['oldest']['seconds']:.2f} s", flush=True)
        return out

    def stop_job(self, job: str) -> None:
        """Kill the job (its namespace init), wait until revenant sees it gone, purge it, remove its files."""
        init = self.jobs.pop(job, 0)
        if init:
            try:
                p = psutil.Process(init)
                # The namespace's init, started or restored (its argv then names the workdir, not the storage).
                if INIT_NAME in p.cmdline() and str(self.base) in " ".join(p.cmdline()):
                    p.kill()  # the init of a PID namespace: everything in it dies with it
            except psutil.Error:
                pass
        deadline = time.monotonic() + 30
        while self.cluster_up and time.monotonic() < deadline:
            try:
                if self.show(job)["state"] not in ("running", "checkpointing", "restoring"):
                    break
            except BenchError:
                break
            time.sleep(0.1)
        if self.cluster_up:
            done = self.cli("job", "purge", job, check=False)
            if done.returncode != 0:
                print(f"warning: revenant job purge {job}: {done.stderr.strip()}", file=sys.stderr)
        shutil.rmtree(self.storage / "jobs" / job, ignore_errors=True)

    # ------------------------------------------------------------------ clean-up

    def cleanup(self, ok: bool) -> None:
        for job in list(self.jobs):
            try:
                self.stop_job(job)
            except Exception as exc:  # keep cleaning
                print(f"warning: could not stop job {job}: {exc}", file=sys.stderr)
        try:
            self.down()
        finally:
            self._sweep()
            shutil.rmtree(self.storage / "jobs", ignore_errors=True)
            if ok and not self.args.keep:
                shutil.rmtree(self.cluster, ignore_errors=True)
                if self.own_base:
                    shutil.rmtree(self.base, ignore_errors=True)
            elif self.cluster.exists():
                print(f"cluster logs kept in {self.cluster / 'logs'}", file=sys.stderr)

    def _sweep(self) -> None:
        sweep(self.base, WORKLOAD)


# ---------------------------------------------------------------------- summary and report
