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
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, filesystem, text_table, write_json
from storage_bench import (Bench, CHECK_EVERY, GiB, MiB, REPO, STEADY_FROM, TARGETS, WORKLOAD, median, ratio,
                           rounded)


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
        "steady_added_ratio_median": rounded(ratio(median(steady), full)),
        "steady_added_ratio_max": rounded(ratio(max(steady), full)) if steady else None,
        "wall_s_median": rounded(median([r["wall_s"] for r in rows])),
        "freeze_s_median": rounded(median([r["freeze_s"] for r in rows])),
        "duration_s_median": rounded(median([r["duration_s"] for r in rows])),
        "convert_s_median": rounded(median(conv)), "convert_s_total": rounded(sum(conv)),
        "restore_newest_s": rounded(median([r["seconds"] for r in rest.get("newest", [])])),
        "restore_newest_best_s": rounded(min((r["seconds"] for r in rest.get("newest", [])), default=None)),
        "restore_newest_epochs": [r["epoch"] for r in rest.get("newest", [])],
        "restore_oldest_s": rounded(rest.get("oldest", {}).get("seconds")),
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
               "restore_newest_ratio": rounded(ratio(on["restore_newest_s"], off["restore_newest_s"]), 3),
               "restore_oldest_ratio": rounded(ratio(on["restore_oldest_s"], off["restore_oldest_s"]), 3),
               "checkpoint_wall_ratio": rounded(ratio(on["wall_s_median"], off["wall_s_median"]), 3),
               "freeze_ratio": rounded(ratio(on["freeze_s_median"], off["freeze_s_median"]), 3)}
        out.append(row)
    return out


def verdicts(ratios: list[dict], summaries: list[dict]) -> list[dict]:
    def met(value: float | None, target: float) -> str:
        return "n/a" if value is None else "met" if value <= target else "NOT met"

    out = []
    one = next((r for r in ratios if abs(r["fraction"] - 0.01) < 1e-9), None)
    if one is not None:
        out.append({"measure": "bytes added by a 1 % epoch (steady state, worst) / full image", "fraction": 0.01,
                    "value": one["bytes_ratio_on"], "target": TARGETS["bytes_1pct"],
                    "verdict": met(one["bytes_ratio_on"], TARGETS["bytes_1pct"])})
    for s in (s for s in summaries if s["incremental"]):
        gib = (s["full_image_bytes"] or 0) / GiB
        for key, measure, value in (
                ("storage_1pct", "the kept epochs on disk / a full image (on)",
                 ratio(s["storage_du_bytes"], s["full_image_bytes"]) if abs(s["fraction"] - 0.01) < 1e-9 else None),
                ("oldest_vs_newest", "oldest kept restore / newest restore (on)",
                 ratio(s["restore_oldest_s"], s["restore_newest_s"])),
                ("convert_s_per_gib", "conversion s per GiB (on, median)",
                 s["convert_s_median"] / gib if s["convert_s_median"] is not None and gib else None)):
            if value is not None:
                out.append({"measure": measure, "fraction": s["fraction"], "value": rounded(value, 3),
                            "target": TARGETS[key], "verdict": met(value, TARGETS[key])})
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
             _f(ratio(r["added_bytes"], full[(r["fraction"], r["incremental"])]), "{:.1%}"),
             _f(r["wall_s"]), _f(r["freeze_s"], "{:.3f}"), _f(r["duration_s"]),
             _f(sum(c["seconds"] or 0 for c in r["converted"])) if r["converted"] else "-",
             _f(sum(c["bytes"] or 0 for c in r["converted"]) / MiB, "{:.1f}") if r["converted"] else "-"]
            for r in epochs]
    lines = ["per epoch: steps = the job's steps since the previous epoch; added = the job's epochs/ + packs/ on "
             "disk after the checkpoint and the conversion it caused, minus before (this epoch's full image, less "
             "the previous one's, plus the previous one's delta); convert = that conversion's seconds; delta = "
             "the previous epoch's own bytes once converted (its \"converted\" event)", text_table(header, rows), ""]
    header2 = ["dirty", "incr", "full MiB", f"added {STEADY_FROM}+ med/max", "wall med s", "freeze med s",
               "restore newest med/best s", "restore oldest s", "on disk MiB"]
    rows2 = [[f"{s['fraction'] * 100:g}%", "on" if s["incremental"] else "off",
              _f((s["full_image_bytes"] or 0) / MiB, "{:.1f}"),
              f"{_f(s['steady_added_ratio_median'], '{:.1%}')} / {_f(s['steady_added_ratio_max'], '{:.1%}')}",
              _f(s["wall_s_median"]), _f(s["freeze_s_median"], "{:.3f}"),
              f"{_f(s['restore_newest_s'])} / {_f(s['restore_newest_best_s'])}",
              f"{_f(s['restore_oldest_s'])} (#{s['restore_oldest_epoch']})",
              _f((s["storage_du_bytes"] or 0) / MiB, "{:.1f}")] for s in summary]
    lines += ["per configuration", text_table(header2, rows2), ""]
    header3 = ["dirty", "bytes/full on", "bytes/full off", "restore newest on/off", "restore oldest on/off",
               "ckpt wall on/off", "freeze on/off"]
    rows3 = [[f"{r['fraction'] * 100:g}%", _f(r["bytes_ratio_on"], "{:.1%}"), _f(r["bytes_ratio_off"], "{:.1%}"),
              _f(r["restore_newest_ratio"], "{:.3f}"), _f(r["restore_oldest_ratio"], "{:.3f}"),
              _f(r["checkpoint_wall_ratio"], "{:.3f}"), _f(r["freeze_ratio"], "{:.3f}")] for r in ratios]
    lines += ["incremental on against off", text_table(header3, rows3), ""]
    header4 = ["target", "dirty", "value", "target", "verdict"]
    rows4 = [[c["measure"], f"{c['fraction'] * 100:g}%",
              _f(c["value"], "{:.1%}" if c["measure"].startswith("bytes") else "{:.3f}"),
              ("<= {:.0%}" if c["measure"].startswith("bytes") else "<= {:.2f}").format(c["target"]), c["verdict"]]
             for c in checks]
    lines += ["targets (issues 12 and 31)", text_table(header4, rows4), ""]
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
    p.add_argument("--pack-compression", default="none", choices=("none", "zstd", "lz4"),
                   help="the incremental side's --pack-compression (default none)")
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
        print(f"bench dir {bench.base} ({filesystem(bench.base)}); {args.size_mib} MiB job, fractions {args.fractions}, "
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
    checks = verdicts(ratios, summary)
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
        "storage": {"dir": str(bench.base), "fs": filesystem(bench.base)},
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
    write_json(args.out, {"meta": meta, "targets": checks, "ratios": ratios, "summary": summary,
                                    "configs": bench.configs})
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
