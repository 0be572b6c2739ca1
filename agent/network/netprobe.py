"""Can this node's criu carry a job's sockets?  ``criu check`` says nothing about it: criu 4.1
asks every socket for SO_PASSCRED, which Linux 6.16 refuses on anything but unix, netlink and
bluetooth sockets, so it dumps no UDP or TCP socket at all there (criu issue #2705, fixed in 4.2).

The probe dumps and restores a small process of its own, as the agent dumps jobs: it holds a
UDP socket and a listening TCP socket (IPv4, and IPv6 where the node has it), an established
loopback TCP pair and a unix datagram socket connected to one outside it, and uses each every
few milliseconds; it must go on counting, every socket working, after its restore.  One probe with everything first; if it fails, one per
feature, so that the report says which: ``inet_sockets`` (UDP and listening TCP),
``tcp_established`` (with ``--tcp-established`` and the network lock), ``ext_unix_sk``
(``--ext-unix-sk``).  The agent runs it at start-up (its capabilities, health YELLOW on a
failure) and set-up runs it on the criu it installs: ``python -m revenant.agent.network.netprobe CRIU``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from revenant.agent.pipeline import criu as criu_mod
from revenant.agent.processes import procs
from revenant.messages import CriuInfo

log = logging.getLogger(__name__)

FEATURES = ("inet_sockets", "tcp_established", "ext_unix_sk")

PROBE = r"""
import os, socket, sys, time
what = sys.argv[1].split(",")
held = []
if "inet_sockets" in what:
    def echo(udp):  # a datagram queued at the dump is dropped (criu keeps no UDP queue): UDP loses some
        udp.sendto(b"u", udp.getsockname()[:2])
        try:
            udp.recv(1)
        except socket.timeout:
            pass
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 0)); udp.settimeout(0.5)
    lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(4)
    held.append(lambda: echo(udp))
    try:  # and IPv6, where the node has it
        udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); udp6.bind(("::1", 0)); udp6.settimeout(0.5)
        lis6 = socket.socket(socket.AF_INET6); lis6.bind(("::1", 0)); lis6.listen(4)
        held.append(lambda: echo(udp6))
    except OSError:
        pass
if "tcp_established" in what:
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    cli = socket.create_connection(srv.getsockname()); acc, _ = srv.accept(); srv.close()
    held.append(lambda: (cli.sendall(b"t"), acc.recv(1), acc.sendall(b"r"), cli.recv(1)))
if "ext_unix_sk" in what:
    ext = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); ext.connect(sys.argv[2])
    def ext_send():
        try:
            ext.send(b"x", socket.MSG_DONTWAIT)
        except BlockingIOError:  # the agent's end is not read: its queue fills, it stays connected
            pass
    held.append(ext_send)
n = 0
while True:
    for use in held:
        use()
    n += 1
    print(n, flush=True)
    time.sleep(0.01)
"""


def network_lock(features: dict[str, bool]) -> str:
    """How criu locks the network while a job with connections is frozen: nftables where this
    criu was built with libnftables, else iptables where the host has it, else "" (none)."""
    if features.get("network_lock_nftables"):
        return "nftables"
    return "iptables" if shutil.which("iptables") else ""


def _count(out: Path) -> int:
    try:
        lines = out.read_text().split()
    except OSError:
        return 0
    return int(lines[-1]) if lines and lines[-1].isdigit() else 0


async def _until(out: Path, above: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if _count(out) > above:
            return True
        await asyncio.sleep(0.02)
    return False


def _last_line(out: Path) -> str:
    """The probe's last line of output (one line: it goes into health reasons)."""
    try:
        lines = out.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return lines[-1][:200] if lines else "no output"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return "state " + f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


async def probe_once(criu: str, what: list[str], lock: str, scratch: Path, timeout_s: float = 30.0) -> str:
    """Dump and restore a probe holding ``what``: "" if it came back working, else why not."""
    d = Path(tempfile.mkdtemp(prefix="netprobe-", dir=scratch))
    out, images, sink_path = d / "out", d / "images", d / "sink"
    images.mkdir()
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(sink_path))
    restored, proc = 0, None
    try:
        with open(out, "w") as f:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PROBE, ",".join(what), str(sink_path),
                                                        stdin=asyncio.subprocess.DEVNULL, stdout=f,
                                                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        if not await _until(out, 2, timeout_s):
            return f"the probe did not start: {_last_line(out)}"
        lock_args = ["--network-lock", lock] if lock else []
        dump = [criu, "dump", "-t", str(proc.pid), "-D", str(images), "-W", str(d), "-o", "dump.log", "-v2",
                "--tcp-established", "--ext-unix-sk", *lock_args]
        done = await procs.run(dump, timeout_s)
        if done.returncode != 0:
            return criu_mod.log_error(d / "dump.log", done.output)
        at = _count(out)
        # The same lock: the restore removes the table the dump's left (criu's CRIU-<run id>).
        restore = [criu, "restore", "-D", str(images), "-W", str(d), "-o", "restore.log", "-v2", "--tcp-established",
                   "--ext-unix-sk", *lock_args, "--restore-detached", "--restore-sibling", "--pidfile", str(d / "pid")]
        done = await procs.run(restore, timeout_s)
        if done.returncode != 0:
            return criu_mod.log_error(d / "restore.log", done.output)
        restored = int((d / "pid").read_text())
        if not await _until(out, at + 3, timeout_s):
            return f"the restored probe stopped ({_state(restored)}): {_last_line(out)}"
        return ""
    except asyncio.TimeoutError:
        return f"criu did not finish within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot run the probe: {exc}"
    finally:
        if proc is not None:  # a dump kills it; a failed one may not have
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
            await proc.wait()
        if restored:
            await asyncio.to_thread(_kill, restored)
        sink.close()
        shutil.rmtree(d, ignore_errors=True)


async def probe(criu: str, lock: str, scratch: Path, timeout_s: float = 30.0) -> tuple[dict[str, bool], str]:
    """Each of FEATURES, and the first reason one failed ("" if none did)."""
    why = await probe_once(criu, list(FEATURES), lock, scratch, timeout_s)
    if not why:
        return dict.fromkeys(FEATURES, True), ""
    found, first = {}, ""
    for feature in FEATURES:
        fail = await probe_once(criu, [feature], lock, scratch, timeout_s)
        found[feature] = not fail
        first = first or (f"{feature}: {fail}" if fail else "")
    return found, first or why


async def inspect(info: CriuInfo, scratch: Path, timeout_s: float = 30.0) -> None:
    """Probe ``info``'s criu (usable) in ``scratch`` (node-local): its features, and why not
    (``network_error``, logged)."""
    try:
        scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        found, why = await probe(info.path or "", network_lock(info.features), scratch, timeout_s)
    except OSError as exc:
        found, why = dict.fromkeys(FEATURES, False), f"cannot run the socket probe: {exc}"
    info.features.update(found)
    info.network_error = why or None
    if why:
        log.warning("criu %s cannot checkpoint sockets here: %s", info.version, why)


async def _main(criu: str) -> int:
    info = await criu_mod.inspect_criu(criu)
    if not info.ok:
        print(f"netprobe: {info.error}", file=sys.stderr)
        return 1
    scratch = Path(tempfile.mkdtemp(prefix="revenant-netprobe-"))
    try:
        found, why = await probe(criu, network_lock(info.features), scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(" ".join(f"{k}={'yes' if v else 'no'}" for k, v in found.items()))
    if why:
        print(f"netprobe: criu {info.version} cannot carry sockets here: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1] if len(sys.argv) > 1 else criu_mod.locate_criu())))
