"""bench/failover.py's proactive scenario: a node turns RED, then dies 5 s later; the work its job
re-does with each ``--on-sick`` policy (none, checkpoint, migrate), side by side.

Not a benchmark of its own: ``bench/failover.py --scenario proactive`` runs it.  For each policy,
on a fresh local cluster:

1. ``revenant up --nodes 1 --insecure --detach``: NATS, the coordinator and node-1 (the healthy
   node), all with the defaults (no REVENANT_AGENT_* or REVENANT_COORDINATOR_* setting: the point
   is that the defaults, proactive_hold_s 2 s among them, meet the targets).  The sick node,
   node-2, is an agent this benchmark starts itself, with its own environment: its
   ``memory_yellow_percent`` and ``memory_red_percent`` just above the machine's memory use now
   (1.5 GiB and 3 GiB above it).  The agents of one machine share its memory, so only node-2's
   thresholds make it the sick one.
2. ``revenant submit --node node-2 --checkpoint 5:00 --on-sick POLICY --requeue`` a job that
   prints ``tick N WALL ok`` every 0.1 s (bench/failover.py's workload, 16 MiB): its progress
   is the tick number, its wall time on the line.  The periodic checkpoint is 5 minutes away:
   no epoch of the schedule falls in the run.  (``--requeue``: a job with no epoch at its node's
   death starts again from the beginning rather than fails.)  Its working directory is one of
   its own in the cluster directory: a restore moves aside whatever changed in the working
   directory after the epoch, which must not be the files of a repository being edited.
3. After 20 s of the job, a process allocates and touches enough memory to take the machine
   1.5 GiB past node-2's RED threshold (bench/workloads/hold_memory.py).  YELLOW and RED verdicts
   = the arrival of node-2's first heartbeat saying YELLOW-or-worse, and RED.
4. Death at the RED verdict + 5 s: SIGKILL of node-2's agent, its children, the job's copy on
   node-2 (its namespace init, if it still runs there) and the allocator.
5. Wait for the job to run on node-1 again and print for 2 s.

The job's output is read every 50 ms and right after the kill, so every line a copy printed is
seen before a restore rolls the output back (to the epoch) or a requeue empties it.  The restored
copy is the one started by node-1's first ``restore`` or ``start`` request (a passive NATS
subscriber timestamps it): every line stamped before that request is the old copy's, every
later line the new copy's.  Then

  progress at death  the old copy's last tick, in seconds of its run (wall of that tick − wall of
                     its tick 1 + 0.1 s);
  resumed from       the tick before the new copy's first line, in the same seconds (0: it started
                     over);
  work re-done       progress at death − resumed from (seconds of the job's progress run twice).

Targets: migrate 0 s (the job moved before the death); checkpoint ≤ YELLOW verdict → death;
none: everything since the start (no periodic epoch within 5 minutes).  Also reported: the
epochs of cause ``health`` (``epoch_event`` created) after the RED verdict, RED verdict → the
epoch the job came back from (the proactive action's) and → that epoch's last output line (the
job's state saved), RED verdict → the job running on node-1 (the ``migrated``/``restored``/
``requeued`` event); the JSON has the coordinator's log lines about the job and node-2.  The
allocator fills memory at some GB/s, so node-2 usually reports YELLOW a second or more before
RED, and the coordinator may act on the YELLOW already (a checkpoint, with either policy).

One run per policy; the table goes to stdout, every run to bench/results/failover-proactive.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


class BenchError(Exception):
    pass


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _sub(a: float | None, b: float | None) -> float | None:
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


def _memory() -> tuple[float, int, int]:
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


# ====================================================================== one run

def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Run:
    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        self.args = args
        self.policy = policy
        self.dir = Path(tempfile.mkdtemp(prefix=f"revenant-bench-proactive-{policy}-", dir=args.base))
        self.tag = f"pabench-{os.getpid()}-{policy}-{random.randrange(1 << 30):x}"
        self.env, self.dropped = clean_env()
        self.cluster: dict | None = None
        self.watch: Watch | None = None
        self.tail: Tail | None = None
        self.agent: subprocess.Popen | None = None
        self.agent_ct = 0.0
        self.alloc: subprocess.Popen | None = None
        self.result: dict = {"policy": policy, "dir": str(self.dir), "status": "error",
                             "loadavg_before": list(os.getloadavg())}

    def _rv(self, *args: str, timeout: float = 60.0) -> str:
        """``revenant ARGS`` on this cluster (``--dir`` goes before a ``--``: the job's command)."""
        cut = args.index("--") if "--" in args else len(args)
        return rv(*args[:cut], "--dir", str(self.dir), *args[cut:], timeout=timeout, env=self.env)

    def _nodes(self) -> dict[str, dict]:
        return {n["name"]: n for n in json.loads(self._rv("nodes", "--json"))}

    def _start_sick_agent(self) -> None:
        """node-2, with its memory thresholds just above the machine's use now."""
        import psutil

        percent, total, available = _memory()
        if available < RED_ABOVE + PAST_RED + 2 * GiB:
            raise BenchError(f"{available / GiB:.1f} GiB available: the scenario needs "
                             f"{(RED_ABOVE + PAST_RED + 2 * GiB) / GiB:.1f} GiB")
        yellow = round(percent + 100 * YELLOW_ABOVE / total, 2)
        red = round(percent + 100 * RED_ABOVE / total, 2)
        env = dict(self.env, REVENANT_AGENT_MEMORY_YELLOW_PERCENT=str(yellow),
                   REVENANT_AGENT_MEMORY_RED_PERCENT=str(red))
        assert self.cluster is not None
        argv = [sys.executable, "-m", "revenant.cli", "agent", "--node", SICK, "--nats", self.cluster["nats_url"],
                "--http-port", "0", "--storage", self.cluster["storage"]]
        with open(self.dir / "logs" / f"{SICK}.log", "ab") as log:
            self.agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        self.agent_ct = psutil.Process(self.agent.pid).create_time()
        self.result.update({"memory_percent_at_start": percent, "memory_total_gib": _r(total / GiB, 1),
                            "sick_thresholds": {"memory_yellow_percent": yellow, "memory_red_percent": red}})
        deadline = time.monotonic() + 60
        while True:
            node = self._nodes().get(SICK)
            hb = self.watch.last_heartbeat() if self.watch else None
            if node and node["state"] == "alive" and hb and hb["state"] == "GREEN":
                return
            if self.agent.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{SICK} did not come up GREEN: {node and node.get('health')}, "
                                 f"last heartbeat {hb}; see {self.dir / 'logs' / (SICK + '.log')}")
            time.sleep(0.3)

    def _submit(self) -> tuple[str, Path, int, float]:
        """The job on node-2; (id, output, its namespace init's pid and create time) once it ticks."""
        import psutil

        argv = [sys.executable, str(BENCH / "failover.py"), "--workload", str(JOB_MIB), "--tag", self.tag]
        # Its own working directory: a restore moves aside what changed there after the epoch.
        work = self.dir / "work"
        work.mkdir()
        job = self._rv("submit", "--node", SICK, "--name", f"proactive-{self.policy}", "--checkpoint", INTERVAL,
                       "--on-sick", self.policy, "--requeue", "--workdir", str(work), "--", *argv).strip()
        info = json.loads(self._rv("show", "job", job, "--json"))
        output = Path(info["output"])
        deadline = time.monotonic() + self.args.ready_timeout
        while not (output.exists() and ticks(output.read_text(errors="replace"))):
            if time.monotonic() > deadline:
                raise BenchError(f"job {job} printed no tick in {self.args.ready_timeout:g} s")
            time.sleep(0.1)
        info = json.loads(self._rv("show", "job", job, "--json"))
        if info["node"] != SICK or info["state"] != "running":
            raise BenchError(f"job {job} is {info['state']} on {info['node']}, not running on {SICK}")
        pid = int(info["pid"])
        return job, output, pid, psutil.Process(pid).create_time()

    def _allocate(self) -> int:
        """Start the allocator: the machine this far past node-2's RED threshold.  Returns MiB."""
        percent, total, _ = _memory()
        red = self.result["sick_thresholds"]["memory_red_percent"]
        mib = max(256, int(((red - percent) / 100 * total + PAST_RED) / MiB))
        self.alloc = subprocess.Popen([sys.executable, str(BENCH / "workloads" / "hold_memory.py"), str(mib), "3600"],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        return mib

    def _death(self, job_pid: int, job_ct: float) -> dict:
        """SIGKILL node-2: its agent and what it started, the job's copy there, the allocator."""
        import psutil

        assert self.agent is not None
        try:
            children = [c.pid for c in psutil.Process(self.agent.pid).children(recursive=True)]
        except psutil.Error:
            children = []
        copy_alive = _alive(job_pid, job_ct)
        t = time.time()
        _kill(self.agent.pid)
        for pid in children:
            _kill(pid)
        if copy_alive:
            _kill(job_pid)
        if self.alloc is not None:
            _kill(self.alloc.pid)
        return {"t": t, "agent_children": children, "sick_copy_alive": copy_alive}

    def execute(self) -> None:
        r = self.result
        r["env_dropped"] = self.dropped
        rv("up", "--nodes", "1", "--insecure", "--detach", "--dir", str(self.dir), timeout=120, env=self.env)
        self.cluster = json.loads((self.dir / "cluster.json").read_text())
        self.watch = Watch(self.cluster["nats_url"])
        self.watch.start()
        if not self.watch.ready.wait(15) or self.watch.error:
            raise BenchError(f"NATS watcher could not start: {self.watch.error}")
        self._start_sick_agent()
        job, output, job_pid, job_ct = self._submit()
        r["job"] = job
        self.tail = Tail(output)
        self.tail.start()
        t_ready = time.time()
        time.sleep(RUN_BEFORE_S)
        hb = self.watch.last_heartbeat()
        if not hb or hb["state"] != "GREEN":
            raise BenchError(f"{SICK} not GREEN before the memory went: {hb}")

        # -------------------------------------------------- the sickness, then the death
        t_alloc = time.time()
        r["allocated_mib"] = self._allocate()
        r["ran_before_s"] = _r(t_alloc - t_ready)
        deadline = time.monotonic() + 90
        while (red := self.watch.first_heartbeat(t_alloc, ("RED",))) is None:
            if time.monotonic() > deadline or (self.alloc and self.alloc.poll() is not None):
                raise BenchError(f"{SICK} never turned RED; last heartbeat {self.watch.last_heartbeat()}")
            time.sleep(0.02)
        yellow = self.watch.first_heartbeat(t_alloc, ("YELLOW", "RED"))
        time.sleep(max(0.0, red["arrived"] + DEATH_AFTER_RED_S - time.time()))
        death = self._death(job_pid, job_ct)
        self.tail.read_now()
        t_death = death["t"]
        r.update({"t_alloc": t_alloc, "t_yellow": yellow["arrived"], "t_red": red["arrived"], "t_death": t_death,
                  "yellow_heartbeat": yellow, "red_heartbeat": red, "death": death})

        # -------------------------------------------------- the job runs on node-1 again
        deadline = time.monotonic() + self.args.failover_timeout
        back = None
        while back is None:
            back = self.watch.event("job_event.v1", job, ("restored", "requeued", "migrated", "failed"), t_alloc)
            if back is None and time.monotonic() > deadline:
                raise BenchError(f"job {job} not running again {self.args.failover_timeout:g} s after the death")
            time.sleep(0.05)
        request = self.watch.first_request(t_alloc)
        if back["kind"] == "failed" or request is None:
            r["status"] = "failed"
            r["back"] = back
            return
        while True:  # the new copy's output, NEW_COPY_S of it, after the death too
            new = [x for x in self.tail.lines() if x[1] >= request["arrived"]]
            if new and new[-1][1] >= max(new[0][1], t_death) + NEW_COPY_S:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"job {job}'s restored copy printed nothing for {NEW_COPY_S:g} s")
            time.sleep(0.1)
        self.tail.stop()
        r["status"] = "ok"
        self._analyse(job, back, request)

    def _analyse(self, job: str, back: dict, request: dict) -> None:
        r = self.result
        assert self.watch is not None and self.tail is not None
        lines = self.tail.lines()
        old = [x for x in lines if x[1] < request["arrived"]]
        new = [x for x in lines if x[1] >= request["arrived"]]
        wall = {n: w for n, w, _ in old}
        if not old or 1 not in wall:
            raise BenchError(f"job {job}: the first copy's output was not seen from its first tick")
        start = wall[1] - TICK_S

        def progress(n: int) -> float | None:
            return 0.0 if n == 0 else _sub(wall.get(n), start)

        at_death = max(n for n, _, _ in old)
        resumed_from = new[0][0] - 1
        created = [e for e in self.watch.events if e.get("type") == "epoch_event.v1" and e.get("job") == job
                   and e.get("kind") == "created"]
        # The epoch the job came back from (none after a requeue): the proactive action's.
        epoch = next((e for e in created if e.get("n") == back.get("epoch")), None) if back.get("epoch") else None
        r.update({
            "back": {k: back.get(k) for k in ("kind", "at", "node", "from_node", "epoch", "cause", "reasons", "reason")},
            "restore_request": request,
            "proactive_epoch": {k: epoch.get(k) for k in ("n", "at", "node", "cause", "reasons", "freeze_s", "bytes")}
            if epoch else None,
            "epochs_created": [{k: e.get(k) for k in ("n", "at", "cause", "reasons")} for e in created],
            "health_epochs_after_red_s": [[e.get("n"), _r(e["at"] - r["t_red"])] for e in created
                                          if e.get("cause") == "health"],
            "ticks_at_death": at_death, "resumed_from_tick": resumed_from,
            "redone_ticks": at_death - resumed_from,
            "progress_at_death_s": _r(progress(at_death)),
            "resumed_from_s": _r(progress(resumed_from)),
            "redone_s": _r(_sub(progress(at_death), progress(resumed_from))),
            "new_copy_corrupt": sum(1 for x in new if x[2] != "ok"),
            "yellow_to_red_s": _r(r["t_red"] - r["t_yellow"]),
            "yellow_to_death_s": _r(r["t_death"] - r["t_yellow"]),
            "red_to_death_s": _r(r["t_death"] - r["t_red"]),
            "red_to_epoch_s": _r(epoch["at"] - r["t_red"]) if epoch else None,
            "red_to_saved_s": _r(_sub(wall.get(resumed_from), r["t_red"])) if epoch else None,
            "red_to_back_s": _r(back["at"] - r["t_red"]),
            "back_before_death_s": _r(r["t_death"] - back["at"]),
        })
        redone = r["redone_s"]
        if self.policy == "migrate":
            r["target"], r["target_met"] = "0 s", r["redone_ticks"] == 0
        elif self.policy == "checkpoint":
            r["target"] = f"≤ YELLOW → death ({r['yellow_to_death_s']:.1f} s)"
            r["target_met"] = redone is not None and redone <= r["yellow_to_death_s"]
        else:
            r["target"] = "everything since the start"
            r["target_met"] = resumed_from == 0
        if r["new_copy_corrupt"]:
            r["status"] = "restored-corrupt"

    def logs(self, job: str | None) -> None:
        """The coordinator's log lines about the job and node-2, and node-2's about the job."""
        keys = [SICK] + ([f"job {job}"] if job else [])
        for name, field in (("coordinator", "coordinator_log"), (SICK, "sick_log")):
            path = self.dir / "logs" / f"{name}.log"
            if path.exists():
                text = path.read_text(errors="replace").splitlines()
                self.result[field] = [ln for ln in text if any(k in ln for k in keys)][-40:]

    # ---------------------------------------------------------------- cleanup

    def cleanup(self) -> None:
        for t in (self.tail,):
            if t is not None:
                t.halt.set()
        if self.agent is not None and _alive(self.agent.pid, self.agent_ct):
            _kill(self.agent.pid)
        if self.alloc is not None and self.alloc.poll() is None:
            _kill(self.alloc.pid)
        for p in (self.agent, self.alloc):
            if p is not None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for _ in range(50):  # every copy of the job, on either node
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()
                    and self.tag in _cmdline(d)]
            if not pids:
                break
            for pid in pids:
                _kill(pid)
            time.sleep(0.1)
        if self.watch is not None:
            self.watch.stop()
        if (self.dir / "cluster.json").exists():
            try:
                subprocess.run([REVENANT, "down", "--dir", str(self.dir), "--timeout", "10"], capture_output=True,
                               timeout=60, env=self.env)
            except subprocess.TimeoutExpired:
                pass
        agents = [(p["name"], p["pid"]) for p in (self.cluster or {}).get("processes", []) if p["role"] == "agent"]
        if self.agent is not None:
            agents.append((SICK, self.agent.pid))
        for name, pid in agents:  # node-local staging leftovers of *our* agents only
            for root in (Path("/dev/shm") / f"revenant-{name}", Path("/var/tmp") / f"revenant-{name}"):
                if root.is_dir():
                    for d in root.iterdir():
                        if f"-{pid}-" in d.name:
                            shutil.rmtree(d, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ====================================================================== report

def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else f"{x:{fmt}}"


def _back(r: dict) -> str:
    b = r.get("back") or {}
    if b.get("kind") == "requeued":
        return "requeued: started over"
    if b.get("kind") in ("restored", "migrated"):
        cause = next((e.get("cause") for e in r.get("epochs_created", []) if e.get("n") == b.get("epoch")), None)
        return f"{b['kind']} from epoch {b.get('epoch')}" + (f" (cause {cause})" if cause else "")
    return b.get("kind") or "–"


def _health_epochs(r: dict) -> str:
    got = r.get("health_epochs_after_red_s")
    return "–" if not got else ", ".join(f"{n}: {_f(s)}" for n, s in got)


ROWS = [  # label, cell
    ("node-2's first YELLOW-or-worse heartbeat → its first RED (s)", lambda r: _f(r.get("yellow_to_red_s"))),
    ("YELLOW → death (s)", lambda r: _f(r.get("yellow_to_death_s"))),
    ("RED → death (s)", lambda r: _f(r.get("red_to_death_s"))),
    ("epochs of cause health, committed (epoch: s after RED)", _health_epochs),
    ("RED → the epoch it came back from, committed (s)", lambda r: _f(r.get("red_to_epoch_s"))),
    ("RED → that epoch's last line (job state saved) (s)", lambda r: _f(r.get("red_to_saved_s"))),
    ("RED → job running on node-1 (s)", lambda r: _f(r.get("red_to_back_s"))),
    ("how it came back", _back),
    ("job's copy still on node-2 at the death", lambda r: "–" if "death" not in r
     else "yes" if r["death"]["sick_copy_alive"] else "no (it had moved)"),
    ("progress of node-2's copy when it ended: death, or the move (s)",
     lambda r: _f(r.get("progress_at_death_s"), ".1f")),
    ("progress the restored copy resumed from (s)", lambda r: _f(r.get("resumed_from_s"), ".1f")),
    ("**work re-done (s)**", lambda r: "–" if r.get("redone_s") is None
     else f"**{r['redone_s']:.1f}** ({r['redone_ticks']} ticks)"),
    ("target", lambda r: r.get("target", "–")),
    ("met", lambda r: "–" if "target_met" not in r else "yes" if r["target_met"] else "**NO**"),
]


def table(runs: list[dict]) -> str:
    by = {r["policy"]: r for r in runs}
    cols = [p for p in POLICIES if p in by]
    lines = [f"| node RED, dead {DEATH_AFTER_RED_S:g} s later; job `--checkpoint {INTERVAL}` | "
             + " | ".join(f"`--on-sick {p}`" for p in cols) + " |",
             "|---|" + "---|" * len(cols),
             "| run | " + " | ".join(by[p]["status"] for p in cols) + " |"]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(by[p]) for p in cols) + " |")
    return "\n".join(lines)


def machine() -> dict:
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)}


# ====================================================================== main

def main(args: argparse.Namespace) -> int:
    """Run the scenario once per policy (``args``: bench/failover.py's: base, keep, out, timeouts)."""
    out = args.out or REPO / "bench" / "results" / "failover-proactive.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    defaults = coordinator_defaults()
    doc = {"benchmark": "failover-proactive", "started_at": time.time(), "machine": machine(),
           "config": {"policies": list(POLICIES), "run_before_s": RUN_BEFORE_S,
                      "death_after_red_s": DEATH_AFTER_RED_S, "checkpoint_interval": INTERVAL,
                      "job_mib": JOB_MIB, "tick_s": TICK_S, "yellow_above_gib": YELLOW_ABOVE / GiB,
                      "red_above_gib": RED_ABOVE / GiB, "past_red_gib": PAST_RED / GiB,
                      "coordinator_defaults": defaults, "argv": sys.argv[1:]},
           "runs": []}

    def save() -> None:
        doc["elapsed_s"] = _r(time.time() - doc["started_at"], 1)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        tmp.replace(out)

    interrupted = False
    try:
        for policy in POLICIES:
            run = Run(args, policy)
            print(f"[proactive, --on-sick {policy}] cluster in {run.dir}", file=sys.stderr, flush=True)
            try:
                run.execute()
            except BenchError as exc:
                run.result["error"] = str(exc)
                print(f"  error: {exc}", file=sys.stderr, flush=True)
            finally:
                run.logs(run.result.get("job"))
                run.cleanup()
            doc["runs"].append(run.result)
            save()
            r = run.result
            print(f"  {r['status']}: re-done {r.get('redone_s')} s ({r.get('redone_ticks')} ticks), "
                  f"RED → epoch {r.get('red_to_epoch_s')} s, RED → back {r.get('red_to_back_s')} s, "
                  f"{_back(r)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; cleaned up", file=sys.stderr)
    doc["finished_at"] = time.time()
    save()
    hold = defaults.get("proactive_hold_s")
    print(f"\nfailover, proactive: node-2 turns RED (memory past its red threshold), dies "
          f"{DEATH_AFTER_RED_S:g} s later; coordinator defaults (proactive_hold_s {hold} s, on_sick "
          f"{defaults.get('on_sick')}); kernel {doc['machine']['kernel']}, {doc['machine']['cpus']} CPUs, "
          f"{doc['elapsed_s']:.0f} s; every run in {out}\n")
    if doc["runs"]:
        print(table(doc["runs"]))
    return 130 if interrupted else 0
