"""A NATS server lost is not a node lost: `revenant up --nats-servers 3` runs three nats-servers as
one JetStream cluster, every stream and bucket on all three.  One of them is SIGKILLed under a job
that checkpoints every second (the one leading the lease bucket, the worst case for the jobs: no
lease can be renewed until the two others elect a new leader, so the agents fence); its
supervisor is held meanwhile, so it stays down.  No node is declared dead, the job goes on with
the same pid and generation and not a line lost or repeated, and it is checkpointed again on the
two servers left.  Once the supervisor restarts the server it catches up with every stream."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time

import pytest

from conftest import COUNTER, Cluster, counter_reference, revenant_cli, wait_until
from nats_cluster_helpers import STREAMS, caught_up, doc, newest_epoch, output, streams, streams_now
from revenant.common.errors import BusError
from revenant.common.messaging import bus
from revenant.messages import subjects

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

LINES = 100_000
INTERVAL = 0.05


def refused_on_the_cluster_port(cluster: Cluster) -> bool:
    """A client that knows no route password cannot connect where the servers route to each other."""
    conf = (cluster.dir / "nats" / "1" / "server.conf").read_text()
    port = re.search(r'cluster \{\s+name: "\w+"\s+listen: "127\.0\.0\.1:(\d+)"', conf).group(1)

    async def attempt() -> bool:
        try:
            nc = await bus.connect(f"nats://127.0.0.1:{port}", "intruder", endless_reconnect=False,
                                   connect_timeout_s=2)
        except BusError:
            return True
        await nc.close()
        return False
    return asyncio.run(attempt())


@pytest.mark.timeout(240)
def test_a_nats_server_killed_under_a_running_job_costs_no_node_and_catches_up(make_cluster, tmp_path):
    cluster = Cluster(tmp_path / "cluster")
    make_cluster.clusters.append(cluster)  # its teardown: `revenant down`, then kill what is left
    revenant_cli("up", "--nats-servers", "3", "--nodes", "2", "--dir", str(cluster.dir), "--detach", check=True)
    servers = {p["name"]: p for p in doc(cluster)["processes"] if p["role"] == "nats-server"}
    assert sorted(servers) == ["nats-server-1", "nats-server-2", "nats-server-3"]
    assert len(doc(cluster)["nats_url"].split(",")) == 3
    assert refused_on_the_cluster_port(cluster)
    before_kill = streams(cluster)
    assert {name: s["replicas"] for name, s in before_kill.items()} == {name: 3 for name in STREAMS}

    job = cluster.cli("submit", "--node", "node-1", "--checkpoint", "0:1", "--", sys.executable, str(COUNTER),
                      str(LINES), str(INTERVAL)).stdout.strip()
    assert wait_until(lambda: newest_epoch(cluster, job) >= 1 and output(cluster, job).count(b"\n") > 20, timeout=30)
    before = cluster.job(job)

    victim_server = before_kill[f"KV_{subjects.LEASES_BUCKET}"]["leader"]  # revenant-nats-<i>
    victim = servers[f"nats-server-{victim_server.rsplit('-', 1)[1]}"]
    supervisor = doc(cluster)["supervisor"]["pid"]
    os.kill(supervisor, signal.SIGSTOP)  # it would restart the server within 0.5 s
    try:
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        lines_at_kill = output(cluster, job).count(b"\n")
        epoch_at_kill = newest_epoch(cluster, job)

        # The job runs on (after a freeze while the lease bucket elects a new leader) ...
        assert wait_until(lambda: output(cluster, job).count(b"\n") > lines_at_kill + 60, timeout=60), \
            "the job did not go on"
        # ... and is checkpointed on the two servers left: on its schedule, and when asked.
        assert wait_until(lambda: newest_epoch(cluster, job) > epoch_at_kill, timeout=30)
        # (A periodic checkpoint every second may be under way: the manual one is asked again.)
        assert wait_until(lambda: cluster.cli("checkpoint", "create", job, check=False).returncode == 0, timeout=30)
        now = cluster.job(job)
        assert (now["state"], now["pid"], now["generation"], now["node"]) == \
            ("running", before["pid"], before["generation"], before["node"])
        assert {n["name"]: n["state"] for n in cluster.json("nodes")} == {"node-1": "alive", "node-2": "alive"}
        # Every stream answers, led by one of the two servers left, its three replicas configured.
        down = wait_until(lambda: (state := streams_now(cluster)) and all(
            s["leader"] and s["leader"] != victim_server for s in state.values()) and state, timeout=30)
        assert down and all(s["replicas"] == 3 for s in down.values()), down
    finally:
        os.kill(supervisor, signal.SIGCONT)

    # The supervisor starts the server again, on its ports with its store, and it catches up.
    assert wait_until(lambda: next(p for p in doc(cluster)["processes"] if p["name"] == victim["name"])["pid"]
                      != victim["pid"], timeout=30)
    assert wait_until(lambda: caught_up(cluster), timeout=60), streams(cluster)

    events = cluster.events()
    dead = [e for e in events if e.get("type") == "node_event.v1" and e.get("kind") in ("dead", "left")]
    assert not dead, dead
    moved = [e for e in events if e.get("type") == "job_event.v1"
             and e.get("kind") in ("restoring", "restored", "requeued", "failed")]
    assert not moved, moved
    epochs_after = [e for e in events if e.get("type") == "epoch_event.v1" and e.get("kind") == "created"
                    and e["at"] > killed_at]
    assert epochs_after, "no checkpoint after the kill"
    final = cluster.job(job)
    assert (final["pid"], final["generation"]) == (before["pid"], before["generation"])
    out = output(cluster, job)
    assert out == counter_reference(tmp_path, LINES)[:len(out)], "the job's output is not the uninterrupted run's"
    # Clients (`revenant events` made sure of the event stream, asking for one replica) took none away.
    assert {name: s["replicas"] for name, s in streams(cluster).items()} == {name: 3 for name in STREAMS}
