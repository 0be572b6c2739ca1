"""How much of one CPU core an idle agent uses: 1 s heartbeats, every probe on.

Starts a private nats-server and one ``revenant agent`` (the installed CLI,
exactly as a node runs it), waits for its first heartbeat and a warm-up, then
reads the agent process's CPU time with psutil across ``--duration`` seconds.
The goal is below 0.5% of one core.

    .venv/bin/python bench/agent_overhead.py                 # 60 s, the reference run
    .venv/bin/python bench/agent_overhead.py --duration 10   # a quick look

Prints a table and writes bench/results/agent_overhead.json.  Other load on the
machine does not enter the figure (it is the agent's own CPU time), but a busy
machine stretches the agent's wake-ups, so note the load average it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
import psutil

from revenant.agent.storage import imagekeys
from revenant.common.messaging.natsserver import start_nats_server
from revenant.messages import Heartbeat, decode_as, subjects

# bench/ is not a package: these are this script's own directory's.
from harness import write_json

REPO = Path(__file__).resolve().parent.parent
GOAL_PERCENT = 0.5
NODE = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured (default 60)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after the first heartbeat before measuring")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval in seconds (default 1)")
    p.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `revenant agent` (repeat it), e.g. --agent-arg=--config=bench.toml")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_overhead.json")
    p.add_argument("--start-timeout", type=float, default=90.0, help="wait this long for the first heartbeat")
    args = p.parse_args(argv)
    if not args.duration > 0 or args.warmup < 0 or not args.interval > 0:
        p.error("--duration and --interval must be positive, --warmup not negative")
    return args


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    # Children too: anything the agent runs on its own account counts against it.
    return t.user + t.system + t.children_user + t.children_system


async def measure(args: argparse.Namespace, nats_url: str, agent: subprocess.Popen[bytes]) -> dict:
    beats: list[Heartbeat] = []
    first = asyncio.Event()

    async def on_beat(msg) -> None:
        beats.append(decode_as(msg.data, Heartbeat))
        first.set()

    nc = await nats.connect(nats_url, connect_timeout=5)
    try:
        await nc.subscribe(subjects.heartbeat(NODE), cb=on_beat)
        deadline = time.monotonic() + args.start_timeout
        while not first.is_set():
            if agent.poll() is not None:
                raise SystemExit(f"agent exited with status {agent.returncode} before its first heartbeat")
            if time.monotonic() > deadline:
                raise SystemExit(f"no heartbeat within {args.start_timeout:g} s")
            try:
                await asyncio.wait_for(first.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(args.warmup)
        proc = psutil.Process(agent.pid)
        seen_before, cpu0, wall0 = len(beats), cpu_seconds(proc), time.monotonic()
        await asyncio.sleep(args.duration)
        cpu1, wall1, seen = cpu_seconds(proc), time.monotonic(), len(beats) - seen_before
        memory = proc.memory_info().rss
        threads = proc.num_threads()
    finally:
        await nc.close()
    if agent.poll() is not None:
        raise SystemExit(f"agent exited with status {agent.returncode} during the measurement")
    last = next(b for b in reversed(beats) if b.health is not None)  # the last full heartbeat (heartbeat.v2)
    wall = wall1 - wall0
    share = (cpu1 - cpu0) / wall * 100
    return {
        "cpu_percent_of_one_core": round(share, 4),
        "goal_percent": GOAL_PERCENT,
        "meets_goal": share < GOAL_PERCENT,
        "cpu_seconds": round(cpu1 - cpu0, 4),
        "wall_seconds": round(wall, 3),
        "heartbeats": seen,
        "heartbeat_interval_s": args.interval,
        "cpu_ms_per_heartbeat": round((cpu1 - cpu0) * 1000 / seen, 3) if seen else None,
        "rss_bytes": memory,
        "threads": threads,
        "health": last.health.state,
        "health_reasons": list(last.health.reasons),
        "gpu": last.capabilities.gpu,
        "gpus": len(last.health.gpus),
        "criu_ok": last.capabilities.criu.ok,
        "agent_args": args.agent_arg,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def report(result: dict) -> str:
    rows = [
        ("CPU, % of one core", f"{result['cpu_percent_of_one_core']:.3f} %"),
        ("goal", f"< {result['goal_percent']} %  ({'met' if result['meets_goal'] else 'NOT met'})"),
        ("CPU time / wall time", f"{result['cpu_seconds']:.3f} s / {result['wall_seconds']:.1f} s"),
        ("heartbeats (interval)", f"{result['heartbeats']} ({result['heartbeat_interval_s']:g} s)"),
        ("CPU per heartbeat", f"{result['cpu_ms_per_heartbeat']} ms"),
        ("resident memory", f"{result['rss_bytes'] / 2**20:.1f} MiB, {result['threads']} threads"),
        ("health", f"{result['health']} {'; '.join(result['health_reasons'])}".strip()),
        ("gpu / criu", f"{result['gpu']} ({result['gpus']} GPUs) / {'ok' if result['criu_ok'] else 'unusable'}"),
        ("load average", " ".join(map(str, result["load_average"])) + f" on {result['cpus']} CPUs"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    revenant = Path(sys.executable).parent / "revenant"
    with tempfile.TemporaryDirectory(prefix="revenant-bench-") as tmp:
        server = start_nats_server(Path(tmp) / "nats", log_file=Path(tmp) / "nats.log")
        agent_log = open(Path(tmp) / "agent.log", "wb")
        cmd = [str(revenant), "agent", "--node", NODE, "--nats", server.url, "--storage", str(Path(tmp) / "storage"),
               "--heartbeat-interval", str(args.interval), "--log-level", "WARNING",
               "--image-keys", str(imagekeys.write(Path(tmp) / "image.keys")[0].path), *args.agent_arg]
        agent = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=agent_log, stderr=subprocess.STDOUT)
        try:
            result = asyncio.run(measure(args, server.url, agent))
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
            agent_log.close()
            server.stop()
            if agent.returncode not in (0, -signal.SIGTERM):
                sys.stderr.write((Path(tmp) / "agent.log").read_text()[-4000:])
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
