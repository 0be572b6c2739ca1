"""Concurrent checkpoints of jobs that share a working directory: do they collide?

Drives the agent's own code path in this process, with real criu and no bus: a
``Supervisor`` (agent/running/jobs.py: the launcher's PID namespace and revenant-init)
and its ``Engine`` (agent/checkpointing/engine.py: criu dump, output sizes, commit, retention),
exactly what an agent runs for ``revenant checkpoint create``.  The engine's
concurrency is set to --jobs, so every criu of a round runs at the same time
(an agent's default ``checkpoint_concurrency`` is 2; a drain dumps all at once).

1. start --jobs counter jobs (tests/jobs/counter.py: a line every 20 ms, each
   hashed over all earlier ones), all in one working directory: what a user who
   submits from one directory gets;
2. --rounds rounds: checkpoint every job at once (``stop=False``), counting the
   dumps that fail and by which error line;
3. then every job is vacated (all at once) and restored (all at once): each must
   come back as this process's own child and go on writing, and its output must
   be one unbroken hash chain (output rollback: no line lost or doubled).

``--unfixed`` starts the jobs the way revenant did before the fix (the
namespace's init working in the shared workdir, where criu's parasite mounts its
/proc at ``proc.crtools``), to show the collision.  Goal: 0 failed dumps.

    .venv/bin/python bench/concurrent_dumps.py                    # 4 jobs x 250 rounds = 1,000 dumps
    .venv/bin/python bench/concurrent_dumps.py --unfixed          # the same, as before the fix
    .venv/bin/python bench/concurrent_dumps.py --rounds 20        # a quick look

Everything it writes goes under --base (removed at the end) and its jobs die
with it.  Run it as root (criu needs it), on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import hashlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil

from revenant.agent.checkpointing.engine import Engine
from revenant.agent.pipeline.criu import inspect_criu
from revenant.agent.processes import procs
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError, wait_for, write_json

REPO = Path(__file__).resolve().parent.parent
COUNTER = REPO / "tests" / "jobs" / "counter.py"


def chain_ok(output: bytes) -> tuple[bool, int]:
    """The counter's output is lines 0, 1, 2, ... each with the hash over all before it."""
    h = hashlib.sha256()
    lines = output.decode(errors="replace").splitlines()
    for i, line in enumerate(lines):
        h.update(str(i).encode())
        if line != f"line {i} {h.hexdigest()[:16]}":
            return False, i
    return True, len(lines)


def in_shared_workdir(sup: Supervisor) -> None:
    """Start jobs as revenant did before the fix: the init works in the job's workdir."""
    spawn = sup.launcher.spawn

    async def spawn_there(spec: JobSpec, files: JobFiles, env: dict[str, str]):
        shared = copy.copy(files)
        shared.dir = Path(spec.workdir)
        return await spawn(spec, shared, env)

    sup.launcher.spawn = spawn_there  # type: ignore[method-assign]


async def dump_round(sup: Supervisor, jobs: list[str]) -> list[tuple[str, float, str]]:
    """Checkpoint every job at once: (job, seconds, error or "") for each."""

    async def one(job: str) -> tuple[str, float, str]:
        t = time.monotonic()
        try:
            await sup.checkpoint(job, sup.jobs[job].generation, stop=False)
            return job, time.monotonic() - t, ""
        except RevenantError as exc:
            return job, time.monotonic() - t, str(exc)

    return await asyncio.gather(*(one(j) for j in jobs))


async def vacate_and_restore(sup: Supervisor, specs: list[JobSpec]) -> dict:
    """Vacate every job at once, restore every one at once; check each is our child, running,
    with one unbroken output."""
    vacated = await asyncio.gather(*(sup.checkpoint(s.id, sup.jobs[s.id].generation, stop=True) for s in specs),
                                   return_exceptions=True)
    errors = [str(v) for v in vacated if isinstance(v, BaseException)]
    if errors:
        return {"ok": False, "error": f"vacate: {errors[0]}"}
    restored = await asyncio.gather(*(sup.restore(s, 2) for s in specs), return_exceptions=True)
    errors = [str(r) for r in restored if isinstance(r, BaseException)]
    if errors:
        return {"ok": False, "error": f"restore: {errors[0]}"}
    for s in specs:
        out = JobFiles(sup.storage, s.id).output
        before = out.stat().st_size
        await wait_for(lambda: out.stat().st_size > before + 200, 10, f"job {s.id} writing after its restore")
        pid = sup.jobs[s.id].pid
        if psutil.Process(pid).ppid() != os.getpid():
            return {"ok": False, "error": f"job {s.id} (pid {pid}) is not this process's child"}
        ok, at = chain_ok(out.read_bytes())
        if not ok:
            return {"ok": False, "error": f"job {s.id}: output broken at line {at}"}
    return {"ok": True}


async def run(args: argparse.Namespace) -> dict:
    procs.become_subreaper()
    info = await inspect_criu()
    if not info.ok:
        raise BenchError(info.error)
    base = args.base / f"revenant-bench-dumps-{os.getpid()}"
    workdir = base / "workdir"
    workdir.mkdir(parents=True)
    engine = Engine(criu_path=info.path, criu_version=info.version or "", node="bench", storage=base / "storage",
                    work_roots=[Path("/dev/shm") / f"revenant-bench-dumps-{os.getpid()}"], concurrency=args.jobs)
    # No lease renews the dead man's switch here: a long timeout keeps it quiet.
    sup = Supervisor("bench", base / "storage", engine, lambda subject, msg: None, switch_timeout_s=3600)
    if args.unfixed:
        in_shared_workdir(sup)
    specs = [JobSpec(id=str(i + 1), argv=[sys.executable, str(COUNTER), "100000000", "0.02"], workdir=str(workdir),
                     max_epochs=1) for i in range(args.jobs)]
    try:
        for s in specs:
            await sup.start(s, 1)
        for s in specs:
            out = JobFiles(sup.storage, s.id).output
            await wait_for(lambda: out.stat().st_size > 100, 30, f"job {s.id}'s first lines")
        rounds, started = [], time.monotonic()
        for r in range(args.rounds):
            t = time.monotonic()
            results = await dump_round(sup, [s.id for s in specs])
            rounds.append({"round": r, "s": round(time.monotonic() - t, 3),
                           "dumps": [{"job": j, "s": round(d, 3), "error": e} for j, d, e in results]})
            failed = [e for _, _, e in results if e]
            if failed or (r + 1) % 25 == 0:
                print(f"round {r + 1}/{args.rounds}: {len(failed)} failed" + (f": {failed[0]}" if failed else ""),
                      file=sys.stderr)
        elapsed = time.monotonic() - started
        after = await vacate_and_restore(sup, specs)
    finally:
        await sup.shutdown("the benchmark is over")
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / f"revenant-bench-dumps-{os.getpid()}", ignore_errors=True)
    return summarize(args, rounds, elapsed, after, info.version or "")


def summarize(args: argparse.Namespace, rounds: list[dict], elapsed: float, after: dict, version: str) -> dict:
    dumps = [d for r in rounds for d in r["dumps"]]
    failed = [d for d in dumps if d["error"]]
    ok_s = sorted(d["s"] for d in dumps if not d["error"])
    round_s = [r["s"] for r in rounds]
    errors = collections.Counter(d["error"].split(" (criu log: ")[0] for d in failed)
    return {"mode": "unfixed (init in the shared workdir)" if args.unfixed else "fixed (init in the job's own dir)",
            "criu": version, "jobs": args.jobs, "rounds": args.rounds, "dumps": len(dumps), "failed": len(failed),
            "failure_rate": round(len(failed) / len(dumps), 4) if dumps else None,
            "rounds_with_a_failure": sum(1 for r in rounds if any(d["error"] for d in r["dumps"])),
            "dump_s_median": round(statistics.median(ok_s), 3) if ok_s else None,
            "dump_s_p95": ok_s[int(0.95 * (len(ok_s) - 1))] if ok_s else None,
            "round_s_median": round(statistics.median(round_s), 3) if round_s else None,
            "elapsed_s": round(elapsed, 1), "vacate_and_restore": after,
            "errors": dict(errors.most_common()), "goal_met": not failed and after.get("ok", False),
            "failures": [{"round": r["round"], **d} for r in rounds for d in r["dumps"] if d["error"]],
            "round_s": round_s}


def table(s: dict) -> str:
    rows = [("mode", s["mode"]), ("criu", s["criu"]),
            ("jobs dumped at once × rounds", f"{s['jobs']} × {s['rounds']}"),
            ("dumps", s["dumps"]), ("failed dumps (goal 0)", s["failed"]), ("failure rate", s["failure_rate"]),
            ("rounds with a failure", s["rounds_with_a_failure"]),
            ("one dump, s (median / p95)", f"{s['dump_s_median']} / {s['dump_s_p95']}"),
            ("one round, s (median)", s["round_s_median"]), ("all rounds, s", s["elapsed_s"]),
            ("then vacate + restore all at once", "ok" if s["vacate_and_restore"].get("ok")
             else s["vacate_and_restore"].get("error"))]
    lines = ["| concurrent dumps | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    for err, n in s["errors"].items():
        lines.append(f"| error × {n} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=4, help="jobs dumped at once (4)")
    p.add_argument("--rounds", type=int, default=250, help="rounds (250)")
    p.add_argument("--unfixed", action="store_true", help="start the jobs as before the fix (init in the workdir)")
    p.add_argument("--base", type=Path, default=Path("/var/tmp"), help="where storage and the workdir go (/var/tmp)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (bench/results/concurrent_dumps.json; with --unfixed, ..._unfixed.json)")
    args = p.parse_args(argv)
    out = args.out or REPO / "bench" / "results" / (
        "concurrent_dumps_unfixed.json" if args.unfixed else "concurrent_dumps.json")
    try:
        summary = asyncio.run(run(args))
    except (BenchError, RevenantError, OSError) as exc:
        print(f"concurrent_dumps: {exc}", file=sys.stderr)
        return 2
    print(table(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"summary": summary})
    print(f"\nJSON: {out}")
    return 0 if summary["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
