"""``revenant up`` and ``revenant down``: a local cluster for development and demos.

``up`` starts an embedded nats-server (JetStream, state under DIR/nats), or with
``--nats-servers 3`` three of them as one JetStream cluster (state under DIR/nats/<i>),
one coordinator and N agents named node-1..node-N that share DIR/storage, which
stands in for a cluster's shared filesystem.  Every process runs in its own
session so that a Ctrl-C reaches ``up`` alone, which then stops them in order:
the coordinator first, then the agents (each drains its jobs, which the next
``up`` on DIR restores), then NATS.  Until then ``up`` (or, with ``--detach``, the
``revenant supervise`` it leaves behind) restarts any of them that dies: see
``cli/supervise.py``.  ``down`` stops that supervisor first, then the rest in the
same order.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import psutil

from revenant.cli.client import request_nodes
from revenant.common import bus, security
from revenant.common.cluster import ClusterFile, ProcessInfo, cluster_file, read_cluster, write_cluster
from revenant.common.errors import ClusterNotFound, RevenantError
from revenant.common.natsserver import pin_option, start_local_nats, write_server_config
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


async def _nodes(url: str, creds: str, timeout_s: float) -> NodesReply:
    nc = await bus.connect(url, "revenant-cli", endless_reconnect=False, **security.client_credentials(creds))
    try:
        return await request_nodes(nc, timeout_s)
    finally:
        await nc.close()


def _wait_alive(url: str, names: list[str], procs: list[tuple[subprocess.Popen[bytes], ProcessInfo]],
                timeout_s: float, creds: str = "") -> NodesReply:
    deadline = time.monotonic() + timeout_s
    missing = set(names)
    while time.monotonic() < deadline:
        for proc, info in procs:
            if proc.poll() is not None:
                what = info.name if info.name == info.role else f"{info.role} {info.name}"
                raise RevenantError(f"{what} exited with status {proc.returncode} at start; "
                                    f"log {info.log}:\n{_tail(info.log)}")
        try:
            reply = asyncio.run(_nodes(url, creds, 1.0))
            missing = set(names) - {n.name for n in reply.nodes if n.state == "alive"}
            if not missing:
                return reply
        except RevenantError:
            pass
        time.sleep(0.2)
    raise RevenantError(f"nodes not alive after {timeout_s:g} s: {', '.join(sorted(missing))}")


def refuse_running(root: Path) -> None:
    """Refuse a directory whose cluster still runs (any process it records, its supervisor too)."""
    if not cluster_file(root).exists():
        return
    try:
        old = read_cluster(root)
    except ClusterNotFound:
        return
    recorded = old.processes + ([old.supervisor] if old.supervisor is not None else [])
    if any(_ours(p) for p in recorded):
        raise RevenantError(f"a cluster is already running in {root}; stop it with 'revenant down --dir {root}'")


def _supervisor_info(logs: Path) -> ProcessInfo:
    me = os.getpid()
    try:
        argv = psutil.Process(me).cmdline()
    except psutil.Error:
        argv = [sys.executable, *sys.argv]
    return ProcessInfo(role="supervisor", name="supervisor", pid=me, create_time=_create_time(me),
                       log=str(logs / "supervisor.log"), argv=argv)


INSECURE_WARNING = ("INSECURE: this cluster's NATS asks no one for a credential: anyone who can reach "
                    "its port can command every node and run anything as root on it (revenant up --insecure)")


def generate_identities(root: Path, names: list[str]) -> security.Keyring:
    """The cluster's identities (DIR/keys, mode 0700; seeds 0600; existing ones kept) and the
    nats-server configuration that admits them alone, each with its permissions (DIR/nats.conf)."""
    keyring = security.Keyring(root / "keys")
    keyring.ensure_all(security.cluster_identities(names))
    write_server_config(root / "nats.conf", security.render_authorization(keyring.public))
    return keyring


def check_nats_servers(root: Path, count: int, external_nats: str | None) -> None:
    """Refuse a server count that cannot work, or that does not match the NATS state DIR holds
    (the job table is in it: a new layout would start from an empty one)."""
    if count < 1 or count == 2:
        raise RevenantError(f"--nats-servers must be 1, or 3 or more (a JetStream cluster of 2 stops when "
                            f"either server is lost), got {count}")
    if external_nats and count != 1:
        raise RevenantError("--nats uses an external NATS and --nats-servers starts servers: give one of them")
    nats = root / "nats"
    members = sum(1 for d in nats.glob("[0-9]*") if (d / "jetstream").is_dir())
    if not external_nats and count == 1 and members:
        raise RevenantError(f"{root} holds the state of a {members}-server NATS cluster ({nats}/<i>): "
                            f"start it with --nats-servers {members}")
    if not external_nats and count > 1 and ((nats / "jetstream").is_dir() or members > count):
        have = "one server" if (nats / "jetstream").is_dir() else f"a {members}-server cluster"
        raise RevenantError(f"{root} holds the state of {have} in {nats}: start it as it was "
                            f"(--nats-servers {members or 1}), or use a new directory")


def start_cluster(root: Path, n_nodes: int, *, external_nats: str | None, timeout_s: float, insecure: bool = False,
                  nats_servers: int = 1) -> tuple[ClusterFile, dict[str, subprocess.Popen[bytes]]]:
    """Start nats-server (unless ``external_nats``; ``nats_servers`` of them, one JetStream
    cluster, if more than one), the coordinator and the agents, as this
    process's children; wait until every node is alive; write cluster.json, naming this process
    their supervisor and pinning the ports each one chose into its argv, so that a restart with
    that argv comes back on them.  Each process gets its own NATS identity (DIR/keys), and
    cluster.json the admin's; with ``insecure`` none does, and the bus is open to anyone.
    (With ``external_nats``, that server must admit DIR/keys' identities: see ``revenant keys``.)
    Returns the file and the children by name.  A failure, a
    Ctrl-C, a SIGTERM or a SIGUSR1 (``revenant down``) on the way stops what started."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.default_int_handler)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logs.chmod(0o700)  # they name every user's jobs: root's, as the keys are
    storage = root / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    started: list[tuple[subprocess.Popen[bytes], ProcessInfo]] = []
    names = [f"node-{i}" for i in range(1, n_nodes + 1)]
    keys = None if insecure else generate_identities(root, names)

    def creds(identity: str) -> list[str]:
        return [] if keys is None else ["--creds", str(keys.seed_path(identity))]

    try:
        # (The coordinator's identity may ask JetStream whether the cluster is ready.)
        js_creds = {} if keys is None else security.credentials(security.COORDINATOR,
                                                                str(keys.seed_path(security.COORDINATOR)))
        servers = [] if external_nats else start_local_nats(
            root / "nats", nats_servers, log_dir=logs, config_file=None if keys is None else root / "nats.conf",
            credentials=js_creds, timeout_s=timeout_s)
        # Every process gets every server's URL, comma-separated: it reconnects to another.
        url = external_nats or ",".join(server.url for server in servers)
        for i, server in enumerate(servers, 1):
            name = "nats-server" if nats_servers == 1 else f"nats-server-{i}"
            started.append((server.process, ProcessInfo(
                role="nats-server", name=name, pid=server.pid, create_time=_create_time(server.pid),
                log=str(logs / f"{name}.log"), argv=server.argv)))
        py = [sys.executable, "-m", "revenant.cli"]
        # Every process serves its HTTP endpoints on a free port; cluster.json records which.
        started.append(_spawn("coordinator", "coordinator", py + ["coordinator", "--nats", url, "--name", "coordinator",
                                                                  "--http-port", "0", *creds(security.COORDINATOR)],
                              logs / "coordinator.log"))
        for name in names:
            started.append(_spawn("agent", name, py + ["agent", "--node", name, "--nats", url, "--http-port", "0",
                                                       "--storage", str(storage),
                                                       *creds(security.agent_identity(name))], logs / f"{name}.log"))
        infos = [info for _, info in started]
        admin = "" if keys is None else str(keys.seed_path(security.ADMIN))
        cluster = ClusterFile(nats_url=url, dir=str(root), storage=str(storage), created_at=time.time(),
                              processes=infos, supervisor=_supervisor_info(logs), creds=admin, insecure=insecure)
        write_cluster(root, cluster)
        reply = _wait_alive(url, names, started, timeout_s, admin)
        urls = {n.name: n.capabilities.metrics_url for n in reply.nodes}
        for info in infos:
            if info.role == "agent":
                info.metrics_url = urls.get(info.name, "")
            elif info.role == "coordinator":
                info.metrics_url = reply.coordinator_metrics_url
            port = urlsplit(info.metrics_url).port if info.metrics_url else None
            if port:
                info.argv = pin_option(info.argv, "--http-port", str(port))
        write_cluster(root, cluster)
    except BaseException:
        # Interrupted or failed while starting: stop what started, and let no
        # second Ctrl-C cut the clean-up short and leave processes behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        _stop_processes([info for _, info in started], timeout_s=5.0)
        cluster_file(root).unlink(missing_ok=True)
        raise
    return cluster, {info.name: proc for proc, info in started}


def up(directory: str, n_nodes: int, *, detach: bool, external_nats: str | None = None, timeout_s: float = 30.0,
       insecure: bool = False, nats_servers: int = 1) -> int:
    """Start a local cluster and supervise it: in this process, or with ``detach`` in a
    detached ``revenant supervise`` that this one waits for (until every node is alive).
    Authenticated (each process its own NATS identity) unless ``insecure``."""
    if n_nodes < 1:
        raise RevenantError(f"--nodes must be at least 1, got {n_nodes}")
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    refuse_running(root)
    check_nats_servers(root, nats_servers, external_nats)
    if insecure:
        print(f"revenant: WARNING: {INSECURE_WARNING}", file=sys.stderr)
    if detach:
        url = _up_detached(root, n_nodes, external_nats, timeout_s, insecure, nats_servers)
    else:
        from revenant.cli.supervise import log_to

        log_to(root, echo=True)
        cluster, procs = start_cluster(root, n_nodes, external_nats=external_nats, timeout_s=timeout_s,
                                       insecure=insecure, nats_servers=nats_servers)
        url = cluster.nats_url
    mode = "INSECURE (no authentication)" if insecure else f"authenticated (keys in {root / 'keys'})"
    print(f"revenant: cluster up in {root}: {n_nodes} node(s) alive, NATS at {url}, {mode}", file=sys.stderr)
    print(f"revenant: try 'revenant nodes --dir {root}'; stop with "
          f"{'revenant down --dir ' + str(root) if detach else 'Ctrl-C'}", file=sys.stderr)
    if detach:
        return 0
    from revenant.cli.supervise import supervise_until_stopped

    return supervise_until_stopped(root, cluster, procs)


def _up_detached(root: Path, n_nodes: int, external_nats: str | None, timeout_s: float, insecure: bool,
                 nats_servers: int = 1) -> str:
    """Start ``revenant supervise`` in its own session and wait for its word on the start
    (through a pipe); returns the NATS URL.  Interrupted, it stops the supervisor, which stops
    what it started."""
    log_path = root / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "revenant.cli", "supervise", str(root), "--nodes", str(n_nodes),
            "--timeout", str(timeout_s), "--ready-fd", str(write_fd), "--nats-servers", str(nats_servers)]
    argv += ["--nats", external_nats] if external_nats else []
    argv += ["--insecure"] if insecure else []
    try:
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    # Starting NATS, then the nodes (timeout_s), then on a failure stopping what started.
    deadline = time.monotonic() + timeout_s + 60.0
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            data = _read_until_eof(pipe, deadline)
    except BaseException:
        proc.terminate()  # it stops what it started, then exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        raise
    try:
        report = json.loads(data) if data else {}
    except ValueError:
        report = {}
    if "nats_url" in report:
        return str(report["nats_url"])
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    if "error" in report:
        raise RevenantError(str(report["error"]))
    status = "is still running" if proc.poll() is None else describe_exit(proc.returncode)
    raise RevenantError(f"the supervisor ({status}) gave no word on the start; log {log_path}:\n{_tail(str(log_path))}")


def _read_until_eof(pipe: BinaryIO, deadline: float) -> bytes:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RevenantError("the cluster did not come up in time (no word from the supervisor)")
        ready, _, _ = select.select([pipe], [], [], left)
        if ready:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


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


def _stop_supervisor(info: ProcessInfo) -> None:
    """Stop the supervisor before anything else, so that it restarts nothing that is being
    stopped: SIGUSR1 makes it exit at once (leaving the rest to ``down``); SIGKILL if it does not."""
    proc = _ours(info)
    if proc is None:
        return
    try:
        proc.send_signal(signal.SIGUSR1)
    except psutil.Error:
        return
    for p in _wait_gone([proc], 10.0):
        try:
            p.kill()
        except psutil.Error:
            pass
        _wait_gone([p], 5.0)


def down(directory: str, timeout_s: float = 30.0) -> int:
    cluster = read_cluster(directory)
    if cluster.supervisor is not None:
        _stop_supervisor(cluster.supervisor)
        try:
            cluster = read_cluster(directory)  # what it restarted last is in the file it left
        except ClusterNotFound:
            pass  # it was stopping the cluster itself (Ctrl-C, SIGTERM): stop what it had
    killed = _stop_processes(cluster.processes, timeout_s)
    left = [f"{p.role} {p.name} (pid {p.pid})" for p in cluster.processes if _ours(p) is not None]
    if left:
        raise RevenantError(f"could not stop: {', '.join(left)}")
    cluster_file(directory).unlink(missing_ok=True)
    note = f" (killed after {timeout_s:g} s: {', '.join(killed)})" if killed else ""
    print(f"revenant: cluster in {os.path.abspath(directory)} stopped{note}", file=sys.stderr)
    return 0
