"""Pack compression on the memory of real jobs: what zstd and lz4 save, and what they cost.

For each workload, on a one-node local cluster (``revenant up``; its agent allows root jobs):

1. submit it, wait for its ``ready`` line (or its first output line), and let it run
   --warm seconds more;
2. ``revenant checkpoint create`` it: a real criu dump, a plain epoch;
3. feed every ``pages-*.img`` of that epoch, as one run of 4 KiB pages, to a pack writer
   for each codec exactly as a conversion does (agent/storage/packfile.py ``FramedPack``: frames
   of 64 pages, each compressed alone, kept as it is where that is no smaller), writing to a
   counting sink, and time it (the thread's CPU time, and wall); then decompress every frame
   back (``packfile._decompress``) and time that too.

Workloads: ``numpy`` bench/workloads/numpy_train.py (an MLP trained by SGD on a synthetic data
set of --mib MiB of float32, with momentum, in a python3 that has numpy: PATH's, the system's),
``torch`` bench/workloads/torch_train.py (a deep MLP trained by Adam: weights, gradients and the
optimiser's moments, --mib MiB in all, in a python3 that has torch: Debian's python3-torch, or
the PyTorch tier's venv), ``random``
bench/workloads/hold_memory.py (--mib MiB of pseudo-random, page-distinct memory) and
``python`` tests/jobs/memhog.py-like objects: a dict of --mib MiB of short strings and ints
(what an interpreter's heap holds).  Prints a table and writes JSON (bench/results/).

    .venv/bin/python bench/pack_compression.py                  # 256 MiB each
    .venv/bin/python bench/pack_compression.py --mib 64 --workloads numpy   # a quick look

A conversion compresses only the pages new to the job's packs (deduplication first); this
measures what compression does to the pages it gets.  The freeze and the checkpoint's reply do
not include it: a conversion runs after the reply (agent/checkpointing/policy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from revenant.agent.storage import packfile as frames  # FramedPack, its frames and codecs

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, cluster_down, cluster_up, machine, rv, text_table, write_json

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
PYOBJECTS = ("import sys, time\n"
             "n = int(sys.argv[1]) * 1024 * 1024 // 120\n"
             "heap = {f'key-{i:09d}': (i, str(i * 7919), float(i) / 3) for i in range(n)}\n"
             "print('ready', len(heap), flush=True)\n"
             "while True:\n    time.sleep(1)\n")


def python_with(module: str) -> str:
    """A python3 that has ``module`` (PATH's first, the system's, this one's, the PyTorch tier's:
    deploy/scripts/setup-torch.sh); "" if none has."""
    for python in dict.fromkeys(filter(None, [shutil.which("python3"), "/usr/bin/python3", sys.executable,
                                              "/opt/revenant/torch-venv/bin/python"])):
        if os.path.exists(python) and \
                subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0:
            return python
    return ""


MISSING = {"numpy": "numpy (pip install numpy)",
           "torch": "torch (apt-get install python3-torch, or deploy/scripts/setup-torch.sh)"}


def workloads(mib: int) -> dict[str, list[str]]:
    return {"numpy": [python_with("numpy"), str(REPO / "bench" / "workloads" / "numpy_train.py"), str(mib)],
            "torch": [python_with("torch"), str(REPO / "bench" / "workloads" / "torch_train.py"), str(mib)],
            "random": [sys.executable, str(REPO / "bench" / "workloads" / "hold_memory.py"), str(mib)],
            "python": ["/usr/bin/python3", "-c", PYOBJECTS, str(mib)]}


class _Count:
    def __init__(self) -> None:
        self.bytes = 0
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        self.frames.append(data)


def measure(images: list[Path], codec: str) -> dict:
    """One pack of every page of ``images`` with ``codec``: sizes, compress and decompress times."""
    sink = _Count()
    pack = frames.FramedPack(sink, codec)  # type: ignore[arg-type]
    raw = 0
    c0, w0 = time.thread_time(), time.perf_counter()
    for path in images:
        with open(path, "rb", buffering=0) as f:
            while data := f.read(2048 * frames.PAGE):
                raw += len(data)
                pack.write(data)
    pack.finish()
    c1, w1 = time.thread_time(), time.perf_counter()
    sizes = [min(frames.FRAME_PAGES * frames.PAGE, raw - i * frames.FRAME_PAGES * frames.PAGE)
             for i in range(len(sink.frames))]
    for data, size in zip(sink.frames, sizes):
        frames._decompress(codec, data, size)
    c2, w2 = time.thread_time(), time.perf_counter()
    kept = sum(1 for data, size in zip(sink.frames, sizes) if len(data) == size)
    return {"codec": codec, "raw_bytes": raw, "stored_bytes": sink.bytes, "ratio": sink.bytes / max(1, raw),
            "frames": len(sink.frames), "frames_kept_raw": kept,
            "compress_cpu_s": c1 - c0, "compress_wall_s": w1 - w0, "decompress_cpu_s": c2 - c1,
            "decompress_wall_s": w2 - w1}


def run_workload(cluster: Path, name: str, argv: list[str], warm_s: float) -> dict:
    job = rv("submit", "--dir", str(cluster), "--name", f"compress-{name}", "--workdir", str(cluster), "--",
             *argv, timeout=60).stdout.strip()
    try:
        out = cluster / "storage" / "jobs" / job / "output.log"
        deadline = time.monotonic() + 300
        while not (out.exists() and b"ready" in out.read_bytes()):
            state = json.loads(rv("show", "job", job, "--dir", str(cluster), "--json").stdout)["state"]
            if state != "running" or time.monotonic() > deadline:
                raise BenchError(f"{name}: job {job} is {state}, never ready; output: {out.read_bytes()[-300:]!r}"
                                 if out.exists() else f"{name}: job {job} is {state}")
            time.sleep(0.5)
        time.sleep(warm_s)
        done = json.loads(rv("checkpoint", "create", job, "--dir", str(cluster), "--json", timeout=600).stdout)
        n = done["epochs"][-1]["n"]
        images = sorted((cluster / "storage" / "jobs" / job / "epochs" / str(n)).glob("pages-*.img"))
        return {"workload": name, "job": job, "epoch": n,
                "results": [measure(images, codec) for codec in frames.CODECS]}
    finally:
        rv("checkpoint", "vacate", job, "--dir", str(cluster), check=False, timeout=600)
        rv("job", "purge", job, "--dir", str(cluster), check=False)


def report(rows: list[dict]) -> str:
    header = ["workload", "codec", "MiB", "stored MiB", "ratio", "saved MiB", "frames kept raw",
              "compress MiB/s (cpu)", "decompress MiB/s (cpu)"]
    table = []
    for r in rows:
        for x in r["results"]:
            mib = x["raw_bytes"] / MiB
            table.append([r["workload"], x["codec"], f"{mib:.0f}", f"{x['stored_bytes'] / MiB:.1f}",
                          f"{x['ratio']:.3f}", f"{(x['raw_bytes'] - x['stored_bytes']) / MiB:.1f}",
                          f"{x['frames_kept_raw']}/{x['frames']}", f"{mib / max(1e-9, x['compress_cpu_s']):.0f}",
                          f"{mib / max(1e-9, x['decompress_cpu_s']):.0f}"])
    return text_table(header, table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="each job's memory, MiB (256)")
    p.add_argument("--workloads", default="numpy,torch,random,python", help="which (numpy,torch,random,python)")
    p.add_argument("--warm", type=float, default=3.0, help="seconds a job runs after ready, before its dump (3)")
    p.add_argument("--dir", default="/var/tmp", help="where the cluster (its storage) goes (/var/tmp)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pack_compression.json")
    args = p.parse_args(argv)
    chosen = [w for w in args.workloads.split(",") if w]
    known = workloads(args.mib)
    if args.mib < 1 or not chosen or any(w not in known for w in chosen):
        p.error(f"--mib must be positive and --workloads among {', '.join(known)}")
    base = Path(tempfile.mkdtemp(prefix="revenant-bench-compress-", dir=args.dir))
    cluster = base / "cluster"
    rows: list[dict] = []
    try:
        cluster_up(cluster, 1)
        for name in chosen:
            if not known[name][0]:
                print(f"{name}: left out: no python3 here has {MISSING[name]}", file=sys.stderr)
                continue
            rows.append(run_workload(cluster, name, known[name], args.warm))
            print(f"{name}: " + ", ".join(f"{x['codec']} {x['ratio']:.3f}" for x in rows[-1]["results"]), flush=True)
    except (BenchError, OSError) as exc:
        print(f"pack_compression: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster_down(cluster)
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(report(rows))
    meta = {"command": "bench/pack_compression.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "mib": args.mib, "warm_s": args.warm, "frame_pages": frames.FRAME_PAGES, "machine": machine(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(args.out, {"meta": meta, "runs": rows})
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
