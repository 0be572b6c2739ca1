"""``revenant up`` and ``revenant down``: a local cluster for development and demos.

``up`` starts an embedded nats-server (JetStream, state under DIR/nats), one
coordinator and N agents named node-1..node-N that share DIR/storage, which
stands in for a cluster's shared filesystem.  Every process runs in its own
session so that a Ctrl-C reaches ``up`` alone, which then stops them in order:
the coordinator first, then the agents (each drains its jobs, which the next
``up`` on DIR restores), then NATS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from revenant.cli.client import request_nodes
from revenant.common import bus
from revenant.common.cluster import ClusterFile, ProcessInfo, cluster_file, read_cluster, write_cluster
from revenant.common.errors import ClusterNotFound, RevenantError
from revenant.common.natsserver import start_nats_server
from revenant.messages import NodesReply

# The coordinator first: the agents' drains leave their evicted jobs in the event stream,
# for the next coordinator on this directory to restore, not for this one to chase around
# nodes that are all going away.
STOP_ORDER = ("coordinator", "agent", "nats-server")


def _spawn(role: str, name: str, argv: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, ProcessInfo(role=role, name=name, pid=proc.pid, create_time=_create_time(proc.pid),
                             log=str(log_path), argv=argv)


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _ours(info: ProcessInfo) -> psutil.Process | None:
    """The live process behind ``info``, or None if it is gone (or its pid was reused)."""
    try:
        proc = psutil.Process(info.pid)
        if abs(proc.create_time() - info.create_time) > 0.5 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _tail(path: str, lines: int = 5) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def _nodes(url: str, timeout_s: float) -> NodesReply:
    nc = await bus.connect(url, "revenant-cli", endless_reconnect=False)
    try:
        return await request_nodes(nc, timeout_s)
    finally:
        await nc.close()


def _wait_alive(url: str, names: list[str], procs: list[tuple[subprocess.Popen[bytes], ProcessInfo]],
                timeout_s: float) -> NodesReply:
    deadline = time.monotonic() + timeout_s
    missing = set(names)
    while time.monotonic() < deadline:
        for proc, info in procs:
            if proc.poll() is not None:
                raise RevenantError(f"{info.role} {info.name} exited with status {proc.returncode} at start; "
                                    f"log {info.log}:\n{_tail(info.log)}")
        try:
            reply = asyncio.run(_nodes(url, 1.0))
            missing = set(names) - {n.name for n in reply.nodes if n.state == "alive"}
            if not missing:
                return reply
        except RevenantError:
            pass
        time.sleep(0.2)
    raise RevenantError(f"nodes not alive after {timeout_s:g} s: {', '.join(sorted(missing))}")


def up(directory: str, n_nodes: int, *, detach: bool, external_nats: str | None = None, timeout_s: float = 30.0) -> int:
    if n_nodes < 1:
        raise RevenantError(f"--nodes must be at least 1, got {n_nodes}")
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if cluster_file(root).exists():
        try:
            old = read_cluster(root)
        except ClusterNotFound:
            old = None
        if old is not None and any(_ours(p) for p in old.processes):
            raise RevenantError(f"a cluster is already running in {root}; stop it with 'revenant down --dir {root}'")
    logs = root / "logs"
    storage = root / "storage"
    storage.mkdir(parents=True, exist_ok=True)

    started: list[tuple[subprocess.Popen[bytes], ProcessInfo]] = []
    infos: list[ProcessInfo] = []
    try:
        if external_nats:
            url = external_nats
        else:
            server = start_nats_server(root / "nats", log_file=logs / "nats-server.log", new_session=True)
            url = server.url
            infos.append(ProcessInfo(role="nats-server", name="nats-server", pid=server.pid,
                                     create_time=_create_time(server.pid), log=str(logs / "nats-server.log"),
                                     argv=[str(a) for a in server.process.args]))
        py = [sys.executable, "-m", "revenant.cli"]
        # Every process serves its HTTP endpoints on a free port; cluster.json records which.
        started.append(_spawn("coordinator", "coordinator", py + ["coordinator", "--nats", url, "--name", "coordinator",
                                                                  "--http-port", "0"], logs / "coordinator.log"))
        names = [f"node-{i}" for i in range(1, n_nodes + 1)]
        for name in names:
            started.append(_spawn("agent", name, py + ["agent", "--node", name, "--nats", url, "--http-port", "0",
                                                       "--storage", str(storage)], logs / f"{name}.log"))
        infos += [info for _, info in started]
        cluster = ClusterFile(nats_url=url, dir=str(root), storage=str(storage), created_at=time.time(), processes=infos)
        write_cluster(root, cluster)
        reply = _wait_alive(url, names, started, timeout_s)
        urls = {n.name: n.capabilities.metrics_url for n in reply.nodes}
        for info in infos:
            if info.role == "agent":
                info.metrics_url = urls.get(info.name, "")
            elif info.role == "coordinator":
                info.metrics_url = reply.coordinator_metrics_url
        write_cluster(root, cluster)
    except BaseException:
        # Interrupted or failed while starting: stop what started, and let no
        # second Ctrl-C cut the clean-up short and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_processes(infos, timeout_s=5.0)
        cluster_file(root).unlink(missing_ok=True)
        raise

    print(f"revenant: cluster up in {root}: {n_nodes} node(s) alive, NATS at {url}", file=sys.stderr)
    print(f"revenant: try 'revenant nodes --dir {root}'; stop with "
          f"{'revenant down --dir ' + str(root) if detach else 'Ctrl-C'}", file=sys.stderr)
    if detach:
        return 0
    return _foreground(root, infos, started)


def _foreground(root: Path, infos: list[ProcessInfo], started: list[tuple[subprocess.Popen[bytes], ProcessInfo]]) -> int:
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop:
        time.sleep(0.2)
    print("revenant: stopping the cluster", file=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stop_processes(infos, timeout_s=30.0)
    cluster_file(root).unlink(missing_ok=True)
    return 0


def _running(proc: psutil.Process) -> bool:
    """Still running: a zombie is not (where pid 1 never reaps, zombies linger)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until ``procs`` have exited (reaping our own children); returns those still running."""
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        for p in alive:
            try:
                os.waitpid(p.pid, os.WNOHANG)  # our child (foreground up): reap it
            except ChildProcessError:
                pass
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _stop_processes(infos: list[ProcessInfo], timeout_s: float) -> list[str]:
    """SIGTERM each role in order, wait, then SIGKILL what is left; returns what had to be killed."""
    killed: list[str] = []
    for role in STOP_ORDER:
        procs = [p for info in infos if info.role == role and (p := _ours(info)) is not None]
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        for p in _wait_gone(procs, timeout_s):
            try:
                p.kill()
                killed.append(f"{role} pid {p.pid}")
            except psutil.Error:
                pass
            _wait_gone([p], 5)
    return killed


def down(directory: str, timeout_s: float = 30.0) -> int:
    cluster = read_cluster(directory)
    killed = _stop_processes(cluster.processes, timeout_s)
    left = [f"{p.role} {p.name} (pid {p.pid})" for p in cluster.processes if _ours(p) is not None]
    if left:
        raise RevenantError(f"could not stop: {', '.join(left)}")
    cluster_file(directory).unlink(missing_ok=True)
    note = f" (killed after {timeout_s:g} s: {', '.join(killed)})" if killed else ""
    print(f"revenant: cluster in {os.path.abspath(directory)} stopped{note}", file=sys.stderr)
    return 0
