"""Failover: the time from SIGKILL of a node to its job running on another node.

For each job size M (MiB), each image cache state (warm, cold), each restore
mode (eager, lazy) and each NATS server count N (1; with --nats-servers 1,3 also
3), and each run, on a fresh local cluster (``revenant up --nodes 2``, with N > 1
``--nats-servers N``: a JetStream cluster of N servers on loopback; its directory
on disk under /var/tmp, the agents started with
``REVENANT_AGENT_RESTORE_MODE=<mode>``):

1. ``revenant submit --node node-1`` a job that holds M MiB of resident,
   page-distinct memory (this file run as ``--workload M``: random bytes, every
   4 KiB page stamped with its index) and prints a line every 0.1 s with its wall
   time and a check of 64 random pages' stamps.
2. Once it printed ``ready``: one manual ``revenant checkpoint create`` (no
   periodic timer, so the timing is ours), then a settle pause plus a random
   0-1 s, so the kill falls at a random phase of the heartbeat and lease cycles.
   Cold runs evict the epoch's image files from the page cache (posix_fadvise
   DONTNEED on those files only; nothing else on the machine is touched) just
   before the kill, as when another node wrote them to shared storage; warm runs
   restore from images written 2-3 s before the kill, still in memory (a best
   case).
3. T0 = wall time just before SIGKILL of node-1's agent, then of the job's
   namespace init (the agent's death would take the job anyway).
4. Wait for the job's ``restored`` event, then for the job's output in the 3 s
   after its first line stamped after T0 (the restored process really runs and
   its memory checks out), then (lazy) for the job's ``restore_completed``
   event: every page of the lazily restored job is in.

Runs alternate between the cache states, modes and server counts of one size
(1, 3, 1, 3, ...), so a drift of the machine's load touches them alike.  Eager
and lazy differ only in the agents' ``restore_mode``: an eager restore brings in
every page before the job runs again; a lazy one starts the job at once and its
pages arrive while it runs (page faults, plus a background fill), ending with
``restore_completed``.

How the parts are measured (all on this machine's wall clock, which the
coordinator's event ``at`` fields also use):

detection  T0 -> the node's ``dead`` event (``at``).  Also the event's
           ``silence_s``: seconds since the coordinator last heard node-1.
decision   ``dead`` event -> the coordinator's ``restore`` request reaching
           node-2.  A passive NATS subscriber of this benchmark on
           ``revenant.node.*.cmd.*`` timestamps the request as it arrives (core
           NATS delivers each request to every subscriber; we never reply; on a
           NATS cluster it is given every server's URL, as cluster.json lists
           them, and connects to one, the others routing to it).  It
           is mostly the wait for node-1's lease to expire (the coordinator logs
           "waiting X s for node node-1's lease" when there is a wait); the
           benchmark also watches the lease bucket itself, like the coordinator.
restore    restore request -> the ``restored`` event (``at``): the agent's
           restore (verify the images, roll the output back, criu restore) plus
           its reply and the coordinator's job-record write.  It is split with a
           /proc scan (every 25 ms, only while a restore is in flight, so it
           cannot slow detection or decision): the criu restore process's start
           time (from /proc/PID/stat, 10 ms resolution) and node-2's log line
           "job N restored from epoch" (millisecond resolution), logged right
           after criu exits; the first scan that no longer sees criu is in the
           JSON too (``restore_criu_scan_s``, up to 25 ms late).  So:
           verify = request -> criu start, criu = criu start -> log line,
           reply = log line -> ``restored`` event.  (Lazy: criu returns once
           the job runs, before its pages are in.)
total      T0 -> ``restored`` event: the job runs again (eager: with all its
           memory).  The event's ``since_last_heartbeat_s`` is reported too,
           and "last heartbeat -> restore request"
           (= dead.at - dead.silence_s -> request).
resumed    T0 -> the wall time in the restored job's first output line: the
           job prints again.
all pages  T0 -> the job's ``restore_completed`` event (``at``), and the
           event's own ``duration_s`` (restore start -> last page) and
           ``bytes`` (page bytes fetched).  Lazy only; eager restores emit no
           such event (None, "–" in the table).
slowdown   the restored job's gaps between consecutive output lines whose
           first line falls in the 3 s after its first new line (p50 and max),
           against the median gap of the same job before the kill (its lines
           between the checkpoint and T0); ratio = after / before.  Every 0.1 s
           tick reads 64 random pages, so missing pages (lazy) show as longer
           gaps.  A CORRUPT check in that window fails the run.

Goals (from the issues): total <= 3 s + restore, i.e. detection + decision
<= 3 s; last heartbeat -> restore request <= 3 s (the timeline in
docs/configuration.md promises the restore starts by 3.0 s).  Lazy restore:
T0 -> restore_completed (lazy) / T0 -> restored (eager) <= 1.3 per size and
cache state (medians), and T0 -> printing again (lazy, cold) <= 3.5 s for 1 GiB
and 4 GiB jobs.  Both are printed below the tables.  A 3-server NATS cluster:
median total on 3 servers / median total on 1 <= 1.2, per size, cache state
and mode (a row of the table, and a line below it, when 1 and 3 both ran).

A run whose failover never completes (the coordinator gives up, no ``restored``
event within the timeout, a lazy restore evicted before ``restore_completed``)
is recorded as failed, with the coordinator's log lines, and left out of the
medians; the benchmark keeps going until --runs runs succeeded or
--max-attempts were made, per size, cache state, mode and server count.

    .venv/bin/python bench/failover.py                    # 1024 MiB; warm, cold; eager, lazy; 3 runs each (~5 min)
    .venv/bin/python bench/failover.py --sizes 1024,4096  # the full run, with a 4 GiB job too (~15 min)
    .venv/bin/python bench/failover.py --sizes 64 --runs 1 --restore-mode eager --cache warm  # a quick look
    .venv/bin/python bench/failover.py --nats-servers 1,3 # each of those on 1 and on 3 NATS servers (~12 min)

--restore-mode eager,lazy (default both) and --cache warm|cold|both (default
both) pick what runs.  An eager run sets REVENANT_AGENT_RESTORE_MODE=eager only
where the agent has a restore_mode setting (without one it restores eagerly
anyway); lazy needs that setting.  --nats-servers COUNTS (default 1) runs each
of those once per count, e.g. 1,3 (a count is 1, or 3 or more, as ``revenant
up`` takes it).

--auth secure,insecure runs every configuration on authenticated clusters (``revenant up`` as it
is by default: an NKey identity per process, nats-server checking each one's permissions; the
default, ``--auth secure``) and on ``revenant up --insecure`` ones, the two taking turns (innermost,
after the server counts); the table then has a column per side and a second table the medians'
secure / insecure per part (detection, decision, restore and its split, total, last heartbeat ->
restore request, resumed), also in the JSON (``summary_by_auth``, ``auth_ratio``; default file
bench/results/failover-auth.json).  The observer connects as the coordinator identity on the
secure side, with no credential on the other.

    .venv/bin/python bench/failover.py --auth secure,insecure --sizes 64 --restore-mode eager --cache warm --runs 5

Prints one Markdown table per size (median [min-max] over the restored runs; one
column per cache state, mode and server count, its count in the "NATS servers"
row; with 1 and 3 a last row of total on 3 / on 1, goal met or not), then the
lazy/eager ratios and targets and the server-count ratios, and writes every run
(with its ``nats_servers``) and the summary to bench/results/failover.json (after
each run): ``summary`` (over the 1-server runs), ``summary_by_nats_servers``
(the same per count) and ``nats_servers_ratio`` (size -> cache -> mode -> N:
the medians, ratio, goal, met).
The lazy-restore measures live in bench/failover_lazy.py.  This is a benchmark,
not a test; numbers from a shared or noisy machine vary.  Everything it starts is
stopped and every cluster directory removed, also on an error or Ctrl-C; if it is
killed outright, run ``revenant down --dir DIR`` on the directory it printed.

    .venv/bin/python bench/failover.py --scenario proactive   # a node turns RED, dies 5 s later (~3 min)

runs the proactive scenario instead (bench/failover_proactive.py: the work a job re-does with
each --on-sick policy); it writes bench/results/failover-proactive.json.
"""
from __future__ import annotations

import argparse
import mmap
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

# bench/ is not a package: these are this script's own directory's.
from failover_cluster import GOAL_S, LEASE_MARGIN_S, LEASE_TTL_S, REPO, SERVERS_GOAL_RATIO, TICK_S, MiB, rounded
from failover_lazy import (CACHES, LAZY_TARGET_RATIO, LAZY_TARGET_RESUMED_S, MODES, WINDOW_S,
                           agent_has_restore_mode, targets)
from failover_report import auth_ratio, auth_table, servers_lines, servers_ratio, summarize, table
from failover_run import Run
from harness import BenchError, machine, write_json

PAGE = mmap.PAGESIZE
_STAMP = struct.Struct("<QQ")
_STAMP_KEY = 0x5245564E414E54


# ====================================================================== the workload


def workload(mib: int, interval: float) -> None:
    """Hold ``mib`` MiB of resident, non-zero, page-distinct memory; print a checked tick every ``interval``."""
    t0 = time.monotonic()
    size = mib * MiB
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = os.urandom(16 * MiB)
    view = memoryview(buf)
    step = MiB
    for i, off in enumerate(range(0, size, step)):
        start = (i * 4099) % (len(block) - step)  # rotating, page-unaligned offset
        view[off:off + step] = block[start:start + step]
    del block  # the image should be the job's M MiB plus the interpreter, not our scratch block
    pages = size // PAGE
    for n in range(pages):
        _STAMP.pack_into(buf, n * PAGE, n + 1, _STAMP_KEY ^ n)
    total = 0
    for off in range(0, size, PAGE):  # read every page back: all resident and warm
        total += buf[off + 16]
    print(f"ready {mib} MiB pid {os.getpid()} fill {time.monotonic() - t0:.2f} s check {total & 0xffff}",
          flush=True)
    rng = random.Random()
    n = 0
    while True:
        time.sleep(interval)
        n += 1
        ok = True
        for _ in range(64):
            p = rng.randrange(pages)
            if _STAMP.unpack_from(buf, p * PAGE) != (p + 1, _STAMP_KEY ^ p):
                ok = False
                break
        print(f"tick {n} {time.time():.3f} {'ok' if ok else 'CORRUPT'}", flush=True)


# ====================================================================== main


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise BenchError(f"{what} {text!r}: give one or more of {', '.join(allowed)}, comma-separated")
    return list(dict.fromkeys(got))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024", help="job sizes in MiB, comma-separated (1024; the full run: 1024,4096)")
    p.add_argument("--runs", type=int, default=3,
                   help="successful failovers wanted per size, cache, mode and server count (3)")
    p.add_argument("--restore-mode", default="eager,lazy",
                   help="restore modes, comma-separated: each runs on clusters whose agents have "
                        "REVENANT_AGENT_RESTORE_MODE=<mode> (eager,lazy)")
    p.add_argument("--cache", default="both", choices=("warm", "cold", "both"),
                   help="the epoch's images in the page cache at the kill (warm), evicted from it with "
                        "posix_fadvise DONTNEED on those files only, as when another node wrote them (cold), "
                        "or runs of each (both, the default)")
    p.add_argument("--cold-images", action="store_true", help=argparse.SUPPRESS)  # the old spelling of --cache cold
    p.add_argument("--nats-servers", default="1", metavar="COUNTS",
                   help="nats-server counts, comma-separated: each size, cache and mode runs on clusters "
                        "started with revenant up --nats-servers N for each N, the counts taking turns "
                        "(1; 1,3 also gives the median total on 3 servers / on 1, goal ≤ 1.2)")
    p.add_argument("--auth", default="secure", metavar="SIDES",
                   help="secure (revenant up as it is by default: every process its own NKey identity, the "
                        "server checking each one's permissions) and/or insecure (revenant up --insecure: an "
                        "open bus), comma-separated; with both the sides take turns (secure)")
    p.add_argument("--max-attempts", type=int, default=0,
                   help="attempts per size, cache, mode and server count at most (0: 2 × runs + 2)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds between the checkpoint and the kill, plus a random 0-1 s (2.0)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="for the job to fill its memory (300)")
    p.add_argument("--failover-timeout", type=float, default=90.0,
                   help="for the restored event after T0, and (lazy) for restore_completed after that (90)")
    p.add_argument("--base", type=Path, default=Path("/var/tmp"), help="where cluster directories go (/var/tmp)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (bench/results/failover.json)")
    p.add_argument("--keep", action="store_true", help="keep each cluster directory (logs, images)")
    p.add_argument("--scenario", default="failover", choices=("failover", "proactive"),
                   help="failover: a node killed outright (the default); proactive: a node turns RED and dies "
                        "5 s later, once per --on-sick policy (bench/failover_proactive.py)")
    p.add_argument("--workload", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _print_run(r: dict) -> None:
    print(f"  {r['status']}: detection {r.get('detection_s')} s, decision {r.get('decision_s')} s, "
          f"restore {r.get('restore_s')} s, total {r.get('total_s')} s, resumed {r.get('resumed_s')} s, "
          f"all pages in {r.get('restore_completed_s')} s, output gap p50 {r.get('gap_after_p50_s')} / "
          f"max {r.get('gap_after_max_s')} s (before {r.get('gap_before_p50_s')} s)", file=sys.stderr, flush=True)
    if r["status"] not in ("restored", "error"):
        if r.get("evicted_after_t0"):
            print(f"    evicted: {r['evicted_after_t0'].get('reason')}", file=sys.stderr)
        for line in r.get("coordinator_log", [])[-4:]:
            print(f"    {line}", file=sys.stderr)


def _server_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 or n == 2 for n in counts):
        raise BenchError(f"--nats-servers {text!r}: give server counts, 1 or 3 or more, comma-separated (e.g. 1,3)")
    return list(dict.fromkeys(counts))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload is not None:
        workload(args.workload, TICK_S)
        return 0
    if args.scenario == "proactive":
        if args.nats_servers.strip() != "1":
            print("failover: --nats-servers is for the failover scenario; the proactive one runs on one server",
                  file=sys.stderr)
            return 2
        from failover_proactive import main as proactive

        return proactive(args)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        if not sizes or min(sizes) <= 0:
            raise ValueError
    except ValueError:
        print(f"failover: --sizes {args.sizes!r}: give sizes in MiB, comma-separated", file=sys.stderr)
        return 2
    try:
        counts = _server_counts(args.nats_servers)
        auths = _choices(args.auth, ("secure", "insecure"), "--auth")
        modes = _choices(args.restore_mode, MODES, "--restore-mode")
        if set(modes) - {"eager"} and not agent_has_restore_mode():
            raise BenchError("this revenant's agent has no restore_mode setting (no lazy restore): "
                             "run with --restore-mode eager")
    except BenchError as exc:
        print(f"failover: {exc}", file=sys.stderr)
        return 2
    caches = ["cold"] if args.cold_images else list(CACHES) if args.cache == "both" else [args.cache]
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("failover-auth.json" if "insecure" in auths else "failover.json")
    max_attempts = args.max_attempts or 2 * args.runs + 2

    def on_term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    doc = {"benchmark": "failover", "started_at": time.time(), "machine": machine(),
           "config": {"sizes_mib": sizes, "runs": args.runs, "max_attempts": max_attempts, "settle_s": args.settle,
                      "restore_modes": modes, "caches": caches, "nats_servers": counts, "window_s": WINDOW_S,
                      "kill_phase": "settle + uniform(0, 1) s after the checkpoint", "base": str(args.base),
                      "lease_ttl_s": LEASE_TTL_S, "lease_margin_s": LEASE_MARGIN_S, "goal_s": GOAL_S,
                      "lazy_target_ratio": LAZY_TARGET_RATIO, "lazy_target_resumed_s": LAZY_TARGET_RESUMED_S,
                      "servers_goal_ratio": SERVERS_GOAL_RATIO, "auth": auths,
                      "argv": sys.argv[1:] if argv is None else argv},
           "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # summary: the shape it always had, over the 1-server runs (without any, the first count's);
        # summary_by_nats_servers: that per server count; nats_servers_ratio: N servers / 1, if both ran.
        by = {str(n): summarize(doc["runs"], sizes, caches, modes, n) for n in counts}
        doc["summary"] = by["1"] if "1" in by else by[str(counts[0])]
        doc["summary_by_nats_servers"] = by
        doc["nats_servers_ratio"] = servers_ratio(by, sizes, caches, modes)
        if len(auths) > 1:  # secure against insecure, on the first server count
            doc["summary_by_auth"] = {a: summarize(doc["runs"], sizes, caches, modes, counts[0], a) for a in auths}
            doc["auth_ratio"] = auth_ratio(doc["summary_by_auth"], sizes, caches, modes)
        doc["elapsed_s"] = rounded(time.time() - doc["started_at"], 1)
        write_json(args.out, doc)

    interrupted = False
    # The server counts and the sides innermost: 1, 3, 1, 3, ..., secure, insecure, ... so that a drift
    # of the load touches both alike.
    combos = [(c, m, n, a) for c in caches for m in modes for n in counts for a in auths]
    try:
        for mib in sizes:
            ok = dict.fromkeys(combos, 0)
            tried = dict.fromkeys(combos, 0)
            while any(ok[k] < args.runs and tried[k] < max_attempts for k in combos):
                for key in combos:  # one attempt each in turn: a drift of the load touches all alike
                    cache, mode, servers, auth = key
                    if ok[key] >= args.runs or tried[key] >= max_attempts:
                        continue
                    tried[key] += 1
                    run = Run(args, mib, tried[key], args.base, mode, cache, servers, auth)
                    on = "" if counts == [1] else f", {servers} NATS server{'s' if servers > 1 else ''}"
                    on += "" if auths == ["secure"] else f", {auth}"
                    print(f"[{mib} MiB, {cache}, {mode}{on}, attempt {tried[key]}] cluster in {run.dir}",
                          file=sys.stderr, flush=True)
                    try:
                        run.execute()
                    except BenchError as exc:
                        run.result["error"] = str(exc)
                        print(f"  error: {exc}", file=sys.stderr, flush=True)
                    finally:
                        run.cleanup()
                    doc["runs"].append(run.result)
                    save()
                    if run.result["status"] == "restored":
                        ok[key] += 1
                    _print_run(run.result)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; cleaned up", file=sys.stderr)
    doc["finished_at"] = time.time()
    save()
    cold = " (cold: evicted from the page cache before the kill)" if "cold" in caches else ""
    print(f"\nfailover, restore {' and '.join(modes)}, images {' and '.join(caches)}{cold}, "
          f"NATS servers {' and '.join(map(str, counts))}, bus {' and '.join(auths)}, kernel {doc['machine']['kernel']}, "
          f"{doc['machine']['cpus']} CPUs, {doc['elapsed_s']:.0f} s; every run in {args.out}\n")
    for mib in sizes:
        if len(auths) > 1:
            print(auth_table(doc["summary_by_auth"], mib, caches, modes, doc["auth_ratio"]) + "\n")
        else:
            print(table(doc["summary_by_nats_servers"], mib, caches, modes, doc["nats_servers_ratio"]) + "\n")
    for n in counts:
        lines = targets(doc["summary_by_nats_servers"][str(n)], sizes, caches, modes)
        if lines:
            on = "" if len(counts) == 1 else f", {n} NATS server{'s' if n > 1 else ''}"
            print(f"Lazy restore targets (medians{on}):\n" + lines)
    lines = servers_lines(doc["nats_servers_ratio"])
    if lines:
        print("NATS cluster goal (medians, total T0 → restored):\n" + lines)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
