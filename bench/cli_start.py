"""How long a one-shot CLI command takes from the shell, against a live local cluster.

A user's `revenant show job`, `jobs`, `nodes`, `signal`... spends its time starting Python and
importing what it needs; the cluster answers in a few milliseconds.  This times each command
``--runs`` times (median and best wall time, as a shell's `time` would see it), beside two
baselines measured in the same run on the same machine: the interpreter alone (``python -c
pass``, with the same venv's site) and the round trip alone (a request on a connection already
open).  It also sums ``python -X importtime`` for the command's imports.  Goal: `show job`
≤ 0.12 s.  Prints a table and writes bench/results/cli_start.json.

    .venv/bin/python bench/cli_start.py --runs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (BIN, REVENANT, cluster_down, cluster_up, export_ref, machine, rv, text_table,  # noqa: E402
                     write_json)

RESULTS = Path(__file__).resolve().parent / "results" / "cli_start.json"
GOAL_S = 0.12


def timed(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        began = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out.append(time.perf_counter() - began)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return out


def import_ms(args: list[str], env: dict[str, str]) -> float:
    """The command's imports, summed from ``-X importtime`` (their cumulative top-level times)."""
    code = ("import sys; from revenant.cli.main import main; sys.argv = ['revenant', *sys.argv[1:]]; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([str(BIN / "python"), "-X", "importtime", "-c", code, *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    total = 0
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):
            total += int(m.group(1))
    return total / 1000


async def round_trip(url: str, creds: str, job: str, runs: int) -> list[float]:
    from revenant.client import Client

    async with Client.connect(nats=url, creds=creds) as c:
        await c.job(job)
        out = []
        for _ in range(runs):
            began = time.perf_counter()
            await c.job(job)
            out.append(time.perf_counter() - began)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--baseline", metavar="REF", help="also time `show job` as git REF's code runs it, alternating")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rv-clistart-"))
    cluster_up(base / "cluster", 1)
    try:
        doc = json.loads((base / "cluster" / "cluster.json").read_text())
        env = {**os.environ, "REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}
        job = rv("submit", "--", "sleep", "3600", env=env).stdout.strip()
        commands = {"show job": ["show", "job", job], "jobs": ["jobs"], "nodes": ["nodes"],
                    "signal": ["signal", job, "CONT"], "--help": ["--help"]}
        rows, results = [], {}
        baseline = timed([str(BIN / "python"), "-c", "pass"], env, args.runs)
        trip = asyncio.run(round_trip(doc["nats_url"], doc.get("creds", ""), job, args.runs))
        for name, argv in commands.items():
            walls = timed([REVENANT, *argv], env, args.runs)
            results[name] = {"median_s": statistics.median(walls), "best_s": min(walls),
                             "imports_ms": import_ms(argv, env)}
        if args.baseline:  # the same command, the older code on PYTHONPATH ahead of this checkout's
            old_env = {**env, "PYTHONPATH": str(export_ref(args.baseline, base / "baseline"))}
            walls = timed([str(BIN / "python"), "-m", "revenant.cli.main", *commands["show job"]], old_env, args.runs)
            results[f"show job at {args.baseline}"] = {"median_s": statistics.median(walls), "best_s": min(walls),
                                                       "imports_ms": import_ms(commands["show job"], old_env)}
        results["python -c pass"] = {"median_s": statistics.median(baseline), "best_s": min(baseline)}
        results["round trip (open connection)"] = {"median_s": statistics.median(trip), "best_s": min(trip)}
        for name, r in results.items():
            rows.append([name, f"{r['median_s'] * 1000:.0f} ms", f"{r['best_s'] * 1000:.0f} ms",
                         f"{r['imports_ms']:.0f} ms" if "imports_ms" in r else "-"])
        print(text_table(["command", "median wall", "best wall", "imports"], rows))
        met = results["show job"]["median_s"] <= GOAL_S
        print(f"show job: {results['show job']['median_s'] * 1000:.0f} ms median, goal ≤ {GOAL_S * 1000:.0f} ms: "
              f"{'met' if met else 'NOT met'}")
        write_json(RESULTS, {"machine": machine(), "runs": args.runs, "goal_s": GOAL_S, "met": met,
                             "results": results})
        rv("cancel", job, "--signal", "KILL", "--grace", "0", env=env)
    finally:
        cluster_down(base / "cluster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
