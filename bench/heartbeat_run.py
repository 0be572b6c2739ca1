"""One size of the heartbeat benchmark (bench/heartbeats.py): a private nats-server (or cluster)
and a real coordinator, the load generators, the idle, warm-up, steady-state and silence phases,
and everything measured in them.  With ``auth="secure"`` the bus is authenticated as ``revenant up``
makes it: a keyring of the cluster's identities (coordinator, admin, an agent per simulated node)
and the server's ``authorization`` block of them all, rendered by the production functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import nats
import nats.errors
import psutil

from revenant.cli.client import request_nodes
from revenant.common.errors import RevenantError
from revenant.common.messaging import bus
from revenant.common.messaging.kv import open_bucket
from revenant.common.messaging.natsserver import (NatsServer, start_nats_cluster, start_nats_server, wait_jetstream,
                                                  write_server_config)
from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig
from revenant.messages import MessageError, NodeEvent, decode, subjects

# bench/ is not a package: these are this script's own directory's.
from harness import (REPO, code_fingerprint, cpu_s, http_get, metric, quantile, rss, stop_process,
                     top_functions)
from heartbeat_load import CTL, LATENESS_BUCKETS_MS, lateness_quantile, lease_window, node_name

NODE_METRICS_OFF_FROM = 50_000
# The benchmark's script: its "generate" command runs a load generator (bench/heartbeat_load.py).
HEARTBEATS = Path(__file__).resolve().parent / "heartbeats.py"


class Run:
    """One size: its own nats-server (or cluster of ``servers``), coordinator and generators."""

    def __init__(self, args: argparse.Namespace, n: int, tmp: Path, servers: int = 1,
                 auth: str = "insecure", rep: int = 0) -> None:
        self.args = args
        self.n = n
        self.tmp = tmp
        self.servers = servers
        self.auth = auth
        self.rep = rep
        self.procs: list[subprocess.Popen] = []
        self.events: list[tuple[float, str, NodeEvent]] = []  # (received wall, subject, event)
        self.result: dict = {"nodes": n, "nats_servers": servers, "auth": auth, "conns": args.conns, "rep": rep}
        self.notes: list[str] = []
        self.keys: security.Keyring | None = None

    def log(self, text: str) -> None:
        where = f", {self.servers} servers" if self.servers > 1 else ""
        side = f", {self.auth}" if len(self.args.auth) > 1 or self.auth != "insecure" else ""
        print(f"  [{self.n:>6} nodes{where}{side}] {text}", flush=True)

    def creds(self) -> dict[str, str | None]:
        """bus.connect's credentials for the benchmark's own clients: the coordinator identity's on an
        authenticated bus (the one allowed to hear the node events and to ask for the node table)."""
        if self.keys is None:
            return {}
        return security.credentials(security.COORDINATOR, str(self.keys.seed_path(security.COORDINATOR)))

    def nats_creds(self) -> dict:
        """The same for a plain nats-py connect."""
        c = self.creds()
        return {"nkeys_seed": c["nkey_seed"], "inbox_prefix": c["inbox_prefix"]} if c else {}

    def make_keys(self) -> Path:
        """As ``revenant up`` does (cli/cluster/processes.py generate_identities): a seed per identity of the
        cluster (coordinator, admin, agent-<node> per simulated node) and the server configuration
        whose authorization block admits them alone, each with its permissions."""
        r = self.result
        t0 = time.monotonic()
        self.keys = security.Keyring(self.tmp / "keys")
        self.keys.ensure_all(security.cluster_identities(node_name(i) for i in range(self.n)))
        text = security.render_authorization(self.keys.public)
        conf = write_server_config(self.tmp / "nats.conf", text)
        r["auth_users"] = len(self.keys.public)
        r["auth_config_bytes"] = conf.stat().st_size
        r["auth_keys_s"] = round(time.monotonic() - t0, 2)
        self.log(f"{len(self.keys.public):,} identities, nats.conf {r['auth_config_bytes'] / 2**20:.1f} MiB, "
                 f"in {r['auth_keys_s']} s")
        return conf

    async def start_nats(self) -> list[NatsServer]:
        """One nats-server, or a JetStream cluster of ``servers`` started as `revenant up --nats-servers`
        starts it (common/messaging/natsserver.py), ready once its metadata leader is elected; with
        ``auth="secure"`` given the configuration file of :meth:`make_keys`."""
        conf = self.make_keys() if self.auth == "secure" else None
        t0 = time.monotonic()
        if self.servers == 1:
            server = start_nats_server(self.tmp / "nats", log_file=self.tmp / "nats.log", config_file=conf,
                                       ready_timeout_s=60.0)
            self.result["nats_start_s"] = round(time.monotonic() - t0, 3)
            return [server]
        servers = start_nats_cluster(self.tmp / "nats", self.servers, log_dir=self.tmp, authorization=conf)
        try:
            await wait_jetstream(",".join(s.url for s in servers), self.servers, 30.0, **self.creds())
            self.result["nats_start_s"] = round(time.monotonic() - t0, 3)
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers

    async def open_leases(self, url: str) -> None:
        """The lease bucket, created as an agent creates it (its TTL, history 1, the replicas that
        ``nats_replicas`` gives on this bus); its stream's leader and replicas go into the result."""
        r = self.result
        nc = await bus.connect(url, "bench-hb-leases", endless_reconnect=False, **self.creds())
        try:
            replicas = bus.replicas_for(nc, self.args.replicas)
            js = nc.jetstream()
            # A cluster just formed may refuse a replicated stream for a moment (its peers are not
            # all current yet): try again, as an agent's lease keeper does at each renewal.
            deadline = time.monotonic() + 20
            while True:
                try:
                    await open_bucket(js, subjects.LEASES_BUCKET, AgentConfig().lease_ttl_s, replicas=replicas)
                    break
                except RevenantError as exc:
                    if time.monotonic() > deadline:
                        raise
                    self.log(f"lease bucket not created yet ({exc}); trying again")
                    await asyncio.sleep(0.5)
            info = await js.stream_info(f"KV_{subjects.LEASES_BUCKET}")
            r["lease_replicas"] = info.config.num_replicas or 1
            r["lease_stream_leader"] = info.cluster.leader if info.cluster else ""
        finally:
            await nc.close()

    async def check_enforced(self, url: str) -> None:
        """On the secure side, that the server really checks: a connection without a key is refused,
        and ``agent-<node 0>`` may publish its own heartbeat but not node 1's."""
        from heartbeat_load import connect_options

        async def attempt(seed: bytes | None, subject: str) -> str:
            u = urllib.parse.urlsplit(url.split(",")[0])
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            try:
                info = json.loads((await reader.readline())[5:])
                writer.write(connect_options("bench-auth-check", info, seed)
                             + f"PUB {subject} 0\r\n\r\nPING\r\n".encode())
                line = await asyncio.wait_for(reader.readline(), 5)
                while line.startswith((b"+OK", b"INFO")):
                    line = await asyncio.wait_for(reader.readline(), 5)
                return line.decode(errors="replace").strip()
            finally:
                writer.close()

        assert self.keys is not None
        seed = self.keys.seed_path(security.agent_identity(node_name(0))).read_bytes().strip()
        anonymous = await attempt(None, subjects.heartbeat(node_name(0)))
        own = await attempt(seed, subjects.heartbeat(node_name(0)))
        other = await attempt(seed, subjects.heartbeat(node_name(1)))
        ok = "authorization violation" in anonymous.lower() and own == "PONG" and "permissions violation" in other.lower()
        self.result["auth_enforced"] = {"ok": ok, "no_key": anonymous, "own_heartbeat": own,
                                        "another_node_heartbeat": other}
        if not ok:
            raise SystemExit(f"the secure side is not enforced: {self.result['auth_enforced']}")

    # ------------------------------------------------------------------ processes

    def start_coordinator(self, url: str) -> subprocess.Popen:
        self.coord_log = self.tmp / "coordinator.log"
        args = ["coordinator", "--nats", url, "--http-port", "0", "--name", "bench-coordinator"]
        if self.keys is not None:  # its own identity, as revenant up starts it
            args += ["--creds", str(self.keys.seed_path(security.COORDINATOR))]
        env = {**os.environ, **dict(kv.split("=", 1) for kv in self.args.coordinator_env)}
        # Per-node health series cost a scrape seconds at 100,000 nodes (the loop stops while it
        # renders): from NODE_METRICS_OFF_FROM nodes the coordinator runs as docs/deploy.md says
        # a large cluster should, with node_metrics = false (--coordinator-env overrides).
        env.setdefault("REVENANT_COORDINATOR_NODE_METRICS", "false" if self.n >= NODE_METRICS_OFF_FROM else "true")
        self.result["node_metrics"] = env["REVENANT_COORDINATOR_NODE_METRICS"]
        if self.args.source is None:  # the installed command: the working tree, as production runs it
            cmd = [str(Path(sys.executable).parent / "revenant"), *args]
        else:  # the same command from an exported commit (see --coordinator-ref)
            cmd = [sys.executable, "-m", "revenant.cli", *args]
            env["PYTHONPATH"] = str(self.args.source)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.coord_log, "wb"),
                                stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def start_profiler(self, pid: int, phase: str) -> subprocess.Popen | None:
        """py-spy (installed in the venv by hand; not a project dependency) on the coordinator."""
        if not self.args.profile:
            return None
        spy = Path(sys.executable).parent / "py-spy"
        out = self.args.out.parent / f"{self.args.out.stem}-{self.n}-profile-{phase}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)  # never report an older run's profile
        # --gil: only samples that hold the GIL, i.e. Python running, not the loop waiting in epoll.
        cmd = [str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking", "--gil",
               "--output", str(out)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(self.tmp / f"py-spy-{phase}.log", "wb"))
        self.procs.append(proc)
        self.profiles = getattr(self, "profiles", {})
        self.profiles[phase] = (proc, out)
        return proc

    def stop_profiler(self, phase: str) -> None:
        entry = getattr(self, "profiles", {}).get(phase)
        if entry is None:
            return
        proc, out = entry
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if out.exists():
            self.result.setdefault("profiles", {})[phase] = {"file": str(out), "top": top_functions(out)}

    def start_generators(self, url: str, count: int, start_at: float) -> list[subprocess.Popen]:
        gens = []
        bounds = [round(self.n * g / count) for g in range(count + 1)]
        urls = url.split(",")
        for g in range(count):
            # Generator g on server g (mod their number) first, as agents spread over a cluster.
            mine = ",".join(urls[g % len(urls):] + urls[:g % len(urls)])
            cmd = [sys.executable, str(HEARTBEATS), "generate", "--nats", mine, "--index", str(g),
                   "--first", str(bounds[g]), "--last", str(bounds[g + 1]), "--total", str(self.n),
                   "--interval", str(self.args.interval), "--jitter", str(self.args.jitter),
                   "--start-at", repr(start_at), "--seed", str(self.args.seed),
                   "--lease-renew", str(self.args.leases), "--lease-timeout", str(self.args.leases * 2),
                   "--lease-fence", str(AgentConfig().fence_timeout_s), "--full-every", str(self.args.full_every),
                   "--conns", self.args.conns, "--connect-concurrency", str(self.args.connect_concurrency),
                   "--keys", "" if self.keys is None else str(self.keys.directory)]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.tmp / f"gen-{g}.log", "wb"),
                                    stderr=subprocess.STDOUT)
            self.procs.append(proc)
            gens.append(proc)
        return gens

    async def wait_http_url(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"coordinator exited with {proc.returncode}:\n{self.coord_log.read_text()[-3000:]}")
            m = re.search(r"HTTP endpoints on (http://\S+)", self.coord_log.read_text(errors="replace"))
            if m:
                base = m.group(1).rstrip("/")
                status, _, _ = await asyncio.to_thread(http_get, base + "/ready", 5)
                if status == 200:
                    return base
            await asyncio.sleep(0.2)
        raise SystemExit("coordinator not ready within 30 s")

    async def gen_ctl(self, nc, g: int, op: dict, timeout_s: float = 10.0) -> dict:
        resp = await nc.request(f"{CTL}.{g}", json.dumps(op).encode(), timeout=timeout_s)
        return json.loads(resp.data)

    async def gen_stats(self, nc, count: int, reset_max: bool = False) -> list[dict]:
        return await asyncio.gather(*(self.gen_ctl(nc, g, {"op": "stats", "reset_max": reset_max})
                                      for g in range(count)))

    # ------------------------------------------------------------------ the run

    async def execute(self) -> dict:
        r = self.result
        r["coordinator_code_sha256"] = code_fingerprint(self.args.source or REPO)
        servers = await self.start_nats()
        url = ",".join(s.url for s in servers)
        try:
            if self.keys is not None:
                await self.check_enforced(url)
            if self.args.leases > 0:
                await self.open_leases(url)
            coord = self.start_coordinator(url)
            base = await self.wait_http_url(coord)
            r["coordinator_http"] = base
            nc = await nats.connect(url.split(","), name="bench-hb-observer", connect_timeout=5, **self.nats_creds())
            try:
                await nc.subscribe(f"{subjects.EVENTS_PREFIX}.node.>", cb=self._on_event)
                await nc.flush()
                try:
                    await self._execute(nc, servers, coord, base)
                except Exception as exc:
                    if coord.poll() is None:
                        raise
                    raise SystemExit(f"the coordinator exited with status {coord.returncode} "
                                     f"({type(exc).__name__} in the bench): {self.coordinator_last_words()}") from exc
            finally:
                await nc.close()
        finally:
            for phase in list(getattr(self, "profiles", {})):
                self.stop_profiler(phase)
            # The coordinator first: it must not judge nodes whose generator is going away.
            for proc in self.procs:
                stop_process(proc)
            for server in servers:
                server.stop()
            self._read_logs()
        return r

    async def _on_event(self, msg) -> None:
        try:
            ev = decode(msg.data)
        except MessageError:
            return
        if isinstance(ev, NodeEvent):
            self.events.append((time.time(), msg.subject, ev))

    def _kinds(self, kind: str, since: float = 0.0) -> list[NodeEvent]:
        return [ev for t, _, ev in self.events if ev.kind == kind and t >= since]

    async def _execute(self, nc, servers: list[NatsServer], coord: subprocess.Popen, base: str) -> None:
        a, r, n = self.args, self.result, self.n
        # At least one generator per server of the largest cluster measured (the same count on each bus).
        count = a.generators or max(1, math.ceil(n / a.nodes_per_generator), max(a.nats_servers))
        r["generators"] = count
        r["interval_s"] = a.interval
        url = ",".join(s.url for s in servers)
        pc, ps = psutil.Process(coord.pid), [psutil.Process(s.pid) for s in servers]
        # The coordinator's own floor: no nodes yet, only its timers.
        i0, n0, iw0 = cpu_s(pc), sum(cpu_s(p) for p in ps), time.monotonic()
        await asyncio.sleep(a.idle)
        r["coordinator_idle_cpu_percent"] = round((cpu_s(pc) - i0) / (time.monotonic() - iw0) * 100, 2)
        # The bus's own floor too: a cluster keeps its RAFT groups (the coordinator's streams) alive.
        r["nats_server_idle_cpu_percent"] = round((sum(cpu_s(p) for p in ps) - n0) / (time.monotonic() - iw0) * 100, 2)
        t_start = time.time()
        self.start_profiler(coord.pid, "join")
        gens = self.start_generators(url, count, start_at=t_start + 2.0)
        pg = [psutil.Process(p.pid) for p in gens]
        me = psutil.Process()

        # -------------------------------------------------------------- warm-up: everyone joined
        deadline = time.monotonic() + a.join_timeout
        alive = 0
        while True:
            if coord.poll() is not None:
                raise SystemExit(f"the coordinator exited with status {coord.returncode} while {alive} of {n} "
                                 f"nodes were alive: {self.coordinator_last_words()}")
            for p in gens:
                if p.poll() is not None:
                    raise SystemExit(f"a load generator exited with status {p.returncode}; see gen-*.log")
            try:
                status, body, _ = await asyncio.to_thread(http_get, base + "/health", 10)
                counts = json.loads(body).get("nodes", {}) if status == 200 else {}
            except OSError as exc:  # a coordinator too busy to answer is not done joining
                counts = {}
                self.log(f"/health: {exc}")
            alive = counts.get("alive", 0)
            if alive >= n:
                break
            if time.monotonic() > deadline:
                self.stop_profiler("join")
                raise SystemExit(f"only {alive} of {n} nodes alive after {a.join_timeout:g} s")
            await asyncio.sleep(0.5)
        r["all_joined_after_s"] = round(time.time() - (t_start + 2.0), 2)
        # The join events go out one JetStream publish at a time: wait until they stop coming.
        last, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 2.0 and time.monotonic() < deadline + 60:
            seen = len(self._kinds("joined"))
            if seen != last:
                last, stable_since = seen, time.monotonic()
            if seen >= n:
                break
            await asyncio.sleep(0.25)
        r["join_events_seen"] = len(self._kinds("joined"))
        r["join_events_published_after_s"] = round(time.time() - (t_start + 2.0), 2)
        self.log(f"{alive} alive after {r['all_joined_after_s']} s; {r['join_events_seen']} join events seen; "
                 f"warming up {a.warmup:g} s")
        self.stop_profiler("join")
        await asyncio.sleep(a.warmup)

        # -------------------------------------------------------------- steady state
        ts0 = time.monotonic()
        _, m0_text, scrape0 = await asyncio.to_thread(http_get, base + "/metrics", 60)
        g0 = await self.gen_stats(nc, count, reset_max=True)
        mach0 = psutil.cpu_times()
        w0 = time.monotonic()
        self.start_profiler(coord.pid, "steady")
        s0 = [cpu_s(p) for p in ps]
        c0 = {"coordinator": cpu_s(pc), "nats-server": sum(s0), "generators": sum(cpu_s(p) for p in pg),
              "observer": cpu_s(me)}
        rss_samples: list[int] = []
        while time.monotonic() - w0 < a.duration:
            rss_samples.append(rss(pc))
            await asyncio.sleep(min(1.0, max(0.0, a.duration - (time.monotonic() - w0))))
        s1 = [cpu_s(p) for p in ps]
        c1 = {"coordinator": cpu_s(pc), "nats-server": sum(s1), "generators": sum(cpu_s(p) for p in pg),
              "observer": cpu_s(me)}
        w1 = time.monotonic()
        mach1 = psutil.cpu_times()
        rss_samples.append(rss(pc))
        self.stop_profiler("steady")
        g1 = await self.gen_stats(nc, count)
        ts1 = time.monotonic()
        _, m1_text, scrape1 = await asyncio.to_thread(http_get, base + "/metrics", 60)
        wall = w1 - w0
        cpu = {k: (c1[k] - c0[k]) / wall * 100 for k in c0}
        busy = lambda t: t.user + t.nice + t.system + t.irq + t.softirq + t.steal  # noqa: E731
        machine_pct = (busy(mach1) - busy(mach0)) / wall * 100
        published = sum(s["published"] for s in g1) - sum(s["published"] for s in g0)
        leases = sum(s["leases_published"] for s in g1) - sum(s["leases_published"] for s in g0)
        gen_wall = statistics.mean(s["wall"] for s in g1) - statistics.mean(s["wall"] for s in g0)
        m0_text, m1_text = m0_text.decode(), m1_text.decode()
        rcv0 = metric(m0_text, "revenant_heartbeats_received_total", '{result="ok"}') or 0
        rcv1 = metric(m1_text, "revenant_heartbeats_received_total", '{result="ok"}') or 0
        # The counter is read somewhere inside each scrape: take the scrapes' midpoints.
        received_rate = (rcv1 - rcv0) / ((ts1 + scrape1 / 2) - (ts0 + scrape0 / 2))
        r.update({
            "window_s": round(wall, 2),
            "coordinator_cpu_percent": round(cpu["coordinator"], 1),
            "coordinator_rss_mib": round(rss_samples[-1] / 2**20, 1),
            "coordinator_rss_max_mib": round(max(rss_samples) / 2**20, 1),
            "nats_server_cpu_percent": round(cpu["nats-server"], 1),
            "nats_server_cpu_percent_each": [round((b - a0) / wall * 100, 1) for a0, b in zip(s0, s1)],
            "nats_server_rss_mib_each": [round(rss(p) / 2**20, 1) for p in ps],
            "generators_cpu_percent": round(cpu["generators"], 1),
            "observer_cpu_percent": round(cpu["observer"], 1),
            "machine_cpu_percent": round(machine_pct, 1),
            "machine_cpu_capacity_percent": 100 * (os.cpu_count() or 1),
            "other_cpu_percent": round(machine_pct - sum(cpu.values()), 1),
            "target_hb_per_s": round(n / a.interval, 1),
            "published_hb_per_s": round(published / gen_wall, 1),
            "lease_renew_s": a.leases,
            "published_leases_per_s": round(leases / gen_wall, 1),
            "generator_servers": sorted({s["server"] for s in g1}),
            "received_hb_per_s": round(received_rate, 1),
            "coordinator_cpu_us_per_heartbeat": round((c1["coordinator"] - c0["coordinator"]) * 1e6
                                                      / max(1.0, received_rate * wall), 1),
            "publish_errors": sum(s["publish_errors"] for s in g1),
            "coordinator_loop_lag_s": metric(m1_text, "revenant_event_loop_lag_seconds"),
            "metrics_scrape_first_s": round(scrape0, 3),
            "metrics_scrape_s": round(scrape1, 3),
            "metrics_scrape_bytes": len(m1_text),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        })
        hist = [sum(s["lateness_hist"][b] for s in g1) for b in range(len(LATENESS_BUCKETS_MS) + 1)]
        r["generator_lateness"] = {"p50": lateness_quantile(hist, 0.5), "p99": lateness_quantile(hist, 0.99),
                                   "max_s": round(max(s["lateness_max_s"] for s in g1), 3),
                                   "hist_ms": dict(zip([*map(str, LATENESS_BUCKETS_MS), "more"], hist))}
        if a.leases > 0:
            r["leases"] = lease_window(g0, g1, gen_wall, n, a.leases)
        self._check_rate("steady", r["published_hb_per_s"], r["target_hb_per_s"])
        self.log(f"steady: coordinator {r['coordinator_cpu_percent']}% of a core, {r['coordinator_rss_mib']} MiB; "
                 f"published {r['published_hb_per_s']:.0f}/s, received {r['received_hb_per_s']:.0f}/s; "
                 f"machine {machine_pct:.0f}% of {r['machine_cpu_capacity_percent']}%")

        # -------------------------------------------------------------- silence a sample
        k = min(a.silence, n // 2)
        victims = sorted(random.Random(a.seed).sample(range(n), k))
        names = [node_name(i) for i in victims]
        bounds = [round(n * g / count) for g in range(count + 1)]
        per_gen = [[node_name(i) for i in victims if bounds[g] <= i < bounds[g + 1]] for g in range(count)]
        d0 = {"coordinator": cpu_s(pc), "wall": time.monotonic()}
        replies = await asyncio.gather(*(self.gen_ctl(nc, g, {"op": "silence", "nodes": per_gen[g]})
                                         for g in range(count)))
        last_sent: dict[str, float] = {}
        for rep in replies:
            last_sent.update(rep["last_sent"])
        silenced_at = min(rep["silenced_at"] for rep in replies)
        silenced = set(names)
        deadline = time.monotonic() + a.detect_timeout
        while time.monotonic() < deadline:
            if silenced <= {ev.node for ev in self._kinds("dead")}:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(a.tail)
        d1 = {"coordinator": cpu_s(pc), "wall": time.monotonic()}
        r["coordinator_cpu_percent_detection_phase"] = round(
            (d1["coordinator"] - d0["coordinator"]) / (d1["wall"] - d0["wall"]) * 100, 1)
        g2 = await self.gen_stats(nc, count)
        detect_wall = statistics.mean(s["wall"] for s in g2) - statistics.mean(s["wall"] for s in g1)
        r["published_hb_per_s_detection_phase"] = round(
            (sum(s["published"] for s in g2) - sum(s["published"] for s in g1)) / detect_wall, 1)
        self._check_rate("detection", r["published_hb_per_s_detection_phase"], (n - k) / a.interval)
        r["generator_connections"] = sum(s["connections"] for s in g2)
        r["generator_connect_s"] = max(s["connect_s"] for s in g2)
        r["generator_conns_lost"] = sum(s["conns_lost"] for s in g2)
        r["generator_conn_errors"] = sum(s["conn_errors"] for s in g2)
        if r["generator_conns_lost"] or r["generator_conn_errors"]:
            self.notes.append(f"{r['generator_conns_lost']} node connections lost, {r['generator_conn_errors']} "
                              f"-ERR from the server: {'; '.join(s['last_error'] for s in g2 if s['last_error'])}")
        r["probes_answered"] = sum(s["probes_answered"] for s in g2)
        r["probes_ignored"] = sum(s["probes_ignored"] for s in g2)
        self.silenced, self.last_sent = silenced, last_sent

        # -------------------------------------------------------------- the node table over NATS, last:
        # `revenant nodes` at this size (it stalls the coordinator while it builds the reply).
        t0 = time.monotonic()
        try:
            reply = await request_nodes(nc, 30)
            r["nodes_request"] = {"ok": True, "nodes": len(reply.nodes), "s": round(time.monotonic() - t0, 3)}
        except (RevenantError, MessageError) as exc:
            r["nodes_request"] = {"ok": False, "error": str(exc), "s": round(time.monotonic() - t0, 3)}
        await asyncio.sleep(3)  # a verdict caused by that stall would show up here
        self._score(silenced, last_sent, silenced_at)

    def _check_rate(self, phase: str, published: float, target: float) -> None:
        """A note when the generators did not send at their target rate in a phase: short of it, or
        more than it (behind, then catching up in bursts the coordinator did not have to take)."""
        if not 0.97 * target <= published <= 1.03 * target:
            self.notes.append(f"{phase} phase: the generators published {published:.0f} of {target:.0f} "
                              f"heartbeats/s ({published / target:.0%}): not the target rate")

    def _score(self, silenced: set[str], last_sent: dict[str, float], silenced_at: float) -> None:
        r = self.result
        first_dead: dict[str, tuple[float, NodeEvent]] = {}
        for t, _, ev in self.events:
            if ev.kind == "dead" and ev.node not in first_dead:
                first_dead[ev.node] = (t, ev)
        verdict, delivered, coord_silence = [], [], []
        for name in sorted(silenced):
            if name in first_dead:
                t, ev = first_dead[name]
                verdict.append(ev.at - last_sent[name])
                delivered.append(t - last_sent[name])
                coord_silence.append(ev.silence_s)
        r["silenced"] = len(silenced)
        r["silenced_at"] = silenced_at
        r["detected"] = len(verdict)
        r["detection_s"] = {
            "median": round(statistics.median(verdict), 3) if verdict else None,
            "p99": round(quantile(verdict, 0.99), 3) if verdict else None,
            "max": round(max(verdict), 3) if verdict else None,
            "min": round(min(verdict), 3) if verdict else None,
            "delivered_median": round(statistics.median(delivered), 3) if delivered else None,
            "delivered_max": round(max(delivered), 3) if delivered else None,
            "coordinator_silence_median": round(statistics.median(coord_silence), 3) if coord_silence else None,
        }
        false_dead = sorted({ev.node for _, _, ev in self.events if ev.kind == "dead" and ev.node not in silenced})
        false_suspect = sorted({ev.node for _, _, ev in self.events
                                if ev.kind == "suspect" and ev.node not in silenced})
        r["false_dead_events"] = false_dead
        r["false_dead"] = len(false_dead)
        r["false_suspect"] = len(false_suspect)
        r["recovered_events"] = len(self._kinds("recovered"))
        if len(verdict) < len(silenced):
            self.notes.append(f"{len(silenced) - len(verdict)} silenced nodes got no dead event on the bus")

    def coordinator_last_words(self) -> str:
        """The coordinator's own last error: its `revenant: ...` exit line, else its last ERROR line."""
        text = self.coord_log.read_text(errors="replace") if hasattr(self, "coord_log") else ""
        exits = re.findall(r"^revenant: (.*)$", text, re.M)
        errors = re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) \[[^]]*\] (.*)$", text, re.M)
        return (exits or errors or ["nothing in its log"])[-1][:200]

    def _read_logs(self) -> None:
        r = self.result
        text = self.coord_log.read_text(errors="replace") if hasattr(self, "coord_log") else ""
        dead_logged = set(re.findall(r"node (\S+) dead \(silent", text))
        silenced = getattr(self, "silenced", set())
        r["false_dead_in_log"] = len(dead_logged - silenced)
        r["dead_in_log"] = len(dead_logged)
        r["event_queue_full_drops"] = text.count("event queue full")
        r["events_lost"] = text.count("event lost")
        r["coordinator_stalls"] = text.count("coordinator stalled")
        r["leader_lease_lost"] = text.count("lost the leader lease")
        r["coordinator_errors"] = len(re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) ", text, re.M))
        r["coordinator_last_error"] = self.coordinator_last_words() if r["coordinator_errors"] else ""
        r["nats_client_warnings"] = len(re.findall(r"nats \(revenant-coordinator", text))
        nlogs = [f.read_text(errors="replace") for f in [self.tmp / "nats.log", *self.tmp.glob("nats-server-*.log")]
                 if f.exists()]
        r["nats_slow_consumers"] = sum(text.lower().count("slow consumer") for text in nlogs)
        if r["false_dead_in_log"] > r.get("false_dead", 0):
            r["false_dead"] = r["false_dead_in_log"]
        if r["event_queue_full_drops"]:
            self.notes.append(f"the coordinator's event queue overflowed: {r['event_queue_full_drops']} events "
                              f"dropped (join burst)")
        r["notes"] = self.notes
