"""A Jupyter kernel (ipykernel) on its default TCP transport (ZeroMQ over five loopback ports),
driven by jupyter_client with the same connection file throughout: a variable set before a
create, changed after it over the same connections, read after a vacate and restart on the
other node, and after a failover.

After a move the kernel listens again on the same ports, but the connections it had come back
closed: a client's sockets that only receive (its iopub SUB socket) are never told, since
nothing is sent to the peer when a restore closes them (criu's --tcp-close), and they wait for
ever. So after each move the test connects a new client with the same connection file, as a
notebook front end does when it reconnects to a kernel (docs/cli.md, "Jobs that use the
network")."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from conftest import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads]



def show(cluster, job: str) -> dict:
    out = cluster.cli("show", "job", job, "--json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def running_on(cluster, job: str, node: str) -> dict:
    info = wait_until(lambda: (j := show(cluster, job)) and j["state"] == "running" and j["node"] == node and j,
                      timeout=120, interval=0.2)
    assert info, f"job {job} not running on {node}: {show(cluster, job)}"
    return info


def connect(conn: str):
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=conn)
    client.load_connection_file()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    return client


def run(client, code: str) -> str:
    """Execute ``code`` in the kernel; its stdout (the reply must be ok)."""
    out: list[str] = []

    def hook(msg) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    reply = client.execute_interactive(code, timeout=90, output_hook=hook)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out).strip()


@pytest.mark.timeout(400)
def test_a_jupyter_kernel_keeps_its_variables_through_a_create_a_move_and_a_failover(make_cluster, tmp_path):
    try:
        from jupyter_client.connect import write_connection_file
    except ImportError:
        pytest.fail("jupyter_client is missing: make setup installs the workloads extra (ipykernel, jupyter_client)")
    work = tmp_path / "kernel"
    work.mkdir()
    conn, _ = write_connection_file(str(work / "kernel.json"), ip="127.0.0.1", transport="tcp")
    cluster = make_cluster(2)
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(work), "--", sys.executable, "-m",
                      "ipykernel_launcher", "-f", conn, "--HistoryManager.enabled=False").stdout.strip()
    running_on(cluster, job, "node-1")
    client = connect(conn)
    try:
        run(client, "x = 41")
        cluster.cli("checkpoint", "create", job)
        assert run(client, "x += 1; print(x)") == "42"  # over the same connections, unharmed
        cluster.cli("checkpoint", "vacate", job)
    finally:
        client.stop_channels()
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    running_on(cluster, job, "node-2")
    client = connect(conn)
    try:
        assert run(client, "print(x)") == "42"  # the kernel on node-2, on the same ports
        cluster.cli("checkpoint", "create", job)
        first = show(cluster, job)
        os.kill(cluster.pids()["node-2"], signal.SIGKILL)  # the node dies, and the kernel with it
        os.kill(first["pid"], signal.SIGKILL)
        running_on(cluster, job, "node-1")
    finally:
        client.stop_channels()
    client = connect(conn)
    try:
        assert run(client, "x += 1; print(x)") == "43"
    finally:
        client.stop_channels()
