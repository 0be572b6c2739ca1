"""One failover run of bench/failover.py: a fresh local cluster, the job, its checkpoint, the kill,
and the timeline measured from the bus, the logs and /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/ is not a package: these are this script's own directory's.
from failover_cluster import (GOAL_S, LEASE_MARGIN_S, LEASE_TTL_S, CriuScanner, Observer, cached_bytes, cmdline,
                              drop_from_cache, log_time, minus, rounded)
from failover_lazy import (MODE_ENV, expects_completion, gap_before, lazy_measures, up_env, wait_completed,
                           watch_output)
from harness import BenchError, cluster_down, cluster_up, rv

# The job: bench/failover.py run as ``--workload MIB`` (its memory, stamped and checked).
WORKLOAD = Path(__file__).resolve().parent / "failover.py"


class Run:
    def __init__(self, args: argparse.Namespace, mib: int, attempt: int, base: Path,
                 mode: str = "eager", cache: str = "warm", servers: int = 1, auth: str = "secure") -> None:
        self.args = args
        self.mib = mib
        self.attempt = attempt
        self.mode = mode
        self.cache = cache
        self.servers = servers  # nats-servers of the cluster (revenant up --nats-servers)
        self.auth = auth  # secure: revenant up as it is by default (authenticated); insecure: --insecure
        srv = ("" if servers == 1 else f"{servers}srv-") + ("insecure-" if auth == "insecure" else "")
        self.dir = Path(tempfile.mkdtemp(prefix=f"revenant-bench-failover-{mib}-{cache}-{mode}-{srv}", dir=base))
        self.tag = f"fobench-{os.getpid()}-{mib}-{cache}-{mode}-{srv}{attempt}-{random.randrange(1 << 30):x}"
        self.cluster: dict | None = None
        self.observer: Observer | None = None
        self.scan_stop = threading.Event()
        self.result: dict = {"size_mib": mib, "cache": cache, "restore_mode": mode, "nats_servers": servers,
                             "auth": auth, "attempt": attempt, "dir": str(self.dir), "status": "error",
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
        insecure = ["--insecure"] if self.auth == "insecure" else []
        t_up = time.monotonic()
        cluster_up(self.dir, 2, *servers, *insecure, env=env)
        r["cluster_up_s"] = rounded(time.monotonic() - t_up)
        self.cluster = json.loads((self.dir / "cluster.json").read_text())
        if bool(self.cluster.get("insecure")) != (self.auth == "insecure") or (
                self.auth == "secure" and not (self.dir / "nats.conf").exists()):
            raise BenchError(f"asked for a {self.auth} cluster; cluster.json says insecure="
                             f"{self.cluster.get('insecure')}")
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
        scanner = CriuScanner(agent2["pid"], self.observer.restore_request, self.scan_stop, self.dir)
        scanner.start()

        # -------------------------------------------------- the job, resident, with one committed epoch
        argv = [sys.executable, str(WORKLOAD), "--workload", str(self.mib), "--tag", self.tag]
        # Its own working directory: a restore moves aside what changed in it after the epoch.
        # Its memory asked for: past the 8 GiB every job is limited to by default it would be OOM-killed.
        job = rv("submit", "--dir", str(self.dir), "--node", "node-1", "--name", f"failover-{self.mib}",
                 "--workdir", str(self.dir), "--mem", f"{self.mib + 1024}M", "--", *argv).stdout.strip()
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
        r["checkpoint_cli_s"] = rounded(time.monotonic() - t)
        r["checkpoint_out"] = ck.stdout.strip()
        checkpointed = time.time()
        info = json.loads(rv("show", "job", job, "--dir", str(self.dir), "--json").stdout)
        if info["state"] != "running" or info["node"] != "node-1" or not info["epochs"]:
            raise BenchError(f"job {job} not ready for the kill: {info['state']} on {info['node']}, "
                             f"{len(info['epochs'])} epoch(s)")
        r["epoch_bytes"] = info["epochs"][-1]["bytes"]
        r["epoch_freeze_s"] = rounded(info["epochs"][-1]["freeze_s"])
        job_pid = int(info["pid"])
        if "revenant-init" not in " ".join(cmdline(job_pid)) or self.tag not in " ".join(cmdline(job_pid)):
            raise BenchError(f"pid {job_pid} is not job {job}'s namespace init")
        workload_pids = self._workload_pids()
        epoch_dir = Path(self.cluster["storage"]) / "jobs" / job / "epochs" / str(info["epochs"][-1]["n"])
        r["images_cached_before_kill"] = cached_bytes(epoch_dir)
        if self.cache == "cold":
            drop_from_cache(epoch_dir)
            r["images_cached_after_drop"] = cached_bytes(epoch_dir)
        pause = self.args.settle + random.uniform(0.0, 1.0)
        r["pause_before_kill_s"] = rounded(pause)
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
        r["wait_s"] = rounded(t_done - t0)

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
        me = str(WORKLOAD)
        pids = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                cmd = cmdline(name)
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
        coordinator_last_hb = minus(dead_at, dead["silence_s"] if dead else None)
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
        total = minus(restored_at, t0)
        restore = minus(restored_at, request)
        detection = minus(dead_at, t0)
        decision = minus(request, dead_at)
        r.update({
            "kill_after_last_heartbeat_s": rounded(minus(t0, last_hb)),
            "kill_after_last_lease_renewal_s": rounded(minus(t0, last_lease)),
            "lease_entries_after_kill": late_leases,
            "suspect_after_t0_s": rounded(minus(suspect["at"] if suspect else None, t0)),
            "detection_s": rounded(detection),
            "dead_silence_s": dead["silence_s"] if dead else None,
            "decision_s": rounded(decision),
            "restoring_event_after_dead_s": rounded(minus(restoring["at"] if restoring else None, dead_at)),
            "lease_wait_logged_s": wait_logged if wait_logged is not None else (0.0 if request else None),
            "lease_expiry_after_dead_s": rounded(minus(lease_expiry, dead_at)),
            "request_after_lease_expiry_s": rounded(minus(request, lease_expiry)),
            "restore_s": rounded(restore),
            "restore_verify_s": rounded(minus(criu_start, request)),
            "restore_criu_s": rounded(minus(agent_done, criu_start)),
            "restore_criu_scan_s": rounded(minus(criu_gone, criu_start)),
            "restore_read_before_run_mib": None if scanner.read_before_run is None
            else round(scanner.read_before_run / 2**20, 1),
            "restore_after_agent_s": rounded(minus(restored_at, agent_done)),
            "restore_agent_log_after_request_s": rounded(minus(agent_done, request)),
            "criu_processes": criu,
            "total_s": rounded(total),
            "restored_since_last_heartbeat_s": restored.get("since_last_heartbeat_s") if restored else None,
            "heartbeat_to_restore_request_s": rounded(minus(request, coordinator_last_hb)),
            "resumed_s": rounded(minus(resumed["wall"], t0) if resumed else None),
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
                cluster_down(self.dir, "--timeout", "10", timeout=60)
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
