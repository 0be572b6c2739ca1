"""Freeze time of a checkpoint of a job holding established TCP connections, against the same job
holding none, through revenant (`checkpoint create`: criu records each connection to be closed
on restore, `--tcp-close`, and leaves it alone), and bytes lost or duplicated on those
connections; beside it, the same job's freeze under criu alone with the same options.

On a fresh `revenant up --nodes 1` under /var/tmp, alternating: submit
bench/workloads/hold_connections.py with 0 and with N (100) connections to a server in this
process, `checkpoint create` it --creates times, and read each epoch's `freeze_s` (criu's
"Frozen time"); then start the same program outside revenant and `criu dump --leave-running` it
as many times.  The server checks every connection's lines: each one the next number, none
missing, none twice, across every create.  Goal: median freeze with N connections at most 1.2x
the median with none, and 0 bytes lost or duplicated.

    .venv/bin/python bench/connections.py                      # 100 connections, 3 runs x 3 creates
    .venv/bin/python bench/connections.py --conns 20 --runs 1

Prints a table and writes bench/results/connections.json (or --out).  A benchmark, not a timed
test: compare the ratio within one run."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/ is not a package: these are this script's own directory's.
from harness import BIN, REVENANT, cluster_down, cluster_up, write_json

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workloads" / "hold_connections.py"
CRIU = os.environ.get("REVENANT_CRIU") or str(BIN / "criu")
GOAL_RATIO = 1.2


class Server:
    """Accepts connections and checks each one's numbers: 1, 2, 3, ... nothing lost or repeated."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self.sock.getsockname()[1]
        self.bad: list[str] = []
        self.lines = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        expect = 1
        with conn, conn.makefile("rb") as f:
            for raw in f:
                got = int(raw)
                if got != expect:
                    self.bad.append(f"expected {expect}, got {got}")
                expect = got + 1
                self.lines += 1


def run_once(d: Path, server: Server, conns: int, creates: int) -> list[float]:
    job = _submit(d, conns, server.port)
    out = d / "storage" / "jobs" / job / "output.log"
    deadline = time.monotonic() + 60
    while "ready" not in (out.read_text() if out.exists() else ""):
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job} not ready: {out.read_text() if out.exists() else 'no output'}")
        time.sleep(0.1)
    freezes = []
    for _ in range(creates):
        time.sleep(0.5)
        _cli(d, "checkpoint", "create", job)
        epochs = json.loads(_cli(d, "show", "job", job, "--json").stdout)["epochs"]
        freezes.append(epochs[-1]["freeze_s"])
    _cli(d, "checkpoint", "vacate", job, check=False)  # stops it
    return freezes


def criu_alone(scratch: Path, server: Server, conns: int, creates: int) -> list[float]:
    """The same job's freeze under criu alone, with the options revenant gives a create's dump
    (agent/pipeline/criu.py): what criu itself costs per connection, beside revenant's total."""
    out = scratch / f"alone-{conns}.out"
    with open(out, "w") as f:
        job = subprocess.Popen([sys.executable, str(WORKLOAD), str(conns), str(server.port)], stdout=f,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    freezes = []
    try:
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text():
            if time.monotonic() > deadline:
                raise SystemExit(f"criu-alone job not ready: {out.read_text()}")
            time.sleep(0.1)
        for i in range(creates):
            time.sleep(0.5)
            images = Path(tempfile.mkdtemp(prefix=f"alone-{conns}-", dir=scratch))
            done = subprocess.run([CRIU, "dump", "-t", str(job.pid), "-D", str(images), "-o", "dump.log", "-v2",
                                   "--display-stats", "--file-locks", "--external", "mnt[]", "--ext-unix-sk",
                                   "--skip-in-flight", "--tcp-close", "--network-lock", "skip", "--leave-running"],
                                  capture_output=True, text=True, timeout=120)
            frozen = re.search(r"Frozen time:\s*(\d+)\s*us", done.stdout + done.stderr)
            if done.returncode != 0 or frozen is None:
                raise SystemExit(f"criu dump failed: {(images / 'dump.log').read_text()[-500:]}")
            freezes.append(int(frozen.group(1)) / 1e6)
            shutil.rmtree(images, ignore_errors=True)
    finally:
        job.kill()
        job.wait()
    return freezes


def _cli(d: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The CLI against the cluster in ``d``, from ``d`` (a job's workdir: not the repository)."""
    doc = json.loads((d / "cluster.json").read_text())
    env = {**os.environ, "REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}
    proc = subprocess.run([REVENANT, *args], capture_output=True, text=True, timeout=120, env=env, cwd=d)
    if check and proc.returncode != 0:
        raise SystemExit(f"revenant {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return proc


def _submit(d: Path, conns: int, port: int) -> str:
    return _cli(d, "submit", "--", sys.executable, str(WORKLOAD), str(conns), str(port)).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--creates", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "connections.json")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="revenant-bench-conns-", dir="/var/tmp")) / "cluster"
    env = {**os.environ, "REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}  # the job runs as its submitter: root here
    cluster_up(d, 1, env=env)
    server = Server()
    freezes: dict[int, list[float]] = {0: [], args.conns: []}
    alone: dict[int, list[float]] = {0: [], args.conns: []}
    try:
        for _ in range(args.runs):
            for conns in (0, args.conns):
                freezes[conns] += run_once(d, server, conns, args.creates)
                alone[conns] += criu_alone(d.parent, server, conns, args.creates)
    finally:
        cluster_down(d)
    base, loaded = statistics.median(freezes[0]), statistics.median(freezes[args.conns])
    ratio = loaded / base if base else float("inf")
    a_base, a_loaded = statistics.median(alone[0]), statistics.median(alone[args.conns])
    result = {"conns": args.conns, "runs": args.runs, "creates": args.creates,
              "freeze_s": {str(k): v for k, v in freezes.items()},
              "median_freeze_s": {"0": base, str(args.conns): loaded}, "ratio": ratio, "goal_ratio": GOAL_RATIO,
              "criu_alone_freeze_s": {str(k): v for k, v in alone.items()},
              "criu_alone_median_s": {"0": a_base, str(args.conns): a_loaded},
              "criu_alone_ratio": a_loaded / a_base if a_base else float("inf"),
              "lines_checked": server.lines, "lost_or_duplicated": server.bad[:20],
              "ok": ratio <= GOAL_RATIO and not server.bad}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"{'connections':>12} {'median freeze (s)':>18} {'criu alone (s)':>15} {'creates':>8}")
    print(f"{0:>12} {base:>18.4f} {a_base:>15.4f} {len(freezes[0]):>8}")
    print(f"{args.conns:>12} {loaded:>18.4f} {a_loaded:>15.4f} {len(freezes[args.conns]):>8}")
    print(f"ratio {ratio:.2f} (goal <= {GOAL_RATIO}; criu alone {result['criu_alone_ratio']:.2f}); "
          f"{server.lines} lines checked, "
          f"{len(server.bad)} lost or duplicated; wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
