"""The checkpoint engine against raw criu: wall time, freeze time and image size.

For each size M (MiB) it runs, side by side and alternating, the same job
(bench/workloads/hold_memory.py: M MiB of resident, page-distinct data, then
idle) in two ways and checkpoints it once per run:

raw       the job started the way the agent starts one (``unshare --pid --fork
          --kill-child setsid /bin/sh -c <revenant's init script> ...``), then
          ``criu dump -t <namespace init> -D <dir> --leave-running --display-stats``
          straight into a directory on the same filesystem as revenant's storage,
          then an fsync of every image file and of the directory.
          wall = criu's run + the fsyncs.
revenant  ``revenant submit`` to a one-node local cluster (``revenant up``, its
          storage on the real disk), then ``revenant checkpoint create`` timed end
          to end from the shell's point of view: CLI start-up, NATS, coordinator,
          agent, criu into node-local staging (tmpfs), copy to storage with
          SHA-256 and fsync, the manifest, the rename, the reply.
phases    (unless --no-phases) where revenant's time goes, measured outside
          revenant on the same job: a dump with the agent's exact criu flags
          straight into the storage filesystem (+ fsync; then removed), the same
          dump into tmpfs staging as the agent does, then revenant's own commit
          code (``revenant.agent.storage.epochs.JobFiles.commit``) timed on those
          images, the agent's read/write copy + fsync, a sendfile copy + fsync
          and a SHA-256 of the same images, each alone, and an alternative
          commit (sendfile copy || SHA-256 over an mmap).

Freeze time is criu's "Frozen time" (``--display-stats``; for revenant, the
epoch's ``freeze_s``).  Image size is the sum of the image files (``*.img`` and
``stats-dump``; criu's log is not counted), which is what revenant's epoch
records.  Goal: revenant's wall time over raw criu's at most 1.10 at 2 GiB, and
revenant's freeze no longer than raw criu's.

    .venv/bin/python bench/checkpoint.py                          # 64, 512, 2048 MiB, 3 runs each
    .venv/bin/python bench/checkpoint.py --sizes 64 --repeat 1    # a quick look

Every measured step starts after --settle seconds with no other criu running and
idle CPUs (waiting up to --quiet-wait): this VM returns freed memory to its host
(virtio-balloon free page reporting) after about 2 s, and the first touch of
such memory is slow, so steps that ran straight after a big free would look
faster than they are.  Medians are reported; every run (warm-ups included,
flagged) goes to bench/results/checkpoint.json.  This is a benchmark, not a
timed test: on a shared or noisy machine compare the ratios within one run,
never absolute times across runs.  Everything it starts is stopped and everything it writes is
removed, also on an error or Ctrl-C; if it is killed outright, run
``revenant down --dir DIR`` on the directory it printed.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# bench/ is not a package: these are this script's own directory's.
from checkpoint_bench import Bench
from checkpoint_parts import (BIN, GOAL_SIZE_MIB, NODE, REPO, WALL_GOAL, WALL_INCLUDES, WORKLOAD, GiB, MiB, median,
                              prefault, rounded)
from harness import BenchError, filesystem, text_table, write_json


def summarize(runs: list[dict], sizes: list[int], quiet_cpu: float = 25.0) -> list[dict]:
    out = []
    for mib in sizes:
        def pick(side: str, key: str) -> list[float]:
            return [r[key] for r in runs if r["side"] == side and r["mib"] == mib and not r["warmup"]
                    and r.get(key) is not None]

        raw_wall, rev_wall = median(pick("raw", "wall_s")), median(pick("revenant", "wall_s"))
        raw_freeze, rev_freeze = median(pick("raw", "freeze_s")), median(pick("revenant", "freeze_s"))
        ratio = rev_wall / raw_wall if raw_wall and rev_wall else None
        # Paired ratios: run i of revenant against run i of raw (they ran next to each other).
        pairs = [a / b for a, b in zip(pick("revenant", "wall_s"), pick("raw", "wall_s")) if b]
        s = {
            "mib": mib,
            "runs": len(pick("raw", "wall_s")),
            "raw_wall_s": rounded(raw_wall), "raw_criu_s": rounded(median(pick("raw", "criu_s"))),
            "raw_fsync_s": rounded(median(pick("raw", "fsync_s"))),
            "revenant_wall_s": rounded(rev_wall), "revenant_duration_s": rounded(median(pick("revenant", "duration_s"))),
            "revenant_engine_after_freeze_s": rounded(median(pick("revenant", "engine_after_freeze_s"))),
            "revenant_agent_criu_s": rounded(median(pick("revenant", "agent_criu_s"))),
            "revenant_agent_commit_s": rounded(median(pick("revenant", "agent_commit_s"))),
            "revenant_control_plane_s": rounded(median(pick("revenant", "control_plane_s"))),
            "cli_roundtrip_s": rounded(median(pick("revenant", "cli_roundtrip_s"))),
            "wall_ratio": rounded(ratio, 3), "paired_wall_ratio_median": rounded(median(pairs), 3),
            "raw_freeze_s": rounded(raw_freeze), "revenant_freeze_s": rounded(rev_freeze),
            "raw_image_bytes": int(median(pick("raw", "bytes")) or 0),
            "revenant_image_bytes": int(median(pick("revenant", "bytes")) or 0),
            "wall_goal_met": None if ratio is None else ratio <= WALL_GOAL,
            "wall_goal_applies": mib == GOAL_SIZE_MIB,
            "freeze_goal_met": None if rev_freeze is None or raw_freeze is None else rev_freeze <= raw_freeze,
            # Measured runs that started while another criu ran or the CPUs were busy (--quiet-wait ran out).
            "noisy_runs": sum(1 for r in runs if r["mib"] == mib and not r["warmup"]
                              and (r.get("foreign_criu") or r.get("cpu_busy_before_pct", 0) > quiet_cpu)),
        }
        if pick("phases", "stage_dump_s"):
            s["phases"] = {k: rounded(median(pick("phases", k))) for k in
                           ("stage_dump_s", "freeze_s", "direct_dump_s", "direct_fsync_s", "direct_freeze_s",
                            "commit_s", "copy_fsync_s", "sendfile_fsync_s", "sha256_s", "alt_commit_s")}
            s["phases"]["criu_log_bytes"] = int(median(pick("phases", "criu_log_bytes")) or 0)
        out.append(s)
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _yn(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def report(summary: list[dict], meta: dict) -> str:
    header = ["M MiB", "raw wall s", "rev wall s", "ratio", "raw freeze s", "rev freeze s", "raw img MiB",
              "rev img MiB", "wall <=1.10", "freeze <= raw"]
    rows = []
    for s in summary:
        rows.append([str(s["mib"]), _f(s["raw_wall_s"]), _f(s["revenant_wall_s"]), _f(s["wall_ratio"]),
                     _f(s["raw_freeze_s"], "{:.3f}"), _f(s["revenant_freeze_s"], "{:.3f}"),
                     _f(s["raw_image_bytes"] / MiB, "{:.1f}"), _f(s["revenant_image_bytes"] / MiB, "{:.1f}"),
                     _yn(s["wall_goal_met"]) + ("" if s["wall_goal_applies"] else " (n/a)"),
                     _yn(s["freeze_goal_met"])])
    lines = [text_table(header, rows), ""]
    header2 = ["M MiB", "raw criu s", "raw fsync s", "rev engine s", "rev criu s", "rev commit s",
               "rev control s", "cli rtt s"]
    rows2 = [[str(s["mib"]), _f(s["raw_criu_s"]), _f(s["raw_fsync_s"]), _f(s["revenant_duration_s"]),
              _f(s["revenant_agent_criu_s"]), _f(s["revenant_agent_commit_s"]),
              _f(s["revenant_control_plane_s"]), _f(s["cli_roundtrip_s"])] for s in summary]
    lines += [text_table(header2, rows2), ""]
    if any("phases" in s for s in summary):
        header3 = ["M MiB", "staged dump s", "staged freeze s", "direct dump+fsync s", "direct freeze s",
                   "commit s", "copy+fsync s", "sendfile+fsync s", "sha256 s", "alt commit s", "-v4 log MiB"]
        rows3 = [[str(s["mib"]), _f(p["stage_dump_s"]), _f(p["freeze_s"], "{:.3f}"),
                  _f(None if p["direct_dump_s"] is None else p["direct_dump_s"] + p["direct_fsync_s"]),
                  _f(p["direct_freeze_s"], "{:.3f}"), _f(p["commit_s"]),
                  _f(p["copy_fsync_s"]), _f(p["sendfile_fsync_s"]), _f(p["sha256_s"]), _f(p["alt_commit_s"]),
                  _f(p["criu_log_bytes"] / MiB, "{:.1f}")]
                 for s in summary if (p := s.get("phases"))]
        lines += [text_table(header3, rows3), ""]
    noisy = sum(s["noisy_runs"] for s in summary)
    if noisy:
        lines += [f"WARNING: {noisy} measured run(s) started while another criu ran or the CPUs were busy", ""]
    lines += [
        f"medians of {meta['repeat']} run(s) per size and side (after {meta['warmup']} warm-up round(s) per size)",
        f"raw wall      = {WALL_INCLUDES['raw']}",
        f"revenant wall = {WALL_INCLUDES['revenant']}",
        "rev engine = the epoch's duration_s (agent: criu + commit); rev criu = the agent's criu run (dump_s as "
        "manifest.json records it); rev commit = engine - criu; control = rev wall - rev engine; "
        "cli rtt = one `revenant show job` (CLI start-up + NATS + coordinator, no work)",
        "phases (outside revenant): staged dump = criu with the agent's flags (-v4, action script) into tmpfs; "
        "direct = the same criu straight into the storage filesystem, + fsync; "
        "commit = revenant.agent.storage.epochs.JobFiles.commit on those images; copy+fsync (the agent's read/write copy), "
        "sendfile+fsync and sha256 each alone; alt commit = sendfile+fsync || sha256 over mmap",
        f"goals: revenant wall / raw wall <= {WALL_GOAL} at {GOAL_SIZE_MIB} MiB; revenant freeze <= raw freeze",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,512,2048", help="comma-separated MiB (default 64,512,2048)")
    p.add_argument("--repeat", type=int, default=3, help="measured runs per size and side (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per size first (default 1)")
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="skip the phase-by-phase replica of revenant's pipeline")
    p.add_argument("--prefault-gib", type=float, default=None,
                   help="touch this much fresh memory once before anything (default: 4 x the largest size, "
                        "at most what is available less 4 GiB; 0 to skip)")
    p.add_argument("--dir", help="directory on the disk for the cluster (its storage) and raw dumps "
                                 "(default: a new one under /var/tmp, removed at the end)")
    p.add_argument("--staging", default="/dev/shm", help="tmpfs for the phase replica's staging (default /dev/shm)")
    p.add_argument("--criu", default=str(BIN / "criu") if (BIN / "criu").exists() else shutil.which("criu"),
                   help="criu for the raw side (default: the venv's launcher)")
    p.add_argument("--criu-timeout", type=float, default=900.0, help="seconds for one dump (default 900)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each measurement, wait up to this long for other criu processes to finish "
                        "and the CPUs to go idle (default 120)")
    p.add_argument("--quiet-cpu", type=float, default=25.0,
                   help="'idle' for --quiet-wait: at most this %% of all CPUs busy over 0.5 s (default 25)")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds to let the machine settle before each measured step (default 3; this VM hands "
                        "freed memory back to its host after about 2 s, so every step then starts alike)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    p.add_argument("--keep", action="store_true", help="keep the cluster directory (logs) at the end")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        p.error("--sizes: comma-separated whole MiB")
    if not args.sizes or min(args.sizes) < 1 or args.repeat < 1 or args.warmup < 0:
        p.error("--sizes must be positive, --repeat at least 1, --warmup not negative")
    if not args.criu:
        p.error("no criu found; pass --criu")
    return args


def preflight(args: argparse.Namespace, base: Path) -> dict:
    biggest = max(args.sizes) * MiB + 64 * MiB
    disk_free = shutil.disk_usage(base).free
    shm_free = shutil.disk_usage(args.staging).free
    avail = psutil.virtual_memory().available
    # Worst moment: one job, its staging copy in tmpfs and its committed copy in the page cache.
    if disk_free < 3 * biggest:
        raise BenchError(f"{base}: {disk_free / GiB:.1f} GiB free, need {3 * biggest / GiB:.1f}")
    if shm_free < 1.3 * biggest:
        raise BenchError(f"{args.staging}: {shm_free / GiB:.1f} GiB free, need {1.3 * biggest / GiB:.1f}")
    if avail < 3 * biggest:
        raise BenchError(f"{avail / GiB:.1f} GiB of memory available, need {3 * biggest / GiB:.1f}")
    if not WORKLOAD.is_file():
        raise BenchError(f"{WORKLOAD} is missing")
    return {"disk_free_gib": round(disk_free / GiB, 1), "shm_free_gib": round(shm_free / GiB, 1),
            "mem_available_gib": round(avail / GiB, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    ok = False
    try:
        space = preflight(args, bench.base)
        crv = subprocess.run([args.criu, "--version"], capture_output=True, text=True).stdout
        criu_version = (re.search(r"Version:\s*(\S+)", crv) or re.search(r"(\S+)", crv or "?")).group(1)
        print(f"bench dir {bench.base} ({filesystem(bench.base)}); staging {args.staging} ({filesystem(Path(args.staging))}); "
              f"criu {criu_version}", flush=True)
        gib = args.prefault_gib
        if gib is None:
            gib = max(0.0, min(4 * max(args.sizes) / 1024, psutil.virtual_memory().available / GiB - 4))
        pre = prefault(gib)
        print(f"prefault: {pre}", flush=True)
        agent_criu = bench.up()
        print(f"cluster up in {bench.cluster} (agent's criu: {agent_criu})", flush=True)
        for mib in args.sizes:
            rounds = [True] * args.warmup + [False] * args.repeat
            for i, warmup in enumerate(rounds):
                sides = ["raw", "revenant"] if i % 2 == 0 else ["revenant", "raw"]
                if args.phases:
                    sides.append("phases")
                for side in sides:
                    run = {"raw": bench.run_raw, "revenant": bench.run_revenant, "phases": bench.run_phases}[side](
                        mib, warmup)
                    extra = (f"criu {run['criu_s']:.2f} + fsync {run['fsync_s']:.2f}" if side == "raw" else
                             f"engine {run['duration_s']:.2f} = criu {run.get('agent_criu_s', 0):.2f} + commit "
                             f"{run.get('agent_commit_s', 0):.2f}, control {run['control_plane_s']:.2f}"
                             if side == "revenant" else
                             f"staged {run['stage_dump_s']:.2f}, direct {run['direct_dump_s']:.2f}+"
                             f"{run['direct_fsync_s']:.2f} (freeze {run['direct_freeze_s'] or 0:.3f}), "
                             f"commit {run['commit_s']:.2f}, copy+fsync "
                             f"{run['copy_fsync_s']:.2f}, sendfile+fsync {run['sendfile_fsync_s']:.2f}, sha256 "
                             f"{run['sha256_s']:.2f}, alt commit {run['alt_commit_s']:.2f}")
                    wall = f"wall {run['wall_s']:6.2f} s  " if "wall_s" in run else ""
                    print(f"{mib:5d} MiB {'warm-up ' if warmup else ''}{side:<8} {wall}"
                          f"freeze {run['freeze_s'] or 0:6.3f} s  {run['bytes'] / MiB:7.1f} MiB  ({extra})"
                          + (f"  [other criu running: {run['foreign_criu']}]" if run.get("foreign_criu") else "")
                          + (f"  [CPUs {run['cpu_busy_before_pct']:.0f}% busy before]"
                             if run.get("cpu_busy_before_pct", 0) > args.quiet_cpu else ""),
                          flush=True)
        ok = True
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        ok = True  # nothing to debug: remove the cluster directory too
        return 130
    except (BenchError, subprocess.SubprocessError, OSError) as exc:
        print(f"bench/checkpoint.py: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup(ok)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    summary = summarize(bench.runs, args.sizes, args.quiet_cpu)
    meta = {
        "repeat": args.repeat, "warmup": args.warmup, "sizes_mib": args.sizes, "phases": args.phases,
        "wall_includes": WALL_INCLUDES, "goal": {"wall_ratio_max": WALL_GOAL, "at_mib": GOAL_SIZE_MIB,
                                                 "freeze": "revenant freeze_s <= raw criu frozen time"},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
                    "debian": Path("/etc/debian_version").read_text().strip()
                    if Path("/etc/debian_version").exists() else None,
                    "python": platform.python_version()},
        "criu": {"raw": args.criu, "version": criu_version, "agent": agent_criu},
        "storage": {"dir": str(bench.base), "fs": filesystem(bench.base), "revenant_staging": f"/dev/shm/revenant-{NODE}",
                    "replica_staging": args.staging},
        "space_before": space, "prefault": pre,
        "waited_before_steps_s": round(bench.waited_for_others_s, 1),
        "workload": str(WORKLOAD.relative_to(REPO)),
        "command": "bench/checkpoint.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print()
    print(report(summary, meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"meta": meta, "summary": summary, "runs": bench.runs})
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
