"""`revenant checkpoint create` against a raw `criu dump` + `sync -f`: what revenant's commit path costs.

Both sides dump the same job, bench/workloads/hold_memory.py holding --mib MiB
(default 2048) of resident, page-distinct memory, started as the agent starts a
job (agent/running/launcher.py ``init_argv``: its own PID, IPC and mount namespaces, its
private /tmp and /dev/shm, revenant-init, the job's own directory as the init's
working directory), with its images on the same filesystem:

raw       ``criu dump -t <init> -D <dir> --leave-running --display-stats -o dump.log
          --external mnt[]`` (the one flag the job's mount namespace needs), then
          ``sync -f <dir>``: wall = criu's start to sync's exit.
revenant  ``revenant checkpoint create JOB --json`` against a one-node local cluster
          (``revenant up``) whose storage is on that filesystem: wall = exec to exit.
          Every image and the manifest are durable, and the manifest holds a keyed
          BLAKE3 MAC of every file and is signed (the agents' image_integrity "mac",
          the default: agent/storage/imagekeys.py), before it replies.
crc32     the same against a second cluster whose agents run with image_integrity
          "crc32" (no keys; CRC-32s, as before image keys): the baseline of the
          integrity goal (off with --no-crc32).
aead      with --encryption: against a third cluster whose agents run with
          image_encryption "aead" (agent/storage/sealed.py: criu dumps into node-local
          staging, /dev/shm, and the commit encrypts each image with AES-256-GCM on its
          way to the storage): what encryption at rest costs against "mac" (no goal;
          the report states it).

A fresh job is started for every run, each run starts after --settle seconds with
idle CPUs, and the sides alternate (raw first in odd runs).  A round is --runs runs
of each side; the ratio is revenant's best wall time over raw's best, and the
benchmark runs --rounds rounds.  Goal (issue 12): ratio <= 1.10 at 2 GiB, and
revenant's freeze no longer than raw criu's.  Goal (issue 30): with integrity on, the wall and
the freeze within 5% of integrity off (``mac / crc32``: best walls, median freezes).

Where revenant's time goes, per run: ``cli`` the CLI's start-up (the interpreter
importing what ``checkpoint create`` imports, timed alone); ``bus`` one request and
reply through NATS and the coordinator (``revenant show job`` less the start-up);
from the agent's log, ``criu`` the dump (steps before it, criu itself; ``frozen``
is criu's freeze), ``crc after`` the CRC-32s still to take once criu had exited,
``rest crc`` those of the files nobody followed, ``durable`` until the syncfs (or
fsyncs) returned, running alongside those, and ``commit`` all of the commit
(manifest, fsync, rename included); ``control`` what is left of the wall time
(start-up, bus, the coordinator's bookkeeping, the reply).

    .venv/bin/python bench/commit_path.py                        # 2 GiB, 5 runs a side, 2 rounds
    .venv/bin/python bench/commit_path.py --mib 256 --runs 2 --rounds 1   # a quick look
    .venv/bin/python bench/commit_path.py --encryption --no-crc32 --runs 3 --rounds 1   # encryption's cost
    .venv/bin/python bench/commit_path.py --source /tmp/before   # revenant from another tree

``--source DIR`` runs revenant (CLI, coordinator, agent) from ``DIR/revenant`` (for
instance ``git archive HEAD`` unpacked there), to measure before a change.
Everything it starts is stopped and everything it writes is removed, also on an
error or Ctrl-C; killed outright, run ``revenant down --dir DIR`` on the directory
it printed.  Compare ratios within one run, never absolute times across runs:
this machine's disk is very noisy.
"""

from __future__ import annotations

import argparse
import ctypes
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
import time
from pathlib import Path

import psutil

from revenant.agent.pipeline.criu import DUMP_MOUNTS
from revenant.agent.running.jobuser import ENV_FILE, env_script
from revenant.agent.running.launcher import DEFAULT_SCRATCH, INIT_NAME, init_argv, scratch_plan, scratch_script

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, cluster_down, cluster_up, write_json

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workloads" / "hold_memory.py"
BIN = Path(sys.executable).parent
PYTHON = sys.executable
NODE = "node-1"
MiB = 1 << 20
GOAL = 1.10
INTEGRITY_GOAL = 1.05
CRC32_SIDE = "revenant-crc32"
AEAD_SIDE = "revenant-aead"
# What `revenant checkpoint create` imports before it connects.
CLI_IMPORTS = "import revenant.cli.main, revenant.cli.client"
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a child after fork must not dlopen


def _die_with_parent() -> None:
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _frozen_s(text: str) -> float | None:
    m = re.search(r"Frozen time:\s*(\d+)\s*us", text)
    return int(m.group(1)) / 1e6 if m else None


_SEAL_RE = re.compile(r"imagesum: (\S+): (?:CRC-32|crc32|blake3-keyed) \((\w+)\) of (\d+) files \((\d+) followed as criu wrote, ([\d.]+) "
                      r"MiB read after it\) ([\d.]+) s, the rest ([\d.]+) s; durable \((\w+)\) ([\d.]+) s")


_DONE_RE = re.compile(r"engine: checkpoint of (\S+): epoch (\d+), [\d.]+ MiB, criu ([\d.]+) s \(frozen ([\d.]+) s\), "
                      r"commit ([\d.]+) s")


def agent_phases(log_text: str, job: str, epoch: int) -> dict:
    """The agent's own account of one checkpoint (agent/checkpointing/engine.py, agent/storage/imagesum.py log lines)."""
    last_seal: dict = {}
    for line in log_text.splitlines():
        if m := _SEAL_RE.search(line):
            last_seal = {"crc32": m.group(2), "files": int(m.group(3)), "followed": int(m.group(4)),
                         "mib_after_criu": float(m.group(5)), "crc_after_s": float(m.group(6)),
                         "rest_crc_s": float(m.group(7)), "durable_how": m.group(8), "durable_s": float(m.group(9))}
        elif (m := _DONE_RE.search(line)) and m.group(1) == job and int(m.group(2)) == epoch:
            return {"criu_s": float(m.group(3)), "frozen_s": float(m.group(4)), "commit_s": float(m.group(5)),
                    **last_seal}
    return {}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = Path(tempfile.mkdtemp(prefix="revenant-bench-commit-", dir=args.dir))
        self.cluster = self.base / "cluster"
        self.storage = self.cluster / "storage"
        # The integrity baseline's cluster: its agents take CRC-32s and sign nothing.
        self.clusters = {"revenant": self.cluster, CRC32_SIDE: self.base / "cluster-crc32",
                         AEAD_SIDE: self.base / "cluster-aead"}
        self.work = self.base / "work"
        self.work.mkdir()
        # The job runs as root, as the raw side's does (the agent refuses root's jobs by default).
        self.env = {**os.environ, "REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}
        if args.source:
            self.env["PYTHONPATH"] = os.pathsep.join([str(Path(args.source).resolve()),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])])
        self.cluster_up = False
        self.live: list[tuple[subprocess.Popen[bytes], int]] = []  # raw workloads: (unshare, init)
        self.jobs: list[tuple[str, Path]] = []  # (job, its cluster)
        self.seq = 0

    # ------------------------------------------------------------------ revenant's CLI

    def cli(self, *argv: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "revenant"), *argv], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout, env=self.env)
        if check and done.returncode != 0:
            raise BenchError(f"revenant {' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
        return done

    def sides(self) -> tuple[str, ...]:
        return (("raw", "revenant") + (() if self.args.no_crc32 else (CRC32_SIDE,))
                + ((AEAD_SIDE,) if self.args.encryption else ()))

    def up(self) -> None:
        self.cluster_up = True
        cluster_up(self.cluster, 1)
        if not self.args.no_crc32:
            cluster_up(self.clusters[CRC32_SIDE], 1, env={**os.environ, "REVENANT_AGENT_IMAGE_INTEGRITY": "crc32"})
        if self.args.encryption:
            cluster_up(self.clusters[AEAD_SIDE], 1, env={**os.environ, "REVENANT_AGENT_IMAGE_ENCRYPTION": "aead"})
        if not self.storage.is_dir():
            raise BenchError(f"no storage at {self.storage}")

    def down(self) -> None:
        if self.cluster_up:
            self.cluster_up = False
            for side in self.sides()[1:]:
                cluster_down(self.clusters[side])

    def startup_s(self) -> float:
        t = time.monotonic()
        subprocess.run([PYTHON, "-c", CLI_IMPORTS], check=True, env=self.env)
        return time.monotonic() - t

    # ------------------------------------------------------------------ runs

    def quiet(self) -> float:
        """--settle seconds, then until the CPUs are idle (at most --quiet-wait s); the CPU % last seen."""
        time.sleep(self.args.settle)
        deadline = time.monotonic() + self.args.quiet_wait
        while True:
            busy = psutil.cpu_percent(interval=0.5)
            if busy <= 25.0 or time.monotonic() > deadline:
                return busy

    def wait_ready(self, out: Path, alive) -> None:
        deadline = time.monotonic() + 60 + self.args.mib / 20
        while time.monotonic() < deadline:
            if out.exists() and "ready " in out.read_text(errors="replace"):
                return
            if not alive():
                raise BenchError(f"the workload died before it was ready: {out.read_text(errors='replace')[-300:]!r}")
            time.sleep(0.1)
        raise BenchError(f"the workload was not ready in time ({out})")

    def run_raw(self) -> dict:
        self.seq += 1
        jobdir = self.storage / "raw" / str(self.seq)
        images = jobdir / "images"
        images.mkdir(parents=True)
        out, stamp = jobdir / "output.log", jobdir / "alive"
        out.touch()
        stamp.touch()
        job = [PYTHON, str(WORKLOAD), str(self.args.mib)]
        # As agent/running/launcher.py (Launcher.spawn, _scratch) starts a root job: same namespaces, same init.
        mounts, _ = scratch_plan(DEFAULT_SCRATCH, [str(self.work), str(jobdir), PYTHON, str(WORKLOAD)])
        scratch = scratch_script(mounts, str(out), proc=True) if mounts else None
        (jobdir / ENV_FILE).write_text(env_script(dict(os.environ)))  # as the launcher writes the job's (its own env)
        argv = init_argv(Path(out.name), Path(stamp.name), 10**6, job, str(self.work), 10**6, scratch)
        proc = subprocess.Popen(argv, cwd=jobdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        init = 0
        deadline = time.monotonic() + 10
        while not init and time.monotonic() < deadline and proc.poll() is None:
            children = psutil.Process(proc.pid).children()
            init = children[0].pid if children else 0
            time.sleep(0.01)
        self.live.append((proc, init))
        try:
            if not init:
                raise BenchError("the raw job's namespace did not start")
            self.wait_ready(out, lambda: proc.poll() is None)
            busy = self.quiet()
            criu = [self.args.criu, "dump", "-t", str(init), "-D", str(images), "--leave-running", "--display-stats",
                    "-o", "dump.log", *(DUMP_MOUNTS if scratch else ())]
            t0 = time.monotonic()
            done = subprocess.run(criu, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
            t1 = time.monotonic()
            if done.returncode != 0:
                log = (images / "dump.log").read_text(errors="replace") if (images / "dump.log").exists() else ""
                errors = [ln for ln in (log + done.stdout).splitlines() if "Error" in ln and "RLIMIT" not in ln]
                raise BenchError(f"raw criu dump failed: {(errors or ['?'])[0]}")
            subprocess.run(["sync", "-f", str(images)], check=True)
            t2 = time.monotonic()
            size = sum(p.stat().st_size for p in images.iterdir() if p.suffix == ".img")
        finally:
            self.stop_raw(proc, init)
            shutil.rmtree(jobdir, ignore_errors=True)
        return {"side": "raw", "seq": self.seq, "wall_s": t2 - t0, "criu_s": t1 - t0, "sync_s": t2 - t1,
                "freeze_s": _frozen_s(done.stdout), "bytes": size, "cpu_busy_before_pct": busy,
                "mount_namespace": scratch is not None}

    def stop_raw(self, proc: subprocess.Popen[bytes], init: int) -> None:
        for pid in (init, proc.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(30)
        self.live = [(p, i) for p, i in self.live if p is not proc]

    def show(self, job: str, cluster: Path | None = None) -> dict:
        return json.loads(self.cli("show", "job", job, "--dir", str(cluster or self.cluster), "--json").stdout)

    def run_revenant(self, side: str = "revenant") -> dict:
        self.seq += 1
        cluster = self.clusters[side]
        job = self.cli("submit", "--dir", str(cluster), "--node", NODE, "--name", f"commit-{self.seq}",
                       "--workdir", str(self.work), "--", PYTHON, str(WORKLOAD), str(self.args.mib)).stdout.strip()
        self.jobs.append((job, cluster))
        try:
            view = self.show(job, cluster)
            self.wait_ready(Path(view["output"]), lambda: self.show(job, cluster)["state"] == "running")
            busy = self.quiet()
            t0 = time.monotonic()
            done = self.cli("checkpoint", "create", job, "--dir", str(cluster), "--json")
            t1 = time.monotonic()
            epoch = json.loads(done.stdout)["epochs"][-1]
            s0 = time.monotonic()
            after = self.show(job, cluster)
            bus_s = time.monotonic() - s0
            if after["state"] != "running":
                raise BenchError(f"job {job} is {after['state']} after its checkpoint")
            startup = self.startup_s()
            log_text = (cluster / "logs" / f"{NODE}.log").read_text(errors="replace")
            manifest = json.loads((cluster / "storage" / "jobs" / job / "epochs" / str(epoch["n"]) / "manifest.json")
                                  .read_text())
        finally:
            self.stop_job(job, cluster)
        # A revenant that does not log its phases: the manifest's criu run and commit (before its own write).
        phases = agent_phases(log_text, job, epoch["n"]) or {"criu_s": manifest["dump_s"],
                                                              "commit_s": manifest["commit_s"]}
        agent_s = phases["criu_s"] + phases["commit_s"]
        return {"side": side, "checksum": manifest.get("checksum", "crc32"), "seq": self.seq, "job": job,
                "encryption": manifest.get("encryption", ""),
                "wall_s": t1 - t0, "freeze_s": epoch["freeze_s"],
                "bytes": epoch["bytes"], "duration_s": epoch["duration_s"], "cli_startup_s": startup,
                "bus_s": max(0.0, bus_s - startup), "agent": phases,
                "control_s": (t1 - t0) - agent_s, "cpu_busy_before_pct": busy}

    def stop_job(self, job: str, cluster: Path) -> None:
        try:
            pid = self.show(job, cluster).get("pid") if self.cluster_up else 0
            if pid:
                p = psutil.Process(pid)
                if INIT_NAME in " ".join(p.cmdline()):
                    p.kill()
            deadline = time.monotonic() + 30
            while self.cluster_up and time.monotonic() < deadline and self.show(job, cluster)["state"] == "running":
                time.sleep(0.1)
        except (BenchError, psutil.Error):
            pass
        if self.cluster_up:
            self.cli("job", "purge", job, "--dir", str(cluster), check=False)
        shutil.rmtree(cluster / "storage" / "jobs" / job, ignore_errors=True)
        self.jobs = [j for j in self.jobs if j[0] != job]

    # ------------------------------------------------------------------ clean-up

    def cleanup(self) -> None:
        for proc, init in list(self.live):
            self.stop_raw(proc, init)
        for job, cluster in list(self.jobs):
            self.stop_job(job, cluster)
        try:
            self.down()
        finally:
            for p in psutil.process_iter(["cmdline"]):  # anything of ours still alive
                try:
                    cmd = " ".join(p.info["cmdline"] or [])
                    if str(WORKLOAD) in cmd and str(self.work) in cmd and p.pid != os.getpid():
                        p.kill()
                except psutil.Error:
                    continue
            shutil.rmtree(self.base, ignore_errors=True)


# ---------------------------------------------------------------------- summary


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], rounds: int) -> list[dict]:
    out = []
    for r in range(1, rounds + 1):
        raw = [x for x in runs if x["round"] == r and x["side"] == "raw"]
        rev = [x for x in runs if x["round"] == r and x["side"] == "revenant"]
        best_raw, best_rev = min(x["wall_s"] for x in raw), min(x["wall_s"] for x in rev)
        ag = [x["agent"] for x in rev if x["agent"]]
        out.append({
            "round": r, "runs": len(raw),
            "raw_best_s": best_raw, "raw_median_s": _med([x["wall_s"] for x in raw]),
            "revenant_best_s": best_rev, "revenant_median_s": _med([x["wall_s"] for x in rev]),
            "ratio_best": best_rev / best_raw, "ratio_median": _med([x["wall_s"] for x in rev]) / _med(
                [x["wall_s"] for x in raw]),
            "raw_freeze_median_s": _med([x["freeze_s"] for x in raw]),
            "revenant_freeze_median_s": _med([x["freeze_s"] for x in rev]),
            "raw_criu_median_s": _med([x["criu_s"] for x in raw]),
            "raw_sync_median_s": _med([x["sync_s"] for x in raw]),
            "revenant_breakdown_median_s": {
                "cli_startup": _med([x["cli_startup_s"] for x in rev]), "bus": _med([x["bus_s"] for x in rev]),
                "criu": _med([a.get("criu_s") for a in ag]), "frozen": _med([x["freeze_s"] for x in rev]),
                "crc_after_criu": _med([a.get("crc_after_s") for a in ag]),
                "rest_crc": _med([a.get("rest_crc_s") for a in ag]),
                "durable": _med([a.get("durable_s") for a in ag]), "commit": _med([a.get("commit_s") for a in ag]),
                "control": _med([x["control_s"] for x in rev]),
                "mib_read_after_criu": _med([a.get("mib_after_criu") for a in ag]),
            },
            "durable_how": sorted({a.get("durable_how", "fsync") for a in ag}),
            "crc32": sorted({a.get("crc32", "zlib") for a in ag}),
            "goal_met": best_rev / best_raw <= GOAL,
        })
        crc = [x for x in runs if x["round"] == r and x["side"] == CRC32_SIDE]
        if crc:  # the integrity goal: keyed MACs and a signed manifest against CRC-32s
            wall = best_rev / min(x["wall_s"] for x in crc)
            freeze = (_med([x["freeze_s"] for x in rev]) or 0) / (_med([x["freeze_s"] for x in crc]) or 1)
            out[-1].update({
                "crc32_best_s": min(x["wall_s"] for x in crc), "crc32_median_s": _med([x["wall_s"] for x in crc]),
                "crc32_freeze_median_s": _med([x["freeze_s"] for x in crc]),
                "mac_vs_crc32_wall": wall, "mac_vs_crc32_freeze": freeze,
                "mac_vs_crc32_commit": (_med([a.get("commit_s") for a in ag]) or 0) / (
                    _med([x["agent"].get("commit_s") for x in crc if x["agent"]]) or 1),
                "integrity_goal_met": wall <= INTEGRITY_GOAL and freeze <= INTEGRITY_GOAL})
            out[-1]["goal_met"] = out[-1]["goal_met"] and out[-1]["integrity_goal_met"]
        aead = [x for x in runs if x["round"] == r and x["side"] == AEAD_SIDE]
        if aead:  # what encryption at rest costs against integrity alone (no goal)
            out[-1].update({
                "aead_best_s": min(x["wall_s"] for x in aead), "aead_median_s": _med([x["wall_s"] for x in aead]),
                "aead_freeze_median_s": _med([x["freeze_s"] for x in aead]),
                "aead_criu_median_s": _med([x["agent"].get("criu_s") for x in aead if x["agent"]]),
                "aead_commit_median_s": _med([x["agent"].get("commit_s") for x in aead if x["agent"]]),
                "aead_vs_mac_wall": min(x["wall_s"] for x in aead) / best_rev,
                "aead_vs_mac_freeze": (_med([x["freeze_s"] for x in aead]) or 0) / (
                    _med([x["freeze_s"] for x in rev]) or 1)})
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _versus(summary: list[dict], key: str, title: str, header: list[str], cells) -> list[str]:
    """A side-against-side table: a row per round that measured ``key`` (none: no table)."""
    rounds = [s for s in summary if key in s]
    if not rounds:
        return []
    return (["", title, "", "| round | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
            + [f"| {s['round']} | " + " | ".join(cells(s)) + " |" for s in rounds])


def report(summary: list[dict], meta: dict) -> str:
    lines = [f"{meta['mib']} MiB job, best of {meta['runs']} alternating runs per side, {len(summary)} round(s); "
             f"storage {meta['storage_fs']}; revenant from {meta['revenant_source']}", "",
             "| round | raw best s | revenant best s | ratio (goal <= 1.10) | raw median s | revenant median s "
             "| median ratio | raw freeze s | revenant freeze s |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['round']} | {_f(s['raw_best_s'])} | {_f(s['revenant_best_s'])} | "
                     f"**{_f(s['ratio_best'], '{:.3f}')}** | {_f(s['raw_median_s'])} | {_f(s['revenant_median_s'])} | "
                     f"{_f(s['ratio_median'], '{:.3f}')} | {_f(s['raw_freeze_median_s'], '{:.3f}')} | "
                     f"{_f(s['revenant_freeze_median_s'], '{:.3f}')} |")
    lines += ["", "Where the time goes (medians, s): raw = criu + sync -f; revenant = cli + bus + criu + commit + the "
              "rest of control", "",
              "| round | raw criu | raw sync -f | cli start-up | bus | agent criu | frozen | crc after criu (MiB) "
              "| rest crc | durable | commit | control | CRC-32 by |", "|---" * 13 + "|"]
    for s in summary:
        b = s["revenant_breakdown_median_s"]
        lines.append(f"| {s['round']} | {_f(s['raw_criu_median_s'])} | {_f(s['raw_sync_median_s'])} | "
                     f"{_f(b['cli_startup'])} | {_f(b['bus'], '{:.3f}')} | {_f(b['criu'])} | {_f(b['frozen'])} | "
                     f"{_f(b['crc_after_criu'])} ({_f(b['mib_read_after_criu'], '{:.0f}')}) | "
                     f"{_f(b['rest_crc'], '{:.3f}')} | {_f(b['durable'])} ({'/'.join(s['durable_how'])}) | "
                     f"{_f(b['commit'])} | {_f(b['control'])} | {'/'.join(s['crc32'])} |")
    lines += _versus(summary, "mac_vs_crc32_wall", "Integrity: revenant (keyed BLAKE3, signed manifest) against "
                     "revenant with image_integrity = crc32",
                     ["mac best s", "crc32 best s", "wall ratio (goal <= 1.05)", "mac freeze s", "crc32 freeze s",
                      "freeze ratio (goal <= 1.05)", "commit ratio"],
                     lambda s: [_f(s['revenant_best_s']), _f(s['crc32_best_s']),
                                f"**{_f(s['mac_vs_crc32_wall'], '{:.3f}')}**", _f(s['revenant_freeze_median_s'], '{:.3f}'),
                                _f(s['crc32_freeze_median_s'], '{:.3f}'), f"**{_f(s['mac_vs_crc32_freeze'], '{:.3f}')}**",
                                _f(s['mac_vs_crc32_commit'], '{:.3f}')])
    lines += _versus(summary, "aead_best_s", "Encryption at rest: revenant with image_encryption = aead (staged in "
                     "/dev/shm, AES-256-GCM on the way to the storage) against revenant (mac)",
                     ["aead best s", "mac best s", "wall ratio", "aead freeze s", "mac freeze s", "freeze ratio",
                      "aead criu s", "aead commit s", "mac commit s"],
                     lambda s: [_f(s['aead_best_s']), _f(s['revenant_best_s']), f"**{_f(s['aead_vs_mac_wall'], '{:.3f}')}**",
                                _f(s['aead_freeze_median_s'], '{:.3f}'), _f(s['revenant_freeze_median_s'], '{:.3f}'),
                                f"**{_f(s['aead_vs_mac_freeze'], '{:.3f}')}**", _f(s['aead_criu_median_s']),
                                _f(s['aead_commit_median_s']), _f(s['revenant_breakdown_median_s']['commit'])])
    lines += ["", "durable runs alongside the digests after criu and ends within commit; control = revenant wall - "
              "(agent criu + commit): CLI start-up, bus, coordinator, reply."]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="the job's memory, MiB (2048)")
    p.add_argument("--runs", type=int, default=5, help="runs of each side per round (5)")
    p.add_argument("--rounds", type=int, default=2, help="rounds (2)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of rest before each measured step (3)")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="then wait up to this for idle CPUs (60)")
    p.add_argument("--dir", default="/var/tmp", help="where the cluster (its storage) and raw dumps go (/var/tmp)")
    p.add_argument("--source", help="run revenant from DIR/revenant instead of the installed package")
    p.add_argument("--criu", default=str(BIN / "criu") if (BIN / "criu").exists() else shutil.which("criu"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "commit_path.json")
    p.add_argument("--no-crc32", action="store_true", help="no integrity baseline (a cluster with image_integrity crc32)")
    p.add_argument("--encryption", action="store_true", help="a side with image_encryption aead (a third cluster)")
    args = p.parse_args(argv)
    if args.mib < 1 or args.runs < 1 or args.rounds < 1 or not args.criu:
        p.error("--mib, --runs and --rounds must be positive, and criu must be found")
    if psutil.virtual_memory().available < 3 * args.mib * MiB or shutil.disk_usage(args.dir).free < 3 * args.mib * MiB:
        print("commit_path: need 3x --mib of free memory and of free disk", file=sys.stderr)
        return 2
    bench = Bench(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    runs: list[dict] = []
    try:
        bench.up()
        print(f"cluster in {bench.cluster}; {args.mib} MiB job, {args.runs} runs a side, {args.rounds} round(s)",
              flush=True)
        for r in range(1, args.rounds + 1):
            for i in range(args.runs):
                sides = bench.sides()
                for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # each side first in turn
                    run = bench.run_raw() if side == "raw" else bench.run_revenant(side)
                    run["round"] = r
                    runs.append(run)
                    extra = (f"criu {run['criu_s']:.2f} + sync {run['sync_s']:.2f}" if side == "raw" else
                             f"agent {run['agent']} cli {run['cli_startup_s']:.2f} bus {run['bus_s']:.3f}")
                    print(f"round {r} run {i + 1} {side:<14} wall {run['wall_s']:6.3f} s freeze "
                          f"{run['freeze_s'] or 0:.3f} s ({extra})", flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    except (BenchError, subprocess.SubprocessError, OSError) as exc:
        print(f"commit_path: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bench.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    summary = summarize(runs, args.rounds)
    fs = next((f"{q.fstype} ({q.mountpoint})" for q in sorted(psutil.disk_partitions(all=True),
                                                                key=lambda q: -len(q.mountpoint))
               if args.dir.startswith(q.mountpoint)), "?")
    meta = {"command": "bench/commit_path.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "mib": args.mib, "runs": args.runs, "rounds": args.rounds, "storage_fs": fs, "sides": list(bench.sides()),
            "revenant_source": args.source or str(REPO), "criu": args.criu, "goal_ratio": GOAL,
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print()
    print(report(summary, meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"meta": meta, "summary": summary, "runs": runs})
    print(f"\nwritten to {args.out}")
    return 0 if all(s["goal_met"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
