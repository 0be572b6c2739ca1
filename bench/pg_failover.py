"""PostgreSQL through random failovers: rows lost or resurrected, against the epochs' truth.

On a fresh `revenant up --nodes 2` under /var/tmp, PostgreSQL runs as the job (its data directory
in the job's working directory; as root through tests/jobs/notroot.c, on TCP, or with ``--user
postgres`` as that user, its socket in its data directory, which each restore makes again as the
user: agent/files/asuser/sockets.py), driven with psql from outside.  Each round, with a
seeded random choice of sizes:

1. inserts and deletes rows in a few transactions, each acknowledged by psql, sometimes
   followed by a `checkpoint;` (the server writes its relation files and closes them);
2. `revenant checkpoint create`: the rows acknowledged so far are that epoch's truth;
3. more inserts and deletes, and again sometimes a `checkpoint;` (all of it after the epoch);
4. SIGKILL of the job's node's agent and of the job; the coordinator restores the job on the
   other node from its newest epoch (the killed agent comes back once its node is declared dead);
5. every id in the table, read by index and by sequential scan (the two must agree), against the
   epoch's truth: *lost* (acknowledged before the epoch, missing) and *resurrected* (deleted
   before the epoch, or written after it, present).  The server must take a write again.

Goal (the issue's): 0 rows lost or resurrected across 20 failovers.

    .venv/bin/python bench/pg_failover.py                 # 20 failovers
    .venv/bin/python bench/pg_failover.py --rounds 3      # a quick look
    .venv/bin/python bench/pg_failover.py --user postgres # as its own user (pg_failover_user.json)

Prints a table and writes bench/results/pg_failover.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, cluster_down, cluster_up, rv, write_json  # noqa: E402  (bench/ is not a package)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "workloads"))
from pgserver import Postgres  # noqa: E402  (the tests' own PostgreSQL harness)


def show(d: Path, job: str) -> dict:
    return json.loads(rv("show", "job", job, "--dir", str(d), "--json").stdout)


def running_elsewhere(d: Path, job: str, gen: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = show(d, job)
        if info["state"] == "running" and info["generation"] > gen:
            return info
        time.sleep(0.2)
    raise BenchError(f"job {job} not running again within {timeout} s: {show(d, job)}")


def agent_pid(d: Path, node: str) -> int:
    """The pid of ``node``'s agent of the cluster in ``d`` (found by its command line)."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if " agent" in cmd and node in cmd and str(d) in cmd:
            return p.info["pid"]
    raise BenchError(f"no agent of {node} is running")


def nodes_alive(d: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = json.loads(rv("nodes", "--dir", str(d), "--json").stdout)
        if len(listed) == 2 and all(n["state"] == "alive" for n in listed):
            return
        time.sleep(0.5)
    raise BenchError("both nodes not alive again")


def writes(pg: Postgres, rnd: random.Random, present: set[int], next_id: list[int]) -> None:
    """A few acknowledged transactions of inserts and deletes; ``present`` follows them."""
    for _ in range(rnd.randint(1, 4)):
        n = rnd.randint(1, 300)
        first = next_id[0]
        pg.insert(first, first + n - 1)
        present.update(range(first, first + n))
        next_id[0] += n
        if present and rnd.random() < 0.5:
            gone = rnd.sample(sorted(present), min(len(present), rnd.randint(1, 20)))
            pg.sql(f"delete from t where id in ({','.join(map(str, gone))})")
            present.difference_update(gone)
    if rnd.random() < 0.6:
        pg.sql("checkpoint")


def run(args: argparse.Namespace) -> dict:
    d = Path(tempfile.mkdtemp(prefix="revenant-bench-pg-", dir=args.base))
    d.chmod(0o755)  # the job's user searches its way to its data directory
    env = {**os.environ, "REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}
    rnd = random.Random(args.seed)
    rounds = []
    cluster_up(d / "cluster", 2, env=env)
    try:
        pg = Postgres(d, user=args.user)
        job = rv("submit", "--dir", str(d / "cluster"), "--node", "node-1", "--workdir", str(pg.workdir),
                 *(("--user", args.user) if args.user else ()), "--max-epochs", "3", "--", *pg.argv()).stdout.strip()
        pg.sql("create table t (id int primary key, v text)", timeout=120)
        present: set[int] = set()
        next_id = [1]
        for r in range(args.rounds):
            writes(pg, rnd, present, next_id)
            rv("checkpoint", "create", job, "--dir", str(d / "cluster"), timeout=300)
            truth = set(present)
            after = set(present)
            writes(pg, rnd, after, next_id)  # after the epoch: rolled back by the failover
            info = show(d / "cluster", job)
            t0 = time.time()
            os.kill(agent_pid(d / "cluster", info["node"]), signal.SIGKILL)
            os.kill(info["pid"], signal.SIGKILL)
            moved = running_elsewhere(d / "cluster", job, info["generation"])
            got = pg.rows()
            back = time.time() - t0
            lost, resurrected = truth - set(got), set(got) - truth
            pg.insert(next_id[0], next_id[0])  # it takes writes again
            present = truth | {next_id[0]}
            next_id[0] += 1
            rounds.append({"round": r + 1, "from": info["node"], "to": moved["node"], "rows": len(truth),
                           "lost": len(lost), "resurrected": len(resurrected), "written_after": len(after ^ truth),
                           "seconds_to_rows": round(back, 2)})
            print(f"round {r + 1}: {info['node']} -> {moved['node']}, {len(truth)} rows, lost {len(lost)}, "
                  f"resurrected {len(resurrected)} ({back:.1f} s)", file=sys.stderr)
            nodes_alive(d / "cluster")
    finally:
        cluster_down(d / "cluster")
        subprocess.run(["rm", "-rf", str(d)], check=False)
    lost = sum(x["lost"] for x in rounds)
    resurrected = sum(x["resurrected"] for x in rounds)
    return {"rounds": rounds, "failovers": len(rounds), "user": args.user or "root", "lost": lost,
            "resurrected": resurrected,
            "seconds_to_rows_median": round(statistics.median(x["seconds_to_rows"] for x in rounds), 2),
            "goal": "0 rows lost or resurrected", "goal_met": lost == 0 and resurrected == 0 and len(rounds) > 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=26)
    p.add_argument("--base", type=Path, default=Path("/var/tmp"))
    p.add_argument("--user", default="", help="run the server as this user (its socket in its data directory)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("pg_failover_user.json" if args.user else "pg_failover.json")
    try:
        s = run(args)
    except (BenchError, AssertionError, OSError, subprocess.SubprocessError) as exc:
        print(f"pg_failover: {exc}", file=sys.stderr)
        return 2
    print("| failovers | rows at the last epoch | lost | resurrected | kill → rows read, median s |")
    print("|---|---|---|---|---|")
    print(f"| {s['failovers']} | {s['rounds'][-1]['rows']} | {s['lost']} | {s['resurrected']} | "
          f"{s['seconds_to_rows_median']} |")
    print(f"goal (0 lost or resurrected): {'met' if s['goal_met'] else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, s)
    return 0 if s["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
