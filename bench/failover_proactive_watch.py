"""bench/failover_proactive.py's constants, its small helpers (the CLI, the job's ticks, the
environment, the memory readings) and its watchers of a run: the cluster's events (Watch) and the
job's output (Tail).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# bench/ is not a package: these are this script's own directory's.
from harness import BenchError

GiB = 1 << 30
MiB = 1 << 20
POLICIES = ("none", "checkpoint", "migrate")
HEALTHY, SICK = "node-1", "node-2"
RUN_BEFORE_S = 20.0          # the job runs this long before the memory goes
DEATH_AFTER_RED_S = 5.0      # the node dies this long after its first RED heartbeat
INTERVAL = "5:00"            # the job's periodic checkpoint interval
JOB_MIB = 16
TICK_S = 0.1                 # the workload's tick
POLL_S = 0.05
YELLOW_ABOVE = 1.5 * GiB     # node-2's thresholds: this much above the memory in use at its start
RED_ABOVE = 3.0 * GiB
PAST_RED = 1.5 * GiB         # the allocator takes the machine this far past RED
NEW_COPY_S = 2.0             # wait for this much of the new copy's output
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
REVENANT = str(Path(sys.executable).parent / "revenant")
DEFAULTS = ("on_sick", "proactive_hold_s", "proactive_cooldown_s", "proactive_pause_fraction",
            "proactive_checkpoint_reasons", "proactive_migrate_reasons", "node_timeout_s")


def rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def rv(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([REVENANT, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise BenchError(f"revenant {' '.join(args[:3])} failed ({proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc.stdout


def ticks(text: str) -> list[tuple[int, float, str]]:
    """The workload's ``tick N WALL ok|CORRUPT`` lines: (N, WALL, check)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "tick":
            try:
                out.append((int(parts[1]), float(parts[2]), parts[3]))
            except ValueError:
                continue
    return out


def clean_env() -> tuple[dict[str, str], list[str]]:
    """This environment without revenant's agent and coordinator settings (the defaults are the
    point), and the names of those it dropped."""
    drop = [k for k in os.environ if k.startswith(("REVENANT_AGENT_", "REVENANT_COORDINATOR_"))]
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["REVENANT_AGENT_ALLOW_ROOT_JOBS"] = "true"  # the job runs as its submitter: root here
    return env, sorted(drop)


def coordinator_defaults() -> dict:
    from revenant.common.settings.config import CoordinatorConfig

    cfg = CoordinatorConfig()
    return {k: getattr(cfg, k) for k in DEFAULTS if hasattr(cfg, k)}


def memory() -> tuple[float, int, int]:
    """(percent in use as the agent's probe reads it, total bytes, available bytes)."""
    import psutil

    vm = psutil.virtual_memory()
    return vm.percent, vm.total, vm.available


# ====================================================================== watchers


class Watch(threading.Thread):
    """A passive NATS client: node-2's heartbeats (health), every event, and node-1's restore and
    start requests, each with its arrival time."""

    def __init__(self, url: str) -> None:
        super().__init__(name="watch", daemon=True)
        self.url = url
        self.lock = threading.Lock()
        self.heartbeats: list[dict] = []
        self.events: list[dict] = []
        self.requests: list[dict] = []
        self.ready = threading.Event()
        self.error: str | None = None
        self._loop = None
        self._halt = None

    def run(self) -> None:
        import asyncio

        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            self.error = f"{type(exc).__name__}: {exc}"
            self.ready.set()

    async def _main(self) -> None:
        import asyncio

        import msgspec

        from revenant.common.messaging import bus
        from revenant.messages import codec

        self._loop = asyncio.get_running_loop()
        self._halt = asyncio.Event()
        nc = await bus.connect(self.url, "bench-failover-proactive")

        async def on_hb(msg) -> None:
            now = time.time()
            try:
                hb = codec.decode(msg.data)
                h = hb.health
            except Exception:  # noqa: BLE001 - not ours to judge
                return
            if h is None:
                return  # a slim heartbeat: the health it last reported still holds
            with self.lock:
                self.heartbeats.append({"arrived": now, "sent_at": hb.sent_at, "state": h.state,
                                        "memory_percent": h.memory_percent, "reasons": list(h.reasons),
                                        "codes": [f.code for f in h.findings]})

        async def on_event(msg) -> None:
            now = time.time()
            try:
                obj = msgspec.to_builtins(codec.decode(msg.data))
            except Exception:  # noqa: BLE001
                return
            obj["arrived"] = now
            with self.lock:
                self.events.append(obj)

        async def on_cmd(msg) -> None:
            verb = msg.subject.rsplit(".", 1)[1]
            if verb in ("restore", "start"):
                with self.lock:
                    self.requests.append({"arrived": time.time(), "verb": verb})

        await nc.subscribe(f"revenant.hb.{SICK}", cb=on_hb)
        await nc.subscribe("revenant.evt.>", cb=on_event)
        await nc.subscribe(f"revenant.node.{HEALTHY}.cmd.*", cb=on_cmd)
        await nc.flush()
        self.ready.set()
        await self._halt.wait()
        await nc.close()

    def stop(self) -> None:
        if self._loop is not None and self._halt is not None:
            try:
                self._loop.call_soon_threadsafe(self._halt.set)
            except RuntimeError:
                pass
        self.join(timeout=5)

    def first_heartbeat(self, after: float, states: tuple[str, ...]) -> dict | None:
        with self.lock:
            return next((dict(h) for h in self.heartbeats if h["arrived"] > after and h["state"] in states), None)

    def last_heartbeat(self) -> dict | None:
        with self.lock:
            return dict(self.heartbeats[-1]) if self.heartbeats else None

    def event(self, type_: str, job: str, kinds: tuple[str, ...], after: float = 0.0) -> dict | None:
        with self.lock:
            return next((dict(e) for e in self.events if e.get("type") == type_ and e.get("job") == job
                         and e.get("kind") in kinds and e.get("at", 0) > after), None)

    def first_request(self, after: float) -> dict | None:
        with self.lock:
            return next((dict(r) for r in self.requests if r["arrived"] > after), None)


class Tail(threading.Thread):
    """Reads the job's output every POLL_S: every tick line any copy printed, before a restore rolls
    the output back or a requeue empties it."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="tail", daemon=True)
        self.path = path
        self.lock = threading.Lock()
        self.seen: dict[tuple[int, float], str] = {}
        self.halt = threading.Event()

    def read_now(self) -> None:
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return
        with self.lock:
            for n, wall, check in ticks(text):
                self.seen.setdefault((n, wall), check)

    def run(self) -> None:
        while not self.halt.is_set():
            self.read_now()
            self.halt.wait(POLL_S)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=2)
        self.read_now()

    def lines(self) -> list[tuple[int, float, str]]:
        with self.lock:
            return sorted(((n, w, c) for (n, w), c in self.seen.items()), key=lambda x: x[1])
