"""Incremental epochs: bytes on disk, checkpoint wall and freeze time, restore time, on and off.

One job at a time (tests/jobs/memdirty.py: SIZE MiB of 4 KiB pages, each a known
function of the step that last wrote it; each step rewrites FRACTION of them, then
sleeps --interval seconds) runs on a one-node local cluster (``revenant up``: a
nats-server, a coordinator and an agent, its storage on the real disk), submitted
with ``--max-epochs EPOCHS`` and ``--incremental`` or ``--no-incremental``.  For
every fraction, both configurations run one after the other (the order alternates
from one fraction to the next), never two jobs at once.

Per configuration:

1. EPOCHS checkpoints (``revenant checkpoint create``), each after the job took at
   least one step since the previous one (a new "step N ok" line in its output, so
   the fraction really was dirtied) and after --settle seconds with no other criu
   running and idle CPUs.  With incremental on, after each checkpoint the epoch it
   superseded is converted to a delta in the background; the next checkpoint waits for
   that conversion's ``converted`` epoch event (``revenant events --follow``), so
   conversion work is never inside a measured checkpoint; its seconds (the event's
   duration_s) are reported on their own.
2. Per epoch: the bytes it added on disk (the job's <storage>/jobs/<job>/epochs and
   packs, every inode counted once, in allocated blocks, measured before the
   checkpoint and after the conversion it caused), the CLI's ``checkpoint create``
   wall time (exec to exit), the epoch's freeze (``freeze_s``: criu's frozen time)
   and the agent's time for it (``duration_s``).  With incremental on, what epoch k
   adds is its own full image less the full image of epoch k-1, plus epoch k-1's
   delta (the pages it changed since epoch k-2): in steady state, one delta.
3. Restores, --restores rounds of: ``checkpoint vacate`` (which commits one more
   epoch and so prunes the oldest), wait for its conversion, then ``checkpoint
   restart`` (the newest epoch), timed from exec until the job runs again (the reply
   says running; else polled); then one vacate more and ``checkpoint restart --epoch
   <oldest kept>``, timed the same way.  After each restore the job's next step must
   be the one after the step it had reached when that epoch was dumped (every vacate
   waits for a step first, so no two epochs hold the same one), its output one
   unbroken run of steps.

The summary compares, per fraction, incremental on against off, with the targets of
issue 12: bytes added by a 1 % epoch at steady state (epochs 3 on: epoch 1 is a full
image either way, and converting epoch 1 stores all its pages once) against a full
image <= 5 %; newest-epoch restore on/off <= 1.10; checkpoint wall on/off <= 1.15
(medians over the epochs); freeze on/off <= 1.05 (medians).  A full image is the
bytes epoch 1 of the same configuration added.

    .venv/bin/python bench/storage.py                                   # 1 GiB, 1/10/100 %, 5 epochs (~30 min)
    .venv/bin/python bench/storage.py --size-mib 64 --epochs 3 --fractions 0.01   # a quick look

Restores run with the images in the page cache (they were just written), on both
sides alike.  This is a benchmark, not a timed test: on a shared or noisy machine
compare the ratios within one run, never absolute times across runs.  Everything it
starts is stopped and everything it writes is removed, also on an error or Ctrl-C;
if it is killed outright, run ``revenant down --dir DIR`` on the directory it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from revenant.agent.running.launcher import INIT_NAME

from checkpoint import _fs, _table, foreign_criu, sweep  # bench/: this script's own directory

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
    "bytes_1pct": 0.05,  # bytes added by a 1 % epoch / a full image
    "restore_newest": 1.10,  # incremental on / off
    "checkpoint_wall": 1.15,
    "freeze": 1.05,
}
_STEP_RE = re.compile(r"^step (\d+) ok$")


class BenchError(Exception):
    pass


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _r(x: float | None, nd: int = 4) -> float | None:
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
        # The benchmark runs as root (criu needs it), so its job does: the agent must allow that.
        env = {**os.environ, "REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}
        done = subprocess.run([self.revenant, "up", "--nodes", "1", "--dir", str(self.cluster), "--detach"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
        if done.returncode != 0:
            raise BenchError(f"revenant up: exit {done.returncode}: {done.stderr.strip()}")
        nodes = json.loads(self.cli("nodes", "--json").stdout)
        criu = nodes[0]["capabilities"]["criu"] if nodes else {}
        if not criu.get("ok"):
            raise BenchError(f"the agent cannot use criu: {criu}")
        self.events = EventTail(self.revenant, self.cluster)
        return {"path": criu.get("path"), "version": criu.get("version")}

    def down(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.cluster_up:
            done = subprocess.run([self.revenant, "down", "--dir", str(self.cluster)], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                print(f"warning: revenant down: {done.stderr.strip()}", file=sys.stderr)
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
                       "--incremental" if incremental else "--no-incremental", "--workdir", str(self.base), "--",
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
                                      "event_after_reply_s": _r(ev["received"] - replied, 3)}
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

def summarize_config(cfg: dict) -> dict:
    rows = cfg["epochs"]
    full = rows[0]["added_bytes"] if rows else None
    steady = [r["added_bytes"] for r in rows if r["k"] >= STEADY_FROM]
    conv = [c["seconds"] for r in rows for c in r["converted"] if c.get("seconds") is not None]
    rest = cfg.get("restore", {})
    return {
        "fraction": cfg["fraction"], "incremental": cfg["incremental"], "job": cfg["job"],
        "full_image_bytes": full,
        "steady_added_bytes": steady,
        "steady_added_ratio_median": _r(_ratio(_median(steady), full)),
        "steady_added_ratio_max": _r(_ratio(max(steady), full)) if steady else None,
        "wall_s_median": _r(_median([r["wall_s"] for r in rows])),
        "freeze_s_median": _r(_median([r["freeze_s"] for r in rows])),
        "duration_s_median": _r(_median([r["duration_s"] for r in rows])),
        "convert_s_median": _r(_median(conv)), "convert_s_total": _r(sum(conv)),
        "restore_newest_s": _r(_median([r["seconds"] for r in rest.get("newest", [])])),
        "restore_newest_best_s": _r(min((r["seconds"] for r in rest.get("newest", [])), default=None)),
        "restore_newest_epochs": [r["epoch"] for r in rest.get("newest", [])],
        "restore_oldest_s": _r(rest.get("oldest", {}).get("seconds")),
        "restore_oldest_epoch": rest.get("oldest", {}).get("epoch"),
        "storage_du_bytes": rows[-1]["storage_after"] if rows else None,
        "steps_not_one": [r["epoch"] for r in rows[1:] if r["steps_since_previous"] != 1],
    }


def compare(configs: list[dict]) -> list[dict]:
    """Per fraction, incremental on against off, with the targets."""
    out = []
    for fraction in sorted({c["fraction"] for c in configs}):
        on = next((c for c in configs if c["fraction"] == fraction and c["incremental"]), None)
        off = next((c for c in configs if c["fraction"] == fraction and not c["incremental"]), None)
        if on is None or off is None:
            continue
        row = {"fraction": fraction,
               "bytes_ratio_on": on["steady_added_ratio_max"], "bytes_ratio_off": off["steady_added_ratio_max"],
               "restore_newest_ratio": _r(_ratio(on["restore_newest_s"], off["restore_newest_s"]), 3),
               "restore_oldest_ratio": _r(_ratio(on["restore_oldest_s"], off["restore_oldest_s"]), 3),
               "checkpoint_wall_ratio": _r(_ratio(on["wall_s_median"], off["wall_s_median"]), 3),
               "freeze_ratio": _r(_ratio(on["freeze_s_median"], off["freeze_s_median"]), 3)}
        out.append(row)
    return out


def verdicts(ratios: list[dict]) -> list[dict]:
    def met(value: float | None, target: float) -> str:
        return "n/a" if value is None else "met" if value <= target else "NOT met"

    out = []
    one = next((r for r in ratios if abs(r["fraction"] - 0.01) < 1e-9), None)
    if one is not None:
        out.append({"measure": "bytes added by a 1 % epoch (steady state, worst) / full image", "fraction": 0.01,
                    "value": one["bytes_ratio_on"], "target": TARGETS["bytes_1pct"],
                    "verdict": met(one["bytes_ratio_on"], TARGETS["bytes_1pct"])})
    for key, measure in (("restore_newest", "newest-epoch restore, on / off"),
                         ("checkpoint_wall", "checkpoint wall (median), on / off"),
                         ("freeze", "freeze (median), on / off")):
        field = {"restore_newest": "restore_newest_ratio", "checkpoint_wall": "checkpoint_wall_ratio",
                 "freeze": "freeze_ratio"}[key]
        for r in ratios:
            out.append({"measure": measure, "fraction": r["fraction"], "value": r[field], "target": TARGETS[key],
                        "verdict": met(r[field], TARGETS[key])})
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(epochs: list[dict], summary: list[dict], ratios: list[dict], checks: list[dict], meta: dict) -> str:
    full = {(s["fraction"], s["incremental"]): s["full_image_bytes"] for s in summary}
    header = ["dirty", "incr", "epoch", "steps", "added MiB", "% of full", "ckpt wall s", "freeze s", "engine s",
              "convert s", "delta MiB"]
    rows = [[f"{r['fraction'] * 100:g}%", "on" if r["incremental"] else "off", str(r["epoch"]),
             str(r["steps_since_previous"]), _f(r["added_bytes"] / MiB, "{:.1f}"),
             _f(_ratio(r["added_bytes"], full[(r["fraction"], r["incremental"])]), "{:.1%}"),
             _f(r["wall_s"]), _f(r["freeze_s"], "{:.3f}"), _f(r["duration_s"]),
             _f(sum(c["seconds"] or 0 for c in r["converted"])) if r["converted"] else "-",
             _f(sum(c["bytes"] or 0 for c in r["converted"]) / MiB, "{:.1f}") if r["converted"] else "-"]
            for r in epochs]
    lines = ["per epoch: steps = the job's steps since the previous epoch; added = the job's epochs/ + packs/ on "
             "disk after the checkpoint and the conversion it caused, minus before (this epoch's full image, less "
             "the previous one's, plus the previous one's delta); convert = that conversion's seconds; delta = "
             "the previous epoch's own bytes once converted (its \"converted\" event)", _table(header, rows), ""]
    header2 = ["dirty", "incr", "full MiB", f"added {STEADY_FROM}+ med/max", "wall med s", "freeze med s",
               "restore newest med/best s", "restore oldest s", "on disk MiB"]
    rows2 = [[f"{s['fraction'] * 100:g}%", "on" if s["incremental"] else "off",
              _f((s["full_image_bytes"] or 0) / MiB, "{:.1f}"),
              f"{_f(s['steady_added_ratio_median'], '{:.1%}')} / {_f(s['steady_added_ratio_max'], '{:.1%}')}",
              _f(s["wall_s_median"]), _f(s["freeze_s_median"], "{:.3f}"),
              f"{_f(s['restore_newest_s'])} / {_f(s['restore_newest_best_s'])}",
              f"{_f(s['restore_oldest_s'])} (#{s['restore_oldest_epoch']})",
              _f((s["storage_du_bytes"] or 0) / MiB, "{:.1f}")] for s in summary]
    lines += ["per configuration", _table(header2, rows2), ""]
    header3 = ["dirty", "bytes/full on", "bytes/full off", "restore newest on/off", "restore oldest on/off",
               "ckpt wall on/off", "freeze on/off"]
    rows3 = [[f"{r['fraction'] * 100:g}%", _f(r["bytes_ratio_on"], "{:.1%}"), _f(r["bytes_ratio_off"], "{:.1%}"),
              _f(r["restore_newest_ratio"], "{:.3f}"), _f(r["restore_oldest_ratio"], "{:.3f}"),
              _f(r["checkpoint_wall_ratio"], "{:.3f}"), _f(r["freeze_ratio"], "{:.3f}")] for r in ratios]
    lines += ["incremental on against off", _table(header3, rows3), ""]
    header4 = ["target", "dirty", "value", "target", "verdict"]
    rows4 = [[c["measure"], f"{c['fraction'] * 100:g}%",
              _f(c["value"], "{:.1%}" if c["measure"].startswith("bytes") else "{:.3f}"),
              ("<= {:.0%}" if c["measure"].startswith("bytes") else "<= {:.2f}").format(c["target"]), c["verdict"]]
             for c in checks]
    lines += ["targets (issue 12)", _table(header4, rows4), ""]
    odd = [(s["fraction"], s["incremental"], s["steps_not_one"]) for s in summary if s["steps_not_one"]]
    if odd:
        lines.append(f"note: (fraction, incremental, epochs) taken after more than one step since the previous "
                     f"epoch (more than the fraction dirtied): {odd}")
    during = [(r["fraction"], r["incremental"], r["epoch"]) for r in epochs if r["step_during_dump"]]
    if during:
        lines.append(f"note: a step ended while `checkpoint create` ran (the epoch holds one of the two steps): "
                     f"{during}")
    noisy = [r["epoch"] for r in epochs if r["foreign_criu"] or r["cpu_busy_before_pct"] > meta["quiet_cpu"]]
    if noisy:
        lines.append(f"WARNING: {len(noisy)} checkpoint(s) started while another criu ran or the CPUs were busy")
    lines.append(f"{meta['size_mib']} MiB job, {meta['epochs']} epochs per configuration (max_epochs "
                 f"{meta['epochs']}), a step every {meta['interval_s']:g} s; newest-epoch restores: median of "
                 f"{meta['restores']}, the oldest kept: one; restores with the images in the page cache; ratios "
                 "are within this run")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="the job's memory, MiB (default 1024)")
    p.add_argument("--epochs", type=int, default=5, help="checkpoints per configuration = max_epochs (default 5)")
    p.add_argument("--fractions", default="0.01,0.1,1",
                   help="comma-separated fractions of the memory dirtied between checkpoints (default 0.01,0.1,1)")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds the job sleeps between steps; long enough for a checkpoint, its conversion and "
                        "--settle, so that one step falls between two checkpoints (default: 8 + 16 s per GiB)")
    p.add_argument("--restores", type=int, default=3,
                   help="rounds of vacate + restart of the newest epoch per configuration (default 3; median)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds to let the machine settle before each checkpoint and restore (default 3)")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="then wait up to this long for other criu processes to end and the CPUs to go idle "
                        "(default 60)")
    p.add_argument("--quiet-cpu", type=float, default=25.0,
                   help="'idle' for --quiet-wait: at most this %% of all CPUs busy over 0.5 s (default 25)")
    p.add_argument("--convert-timeout", type=float, default=600.0,
                   help="seconds to wait for an epoch's conversion (default 600)")
    p.add_argument("--dir", help="directory on the disk for the cluster and its storage "
                                 "(default: a new one under /var/tmp, removed at the end)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "storage.json")
    p.add_argument("--keep", action="store_true", help="keep the cluster directory (logs) at the end")
    args = p.parse_args(argv)
    try:
        args.fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    except ValueError:
        p.error("--fractions: comma-separated numbers in (0, 1]")
    if not args.fractions or not all(0 < f <= 1 for f in args.fractions):
        p.error("--fractions: comma-separated numbers in (0, 1]")
    if args.size_mib < 1 or args.epochs < 2 or args.restores < 1:
        p.error("--size-mib and --restores must be positive and --epochs at least 2")
    if args.interval is None:
        args.interval = round(8 + 16 * args.size_mib / 1024, 1)
    return args


def preflight(args: argparse.Namespace, base: Path) -> dict:
    size = args.size_mib * MiB + 64 * MiB
    disk_free = shutil.disk_usage(base).free
    avail = psutil.virtual_memory().available
    # Worst moment: incremental off, every kept epoch plus the vacates' a full image each.
    if disk_free < (args.epochs + 3) * size:
        raise BenchError(f"{base}: {disk_free / GiB:.1f} GiB free, need {(args.epochs + 3) * size / GiB:.1f}")
    if avail < 3 * size:
        raise BenchError(f"{avail / GiB:.1f} GiB of memory available, need {3 * size / GiB:.1f}")
    if not WORKLOAD.is_file():
        raise BenchError(f"{WORKLOAD} is missing")
    return {"disk_free_gib": round(disk_free / GiB, 1), "mem_available_gib": round(avail / GiB, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    ok = False
    started = time.monotonic()
    try:
        space = preflight(args, bench.base)
        print(f"bench dir {bench.base} ({_fs(bench.base)}); {args.size_mib} MiB job, fractions {args.fractions}, "
              f"{args.epochs} epochs, a step every {args.interval:g} s", flush=True)
        agent_criu = bench.up()
        print(f"cluster up in {bench.cluster} (agent's criu: {agent_criu})", flush=True)
        for i, fraction in enumerate(args.fractions):
            for incremental in ((True, False) if i % 2 == 0 else (False, True)):
                bench.run_config(fraction, incremental)
        ok = True
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        ok = True  # nothing to debug: remove the cluster directory too
        return 130
    except (BenchError, subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
        print(f"bench/storage.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup(ok)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    summary = [summarize_config(c) for c in bench.configs]
    ratios = compare(summary)
    checks = verdicts(ratios)
    meta = {
        "size_mib": args.size_mib, "epochs": args.epochs, "fractions": args.fractions, "interval_s": args.interval,
        "restores": args.restores,
        "settle_s": args.settle, "quiet_cpu": args.quiet_cpu, "check_every": CHECK_EVERY,
        "steady_from_epoch": STEADY_FROM, "targets": TARGETS,
        "added_bytes": "allocated blocks (st_blocks * 512) of <storage>/jobs/<job>/epochs and packs, files and "
                       "directories, each inode once, after the checkpoint and its conversion, minus before",
        "wall": "`revenant checkpoint create JOB --json`, exec to exit",
        "restore": "`revenant checkpoint restart JOB [--epoch N] --json`, exec until the job is running "
                   "(the reply's state, else `show job` polled); images in the page cache",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
                    "debian": Path("/etc/debian_version").read_text().strip()
                    if Path("/etc/debian_version").exists() else None,
                    "python": platform.python_version()},
        "criu": agent_criu,
        "storage": {"dir": str(bench.base), "fs": _fs(bench.base)},
        "space_before": space,
        "waited_for_others_s": round(bench.waited_for_others_s, 1),
        "elapsed_s": round(time.monotonic() - started, 1),
        "workload": str(WORKLOAD.relative_to(REPO)),
        "command": "bench/storage.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print()
    print(report(bench.epochs, summary, ratios, checks, meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "targets": checks, "ratios": ratios, "summary": summary,
                                    "configs": bench.configs}, indent=2) + "\n")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
