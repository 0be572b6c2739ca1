"""The processes of a local cluster (``revenant up``, ``revenant supervise``): starting them in
order with their identities, waiting for the nodes to be alive, recognising our own, and
stopping them in order.  cli/cluster/local.py (``up``, ``down``) and cli/cluster/supervise.py (which restarts
what dies) both build on it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from revenant.agent.storage import imagekeys
from revenant.cli.cluster import netns
from revenant.cli.keys import IMAGE_KEYS
from revenant.cli.client import request_nodes
from revenant.common.errors import ClusterNotFound, RevenantError
from revenant.common.messaging import bus
from revenant.common.messaging.natsserver import pin_option, start_local_nats, write_server_config
from revenant.common.settings import security
from revenant.common.settings.cluster import ClusterFile, ProcessInfo, cluster_file, read_cluster, write_cluster
from revenant.messages import NodesReply

# The coordinator first: the agents' drains leave their evicted jobs in the event stream,
# for the next coordinator on this directory to restore, not for this one to chase around
# nodes that are all going away.
STOP_ORDER = ("coordinator", "agent", "nats-server")


def spawn(role: str, name: str, argv: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, ProcessInfo(role=role, name=name, pid=proc.pid, create_time=create_time(proc.pid),
                             log=str(log_path), argv=argv)


def create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def ours(info: ProcessInfo) -> psutil.Process | None:
    """The live process behind ``info``, or None if it is gone (or its pid was reused)."""
    try:
        proc = psutil.Process(info.pid)
        if abs(proc.create_time() - info.create_time) > 0.5 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def tail(path: str, lines: int = 5) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def nodes(url: str, creds: str, timeout_s: float) -> NodesReply:
    nc = await bus.connect(url, "revenant-cli", endless_reconnect=False, **security.client_credentials(creds))
    try:
        return await request_nodes(nc, timeout_s, creds)
    finally:
        await nc.close()


def wait_alive(url: str, names: list[str], procs: list[tuple[subprocess.Popen[bytes], ProcessInfo]],
                timeout_s: float, creds: str = "") -> NodesReply:
    deadline = time.monotonic() + timeout_s
    missing = set(names)
    while time.monotonic() < deadline:
        for proc, info in procs:
            if proc.poll() is not None:
                what = info.name if info.name == info.role else f"{info.role} {info.name}"
                raise RevenantError(f"{what} exited with status {proc.returncode} at start; "
                                    f"log {info.log}:\n{tail(info.log)}")
        try:
            reply = asyncio.run(nodes(url, creds, 1.0))
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
    if any(ours(p) for p in recorded):
        raise RevenantError(f"a cluster is already running in {root}; stop it with 'revenant down --dir {root}'")


def supervisor_info(logs: Path) -> ProcessInfo:
    me = os.getpid()
    try:
        argv = psutil.Process(me).cmdline()
    except psutil.Error:
        argv = [sys.executable, *sys.argv]
    return ProcessInfo(role="supervisor", name="supervisor", pid=me, create_time=create_time(me),
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


@dataclass(frozen=True)
class Shape:
    """What ``revenant up`` starts: ``nodes`` agents, ``nats_servers`` servers (none with
    ``external_nats``), ``coordinators`` (the first leads, the others stand by), each in a
    network namespace of its own with ``netns``; authenticated unless ``insecure``."""

    nodes: int
    nats_servers: int = 1
    coordinators: int = 1
    netns: bool = False
    external_nats: str | None = None
    insecure: bool = False

    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(1, self.nodes + 1)]

    def server_names(self) -> list[str]:
        if self.external_nats:
            return []
        return ["nats-server"] if self.nats_servers == 1 else [f"nats-server-{i}"
                                                               for i in range(1, self.nats_servers + 1)]

    def coordinator_names(self) -> list[str]:
        return ["coordinator"] + [f"coordinator-{i}" for i in range(2, self.coordinators + 1)]

    def check(self) -> None:
        if self.nodes < 1:
            raise RevenantError(f"--nodes must be at least 1, got {self.nodes}")
        if self.coordinators < 1:
            raise RevenantError(f"--coordinators must be at least 1, got {self.coordinators}")
        if self.netns and self.external_nats:
            raise RevenantError("--netns starts its own NATS in a namespace: it cannot use --nats")

    def options(self) -> list[str]:
        """The command-line options that give this shape (``revenant supervise``'s)."""
        out = ["--nodes", str(self.nodes), "--nats-servers", str(self.nats_servers),
               "--coordinators", str(self.coordinators)]
        out += ["--nats", self.external_nats] if self.external_nats else []
        out += ["--insecure"] if self.insecure else []
        return out + (["--netns"] if self.netns else [])


def start_cluster(root: Path, shape: Shape, *,
                  timeout_s: float) -> tuple[ClusterFile, dict[str, subprocess.Popen[bytes]]]:
    """Start nats-server (unless ``shape.external_nats``; ``shape.nats_servers`` of them, one
    JetStream cluster, if more than one), the coordinators and the agents, as this
    process's children (with ``shape.netns``, each in a network namespace of its own:
    cli/cluster/netns.py); wait until every node is alive; write cluster.json, naming this process
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
    names = shape.node_names()
    keys = None if shape.insecure else generate_identities(root, names)
    signing = root / "keys" / IMAGE_KEYS  # the epochs' image keys, whether or not the bus is open
    signing.parent.mkdir(mode=0o700, exist_ok=True)
    imagekeys.write(signing)
    layout = None

    def creds(identity: str) -> list[str]:
        return [] if keys is None else ["--creds", str(keys.seed_path(identity))]

    def placed(name: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``name``'s namespace, serving HTTP on its address (with --netns)."""
        if layout is None:
            return argv
        return netns.wrap(layout, name) + argv + ["--http-host", layout.members[name].address]

    try:
        if shape.netns:
            layout = netns.plan(root, shape.server_names() + shape.coordinator_names() + names)
            netns.create(layout)
        # (The coordinator's identity may ask JetStream whether the cluster is ready.)
        js_creds = {} if keys is None else security.credentials(security.COORDINATOR,
                                                                str(keys.seed_path(security.COORDINATOR)))
        servers = [] if shape.external_nats else start_local_nats(
            root / "nats", shape.nats_servers, log_dir=logs, config_file=None if keys is None else root / "nats.conf",
            credentials=js_creds, timeout_s=timeout_s,
            placed=None if layout is None else [(layout.members[n].address, tuple(netns.wrap(layout, n)))
                                                for n in shape.server_names()])
        # Every process gets every server's URL, comma-separated: it reconnects to another.
        url = shape.external_nats or ",".join(server.url for server in servers)
        for name, server in zip(shape.server_names(), servers):
            started.append((server.process, ProcessInfo(
                role="nats-server", name=name, pid=server.pid, create_time=create_time(server.pid),
                log=str(logs / f"{name}.log"), argv=server.argv)))
        py = [sys.executable, "-m", "revenant.cli"]
        # Every process serves its HTTP endpoints on a free port; cluster.json records which.
        for name in shape.coordinator_names():
            started.append(spawn("coordinator", name, placed(name, py + [
                "coordinator", "--nats", url, "--name", name, "--http-port", "0", *creds(security.COORDINATOR)]),
                logs / f"{name}.log"))
        for name in names:
            started.append(spawn("agent", name, placed(name, py + [
                "agent", "--node", name, "--nats", url, "--http-port", "0", "--storage", str(storage),
                "--image-keys", str(signing),
                *creds(security.agent_identity(name))]), logs / f"{name}.log"))
        infos = [info for _, info in started]
        admin = "" if keys is None else str(keys.seed_path(security.ADMIN))
        cluster = ClusterFile(nats_url=url, dir=str(root), storage=str(storage), created_at=time.time(),
                              processes=infos, supervisor=supervisor_info(logs), creds=admin,
                              insecure=shape.insecure, netns=layout)
        write_cluster(root, cluster)
        reply = wait_alive(url, names, started, timeout_s, admin)
        _pin_http_ports(infos, reply)
        write_cluster(root, cluster)
    except BaseException:
        # Interrupted or failed while starting: stop what started, and let no
        # second Ctrl-C cut the clean-up short and leave processes behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        stop_processes([info for _, info in started], timeout_s=5.0)
        cluster_file(root).unlink(missing_ok=True)
        if layout is not None:
            netns.remove(layout)
        raise
    return cluster, {info.name: proc for proc, info in started}


def _pin_http_ports(infos: list[ProcessInfo], reply: NodesReply) -> None:
    """Record where each process serves HTTP, and pin that port into its argv (the leading
    coordinator's is in the reply; a standby's is not known here and stays any free port)."""
    urls = {n.name: n.capabilities.metrics_url for n in reply.nodes}
    for info in infos:
        if info.role == "agent":
            info.metrics_url = urls.get(info.name, "")
        elif info.role == "coordinator" and info.name == reply.coordinator:
            info.metrics_url = reply.coordinator_metrics_url
        port = urlsplit(info.metrics_url).port if info.metrics_url else None
        if port:
            info.argv = pin_option(info.argv, "--http-port", str(port))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def running(proc: psutil.Process) -> bool:
    """Still running: a zombie is not (where pid 1 never reaps, zombies linger)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until ``procs`` have exited (reaping our own children); returns those still running."""
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        for p in alive:
            try:
                os.waitpid(p.pid, os.WNOHANG)  # our child (foreground up): reap it
            except ChildProcessError:
                pass
        alive = [p for p in alive if running(p)]
        if alive:
            time.sleep(0.05)
    return alive


def stop_processes(infos: list[ProcessInfo], timeout_s: float) -> list[str]:
    """SIGTERM each role in order, wait, then SIGKILL what is left; returns what had to be killed."""
    killed: list[str] = []
    for role in STOP_ORDER:
        procs = [p for info in infos if info.role == role and (p := ours(info)) is not None]
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        for p in wait_gone(procs, timeout_s):
            try:
                p.kill()
                killed.append(f"{role} pid {p.pid}")
            except psutil.Error:
                pass
            wait_gone([p], 5)
    return killed
