"""Draining a node: SIGTERM to its agent until its job runs on another node.

Baseline, measured in the same run on the same job: what an operator does by
hand to move a job, ``revenant checkpoint vacate`` then ``revenant checkpoint
restart --node node-2`` (each CLI call to its reply).  The drain does the same
two steps without a human: the agent checkpoints and stops the job on SIGTERM
and reports it evicted, and the coordinator restores it at once (no detection,
no lease wait).

For each job size M (MiB) and each run, on a fresh ``revenant up --nodes 2``
(its directory under /var/tmp):

1. submit bench/workloads/hold_memory.py M on node-1 and wait for ``ready``;
2. baseline: vacate, then restart on node-2; then vacate, restart on node-1
   (the job is back where it started, and its images are warm for both);
3. T0 = just before SIGTERM to node-1's agent.  Measured: T0 -> the ``evicted``
   event (the drain's checkpoint), -> the agent's exit, -> the ``restored``
   event on node-2 (``moved``).

Goal: moved <= 1.2 x (vacate + restart) of the baseline; the drain should cost
no more than doing it by hand.  Prints a table and writes JSON.

    .venv/bin/python bench/drain.py                      # 64 and 1024 MiB, 3 runs each
    .venv/bin/python bench/drain.py --sizes 64 --runs 1  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, cluster_down, cluster_up, write_json

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKLOAD = REPO / "bench" / "workloads" / "hold_memory.py"


def rv(*args: str, timeout: float = 600.0) -> str:
    proc = subprocess.run([str(BIN / "revenant"), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise BenchError(f"revenant {' '.join(args[:3])}: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def timed(*args: str) -> float:
    t = time.monotonic()
    rv(*args)
    return time.monotonic() - t


def wait_for(predicate, timeout_s: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise BenchError(f"{what} did not happen within {timeout_s:g} s")


def gone(proc: psutil.Process) -> bool:
    """Exited: no process, or a zombie (a detached agent's parent is pid 1, which here never
    reaps: psutil's wait() would time the reaping, not the exit)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def one_run(base: Path, mib: int, attempt: int) -> dict:
    d = base / f"revenant-bench-drain-{os.getpid()}-{mib}-{attempt}"
    shutil.rmtree(d, ignore_errors=True)
    cluster_up(d, 2)
    cluster = ["--dir", str(d)]
    try:
        job = rv("submit", *cluster, "--node", "node-1", "--workdir", str(d), "--", sys.executable, str(WORKLOAD),
                 str(mib), "1").strip()
        out = d / "storage" / "jobs" / job / "output.log"
        wait_for(lambda: out.exists() and b"ready" in out.read_bytes(), 300, "the workload's ready line", 0.2)
        vacate = timed("checkpoint", "vacate", job, *cluster)
        restart = timed("checkpoint", "restart", job, "--node", "node-2", *cluster)
        rv("checkpoint", "vacate", job, *cluster)
        rv("checkpoint", "restart", job, "--node", "node-1", *cluster)
        info = json.loads(rv("show", "job", job, "--json", *cluster))
        if info["node"] != "node-1" or info["state"] != "running":
            raise BenchError(f"job not back on node-1: {info['state']} on {info['node']}")
        procs = json.loads((d / "cluster.json").read_text())["processes"]
        agent = psutil.Process(next(p["pid"] for p in procs if p["name"] == "node-1"))
        generation = info["generation"]

        def events() -> list[dict]:
            lines = rv("events", "--json", *cluster).splitlines()
            return [e for e in map(json.loads, lines) if e.get("type") == "job_event.v1" and e["job"] == job]

        t0 = time.time()
        agent.send_signal(signal.SIGTERM)
        wait_for(lambda: gone(agent), 120, "the agent's exit", 0.005)
        exited = time.time()
        seen = wait_for(lambda: (evs := events()) and any(e["kind"] == "restored" and e["generation"] > generation
                                                          for e in evs) and evs, 120, "the restore", 0.1)
        restored = next(e for e in seen if e["kind"] == "restored" and e["generation"] > generation)
        evicted = next(e for e in seen if e["kind"] == "evicted" and e["generation"] == generation)
        if restored["node"] != "node-2":
            raise BenchError(f"restored on {restored['node']}")
        epoch = json.loads(rv("show", "job", job, "--json", *cluster))["epochs"][-1]
        return {"size_mib": mib, "attempt": attempt, "status": "moved",
                "vacate_s": round(vacate, 3), "restart_s": round(restart, 3),
                "by_hand_s": round(vacate + restart, 3),
                "checkpointed_s": round(evicted["at"] - t0, 3), "agent_exit_s": round(exited - t0, 3),
                "moved_s": round(restored["at"] - t0, 3), "epoch_bytes": epoch.get("bytes", 0)}
    except (BenchError, subprocess.TimeoutExpired, psutil.Error, StopIteration, KeyError) as exc:
        return {"size_mib": mib, "attempt": attempt, "status": "failed", "error": str(exc) or type(exc).__name__}
    finally:
        cluster_down(d)
        shutil.rmtree(d, ignore_errors=True)


ROWS = [("vacate (CLI)", "vacate_s"), ("restart --node node-2 (CLI)", "restart_s"),
        ("by hand: vacate + restart", "by_hand_s"), ("SIGTERM → job checkpointed (evicted event)", "checkpointed_s"),
        ("SIGTERM → agent exited", "agent_exit_s"), ("SIGTERM → restored on node-2 (moved)", "moved_s")]


def summarize(runs: list[dict], sizes: list[int]) -> dict:
    out = {}
    for mib in sizes:
        ok = [r for r in runs if r["size_mib"] == mib and r["status"] == "moved"]
        s: dict = {"runs": len(ok), "failed": [r for r in runs if r["size_mib"] == mib and r["status"] != "moved"]}
        for _, key in ROWS:
            xs = [r[key] for r in ok]
            s[key] = {"median": round(statistics.median(xs), 3) if xs else None,
                      "min": min(xs) if xs else None, "max": max(xs) if xs else None}
        ratios = [r["moved_s"] / r["by_hand_s"] for r in ok]
        s["moved_over_by_hand"] = round(statistics.median(ratios), 2) if ratios else None
        s["goal_met"] = s["moved_over_by_hand"] is not None and s["moved_over_by_hand"] <= 1.2
        s["epoch_mib"] = round(statistics.median([r["epoch_bytes"] for r in ok]) / (1 << 20), 1) if ok else None
        out[str(mib)] = s
    return out


def table(summary: dict, sizes: list[int]) -> str:
    def cell(d: dict) -> str:
        return "–" if d["median"] is None else f"{d['median']:.2f} [{d['min']:.2f}–{d['max']:.2f}]"

    lines = ["| seconds, median [min–max] | " + " | ".join(f"{m} MiB job" for m in sizes) + " |",
             "|---|" + "---|" * len(sizes),
             "| runs | " + " | ".join(str(summary[str(m)]["runs"]) for m in sizes) + " |",
             "| checkpoint image (MiB) | " + " | ".join(str(summary[str(m)]["epoch_mib"]) for m in sizes) + " |"]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(summary[str(m)][key]) for m in sizes) + " |")
    lines.append("| moved / by hand (goal ≤ 1.2) | " + " | ".join(
        str(summary[str(m)]["moved_over_by_hand"]) for m in sizes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,1024", help="job sizes in MiB, comma-separated (64,1024)")
    p.add_argument("--runs", type=int, default=3, help="runs per size (3)")
    p.add_argument("--base", type=Path, default=Path("/var/tmp"), help="where cluster directories go (/var/tmp)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "drain.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = []
    for mib in sizes:
        for attempt in range(args.runs):
            r = one_run(args.base, mib, attempt)
            print(json.dumps(r), file=sys.stderr)
            runs.append(r)
    summary = summarize(runs, sizes)
    print(table(summary, sizes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"summary": summary, "runs": runs})
    print(f"\nJSON: {args.out}")
    return 0 if all(summary[str(m)]["goal_met"] for m in sizes) else 1


if __name__ == "__main__":
    sys.exit(main())
