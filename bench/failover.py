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
import json
import mmap
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from failover_lazy import (CACHES, LAZY_TARGET_RATIO, LAZY_TARGET_RESUMED_S, MODE_ENV, MODES, WINDOW_S, agent_has_restore_mode,
                           expects_completion, gap_before, lazy_measures, lazy_over_eager, targets, up_env,
                           wait_completed, watch_output)

MiB = 1 << 20
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


# ====================================================================== helpers

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REVENANT = str(BIN / "revenant")
LEASE_TTL_S = 1.7      # docs/configuration.md defaults (coordinator lease_ttl_s, lease_margin_s)
LEASE_MARGIN_S = 0.2
GOAL_S = 3.0
SERVERS_GOAL_RATIO = 1.2  # median total on a 3-server NATS cluster / on one server
TICK_S = 0.1
SCAN_S = 0.025


class BenchError(Exception):
    pass


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _median(xs: list[float]) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rv(*args: str, timeout: float = 60.0, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([REVENANT, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise BenchError(f"revenant {' '.join(args)} failed ({proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc


def log_time(line: str) -> float | None:
    """The wall time of a revenant log line (``%(asctime)s``: local time, milliseconds)."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: str) -> tuple[int, int] | None:
    """(ppid, starttime in clock ticks since boot) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[1].split()
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int | str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _drop_from_cache(d: Path) -> None:
    """Evict these files (only these) from the page cache, as if another node had written them."""
    for f in d.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cached_bytes(d: Path) -> int | None:
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


def _is_criu_restore(cmd: list[str]) -> bool:
    return any(os.path.basename(a) == "criu" for a in cmd[:4]) and "restore" in cmd


def _boot_to_wall(ticks: int) -> float:
    """A /proc starttime (boot-time clock ticks) as wall time."""
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / _CLK_TCK)


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


class CriuScanner(threading.Thread):
    """Once a restore request is out, finds node-2's criu restore in /proc: start time and when it is gone."""

    def __init__(self, agent_pid: int, trigger: threading.Event, stop: threading.Event) -> None:
        super().__init__(name="criu-scan", daemon=True)
        self.agent_pid = agent_pid
        self.trigger = trigger
        self.halt = stop
        self.seen: dict[int, dict] = {}

    def run(self) -> None:
        while not self.trigger.wait(0.05):
            if self.halt.is_set():
                return
        # criu's own process, and the restored tree's root that criu forks as a sibling (our child too):
        # that one starts out as criu and turns into the job.  criu's process is the one that started first.
        deadline = time.monotonic() + 600
        while not self.halt.is_set() and time.monotonic() < deadline:
            now = time.time()
            present = set()
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                st = _proc_stat(name)
                if st is None or st[0] != self.agent_pid:
                    continue
                pid = int(name)
                if pid not in self.seen:
                    if not _is_criu_restore(_cmdline(pid)):
                        continue
                    self.seen[pid] = {"pid": pid, "start": _boot_to_wall(st[1]), "first_seen": now,
                                      "last_seen": now, "gone": None, "became_other": None}
                present.add(pid)
            for pid, rec in self.seen.items():
                if pid in present:
                    rec["last_seen"] = now
                    if rec["became_other"] is None and not _is_criu_restore(_cmdline(pid)):
                        rec["became_other"] = now
                elif rec["gone"] is None:
                    rec["gone"] = now
            main = self.main()
            if main is not None and (main["gone"] is not None or main["became_other"] is not None):
                return
            time.sleep(SCAN_S)

    def main(self) -> dict | None:
        return min(self.seen.values(), key=lambda r: r["start"]) if self.seen else None


# ====================================================================== one run

class Run:
    def __init__(self, args: argparse.Namespace, mib: int, attempt: int, base: Path,
                 mode: str = "eager", cache: str = "warm", servers: int = 1) -> None:
        self.args = args
        self.mib = mib
        self.attempt = attempt
        self.mode = mode
        self.cache = cache
        self.servers = servers  # nats-servers of the cluster (revenant up --nats-servers)
        srv = "" if servers == 1 else f"{servers}srv-"
        self.dir = Path(tempfile.mkdtemp(prefix=f"revenant-bench-failover-{mib}-{cache}-{mode}-{srv}", dir=base))
        self.tag = f"fobench-{os.getpid()}-{mib}-{cache}-{mode}-{srv}{attempt}-{random.randrange(1 << 30):x}"
        self.cluster: dict | None = None
        self.observer: Observer | None = None
        self.scan_stop = threading.Event()
        self.result: dict = {"size_mib": mib, "cache": cache, "restore_mode": mode, "nats_servers": servers,
                             "attempt": attempt, "dir": str(self.dir), "status": "error",
                             "loadavg_before": list(os.getloadavg())}

    # ---------------------------------------------------------------- cluster

    def _pid(self, name: str) -> dict:
        assert self.cluster is not None
        for p in self.cluster["processes"]:
            if p["name"] == name:
                return p
        raise BenchError(f"no {name} in cluster.json")

    def _alive_as_recorded(self, proc: dict) -> bool:
        import psutil

        try:
            return abs(psutil.Process(proc["pid"]).create_time() - proc["create_time"]) < 1.0
        except psutil.Error:
            return False

    def execute(self) -> dict:
        r = self.result
        try:
            env = up_env(self.mode)
        except RuntimeError as exc:
            raise BenchError(str(exc)) from None
        env["REVENANT_AGENT_ALLOW_ROOT_JOBS"] = "true"  # the benchmark's job runs as its user, root here
        r["agent_env"] = {MODE_ENV: env.get(MODE_ENV)}
        servers = [] if self.servers == 1 else ["--nats-servers", str(self.servers)]
        rv("up", "--nodes", "2", "--dir", str(self.dir), "--detach", *servers, timeout=120, env=env)
        self.cluster = json.loads((self.dir / "cluster.json").read_text())
        # With several servers nats_url lists each one, comma-separated: the observer connects
        # through bus.connect, which takes that list (and moves to another server if one goes).
        urls = [u for u in self.cluster["nats_url"].split(",") if u.strip()]
        started = sum(1 for p in self.cluster["processes"] if p["role"] == "nats-server")
        r["nats_urls"] = len(urls)
        if started != self.servers or len(urls) != self.servers:
            raise BenchError(f"asked for {self.servers} nats-server(s); cluster.json lists {started} "
                             f"and {len(urls)} URL(s)")
        agent1, agent2 = self._pid("node-1"), self._pid("node-2")
        seed = self.dir / "keys" / "coordinator.nk"
        self.observer = Observer(self.cluster["nats_url"], "node-1", "node-2",
                                 "" if self.cluster.get("insecure") else str(seed))
        self.observer.start()
        if not self.observer.ready.wait(15) or self.observer.error:
            raise BenchError(f"observer could not start: {self.observer.error}")
        scanner = CriuScanner(agent2["pid"], self.observer.restore_request, self.scan_stop)
        scanner.start()

        # -------------------------------------------------- the job, resident, with one committed epoch
        argv = [sys.executable, str(Path(__file__).resolve()), "--workload", str(self.mib), "--tag", self.tag]
        # Its own working directory: a restore moves aside what changed in it after the epoch.
        job = rv("submit", "--dir", str(self.dir), "--node", "node-1", "--name", f"failover-{self.mib}",
                 "--workdir", str(self.dir), "--", *argv).stdout.strip()
        r["job"] = job
        info = json.loads(rv("show", "job", job, "--dir", str(self.dir), "--json").stdout)
        output = Path(info["output"])
        deadline = time.monotonic() + self.args.ready_timeout
        while True:
            text = output.read_text(errors="replace") if output.exists() else ""
            if "ready" in text:
                r["workload_ready"] = text.split("ready", 1)[1].splitlines()[0].strip()
                break
            if time.monotonic() > deadline:
                raise BenchError(f"job {job} not ready after {self.args.ready_timeout} s: {text[-300:]!r}")
            time.sleep(0.1)
        t = time.monotonic()
        ck = rv("checkpoint", "create", job, "--dir", str(self.dir), timeout=1200)
        r["checkpoint_cli_s"] = _r(time.monotonic() - t)
        r["checkpoint_out"] = ck.stdout.strip()
        checkpointed = time.time()
        info = json.loads(rv("show", "job", job, "--dir", str(self.dir), "--json").stdout)
        if info["state"] != "running" or info["node"] != "node-1" or not info["epochs"]:
            raise BenchError(f"job {job} not ready for the kill: {info['state']} on {info['node']}, "
                             f"{len(info['epochs'])} epoch(s)")
        r["epoch_bytes"] = info["epochs"][-1]["bytes"]
        r["epoch_freeze_s"] = _r(info["epochs"][-1]["freeze_s"])
        job_pid = int(info["pid"])
        if "revenant-init" not in " ".join(_cmdline(job_pid)) or self.tag not in " ".join(_cmdline(job_pid)):
            raise BenchError(f"pid {job_pid} is not job {job}'s namespace init")
        workload_pids = self._workload_pids()
        epoch_dir = Path(self.cluster["storage"]) / "jobs" / job / "epochs" / str(info["epochs"][-1]["n"])
        r["images_cached_before_kill"] = _cached_bytes(epoch_dir)
        if self.cache == "cold":
            _drop_from_cache(epoch_dir)
            r["images_cached_after_drop"] = _cached_bytes(epoch_dir)
        pause = self.args.settle + random.uniform(0.0, 1.0)
        r["pause_before_kill_s"] = _r(pause)
        time.sleep(pause)
        listed = json.loads(rv("nodes", "--dir", str(self.dir), "--json").stdout)
        nodes = {n["name"]: n["state"] for n in listed}
        if nodes.get("node-1") != "alive" or nodes.get("node-2") != "alive":
            raise BenchError(f"nodes not both alive before the kill: {nodes}")
        if not self._alive_as_recorded(agent1):
            raise BenchError("node-1's agent is not the process cluster.json recorded")
        caps = next((n.get("capabilities") or {} for n in listed if n["name"] == "node-2"), {})
        r["node2_lazy_restore"] = caps.get("lazy_restore")  # None: this revenant has no such capability
        r.update(gap_before(output, checkpointed))

        # -------------------------------------------------- the kill
        t0 = time.time()
        os.kill(agent1["pid"], signal.SIGKILL)
        try:
            os.kill(job_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        r["t0"] = t0
        r["killed"] = {"agent": agent1["pid"], "job_init": job_pid, "workload": workload_pids}

        # -------------------------------------------------- wait for the job to run elsewhere
        coord_log = self.dir / "logs" / "coordinator.log"
        deadline = time.monotonic() + self.args.failover_timeout
        status = None
        while status is None:
            ev = self.observer.job_event(job, ("restored", "failed", "requeued"))
            if ev is not None:
                status = "restored" if ev["kind"] == "restored" else ev["kind"]
                break
            if f"job {job}: node node-1 renewed its lease meanwhile" in coord_log.read_text(errors="replace"):
                time.sleep(2.0)  # the coordinator said it gives up; make sure nothing follows
                status = "abandoned" if self.observer.job_event(job, ("restored",)) is None else None
                continue
            if time.monotonic() > deadline:
                status = "timeout"
            time.sleep(0.02)
        t_done = time.time()
        r["status"] = status

        # the restored job's first output line after T0, its next WINDOW_S, and (lazy) all its pages in
        resumed = None
        window: list[dict] = []
        if status == "restored":
            resumed, window = watch_output(output, t0)
            lazy = expects_completion(self.mode, r.get("node2_lazy_restore"))
            wait_completed(self.observer.job_event, job, t0, self.args.failover_timeout if lazy else 0.0)
            survivors = self._workload_pids()
            r["workload_after"] = survivors
            r["one_copy"] = len(survivors) == 1 and not set(survivors) & set(workload_pids)
        scanner.join(timeout=3)  # it ends once criu is gone
        self.scan_stop.set()
        scanner.join(timeout=2)
        r["wait_s"] = _r(t_done - t0)

        # -------------------------------------------------- collect
        stream = [json.loads(line) for line in
                  rv("events", "--dir", str(self.dir), "--json").stdout.splitlines() if line.strip()]
        r["events"] = [e for e in stream if e.get("node") == "node-1" and e.get("type") == "node_event.v1"
                       or e.get("job") == job]
        self._analyse(job, t0, stream, scanner, resumed)
        lazy_measures(r, self.observer.job_event, stream, job, t0, window, self.mode)
        r["coordinator_log"] = [line for line in coord_log.read_text(errors="replace").splitlines()
                                if "node-1" in line or f"job {job}" in line]
        final = json.loads(rv("show", "job", job, "--dir", str(self.dir), "--json").stdout)
        r["final"] = {k: final.get(k) for k in ("state", "node", "pid", "generation", "reason")}
        return r

    def _workload_pids(self, any_tagged: bool = False) -> list[int]:
        """The job's Python processes (with ``any_tagged``: every process whose command line has our tag,
        the job's namespace init included)."""
        me = str(Path(__file__).resolve())
        pids = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                cmd = _cmdline(name)
                if self.tag not in cmd:
                    continue
                if any_tagged or (len(cmd) > 2 and cmd[1] == me and cmd[2] == "--workload"):
                    pids.append(int(name))
        return sorted(pids)

    def _analyse(self, job: str, t0: float, stream: list[dict], scanner: CriuScanner, resumed: dict | None) -> None:
        r = self.result
        obs = self.observer
        assert obs is not None

        def first(pred) -> dict | None:
            return next((e for e in stream if pred(e)), None)

        dead = first(lambda e: e.get("type") == "node_event.v1" and e.get("node") == "node-1"
                     and e.get("kind") == "dead")
        suspect = first(lambda e: e.get("type") == "node_event.v1" and e.get("node") == "node-1"
                        and e.get("kind") == "suspect")
        restoring = first(lambda e: e.get("job") == job and e.get("kind") == "restoring")
        restored = first(lambda e: e.get("job") == job and e.get("kind") == "restored")
        with obs.lock:
            hbs = [t for t in obs.heartbeats.get("node-1", []) if t <= t0]
            leases = [x for x in obs.leases if x["arrived"] <= t0]
            late_leases = [x for x in obs.leases if x["arrived"] > t0]
            requests = [c for c in obs.commands if c["node"] == "node-2" and c["verb"] == "restore"
                        and c["arrived"] > t0]
        last_hb = hbs[-1] if hbs else None
        last_lease = leases[-1]["arrived"] if leases else None
        request = requests[0]["arrived"] if requests else None
        dead_at = dead["at"] if dead else None
        coordinator_last_hb = _sub(dead_at, dead["silence_s"] if dead else None)
        lease_expiry = None if last_lease is None else last_lease + LEASE_TTL_S + LEASE_MARGIN_S
        wait_logged = None
        for line in (self.dir / "logs" / "coordinator.log").read_text(errors="replace").splitlines():
            m = re.search(rf"job {re.escape(job)}: waiting ([0-9.]+) s for node node-1's lease", line)
            if m:
                wait_logged = float(m.group(1))
        agent_done = None
        for line in (self.dir / "logs" / "node-2.log").read_text(errors="replace").splitlines():
            if f"job {job} restored from epoch" in line:
                agent_done = log_time(line)
        criu = sorted(scanner.seen.values(), key=lambda x: x["start"])
        main = scanner.main()
        criu_start = main["start"] if main else None
        criu_gone = (main["gone"] or main["became_other"]) if main else None
        restored_at = restored["at"] if restored else None
        total = _sub(restored_at, t0)
        restore = _sub(restored_at, request)
        detection = _sub(dead_at, t0)
        decision = _sub(request, dead_at)
        r.update({
            "kill_after_last_heartbeat_s": _r(_sub(t0, last_hb)),
            "kill_after_last_lease_renewal_s": _r(_sub(t0, last_lease)),
            "lease_entries_after_kill": late_leases,
            "suspect_after_t0_s": _r(_sub(suspect["at"] if suspect else None, t0)),
            "detection_s": _r(detection),
            "dead_silence_s": dead["silence_s"] if dead else None,
            "decision_s": _r(decision),
            "restoring_event_after_dead_s": _r(_sub(restoring["at"] if restoring else None, dead_at)),
            "lease_wait_logged_s": wait_logged if wait_logged is not None else (0.0 if request else None),
            "lease_expiry_after_dead_s": _r(_sub(lease_expiry, dead_at)),
            "request_after_lease_expiry_s": _r(_sub(request, lease_expiry)),
            "restore_s": _r(restore),
            "restore_verify_s": _r(_sub(criu_start, request)),
            "restore_criu_s": _r(_sub(agent_done, criu_start)),
            "restore_criu_scan_s": _r(_sub(criu_gone, criu_start)),
            "restore_after_agent_s": _r(_sub(restored_at, agent_done)),
            "restore_agent_log_after_request_s": _r(_sub(agent_done, request)),
            "criu_processes": criu,
            "total_s": _r(total),
            "restored_since_last_heartbeat_s": restored.get("since_last_heartbeat_s") if restored else None,
            "heartbeat_to_restore_request_s": _r(_sub(request, coordinator_last_hb)),
            "resumed_s": _r(_sub(resumed["wall"], t0) if resumed else None),
            "resumed_line": resumed,
            "restored_node": restored.get("node") if restored else None,
            "restored_epoch": restored.get("epoch") if restored else None,
            "goal_total_le_3s_plus_restore": None if total is None or restore is None else total <= GOAL_S + restore,
            "goal_heartbeat_to_restore_le_3s": None if request is None or coordinator_last_hb is None
            else request - coordinator_last_hb <= GOAL_S,
        })
        if self.result["status"] == "restored" and (resumed is None or resumed["check"] != "ok"):
            self.result["status"] = "restored-but-not-running" if resumed is None else "restored-corrupt"

    # ---------------------------------------------------------------- cleanup

    def cleanup(self) -> None:
        self.scan_stop.set()
        if self.observer is not None:
            try:
                self.observer.stop()
            except Exception as exc:  # noqa: BLE001 - never skip the rest of the cleanup
                print(f"  observer stop: {exc}", file=sys.stderr)
        if (self.dir / "cluster.json").exists():
            try:
                rv("down", "--dir", str(self.dir), "--timeout", "10", timeout=60, check=False)
            except subprocess.TimeoutExpired:
                pass
        if self.cluster is not None:
            for p in self.cluster["processes"]:
                if self._alive_as_recorded(p):
                    try:
                        os.kill(p["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for _ in range(50):
            pids = self._workload_pids(any_tagged=True)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        # node-local staging leftovers of *our* agents only (other clusters share these roots)
        if self.cluster is not None:
            agents = [p for p in self.cluster["processes"] if p["role"] == "agent"]
            for p in agents:
                for root in (Path("/dev/shm") / f"revenant-{p['name']}", Path("/var/tmp") / f"revenant-{p['name']}"):
                    if root.is_dir():
                        for d in root.iterdir():
                            if f"-{p['pid']}-" in d.name:
                                shutil.rmtree(d, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


# ====================================================================== report

ROWS = [  # label, key, format of one number
    ("detection: T0 → dead event", "detection_s", ".2f"),
    ("  node's silence at the dead event", "dead_silence_s", ".2f"),
    ("  kill after node-1's last heartbeat", "kill_after_last_heartbeat_s", ".2f"),
    ("decision: dead event → restore request", "decision_s", ".2f"),
    ("  lease wait (coordinator log)", "lease_wait_logged_s", ".2f"),
    ("restore: restore request → restored event", "restore_s", ".2f"),
    ("  verify + rollback (request → criu start)", "restore_verify_s", ".2f"),
    ("  criu restore (criu start → agent's log line)", "restore_criu_s", ".2f"),
    ("  reply + job record (agent's log → restored)", "restore_after_agent_s", ".2f"),
    ("**total: T0 → restored event (job runs)**", "total_s", ".2f"),
    ("restored event's since_last_heartbeat_s", "restored_since_last_heartbeat_s", ".2f"),
    ("last heartbeat → restore request", "heartbeat_to_restore_request_s", ".2f"),
    ("**job prints again: T0 → first new line**", "resumed_s", ".2f"),
    ("total − restore (goal ≤ 3 s)", "total_minus_restore_s", ".2f"),
    ("**all pages in: T0 → restore_completed**", "restore_completed_s", ".2f"),
    ("  its duration_s (restore start → last page)", "restore_completed_duration_s", ".2f"),
    ("  its bytes (MiB)", "restore_completed_mib", ".0f"),
    ("output gap before the kill, median", "gap_before_p50_s", ".3f"),
    (f"output gap, first {WINDOW_S:g} s printing again: p50", "gap_after_p50_s", ".3f"),
    ("  max", "gap_after_max_s", ".3f"),
    ("  slowdown p50 (after / before)", "slowdown_p50_ratio", ".2f"),
    ("  slowdown max (after / before)", "slowdown_max_ratio", ".2f"),
]


def _stats(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    return {"median": _r(_median(xs), 4), "min": _r(min(xs), 4) if xs else None,
            "max": _r(max(xs), 4) if xs else None, "n": len(xs)}


def _summarize_one(mine: list[dict]) -> dict:
    ok = [r for r in mine if r["status"] == "restored"]
    for r in ok:
        r["total_minus_restore_s"] = _r(_sub(r.get("total_s"), r.get("restore_s")))
    s: dict = {"attempts": len(mine), "restored": len(ok),
               "failed": [{"attempt": r["attempt"], "status": r["status"], "error": r.get("error")}
                          for r in mine if r["status"] != "restored"]}
    for _, key, _ in ROWS:
        s[key] = _stats([r.get(key) for r in ok])
    s["goal_total_le_3s_plus_restore"] = sum(1 for r in ok if r.get("goal_total_le_3s_plus_restore"))
    s["goal_heartbeat_to_restore_le_3s"] = sum(1 for r in ok if r.get("goal_heartbeat_to_restore_le_3s"))
    s["epoch_mib"] = _r(_median([r["epoch_bytes"] / MiB for r in ok if r.get("epoch_bytes")]), 1)
    s["node2_lazy_restore"] = sum(1 for r in ok if r.get("node2_lazy_restore"))
    s["resumed_le_target"] = sum(1 for r in ok if r.get("resumed_s") is not None
                                 and r["resumed_s"] <= LAZY_TARGET_RESUMED_S)
    return s


def summarize(runs: list[dict], sizes: list[int], caches: list[str], modes: list[str], servers: int = 1) -> dict:
    """{size: {cache: {mode: stats, "lazy_over_eager": ...}}}, over the runs on ``servers`` nats-servers."""
    out: dict = {}
    runs = [r for r in runs if r.get("nats_servers", 1) == servers]
    for mib in sizes:
        out[str(mib)] = {}
        for cache in caches:
            per = {mode: _summarize_one([r for r in runs if r["size_mib"] == mib and r.get("cache", "warm") == cache
                                         and r.get("restore_mode", "eager") == mode]) for mode in modes}
            if "eager" in per and "lazy" in per:
                per["lazy_over_eager"] = lazy_over_eager(per)
            out[str(mib)][cache] = per
    return out


def servers_ratio(by_servers: dict, sizes: list[int], caches: list[str], modes: list[str]) -> dict:
    """{size: {cache: {mode: {N: ...}}}}: per N > 1 nats-servers, the median total (T0 -> restored) on N
    servers over that on one, against SERVERS_GOAL_RATIO.  Empty unless 1 and another count ran."""
    counts = [int(n) for n in by_servers if int(n) != 1]
    if "1" not in by_servers or not counts:
        return {}
    out: dict = {}
    for mib in sizes:
        for cache in caches:
            for mode in modes:
                one = by_servers["1"][str(mib)][cache][mode]["total_s"]["median"]
                for n in counts:
                    many = by_servers[str(n)][str(mib)][cache][mode]["total_s"]["median"]
                    ratio = _r(many / one, 3) if many is not None and one else None
                    out.setdefault(str(mib), {}).setdefault(cache, {}).setdefault(mode, {})[str(n)] = {
                        "total_s_1_server": one, f"total_s_{n}_servers": many, "ratio": ratio,
                        "goal": SERVERS_GOAL_RATIO, "met": None if ratio is None else ratio <= SERVERS_GOAL_RATIO}
    return out


def table(by_servers: dict, mib: int, caches: list[str], modes: list[str], ratios: dict | None = None) -> str:
    """One column per cache state, mode and nats-server count (the counts side by side)."""
    counts = [int(n) for n in by_servers]
    cols = [(c, m, n) for c in caches for m in modes for n in counts]

    def head(c: str, m: str, n: int) -> str:
        return f"{c} {m}" if len(counts) == 1 else f"{c} {m}, {n} server{'s' if n > 1 else ''}"

    def cell(d: dict, fmt: str) -> str:
        if d["median"] is None:
            return "–"
        return f"{d['median']:{fmt}} [{d['min']:{fmt}}–{d['max']:{fmt}}]"

    def row(label: str, f) -> str:
        return f"| {label} | " + " | ".join(f(by_servers[str(n)][str(mib)][c][m]) for c, m, n in cols) + " |"

    def ratio(c: str, m: str, n: int) -> str:
        x = (ratios or {}).get(str(mib), {}).get(c, {}).get(m, {}).get(str(n))
        if x is None:
            return "–"
        if x["ratio"] is None:
            return "no data"
        return f"**{x['ratio']:.2f}** ({'met' if x['met'] else 'not met'})"

    lines = [f"| {mib} MiB job: seconds, median [min–max] | " + " | ".join(head(*col) for col in cols) + " |",
             "|---|" + "---|" * len(cols),
             "| NATS servers | " + " | ".join(str(n) for _, _, n in cols) + " |",
             row("runs restored / attempts", lambda s: f"{s['restored']} / {s['attempts']}"),
             row("node-2 restores lazily (capability)", lambda s: f"{s['node2_lazy_restore']} / {s['restored']}"),
             row("checkpoint image (MiB)", lambda s: "–" if s["epoch_mib"] is None else f"{s['epoch_mib']:.0f}")]
    for label, key, fmt in ROWS:
        lines.append(row(label, lambda s, key=key, fmt=fmt: cell(s[key], fmt)))
    lines.append(row("runs meeting total ≤ 3 s + restore",
                     lambda s: f"{s['goal_total_le_3s_plus_restore']} / {s['restored']}"))
    lines.append(row("runs with last heartbeat → restore ≤ 3 s",
                     lambda s: f"{s['goal_heartbeat_to_restore_le_3s']} / {s['restored']}"))
    if ratios:
        lines.append(f"| **total on N servers / on 1 (goal ≤ {SERVERS_GOAL_RATIO:g})** | "
                     + " | ".join(ratio(*col) for col in cols) + " |")
    return "\n".join(lines)


def servers_lines(ratios: dict) -> str:
    """The NATS-cluster goal, one line per size, cache state, mode and server count."""
    lines = []
    for mib, per_size in ratios.items():
        for cache, per_cache in per_size.items():
            for mode, per_mode in per_cache.items():
                for n, x in per_mode.items():
                    if x["ratio"] is None:
                        lines.append(f"- {mib} MiB, {cache}, {mode}: total on {n} servers / on 1: no data")
                        continue
                    lines.append(f"- {mib} MiB, {cache}, {mode}: T0 → restored on {n} servers "
                                 f"{x[f'total_s_{n}_servers']:.2f} s / on 1 {x['total_s_1_server']:.2f} s = "
                                 f"**{x['ratio']:.2f}** (goal ≤ {SERVERS_GOAL_RATIO:g}: "
                                 f"{'met' if x['met'] else 'not met'})")
    return "\n".join(lines)


def machine() -> dict:
    import platform

    return {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "debian": Path("/etc/debian_version").read_text().strip() if Path("/etc/debian_version").exists()
            else None,
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)}


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
        modes = _choices(args.restore_mode, MODES, "--restore-mode")
        if set(modes) - {"eager"} and not agent_has_restore_mode():
            raise BenchError("this revenant's agent has no restore_mode setting (no lazy restore): "
                             "run with --restore-mode eager")
    except BenchError as exc:
        print(f"failover: {exc}", file=sys.stderr)
        return 2
    caches = ["cold"] if args.cold_images else list(CACHES) if args.cache == "both" else [args.cache]
    if args.out is None:
        args.out = REPO / "bench" / "results" / "failover.json"
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
                      "servers_goal_ratio": SERVERS_GOAL_RATIO,
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
        doc["elapsed_s"] = _r(time.time() - doc["started_at"], 1)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        tmp.replace(args.out)

    interrupted = False
    # The server counts innermost: 1, 3, 1, 3, ... so that a drift of the load touches both alike.
    combos = [(c, m, n) for c in caches for m in modes for n in counts]
    try:
        for mib in sizes:
            ok = dict.fromkeys(combos, 0)
            tried = dict.fromkeys(combos, 0)
            while any(ok[k] < args.runs and tried[k] < max_attempts for k in combos):
                for key in combos:  # one attempt each in turn: a drift of the load touches all alike
                    cache, mode, servers = key
                    if ok[key] >= args.runs or tried[key] >= max_attempts:
                        continue
                    tried[key] += 1
                    run = Run(args, mib, tried[key], args.base, mode, cache, servers)
                    on = "" if counts == [1] else f", {servers} NATS server{'s' if servers > 1 else ''}"
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
          f"NATS servers {' and '.join(map(str, counts))}, kernel {doc['machine']['kernel']}, "
          f"{doc['machine']['cpus']} CPUs, {doc['elapsed_s']:.0f} s; every run in {args.out}\n")
    for mib in sizes:
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
