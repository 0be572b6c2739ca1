"""``revenant up`` and ``revenant down``: a local cluster for development and demos.

``up`` starts an embedded nats-server (JetStream, state under DIR/nats), or with
``--nats-servers 3`` three of them as one JetStream cluster (state under DIR/nats/<i>),
one coordinator and N agents named node-1..node-N that share DIR/storage, which
stands in for a cluster's shared filesystem.  Every process runs in its own
session so that a Ctrl-C reaches ``up`` alone, which then stops them in order:
the coordinator first, then the agents (each drains its jobs, which the next
``up`` on DIR restores), then NATS.  Until then ``up`` (or, with ``--detach``, the
``revenant supervise`` it leaves behind) restarts any of them that dies: see
``cli/cluster/supervise.py``.  ``down`` stops that supervisor first, then the rest in the
same order.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import psutil

from revenant.cli.cluster import netns
from revenant.cli.cluster.processes import (INSECURE_WARNING, Shape, check_nats_servers, describe_exit, ours,
                                    refuse_running, start_cluster, stop_processes, tail, wait_gone)
from revenant.cli.cluster.supervise import log_to, supervise_until_stopped
from revenant.common.errors import ClusterNotFound, RevenantError
from revenant.common.settings.cluster import ProcessInfo, cluster_file, read_cluster


def up(directory: str, shape: Shape, *, detach: bool, timeout_s: float = 30.0) -> int:
    """Start a local cluster and supervise it: in this process, or with ``detach`` in a
    detached ``revenant supervise`` that this one waits for (until every node is alive).
    Authenticated (each process its own NATS identity) unless ``shape.insecure``."""
    shape.check()
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    refuse_running(root)
    check_nats_servers(root, shape.nats_servers, shape.external_nats)
    if shape.netns:
        netns.check()
        netns.sweep()
    if shape.insecure:
        print(f"revenant: WARNING: {INSECURE_WARNING}", file=sys.stderr)
    if detach:
        url = _up_detached(root, shape, timeout_s)
    else:
        log_to(root, echo=True)
        cluster, procs = start_cluster(root, shape, timeout_s=timeout_s)
        url = cluster.nats_url
    mode = "INSECURE (no authentication)" if shape.insecure else f"authenticated (keys in {root / 'keys'})"
    where = ", each process in a network namespace of its own (host side: see cluster.json)" if shape.netns else ""
    print(f"revenant: cluster up in {root}: {shape.nodes} node(s) alive, NATS at {url}, {mode}{where}",
          file=sys.stderr)
    print(f"revenant: try 'revenant nodes --dir {root}'; stop with "
          f"{'revenant down --dir ' + str(root) if detach else 'Ctrl-C'}", file=sys.stderr)
    if detach:
        return 0
    return supervise_until_stopped(root, cluster, procs)


def _up_detached(root: Path, shape: Shape, timeout_s: float) -> str:
    """Start ``revenant supervise`` in its own session and wait for its word on the start
    (through a pipe); returns the NATS URL.  Interrupted, it stops the supervisor, which stops
    what it started."""
    log_path = root / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "revenant.cli", "supervise", str(root), *shape.options(),
            "--timeout", str(timeout_s), "--ready-fd", str(write_fd)]
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
    raise RevenantError(f"the supervisor ({status}) gave no word on the start; log {log_path}:\n{tail(str(log_path))}")


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


def _stop_supervisor(info: ProcessInfo) -> None:
    """Stop the supervisor before anything else, so that it restarts nothing that is being
    stopped: SIGUSR1 makes it exit at once (leaving the rest to ``down``); SIGKILL if it does not."""
    proc = ours(info)
    if proc is None:
        return
    try:
        proc.send_signal(signal.SIGUSR1)
    except psutil.Error:
        return
    for p in wait_gone([proc], 10.0):
        try:
            p.kill()
        except psutil.Error:
            pass
        wait_gone([p], 5.0)


def down(directory: str, timeout_s: float = 30.0) -> int:
    cluster = read_cluster(directory)
    if cluster.supervisor is not None:
        _stop_supervisor(cluster.supervisor)
        try:
            cluster = read_cluster(directory)  # what it restarted last is in the file it left
        except ClusterNotFound:
            pass  # it was stopping the cluster itself (Ctrl-C, SIGTERM): stop what it had
    killed = stop_processes(cluster.processes, timeout_s)
    left = [f"{p.role} {p.name} (pid {p.pid})" for p in cluster.processes if ours(p) is not None]
    if left:
        raise RevenantError(f"could not stop: {', '.join(left)}")
    if cluster.netns is not None:
        netns.remove(cluster.netns)
    cluster_file(directory).unlink(missing_ok=True)
    note = f" (killed after {timeout_s:g} s: {', '.join(killed)})" if killed else ""
    print(f"revenant: cluster in {os.path.abspath(directory)} stopped{note}", file=sys.stderr)
    return 0
