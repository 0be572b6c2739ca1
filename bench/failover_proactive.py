"""bench/failover.py's proactive scenario: a node turns RED, then dies 5 s later; the work its job
re-does with each ``--on-sick`` policy (none, checkpoint, migrate), side by side.

Not a benchmark of its own: ``bench/failover.py --scenario proactive`` runs it.  For each policy,
on a fresh local cluster:

1. ``revenant up --nodes 1 --insecure --detach``: NATS, the coordinator and node-1 (the healthy
   node), all with the defaults (no REVENANT_AGENT_* or REVENANT_COORDINATOR_* setting: the point
   is that the defaults, proactive_hold_s 2 s among them, meet the targets).  The sick node,
   node-2, is an agent this benchmark starts itself, with its own environment: its
   ``memory_yellow_percent`` and ``memory_red_percent`` just above the machine's memory use now
   (1.5 GiB and 3 GiB above it).  The agents of one machine share its memory, so only node-2's
   thresholds make it the sick one.
2. ``revenant submit --node node-2 --checkpoint 5:00 --on-sick POLICY --requeue`` a job that
   prints ``tick N WALL ok`` every 0.1 s (bench/failover.py's workload, 16 MiB): its progress
   is the tick number, its wall time on the line.  The periodic checkpoint is 5 minutes away:
   no epoch of the schedule falls in the run.  (``--requeue``: a job with no epoch at its node's
   death starts again from the beginning rather than fails.)  Its working directory is one of
   its own in the cluster directory: a restore moves aside whatever changed in the working
   directory after the epoch, which must not be the files of a repository being edited.
3. After 20 s of the job, a process allocates and touches enough memory to take the machine
   1.5 GiB past node-2's RED threshold (bench/workloads/hold_memory.py).  YELLOW and RED verdicts
   = the arrival of node-2's first heartbeat saying YELLOW-or-worse, and RED.
4. Death at the RED verdict + 5 s: SIGKILL of node-2's agent, its children, the job's copy on
   node-2 (its namespace init, if it still runs there) and the allocator.
5. Wait for the job to run on node-1 again and print for 2 s.

The job's output is read every 50 ms and right after the kill, so every line a copy printed is
seen before a restore rolls the output back (to the epoch) or a requeue empties it.  The restored
copy is the one started by node-1's first ``restore`` or ``start`` request (a passive NATS
subscriber timestamps it): every line stamped before that request is the old copy's, every
later line the new copy's.  Then

  progress at death  the old copy's last tick, in seconds of its run (wall of that tick − wall of
                     its tick 1 + 0.1 s);
  resumed from       the tick before the new copy's first line, in the same seconds (0: it started
                     over);
  work re-done       progress at death − resumed from (seconds of the job's progress run twice).

Targets: migrate 0 s (the job moved before the death); checkpoint ≤ YELLOW verdict → death;
none: everything since the start (no periodic epoch within 5 minutes).  Also reported: the
epochs of cause ``health`` (``epoch_event`` created) after the RED verdict, RED verdict → the
epoch the job came back from (the proactive action's) and → that epoch's last output line (the
job's state saved), RED verdict → the job running on node-1 (the ``migrated``/``restored``/
``requeued`` event); the JSON has the coordinator's log lines about the job and node-2.  The
allocator fills memory at some GB/s, so node-2 usually reports YELLOW a second or more before
RED, and the coordinator may act on the YELLOW already (a checkpoint, with either policy).

One run per policy; the table goes to stdout, every run to bench/results/failover-proactive.json.
"""
from __future__ import annotations

import argparse
import sys
import time

# bench/ is not a package: these are this script's own directory's.
from failover_proactive_run import Run
from failover_proactive_watch import (DEATH_AFTER_RED_S, GiB, INTERVAL, JOB_MIB, PAST_RED, POLICIES, RED_ABOVE,
                                      REPO, RUN_BEFORE_S, TICK_S, YELLOW_ABOVE, coordinator_defaults, rounded)
from harness import BenchError, machine, write_json


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else f"{x:{fmt}}"


def _back(r: dict) -> str:
    b = r.get("back") or {}
    if b.get("kind") == "requeued":
        return "requeued: started over"
    if b.get("kind") in ("restored", "migrated"):
        cause = next((e.get("cause") for e in r.get("epochs_created", []) if e.get("n") == b.get("epoch")), None)
        return f"{b['kind']} from epoch {b.get('epoch')}" + (f" (cause {cause})" if cause else "")
    return b.get("kind") or "–"


def _health_epochs(r: dict) -> str:
    got = r.get("health_epochs_after_red_s")
    return "–" if not got else ", ".join(f"{n}: {_f(s)}" for n, s in got)


ROWS = [  # label, cell
    ("node-2's first YELLOW-or-worse heartbeat → its first RED (s)", lambda r: _f(r.get("yellow_to_red_s"))),
    ("YELLOW → death (s)", lambda r: _f(r.get("yellow_to_death_s"))),
    ("RED → death (s)", lambda r: _f(r.get("red_to_death_s"))),
    ("epochs of cause health, committed (epoch: s after RED)", _health_epochs),
    ("RED → the epoch it came back from, committed (s)", lambda r: _f(r.get("red_to_epoch_s"))),
    ("RED → that epoch's last line (job state saved) (s)", lambda r: _f(r.get("red_to_saved_s"))),
    ("RED → job running on node-1 (s)", lambda r: _f(r.get("red_to_back_s"))),
    ("how it came back", _back),
    ("job's copy still on node-2 at the death", lambda r: "–" if "death" not in r
     else "yes" if r["death"]["sick_copy_alive"] else "no (it had moved)"),
    ("progress of node-2's copy when it ended: death, or the move (s)",
     lambda r: _f(r.get("progress_at_death_s"), ".1f")),
    ("progress the restored copy resumed from (s)", lambda r: _f(r.get("resumed_from_s"), ".1f")),
    ("**work re-done (s)**", lambda r: "–" if r.get("redone_s") is None
     else f"**{r['redone_s']:.1f}** ({r['redone_ticks']} ticks)"),
    ("target", lambda r: r.get("target", "–")),
    ("met", lambda r: "–" if "target_met" not in r else "yes" if r["target_met"] else "**NO**"),
]


def table(runs: list[dict]) -> str:
    by = {r["policy"]: r for r in runs}
    cols = [p for p in POLICIES if p in by]
    lines = [f"| node RED, dead {DEATH_AFTER_RED_S:g} s later; job `--checkpoint {INTERVAL}` | "
             + " | ".join(f"`--on-sick {p}`" for p in cols) + " |",
             "|---|" + "---|" * len(cols),
             "| run | " + " | ".join(by[p]["status"] for p in cols) + " |"]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(by[p]) for p in cols) + " |")
    return "\n".join(lines)


# ====================================================================== main


def main(args: argparse.Namespace) -> int:
    """Run the scenario once per policy (``args``: bench/failover.py's: base, keep, out, timeouts)."""
    out = args.out or REPO / "bench" / "results" / "failover-proactive.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    defaults = coordinator_defaults()
    doc = {"benchmark": "failover-proactive", "started_at": time.time(), "machine": machine(),
           "config": {"policies": list(POLICIES), "run_before_s": RUN_BEFORE_S,
                      "death_after_red_s": DEATH_AFTER_RED_S, "checkpoint_interval": INTERVAL,
                      "job_mib": JOB_MIB, "tick_s": TICK_S, "yellow_above_gib": YELLOW_ABOVE / GiB,
                      "red_above_gib": RED_ABOVE / GiB, "past_red_gib": PAST_RED / GiB,
                      "coordinator_defaults": defaults, "argv": sys.argv[1:]},
           "runs": []}

    def save() -> None:
        doc["elapsed_s"] = rounded(time.time() - doc["started_at"], 1)
        write_json(out, doc)

    interrupted = False
    try:
        for policy in POLICIES:
            run = Run(args, policy)
            print(f"[proactive, --on-sick {policy}] cluster in {run.dir}", file=sys.stderr, flush=True)
            try:
                run.execute()
            except BenchError as exc:
                run.result["error"] = str(exc)
                print(f"  error: {exc}", file=sys.stderr, flush=True)
            finally:
                run.logs(run.result.get("job"))
                run.cleanup()
            doc["runs"].append(run.result)
            save()
            r = run.result
            print(f"  {r['status']}: re-done {r.get('redone_s')} s ({r.get('redone_ticks')} ticks), "
                  f"RED → epoch {r.get('red_to_epoch_s')} s, RED → back {r.get('red_to_back_s')} s, "
                  f"{_back(r)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; cleaned up", file=sys.stderr)
    doc["finished_at"] = time.time()
    save()
    hold = defaults.get("proactive_hold_s")
    print(f"\nfailover, proactive: node-2 turns RED (memory past its red threshold), dies "
          f"{DEATH_AFTER_RED_S:g} s later; coordinator defaults (proactive_hold_s {hold} s, on_sick "
          f"{defaults.get('on_sick')}); kernel {doc['machine']['kernel']}, {doc['machine']['cpus']} CPUs, "
          f"{doc['elapsed_s']:.0f} s; every run in {out}\n")
    if doc["runs"]:
        print(table(doc["runs"]))
    return 130 if interrupted else 0
