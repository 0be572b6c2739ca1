"""Helpers for the tests that break a 3-server NATS cluster under running jobs
(tests/test_nats_cluster.py, tests/test_nats_faults.py): `revenant up --nats-servers 3`, which
server leads what (each stream's leader as the stream tells it, the JetStream meta leader as the
servers log it), killing one with its supervisor held, and the checks on the counter jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import msgspec
import nats.errors
import psutil

from conftest import COUNTER, Cluster, revenant_cli, wait_until
from revenant.common.errors import BusError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import JobRecord, subjects

T = TypeVar("T")

INTERVAL = 0.05  # the counter's: 20 lines a second
STREAMS = (subjects.EVENTS_STREAM, f"KV_{subjects.JOBS_BUCKET}", "KV_revenant_jobs_archive",
           f"KV_{subjects.LEASES_BUCKET}", f"KV_{subjects.LEADER_BUCKET}")
JOBS_STREAM = f"KV_{subjects.JOBS_BUCKET}"
LEASES_STREAM = f"KV_{subjects.LEASES_BUCKET}"


def up(make_cluster, directory: Path, nodes: int = 2, env: dict | None = None) -> Cluster:
    """`revenant up --nats-servers 3` in ``directory`` (``env``: more environment for it, which its
    agents and coordinator inherit); torn down with the test's other clusters."""
    cluster = Cluster(directory)
    make_cluster.clusters.append(cluster)  # its teardown: `revenant down`, then kill what is left
    revenant_cli("up", "--nats-servers", "3", "--nodes", str(nodes), "--dir", str(directory), "--detach",
                 check=True, env=env)
    return cluster


def doc(cluster: Cluster) -> dict:
    return json.loads((cluster.dir / "cluster.json").read_text())


def servers(cluster: Cluster) -> dict[str, dict]:
    """The cluster's nats-servers as cluster.json records them, by server name (revenant-nats-<i>)."""
    return {f"revenant-nats-{p['name'].rsplit('-', 1)[1]}": p for p in doc(cluster)["processes"]
            if p["role"] == "nats-server"}


def streams(cluster: Cluster) -> dict[str, dict]:
    """Each stream's replica count, leader and followers (name -> current), as the coordinator's
    identity (the one that may read every stream's state) sees them."""
    async def read() -> dict[str, dict]:
        nc = await _connect(cluster)
        try:
            js = nc.jetstream(timeout=3)
            out = {}
            for name in STREAMS:
                with bus.map_exceptions(f"stream {name}"):
                    info = await js.stream_info(name)
                peers = info.cluster.replicas or []
                out[name] = {"replicas": info.config.num_replicas, "leader": info.cluster.leader,
                             "followers": {p.name: bool(p.current and not p.offline and not p.lag) for p in peers}}
            return out
        finally:
            await nc.close()
    return asyncio.run(read())


def _connect(cluster: Cluster):
    """A connection as the coordinator's identity (the one that may read every stream's state)."""
    seed = str(cluster.dir / "keys" / "coordinator.nk")
    return bus.connect(doc(cluster)["nats_url"], "test", endless_reconnect=False,
                       **security.credentials(security.COORDINATOR, seed))


async def _leader(js, group: str) -> str | None:
    """The leader of ``group`` (a stream, or "stream/consumer"); None while it elects one."""
    stream, _, consumer = group.partition("/")
    try:
        info = await (js.consumer_info(stream, consumer) if consumer else js.stream_info(stream))
        return info.cluster.leader
    except (nats.errors.Error, asyncio.TimeoutError):
        return None


def lead(cluster: Cluster, leaders: dict[str, str]) -> None:
    """Move the leadership of each group (a stream, or "stream/consumer") to the server ``leaders``
    names for it: a stepdown that prefers that server (JetStream's API, open to the coordinator's
    identity), until the group reports it."""
    async def move() -> None:
        nc = await _connect(cluster)
        try:
            js = nc.jetstream(timeout=3)
            for group, server in leaders.items():
                subject = "$JS.API.{}.LEADER.STEPDOWN.{}".format("CONSUMER" if "/" in group else "STREAM",
                                                                 group.replace("/", "."))
                deadline = time.monotonic() + 30
                while (now := await _leader(js, group)) != server:
                    assert time.monotonic() < deadline, f"{group} is led by {now}, not {server}"
                    if now is None:
                        await asyncio.sleep(0.2)
                        continue
                    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                        await nc.request(subject, json.dumps({"placement": {"preferred": server}}).encode(), timeout=5)
                    for _ in range(25):  # until the election it started is over
                        await asyncio.sleep(0.2)
                        if await _leader(js, group) not in (None, now):
                            break
        finally:
            await nc.close()
    asyncio.run(move())


def durable_consumers(cluster: Cluster) -> list[str]:
    """The event stream's durable consumers (the coordinator's), as "stream/consumer"."""
    async def read() -> list[str]:
        nc = await _connect(cluster)
        try:
            infos = await nc.jetstream(timeout=3).consumers_info(subjects.EVENTS_STREAM)
            return [f"{subjects.EVENTS_STREAM}/{c.name}" for c in infos if c.config.durable_name]
        finally:
            await nc.close()
    return asyncio.run(read())


def isolate(cluster: Cluster, victim: str, led: tuple[str, ...] = ()) -> None:
    """Make ``victim`` the leader of the streams ``led`` and of no other stream or durable
    consumer: those go to another server."""
    other = next(name for name in servers(cluster) if name != victim)
    lead(cluster, {group: victim if group in led else other for group in (*STREAMS, *durable_consumers(cluster))})


def streams_now(cluster: Cluster) -> dict[str, dict] | None:
    """:func:`streams`, or None while one of them has no leader to answer."""
    try:
        return streams(cluster)
    except BusError:
        return None


def caught_up(cluster: Cluster) -> bool:
    state = streams_now(cluster)
    return state is not None and all(s["leader"] and len(s["followers"]) == 2 and all(s["followers"].values())
                                     for s in state.values())


_META = re.compile(r"^\[\d+\] (\S+ \S+) \[INF\] (?:JetStream cluster new metadata leader: ([\w-]+)/"
                   r"|(Self) is new JetStream cluster metadata leader|JetStream cluster (no) metadata leader)")


def meta_leaders(cluster: Cluster) -> dict[str, str]:
    """Each server's last word on the JetStream meta leader (its log; "" for none): the servers
    listen on no monitoring port, and only the system account may ask them over the bus."""
    out = {}
    for name in servers(cluster):
        log = cluster.dir / "logs" / f"nats-server-{name.rsplit('-', 1)[1]}.log"
        said = ""
        for line in log.read_text(errors="replace").splitlines():
            m = _META.match(line)
            if m:
                said = m.group(2) or (name if m.group(3) else "")
        out[name] = said
    return out


def meta_leader(cluster: Cluster, timeout: float = 30) -> str:
    """The JetStream meta leader, once the three servers agree on it."""
    agreed = wait_until(lambda: len(set(said := meta_leaders(cluster).values())) == 1 and next(iter(said)),
                        timeout=timeout)
    assert agreed, f"the servers do not agree on a meta leader: {meta_leaders(cluster)}"
    return agreed


def client_ports(cluster: Cluster) -> dict[int, str]:
    """Each server's client port -> its name."""
    out = {}
    for name in servers(cluster):
        conf = (cluster.dir / "nats" / name.rsplit("-", 1)[1] / "server.conf").read_text()
        out[int(re.search(r'^listen: "[\d.]+:(\d+)"', conf, re.M).group(1))] = name
    return out


def connected_to(cluster: Cluster, pid: int) -> str:
    """The server the process ``pid`` is connected to now: all of its connections on one server
    (a coordinator's heartbeat connection starts on its main connection's server; an agent's
    liveness thread has its own)."""
    ports = client_ports(cluster)
    names = {ports[c.raddr.port] for c in psutil.Process(pid).net_connections(kind="tcp")
             if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED}
    assert len(names) == 1, f"process {pid} is connected to {names or 'no server'}"
    return names.pop()


@contextlib.contextmanager
def supervisor_held(cluster: Cluster) -> Iterator[None]:
    """`revenant up`'s supervisor stopped (it would restart within 0.5 s whatever is killed)."""
    pid = doc(cluster)["supervisor"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def kill_server(cluster: Cluster, name: str) -> dict:
    """SIGKILL the nats-server ``name``; returns its cluster.json record."""
    victim = servers(cluster)[name]
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


def restarted(cluster: Cluster, victim: dict) -> bool:
    """The supervisor started the server ``victim`` again (a new pid)."""
    return next(p for p in doc(cluster)["processes"] if p["name"] == victim["name"])["pid"] != victim["pid"]


def on_state(cluster: Cluster, job: str, state: str, action: Callable[[], T], timeout: float = 30) -> T:
    """Do ``action`` the moment the job table's record of ``job`` turns ``state`` (a KV watch on
    it: within milliseconds of the coordinator's write, before the command that follows it is
    answered), and return what it returns."""
    async def watch() -> T:
        nc = await _connect(cluster)
        try:
            kv = await nc.jetstream(timeout=3).key_value(subjects.JOBS_BUCKET)
            watcher = await kv.watch(job)
            deadline = time.monotonic() + timeout
            try:
                while time.monotonic() < deadline:
                    try:
                        entry = await watcher.updates(timeout=max(0.1, deadline - time.monotonic()))
                    except nats.errors.TimeoutError:
                        continue
                    if entry is not None and entry.value and \
                            msgspec.msgpack.decode(entry.value, type=JobRecord).state == state:
                        return action()
            finally:
                await watcher.stop()
        finally:
            await nc.close()
        raise AssertionError(f"job {job} was not {state} within {timeout:g} s")
    return asyncio.run(watch())


def log_offset(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def wait_log(path: Path, text: str, offset: int = 0, timeout: float = 30) -> bool:
    """Whether ``text`` shows up in the log ``path`` past ``offset`` within ``timeout``."""
    def seen() -> bool:
        with open(path, "rb") as f:
            f.seek(offset)
            return text.encode() in f.read()
    return wait_until(seen, timeout=timeout, interval=0.02)


# ------------------------------------------------------------------ the counter jobs

def output(cluster: Cluster, job: str) -> bytes:
    return (cluster.storage / "jobs" / job / "output.log").read_bytes()


def lines(cluster: Cluster, job: str) -> int:
    return output(cluster, job).count(b"\n")


def newest_epoch(cluster: Cluster, job: str, waiting: bool = False) -> int:
    """The job's newest epoch; ``waiting`` (polling for a newer one): 0 while no coordinator
    answers (see :func:`show`)."""
    rec = show(cluster, job) if waiting else cluster.job(job)
    return max((e["n"] for e in rec.get("epochs", [])), default=0)


def submit(cluster: Cluster, node: str, count: int, every: str = "0:1") -> str:
    """A counter job of ``count`` lines on ``node``, checkpointed ``every`` (min:s; "": only when
    asked); its line count tells its processes apart from every other job's."""
    schedule = ("--checkpoint", every) if every else ()
    return cluster.cli("submit", "--node", node, *schedule, "--", sys.executable, str(COUNTER), str(count),
                       str(INTERVAL)).stdout.strip()


def copies(count: int) -> list[psutil.Process]:
    """The live (not frozen, not exited) counter processes of the job of ``count`` lines (not the
    shells around them in their namespace, whose command lines name it too)."""
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if cmd[1:3] == [str(COUNTER), str(count)] and proc.info["status"] not in (
                psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            out.append(proc)
    return out


@contextlib.contextmanager
def copies_watched(counts: list[int], interval: float = 0.1) -> Iterator[dict[int, int]]:
    """While the block runs, count the live copies of each counter job (by its line count) every
    ``interval``: the dict it gives holds the most seen at once, per job (read it after the block)."""
    most = {count: 0 for count in counts}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval):
            for count in counts:
                most[count] = max(most[count], len(copies(count)))
    thread = threading.Thread(target=watch, name="copies", daemon=True)
    thread.start()
    try:
        yield most
    finally:
        done.set()
        thread.join()


def show(cluster: Cluster, job: str) -> dict:
    """The job, or {} while no coordinator answers (between a leader's death and its successor's
    election, or while the job table's stream elects a leader)."""
    out = cluster.cli("show", "job", job, "--json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_state(cluster: Cluster, job: str, predicate, timeout: float, what: str) -> dict:
    info = wait_until(lambda: (j := show(cluster, job)) and predicate(j) and j, timeout=timeout, interval=0.2)
    assert info, f"job {job}: {what} did not happen: {show(cluster, job)}"
    return info


def kinds(events: list[dict], job: str, type_: str = "job_event.v1") -> list[str]:
    return [e["kind"] for e in events if e.get("type") == type_ and e.get("job") == job]


def dead_nodes(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("type") == "node_event.v1" and e.get("kind") in ("dead", "left")]


def since(events: list[dict], at: float, type_: str, kind: str, job: str) -> list[dict]:
    return [e for e in events if e.get("type") == type_ and e.get("kind") == kind and e.get("job") == job
            and e["at"] > at]

