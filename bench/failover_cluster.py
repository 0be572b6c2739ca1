"""The failover benchmarks' cluster side (bench/failover.py, bench/connections.py, bench/restart.py,
bench/pg_failover.py): the defaults the timings depend on, the page cache and /proc readings, and
the observers of a run: the bus's events and commands (Observer) and criu's restore processes
(CriuScanner).  The CLI and the cluster's start and stop are bench/harness.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

# bench/ is not a package: these are this script's own directory's.

# ====================================================================== helpers

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
LEASE_TTL_S = 1.7      # docs/configuration.md defaults (coordinator lease_ttl_s, lease_margin_s)
LEASE_MARGIN_S = 0.2
GOAL_S = 3.0
SERVERS_GOAL_RATIO = 1.2  # median total on a 3-server NATS cluster / on one server
TICK_S = 0.1
SCAN_S = 0.025


def rounded(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def median(xs: list[float]) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def log_time(line: str) -> float | None:
    """The wall time of a revenant log line (``%(asctime)s``: local time, milliseconds)."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: str) -> tuple[int, int] | None:
    """(ppid, starttime in clock ticks since boot) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[1].split()
    return int(fields[1]), int(fields[19])


def cmdline(pid: int | str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def drop_from_cache(d: Path) -> None:
    """Evict these files (only these) from the page cache, as if another node had written them."""
    for f in d.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_bytes(d: Path) -> int | None:
    """Bytes of the files in ``d`` in the page cache (util-linux fincore), or None."""
    files = [str(f) for f in d.iterdir() if f.is_file()] if d.is_dir() else []
    if not files or not shutil.which("fincore"):
        return None
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                          capture_output=True, text=True)
    try:
        return sum(int(x) for x in proc.stdout.split())
    except ValueError:
        return None


def is_criu_restore(cmd: list[str]) -> bool:
    return any(os.path.basename(a) == "criu" for a in cmd[:4]) and "restore" in cmd


def boot_to_wall(ticks: int) -> float:
    """A /proc starttime (boot-time clock ticks) as wall time."""
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / CLK_TCK)


# ====================================================================== observers


class Observer(threading.Thread):
    """A passive NATS client: heartbeat, event and command arrival times, and the lease bucket as the
    coordinator watches it.  Runs its own (plain asyncio) loop in a thread.  On an authenticated
    cluster it connects as the coordinator identity (``seed``: DIR/keys/coordinator.nk, which
    ``revenant up`` wrote), the one allowed to hear all of that."""

    def __init__(self, url: str, dead_node: str, target_node: str, seed: str = "") -> None:
        super().__init__(name="observer", daemon=True)
        self.url = url  # one URL, or every server's of a NATS cluster, comma-separated
        self.seed = seed
        self.dead_node = dead_node
        self.target_node = target_node
        self.lock = threading.Lock()
        self.heartbeats: dict[str, list[float]] = {}
        self.leases: list[dict] = []          # node's lease entries: arrival, revision, server timestamp
        self.events: list[dict] = []          # decoded events with arrival time
        self.commands: list[dict] = []        # requests to agents: arrival, node, verb
        self.restore_request = threading.Event()
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
        from revenant.common.settings import security
        from revenant.messages import codec

        self._loop = asyncio.get_running_loop()
        self._halt = asyncio.Event()
        nc = await bus.connect(self.url, "bench-failover-observer",
                               **security.credentials(security.COORDINATOR, self.seed))

        async def on_hb(msg) -> None:
            now = time.time()
            node = msg.subject.rsplit(".", 1)[1]
            with self.lock:
                self.heartbeats.setdefault(node, []).append(now)

        async def on_event(msg) -> None:
            now = time.time()
            try:
                obj = msgspec.to_builtins(codec.decode(msg.data))
            except Exception:  # noqa: BLE001 - not ours to judge
                return
            obj["subject"] = msg.subject
            obj["arrived"] = now
            with self.lock:
                self.events.append(obj)

        async def on_cmd(msg) -> None:
            now = time.time()
            parts = msg.subject.split(".")  # revenant.node.<node>.cmd.<verb>
            rec = {"arrived": now, "node": parts[2], "verb": parts[4]}
            with self.lock:
                self.commands.append(rec)
            if rec["verb"] == "restore" and rec["node"] == self.target_node:
                self.restore_request.set()

        await nc.subscribe("revenant.hb.*", cb=on_hb)
        await nc.subscribe("revenant.evt.>", cb=on_event)
        await nc.subscribe("revenant.node.*.cmd.*", cb=on_cmd)
        js = nc.jetstream()
        kv = await js.key_value("revenant_leases")
        watcher = await kv.watchall(include_history=False, ignore_deletes=True)
        await nc.flush()
        self.ready.set()

        async def watch() -> None:
            while True:
                try:
                    entry = await watcher.updates(timeout=1.0)
                except Exception:  # noqa: BLE001 - timeouts
                    continue
                if entry is not None and entry.key == self.dead_node:
                    with self.lock:
                        self.leases.append({"arrived": time.time(), "revision": entry.revision,
                                            "created": str(getattr(entry, "created", "")),
                                            "op": entry.operation})

        task = asyncio.create_task(watch())
        await self._halt.wait()
        task.cancel()
        try:
            await watcher.stop()
        except Exception:  # noqa: BLE001
            pass
        await nc.close()

    def stop(self) -> None:
        if self._loop is not None and self._halt is not None:
            try:
                self._loop.call_soon_threadsafe(self._halt.set)
            except RuntimeError:
                pass
        self.join(timeout=5)

    def job_event(self, job: str, kinds: tuple[str, ...], after: float = 0.0) -> dict | None:
        with self.lock:
            for e in self.events:
                if (e.get("type") == "job_event.v1" and e.get("job") == job and e.get("kind") in kinds
                        and e.get("at", 0) > after):
                    return dict(e)
        return None


def disk_read_bytes(dev: int | None) -> int | None:
    """Bytes read so far from block device ``dev`` (an st_dev), by /proc/diskstats; None if not found."""
    if dev is None:
        return None
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if (int(parts[0]), int(parts[1])) == (os.major(dev), os.minor(dev)):
                return int(parts[5]) * 512
    return None


class CriuScanner(threading.Thread):
    """Once a restore request is out, finds node-2's criu restore in /proc: start time and when it is gone."""

    def __init__(self, agent_pid: int, trigger: threading.Event, stop: threading.Event,
                 storage: Path | None = None) -> None:
        super().__init__(name="criu-scan", daemon=True)
        self.agent_pid = agent_pid
        self.trigger = trigger
        self.halt = stop
        self.seen: dict[int, dict] = {}
        # Bytes read from the storage's device from the restore request until the job runs (criu
        # restore gone, or become the job): /proc/diskstats, so a cold image's reads count.
        self.dev = os.stat(storage).st_dev if storage is not None else None
        self.read_before_run: int | None = None
        self._read_at_request: int | None = None

    def run(self) -> None:
        while not self.trigger.wait(0.05):
            if self.halt.is_set():
                return
        # criu's own process, and the restored tree's root that criu forks as a sibling (our child too):
        # that one starts out as criu and turns into the job.  criu's process is the one that started first.
        self._read_at_request = disk_read_bytes(self.dev)
        deadline = time.monotonic() + 600
        while not self.halt.is_set() and time.monotonic() < deadline:
            now = time.time()
            present = set()
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                st = proc_stat(name)
                if st is None or st[0] != self.agent_pid:
                    continue
                pid = int(name)
                if pid not in self.seen:
                    if not is_criu_restore(cmdline(pid)):
                        continue
                    self.seen[pid] = {"pid": pid, "start": boot_to_wall(st[1]), "first_seen": now,
                                      "last_seen": now, "gone": None, "became_other": None}
                present.add(pid)
            for pid, rec in self.seen.items():
                if pid in present:
                    rec["last_seen"] = now
                    if rec["became_other"] is None and not is_criu_restore(cmdline(pid)):
                        rec["became_other"] = now
                elif rec["gone"] is None:
                    rec["gone"] = now
            main = self.main()
            if main is not None and (main["gone"] is not None or main["became_other"] is not None):
                now_read = disk_read_bytes(self.dev)
                if now_read is not None and self._read_at_request is not None:
                    self.read_before_run = now_read - self._read_at_request
                return
            time.sleep(SCAN_S)

    def main(self) -> dict | None:
        return min(self.seen.values(), key=lambda r: r["start"]) if self.seen else None
