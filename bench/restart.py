"""`checkpoint restart` of a big vacated job: the CLI call to the job running, eager against lazy.

For each mode (eager, lazy) and run, on a fresh `revenant up --nodes 2` under /var/tmp: submit
bench/failover.py's workload (M MiB of page-stamped memory, a line every 0.1 s) to node-1, vacate
it once it is ready, evict its images from the page cache (cold: as when another node wrote them),
then time `revenant checkpoint restart JOB --node node-2`:

  cli        the CLI call, start to exit (it returns once the coordinator answers: job running)
  restored   the call's start -> the coordinator's `restored` event (`at`)
  printing   the call's start -> the job's first output line stamped after it
  cli_start  `revenant --version`, for the CLI's own start-up on this machine

    .venv/bin/python bench/restart.py                    # 4096 MiB, 2 runs per mode
    .venv/bin/python bench/restart.py --mib 1024 --runs 3

Prints a table and writes bench/results/restart.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/ is not a package: these are this script's own directory's.
from failover_cluster import drop_from_cache  # noqa: E402  (bench/ is not a package)
from harness import REVENANT, cluster_down, cluster_up, rv, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _ready(out: Path, after: float = 0.0, timeout: float = 300.0) -> float | None:
    """Wall time of the first output line stamped after ``after`` (None if none in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for line in out.read_text(errors="replace").splitlines():
                parts = line.split()
                if len(parts) >= 3 and parts[0] == "tick" and float(parts[2]) > after:
                    return float(parts[2])
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return None


def one(mode: str, mib: int, base: Path) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"revenant-bench-restart-{mib}-{mode}-", dir=base))
    env = {**os.environ, "REVENANT_AGENT_RESTORE_MODE": mode, "REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}
    cluster_up(d, 2, env=env)
    try:
        job = rv("submit", "--dir", str(d), "--node", "node-1", "--workdir", str(d), "--", sys.executable,
                 str(REPO / "bench" / "failover.py"), "--workload", str(mib)).stdout.strip()
        storage = Path(json.loads((d / "cluster.json").read_text())["storage"])
        out = storage / "jobs" / job / "output.log"
        if _ready(out) is None:
            raise RuntimeError("the job never printed")
        rv("checkpoint", "vacate", job, "--dir", str(d), timeout=300)
        epochs = sorted((storage / "jobs" / job / "epochs").glob("[0-9]*"), key=lambda e: int(e.name))
        drop_from_cache(epochs[-1])
        t0 = time.time()
        done = subprocess.run([REVENANT, "checkpoint", "restart", job, "--node", "node-2", "--dir", str(d)],
                              capture_output=True, text=True, timeout=300)
        cli = time.time() - t0
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        printing = _ready(out, after=t0, timeout=60)
        lines = rv("events", "--dir", str(d), "--json", check=False).stdout.splitlines()
        events = [json.loads(line) for line in lines if line.strip()]
        restored = [e for e in events if e.get("kind") == "restored" and e.get("job") == job]
        return {"mode": mode, "mib": mib, "cli_s": round(cli, 3),
                "restored_s": round(restored[-1]["at"] - t0, 3) if restored else None,
                "printing_s": round(printing - t0, 3) if printing else None}
    finally:
        cluster_down(d)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=4096)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--base", type=Path, default=Path("/var/tmp"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "restart.json")
    args = p.parse_args()
    t = time.time()
    subprocess.run([REVENANT, "--version"], capture_output=True, check=False)
    cli_start = round(time.time() - t, 3)
    runs = [one(mode, args.mib, args.base) for _ in range(args.runs) for mode in ("eager", "lazy")]
    print(f"{args.mib} MiB job, cold images; CLI start-up alone {cli_start} s\n")
    print("| seconds, median [min–max] | eager | lazy |\n|---|---|---|")
    for key, label in (("cli_s", "CLI call (start to exit)"), ("restored_s", "call → restored event"),
                       ("printing_s", "call → job prints again")):
        cells = []
        for mode in ("eager", "lazy"):
            xs = [r[key] for r in runs if r["mode"] == mode and r[key] is not None]
            cells.append(f"{statistics.median(xs):.2f} [{min(xs):.2f}–{max(xs):.2f}]" if xs else "–")
        print(f"| {label} | {' | '.join(cells)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"cli_start_s": cli_start, "runs": runs})


if __name__ == "__main__":
    main()
