"""Partitions: a randomized nemesis over a ``revenant up --netns`` cluster, every step checked.

Two parts, on clusters where every nats-server, coordinator and agent has a network namespace of
its own (tests/netcluster/ holds the nemesis, the recorder and the checker):

1. **Failover time, partitioned against killed** (3 nodes, 1 server).  Each trial submits a
   stepper job (tests/jobs/stepper.py) on a node, waits for its first epoch, then either SIGKILLs
   the node's agent (its jobs die with it) or cuts the node off from every other process (the
   storage stays shared), alternating.  The time is from the fault to the job table naming the
   job running on another node (a KV watch, on this machine's clock).  Healed (or restarted by
   the supervisor) before the next trial.
2. **A randomized schedule** (4 nodes, 3 servers, 2 coordinators, ``failover_pause_fraction``
   0.5) for ``--duration`` seconds: each round picks one of the faults below at random (seeded),
   holds it 4 to 10 s, heals, and lets the cluster settle 6 s.  One stepper job per node runs
   throughout, checkpointed every 3 s.  At the end the checker reads the whole history.

Faults: a node isolated; the leading coordinator isolated; a nats-server isolated with one node
(its side of a split); a minority split (a server and two nodes against the rest); one-way loss (40% of
what a node sends to a server); one-way drop (nothing from a server reaches a node); flapping
(a node cut and mended every 1.5 s).  Delay is left out where the kernel has no netem.

Prints a table and writes bench/results/nemesis.json: faults applied, failovers, copies seen,
steps and bytes checked, violations (each named: safety), how long each copy frozen at a heal
took to be thawed or killed (the target: 5 s), counted from the heal and from when its node's
lease was back (a split NATS cluster elects its streams' leaders anew as it heals: seconds in
which no lease can be renewed), and part 1's medians.

    .venv/bin/python bench/nemesis.py                   # 5 minutes, 3 trials of each fault kind
    .venv/bin/python bench/nemesis.py --duration 60 --trials 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ is not a package: its modules import their siblings by name; tests/ holds the netcluster.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import REVENANT, ROOT_JOBS, machine, text_table, write_json  # noqa: E402
from netcluster.checker import RUNNING, heal_times  # noqa: E402
from netcluster.nemesis import delay_supported  # noqa: E402
from netcluster.run import Run  # noqa: E402
from revenant.cli.cluster import netns  # noqa: E402

HEAL_BOUND_S = 5.0  # the target: every copy frozen at a heal thawed, or killed with its job elsewhere
TRIAL_STEPS = 250  # 25 s: each trial's job ends on its own
RESULTS = Path(__file__).resolve().parent / "results" / "nemesis.json"


class Cluster:
    """What netcluster.run.Run needs of a cluster: its directory, its storage, its CLI."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.storage = directory / "storage"

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        doc = json.loads((self.dir / "cluster.json").read_text())
        env = {**os.environ, "REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}
        proc = subprocess.run([REVENANT, *args], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=self.dir, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise RuntimeError(f"revenant {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return proc

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.cli("events", "--json").stdout.splitlines()]


def up(directory: Path, nodes: int, servers: int, coordinators: int, env: dict | None = None) -> Run:
    subprocess.run([REVENANT, "up", "--netns", "--nodes", str(nodes), "--nats-servers", str(servers),
                    "--coordinators", str(coordinators), "--dir", str(directory), "--detach"], check=True,
                   capture_output=True, timeout=180, env={**os.environ, **ROOT_JOBS, **(env or {})})
    try:
        return Run(Cluster(directory))
    except BaseException:
        subprocess.run([REVENANT, "down", "--dir", str(directory)], capture_output=True, timeout=180)
        raise


def down(run: Run) -> None:
    """The cluster and its namespaces, even where a process would not stop."""
    try:
        run.stop()
    finally:
        subprocess.run([REVENANT, "down", "--dir", str(run.cluster.dir)], capture_output=True, timeout=180)
        netns.remove(run.layout)


def moved(run: Run, job: str, off: str):
    p = run.placement(job)
    return p is not None and p.node != off and p.state in RUNNING


def failover_times(root: Path, trials: int) -> dict:
    """Part 1: seconds from the fault to the job running elsewhere, by kind of fault."""
    run = up(root / "failover", 3, 1, 1)
    times: dict[str, list[float]] = {"killed": [], "partitioned": []}
    try:
        for i in range(2 * trials):
            kind = "killed" if i % 2 == 0 else "partitioned"
            node = run.nodes[i % len(run.nodes)]
            job = run.submit(node, TRIAL_STEPS, every="0:2")
            run.wait(lambda: run.epoch_of(job) >= 1 and run.placement(job).state == "running", 60, "a first epoch")
            time.sleep(random.uniform(0.5, 1.5))  # a random phase of the heartbeat and lease cycles
            t0 = time.time()
            if kind == "killed":
                agent = next(p for p in json.loads((run.cluster.dir / "cluster.json").read_text())["processes"]
                             if p["name"] == node)
                os.kill(agent["pid"], signal.SIGKILL)
            else:
                run.nemesis.isolate(node)
            run.wait(lambda: moved(run, job, node), 60, f"job {job}'s failover ({kind})")
            at = next(p.t for p in run.history.table if p.job == job and p.node != node and p.state in RUNNING)
            times[kind].append(at - t0)
            run.heal()
            time.sleep(6)  # the supervisor restarts a killed agent; a healed node reconciles
        time.sleep(TRIAL_STEPS * 0.1)  # every job done (completed), for the checker
        violations = run.violations()
    finally:
        down(run)
    out: dict = {kind: {"runs": [round(t, 3) for t in ts], "median_s": round(statistics.median(ts), 3)}
                 for kind, ts in times.items()}
    return {**out, "violations": violations}


def faults(run: Run, rng: random.Random) -> list:
    """Each fault: (name, apply) where apply() starts it on ``run``'s nemesis."""
    n, servers = run.nemesis, [m for m in run.members if m.startswith("nats-server")]
    others = lambda *side: [m for m in run.members if m not in side]  # noqa: E731
    node = lambda: rng.choice(run.nodes)  # noqa: E731
    out = [
        ("node isolated", lambda: n.isolate(node())),
        ("leader isolated", lambda: n.isolate(run.leader() or "coordinator")),
        ("server isolated with a node", lambda: (lambda side: n.partition(side, others(*side)))(
            [rng.choice(servers), node()])),
        ("minority split", lambda: (lambda side: n.partition(side, others(*side)))(
            [rng.choice(servers), *rng.sample(run.nodes, 2)])),
        ("one-way loss 40%", lambda: n.drop(node(), rng.choice(servers), 40)),
        ("one-way drop", lambda: n.drop(rng.choice(servers), node(), 100)),
        ("flapping", lambda: (lambda x: n.flap([x], others(x), 1.5, 8))(node())),
    ]
    if delay_supported():
        out.append(("delay 200 ms", lambda: n.delay(node(), 200)))
    return out


def randomized(root: Path, duration_s: float, seed: int) -> dict:
    """Part 2: faults at random for ``duration_s``, then the checker."""
    rng = random.Random(seed)
    run = up(root / "random", 4, 3, 2, env={"REVENANT_COORDINATOR_FAILOVER_PAUSE_FRACTION": "0.5"})
    applied: list[str] = []
    try:
        jobs = [run.submit(node, 100000, every="0:3") for node in run.nodes]
        run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 90, "a first epoch of every job")
        menu = faults(run, rng)
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            name, apply = rng.choice(menu)
            apply()
            applied.append(name)
            print(f"  {time.strftime('%H:%M:%S')} {name}", flush=True)
            time.sleep(rng.uniform(4, 10))
            run.heal()
            time.sleep(6)
        time.sleep(6)
        violations = run.violations()
    finally:
        down(run)
    heals = {}
    for name, from_lease in (("from_heal", False), ("from_lease", True)):
        took = [t for _, _, t in heal_times(run.history, from_lease)]
        settled = sorted(t for t in took if t is not None)
        heals[name] = {"copies": len(took), "median_s": round(statistics.median(settled), 2) if settled else None,
                       "max_s": round(settled[-1], 2) if settled else None,
                       "slow": run.slow_heals(HEAL_BOUND_S, from_lease)}
    generations = {}
    for p in run.history.table:
        generations.setdefault(p.job, set()).add(p.generation)
    pids = {(c.job, c.pid) for _, seen in run.history.samples for c in seen}
    checked = sum(len((run.cluster.storage / "jobs" / j / "output.log").read_bytes())
                  for j in run.jobs if (run.cluster.storage / "jobs" / j / "output.log").exists())
    return {"seed": seed, "duration_s": duration_s, "faults": applied, "faults_applied": len(applied),
            "failovers": sum(len(g) - 1 for g in generations.values()), "copies_seen": len(pids),
            "steps_seen": len(run.history.steps), "bytes_checked": checked, "violations": violations,
            "heals": len(run.history.heals), "heal_times": heals,
            "delay": "tc netem" if delay_supported() else "left out: this kernel has no netem qdisc"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of randomized faults (default 300)")
    ap.add_argument("--trials", type=int, default=3, help="failover trials of each kind (default 3)")
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random, recorded)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    root = Path(tempfile.mkdtemp(prefix="rv-nemesis-", dir="/var/tmp"))
    times = failover_times(root, args.trials) if args.trials else {}
    result = randomized(root, args.duration, seed) if args.duration > 0 else {}
    slow = result.get("heal_times", {}).get("from_lease", {}).get("slow")
    if result.get("violations") or times.get("violations") or slow:
        print(f"kept for a look: {root} (each cluster's logs/, nemesis.jsonl)")
    else:
        shutil.rmtree(root, ignore_errors=True)
    rows = [[k, str(len(v["runs"])), f"{v['median_s']:.2f}", " ".join(f"{t:.2f}" for t in v["runs"])]
            for k, v in times.items() if k != "violations"]
    print(text_table(["failover", "runs", "median s", "each s"], rows))
    if times:
        gap = times["partitioned"]["median_s"] - times["killed"]["median_s"]
        print(f"partitioned - killed: {gap:+.2f} s (target: within 1 s); violations in these runs: "
              f"{len(times['violations'])}")
        for v in times["violations"]:
            print(f"  violation: {v}")
    if result:
        print(text_table(["faults", "failovers", "copies seen", "steps", "bytes checked", "violations"],
                         [[str(result["faults_applied"]), str(result["failovers"]), str(result["copies_seen"]),
                           str(result["steps_seen"]), str(result["bytes_checked"]), str(len(result["violations"]))]]))
        for v in result["violations"]:
            print(f"  violation: {v}")
        print(text_table(["heal settled, counted from", "heals", "copies frozen", "median s", "max s",
                          f"over {HEAL_BOUND_S:g} s"],
                         [[name.replace("_", " "), str(result["heals"]), str(h["copies"]), str(h["median_s"]),
                           str(h["max_s"]), str(len(h["slow"]))] for name, h in result["heal_times"].items()]))
        for v in result["heal_times"]["from_lease"]["slow"]:
            print(f"  slow: {v}")
    write_json(args.out, {"machine": machine(), "failover": times, "randomized": result})
    print(f"wrote {args.out}")
    return 1 if result.get("violations") or times.get("violations") else 0


if __name__ == "__main__":
    sys.exit(main())
