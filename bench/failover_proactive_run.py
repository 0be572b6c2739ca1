"""One run of bench/failover_proactive.py: a cluster, the job, the node turned RED and killed, and
the watchers of the job's ticks and the cluster's events.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ is not a package: these are this script's own directory's.
from failover_proactive_watch import (BENCH, DEATH_AFTER_RED_S, GiB, INTERVAL, JOB_MIB, MiB, NEW_COPY_S, PAST_RED,
                                      RED_ABOVE, REVENANT, RUN_BEFORE_S, SICK, TICK_S, Tail, Watch, YELLOW_ABOVE,
                                      clean_env, memory, minus, rounded, rv, ticks)
from harness import BenchError

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

        percent, total, available = memory()
        if available < RED_ABOVE + PAST_RED + 2 * GiB:
            raise BenchError(f"{available / GiB:.1f} GiB available: the scenario needs "
                             f"{(RED_ABOVE + PAST_RED + 2 * GiB) / GiB:.1f} GiB")
        yellow = round(percent + 100 * YELLOW_ABOVE / total, 2)
        red = round(percent + 100 * RED_ABOVE / total, 2)
        env = dict(self.env, REVENANT_AGENT_MEMORY_YELLOW_PERCENT=str(yellow),
                   REVENANT_AGENT_MEMORY_RED_PERCENT=str(red))
        assert self.cluster is not None
        argv = [sys.executable, "-m", "revenant.cli", "agent", "--node", SICK, "--nats", self.cluster["nats_url"],
                "--http-port", "0", "--storage", self.cluster["storage"],
                "--image-keys", str(self.dir / "keys" / "image.keys")]
        with open(self.dir / "logs" / f"{SICK}.log", "ab") as log:
            self.agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        self.agent_ct = psutil.Process(self.agent.pid).create_time()
        self.result.update({"memory_percent_at_start": percent, "memory_total_gib": rounded(total / GiB, 1),
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
        percent, total, _ = memory()
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
        r["ran_before_s"] = rounded(t_alloc - t_ready)
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
            return 0.0 if n == 0 else minus(wall.get(n), start)

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
            "health_epochs_after_red_s": [[e.get("n"), rounded(e["at"] - r["t_red"])] for e in created
                                          if e.get("cause") == "health"],
            "ticks_at_death": at_death, "resumed_from_tick": resumed_from,
            "redone_ticks": at_death - resumed_from,
            "progress_at_death_s": rounded(progress(at_death)),
            "resumed_from_s": rounded(progress(resumed_from)),
            "redone_s": rounded(minus(progress(at_death), progress(resumed_from))),
            "new_copy_corrupt": sum(1 for x in new if x[2] != "ok"),
            "yellow_to_red_s": rounded(r["t_red"] - r["t_yellow"]),
            "yellow_to_death_s": rounded(r["t_death"] - r["t_yellow"]),
            "red_to_death_s": rounded(r["t_death"] - r["t_red"]),
            "red_to_epoch_s": rounded(epoch["at"] - r["t_red"]) if epoch else None,
            "red_to_saved_s": rounded(minus(wall.get(resumed_from), r["t_red"])) if epoch else None,
            "red_to_back_s": rounded(back["at"] - r["t_red"]),
            "back_before_death_s": rounded(r["t_death"] - back["at"]),
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
                    and self.tag in cmdline(d)]
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


def cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
