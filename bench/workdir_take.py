"""The working directory's snapshot alone, without criu: how long the part inside the freeze
(``Taker.take``) and the part after the job resumes (``finish``: the gated copies, packing, links)
take, and what each epoch adds, for --files files of --file-kib KiB with 1 % of their 4 KiB
blocks rewritten at random before each epoch (agent/files/workdir.py, agent/files/workdir_packs.py).

    .venv/bin/python bench/workdir_take.py                  # 10,000 files of 104 KiB (1 GiB), 6 epochs
    .venv/bin/python bench/workdir_take.py --files 1000     # a quick look

The first epoch (every file new) is reported apart.  Everything goes under --base (removed at the
end).  Run it as root: the gate (fanotify's permission events) needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import msgspec

from revenant.agent.files import workdir
from revenant.agent.files.filestep import prepare_workdir
from revenant.agent.files.jobfiles import scan_workdir
from revenant.agent.storage.epochs import LISTING, FileEntry, JobFiles, Manifest

# bench/ is not a package: these are this script's own directory's.
from harness import write_json

REPO = Path(__file__).resolve().parent.parent
BLOCK = 4096


def epoch(files: JobFiles, wd: Path, gate: bool = True) -> dict:
    prev, packer = prepare_workdir(files, str(wd), 10)
    tmp = files.new_tmp("bench")
    stats: dict[str, os.stat_result] = {}
    (tmp / LISTING).write_bytes(msgspec.json.encode(scan_workdir(str(wd), 10**6, stats=stats)))
    taker = workdir.Taker(str(wd), tmp, tmp, prev, None, 2**40, gate, packer=packer)
    started = time.perf_counter()
    taken = taker.take(stats)
    frozen = time.perf_counter()
    workdir.finish(taken)
    done = time.perf_counter()
    m = Manifest(job=files.job, epoch=0, generation=1, node="bench", created_at=0, criu_version="", kernel="",
                 workdir=str(wd), workdir_files=len(taken.files), workdir_copied=taken.copied,
                 workdir_linked=taken.linked, workdir_packs=taken.table)
    m.files = {n: FileEntry(size=size, checksum=crc) for n, (size, crc) in taken.known.items()}
    m = files.commit(tmp, m)
    return {"take_s": frozen - started, "finish_s": done - frozen, "added": m.workdir_copied,
            "kept": m.workdir_linked, "files": m.workdir_files}


def change(paths: list[Path], blocks_per_file: int, rnd: random.Random) -> int:
    total = len(paths) * blocks_per_file
    chosen = rnd.sample(range(total), max(1, total // 100))
    for b in chosen:
        with open(paths[b // blocks_per_file], "r+b") as f:
            f.seek(b % blocks_per_file * BLOCK)
            f.write(os.urandom(BLOCK))
    return len({b // blocks_per_file for b in chosen})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--file-kib", type=int, default=104)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--base", type=Path, default=Path("/var/tmp"))
    p.add_argument("--no-gate", action="store_true", help="copy changed files while frozen (agent/files/gate/cowgate.py)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.out = args.out or REPO / "bench" / "results" / f"workdir_take{'_nogate' if args.no_gate else ''}.json"
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the first stores every file)")
    if why := workdir.gate_unavailable():
        print(f"note: {why}; changed files are copied while frozen", file=sys.stderr)
    base = args.base / f"revenant-bench-take-{os.getpid()}"
    wd = base / "wd"
    blocks = args.file_kib * 1024 // BLOCK
    rnd = random.Random(26)
    samples = []
    try:
        paths = []
        for i in range(args.files):
            d = wd / f"d{i % 100}"
            d.mkdir(parents=True, exist_ok=True)
            paths.append(d / f"f{i}")
            paths[-1].write_bytes(os.urandom(blocks * BLOCK))
        files = JobFiles(base / "storage", "1")
        for k in range(args.epochs):
            changed = change(paths, blocks, rnd) if k else args.files
            samples.append({**epoch(files, wd, not args.no_gate), "changed_files": changed})
            s = samples[-1]
            print(f"epoch {k + 1}: take {s['take_s'] * 1000:.0f} ms (frozen), finish {s['finish_s'] * 1000:.0f} ms, "
                  f"{changed} files changed, added {s['added'] / 2**20:.1f} MiB", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    later = samples[1:]
    size = args.files * blocks * BLOCK
    summary = {"files": args.files, "file_kib": args.file_kib, "epochs": args.epochs, "gate": not args.no_gate,
               "samples": samples,
               "first_take_s": round(samples[0]["take_s"], 4), "first_finish_s": round(samples[0]["finish_s"], 4)}
    for key in ("take_s", "finish_s", "added"):
        summary[f"{key}_median"] = round(statistics.median(x[key] for x in later), 4)
    summary["added_share"] = round(summary["added_median"] / size, 4)
    print("| epochs | take (frozen) median ms | finish median ms | added median MiB | of the files |")
    print("|---|---:|---:|---:|---:|")
    print(f"| 2–{args.epochs} | {summary['take_s_median'] * 1000:.0f} | {summary['finish_s_median'] * 1000:.0f} | "
          f"{summary['added_median'] / 2**20:.1f} | {summary['added_share']:.2%} |")
    print(f"first epoch: take {summary['first_take_s'] * 1000:.0f} ms, finish {summary['first_finish_s'] * 1000:.0f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"summary": summary})
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
