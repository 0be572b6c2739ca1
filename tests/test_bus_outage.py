"""A NATS outage costs no work: nats-server is SIGKILLed under three running jobs and started
again on the same port with the same store, 5 s and 20 s later.  The jobs' nodes freeze them
when their leases lapse; once the bus is back the leader lets each go on: the same pid, the same
generation, and not a line lost or repeated."""

from __future__ import annotations

import json
import socket
import sys
import time

import psutil
import pytest

from conftest import COUNTER, Cluster, counter_reference, revenant_cli, running, wait_until
from helpers import external_nats

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

LINES = 100_000
INTERVAL = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(cluster: Cluster, job: str) -> bytes:
    return (cluster.storage / "jobs" / job / "output.log").read_bytes()


def show(cluster: Cluster, job: str) -> dict:
    out = cluster.cli("show", "job", job, "--json", check=False, timeout=20)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def counter_process(init_pid: int) -> psutil.Process:
    return next(p for p, _ in running(init_pid, str(COUNTER)))


@pytest.mark.parametrize("outage_s", [5, 20])
def test_jobs_survive_a_nats_restart_with_their_pid_generation_and_every_line(tmp_path, outage_s):
    port = free_port()
    store = tmp_path / "nats"
    cluster = Cluster(tmp_path / "cluster")
    server = external_nats(cluster.dir, ["node-1", "node-2"], store, port=port, log_file=tmp_path / "nats.log")
    try:
        revenant_cli("up", "--nodes", "2", "--dir", str(cluster.dir), "--detach", "--nats", server.url, check=True)
        jobs = {name: cluster.cli("submit", "--node", node, "--", sys.executable, str(COUNTER), str(LINES),
                                  str(INTERVAL)).stdout.strip()
                for name, node in (("checkpointed", "node-1"), ("bare", "node-1"), ("other", "node-2"))}
        assert wait_until(lambda: all(lines(cluster, j).count(b"\n") > 20 for j in jobs.values()), timeout=30)
        cluster.cli("checkpoint", "create", jobs["checkpointed"])  # "bare" has no epoch and no --requeue
        before = {j: show(cluster, j) for j in jobs.values()}
        assert all(r["state"] == "running" for r in before.values()), before

        server.process.kill()  # kill -9
        server.process.wait()
        time.sleep(outage_s / 2)
        # Half-way through the outage every job is frozen: nothing runs on a node without its lease.
        for job, rec in before.items():
            assert counter_process(rec["pid"]).status() == psutil.STATUS_STOPPED, f"job {job} still runs"
        frozen_at = {j: len(lines(cluster, j)) for j in jobs.values()}
        time.sleep(outage_s / 2)
        assert {j: len(lines(cluster, j)) for j in jobs.values()} == frozen_at  # not a byte while frozen
        server = external_nats(cluster.dir, ["node-1", "node-2"], store, port=port, log_file=tmp_path / "nats-2.log")

        def all_running_again() -> bool:
            return all(counter_process(rec["pid"]).status() != psutil.STATUS_STOPPED for rec in before.values())

        assert wait_until(all_running_again, timeout=60), "a job was never thawed"
        assert wait_until(lambda: all(len(lines(cluster, j)) > frozen_at[j] + 40 for j in jobs.values()), timeout=30)
        reference = counter_reference(tmp_path, LINES)
        for job, rec in before.items():
            now = show(cluster, job)
            assert (now["state"], now["pid"], now["generation"], now["node"]) == \
                ("running", rec["pid"], rec["generation"], rec["node"]), (job, rec, now)
            out = lines(cluster, job)
            assert out == reference[:len(out)], f"job {job}: its output is not the uninterrupted run's"
        events = [json.loads(x) for x in cluster.cli("events", "--json").stdout.splitlines()]
        assert not [e for e in events if e.get("type") == "job_event.v1" and e.get("kind") in ("restoring", "failed")]
    finally:
        if (cluster.dir / "cluster.json").exists():
            revenant_cli("down", "--dir", str(cluster.dir))
        server.stop()
