"""Automatic failover with real processes, real NATS and real CRIU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER, VENV_BIN, counter_reference, gone, running, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

LINES = 160
INTERVAL = 0.05


def submit(cluster, *extra: str, count: int = LINES) -> str:
    return cluster.cli("submit", "--node", "node-1", *extra, "--", sys.executable, str(COUNTER), str(count),
                       str(INTERVAL)).stdout.strip()


def show(cluster, job: str) -> dict:
    """The job, or {} while no coordinator answers (between a leader's death and its successor)."""
    out = cluster.cli("show", "job", job, "--json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_for(cluster, job: str, predicate, timeout: float, what: str) -> dict:
    info = wait_until(lambda: (j := show(cluster, job)) and predicate(j) and j, timeout=timeout, interval=0.2)
    if not info:
        rec = show(cluster, job)
        assert info, f"job {job}: {what} did not happen: {rec}; its processes: {process_states(rec.get('pid'))}"
    return info


def process_states(pid) -> list[str]:
    """What the job's processes are doing (for a failure report): pid, state, wait channel, command."""
    if not pid:
        return ["no pid"]
    out = []
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                wchan = Path(f"/proc/{p.pid}/wchan").read_text().strip()
            except OSError:
                wchan = "?"
            out.append(f"{p.pid} {p.status()} {wchan} {' '.join(p.cmdline())[:80]}")
    except (psutil.Error, TypeError, ValueError) as exc:
        out.append(f"unreadable: {exc!r}")
    return out


def job_events(cluster, job: str) -> list[dict]:
    return [e for e in cluster.events() if e.get("type") == "job_event.v1" and e["job"] == job]


def coordinator_metric(cluster, name: str) -> float:
    import urllib.request

    doc = json.loads((cluster.dir / "cluster.json").read_text())
    url = next(p["metrics_url"] for p in doc["processes"] if p["role"] == "coordinator")
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def frozen_or_gone(init: psutil.Process) -> bool:
    """The job under its namespace's init is stopped (frozen), or the whole copy is gone."""
    return all(status in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) for _, status in running(init, str(COUNTER)))


def output(cluster, job: str) -> bytes:
    return (cluster.storage / "jobs" / job / "output.log").read_bytes()


def test_sigkilled_node_and_job_are_restored_elsewhere_byte_identical(make_cluster, tmp_path):
    cluster = make_cluster(2)
    job = submit(cluster, "--checkpoint", "0:01")
    first = wait_for(cluster, job, lambda j: j["epochs"] and output(cluster, job).count(b"\n") > 40, 30,
                     "a checkpoint")
    agent = cluster.pids()["node-1"]
    os.kill(agent, signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    moved = wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 20, "failover")
    assert moved["generation"] == first["generation"] + 1
    assert psutil.Process(moved["pid"]).ppid() == cluster.pids()["node-2"]
    events = job_events(cluster, job)
    restored = [e for e in events if e["kind"] == "restored"]
    assert [e["kind"] for e in events if e["kind"] in ("restoring", "restored")] == ["restoring", "restored"]
    assert restored[0]["node"] == "node-2" and restored[0]["from_node"] == "node-1"
    assert restored[0]["epoch"] >= 1
    # Detection (<= 3 s by default) plus the restore of a small job.
    assert restored[0]["since_last_heartbeat_s"] < 4.0
    dead = [e for e in cluster.events() if e.get("kind") == "dead" and e.get("node") == "node-1"]
    assert dead and dead[0]["silence_s"] <= 3.0
    wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
    assert output(cluster, job) == counter_reference(tmp_path, LINES)


def test_paused_agent_is_fenced_and_its_job_restored_elsewhere(make_cluster, tmp_path):
    cluster = make_cluster(2)
    job = submit(cluster, "--checkpoint", "0:01")
    first = wait_for(cluster, job, lambda j: j["epochs"] and output(cluster, job).count(b"\n") > 30, 30,
                     "a checkpoint")
    agent = cluster.pids()["node-1"]
    old = psutil.Process(first["pid"])
    os.kill(agent, signal.SIGSTOP)  # like a partition, or a frozen VM: the agent can do nothing
    try:
        # The dead man's switch inside the job's namespace freezes the stale copy by itself.
        assert wait_until(lambda: frozen_or_gone(old), timeout=5), "the paused agent's job kept running"
        moved = wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 20, "failover")
        assert moved["generation"] == 2
        time.sleep(2)  # stay paused well past the lease
    finally:
        os.kill(agent, signal.SIGCONT)
    # Back, the agent notices its lease lapsed, reports the fence and rejoins; the old copy stays gone.
    assert wait_until(lambda: any(e.get("kind") == "fenced" and e.get("node") == "node-1" for e in cluster.events()),
                      timeout=15)
    assert wait_until(lambda: {n["name"]: n for n in cluster.json("nodes")}["node-1"]["state"] == "alive",
                      timeout=15)
    # The leader's answer to its reconcile: the frozen copy moved on, so it is killed, not thawed.
    assert wait_until(lambda: gone(old), timeout=15), \
        "the stale frozen copy was not killed"
    done = wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
    assert done["node"] == "node-2" and done["generation"] == 2
    assert output(cluster, job) == counter_reference(tmp_path, LINES)


def test_sigterm_drains_a_node_its_jobs_go_on_elsewhere(make_cluster, tmp_path):
    cluster = make_cluster(2)
    job = submit(cluster)  # no periodic checkpoint, no --requeue: only the drain can save it
    first = wait_for(cluster, job, lambda j: output(cluster, job).count(b"\n") > 40, 30, "output")
    agent = psutil.Process(cluster.pids()["node-1"])
    agent.terminate()
    agent.wait(timeout=20)  # it checkpoints its job, stops it, and exits
    moved = wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 20, "the move")
    assert moved["generation"] == first["generation"] + 1 and len(moved["epochs"]) == 1
    evicted = [e for e in job_events(cluster, job) if e["kind"] == "evicted"]
    assert evicted and evicted[0]["node"] == "node-1" and evicted[0]["epoch"] == moved["epochs"][0]["n"]
    assert "node-1 is shutting down" in evicted[0]["reason"]
    restored = [e for e in job_events(cluster, job) if e["kind"] == "restored"]
    assert restored and restored[0]["from_node"] == "node-1" and restored[0]["epoch"] == evicted[0]["epoch"]
    assert moved["epochs"][0]["bytes"] > 0  # the restore's reply described the drain's epoch
    done = wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
    assert done["exit_code"] == 0
    assert output(cluster, job) == counter_reference(tmp_path, LINES)


def test_jobs_survive_a_cluster_restart(make_cluster, tmp_path):
    """`down` drains every node; the next `up` on the same directory restores the jobs."""
    cluster = make_cluster(2)
    job = submit(cluster)
    wait_for(cluster, job, lambda j: output(cluster, job).count(b"\n") > 30, 30, "output")
    cluster.cli("down", "--dir", str(cluster.dir))
    stopped_at = output(cluster, job).count(b"\n")
    assert stopped_at < LINES
    again = make_cluster(2)  # the same directory
    assert again.dir == cluster.dir
    done = wait_for(again, job, lambda j: j["state"] == "completed", 60, "completion")
    assert done["generation"] == 2 and done["exit_code"] == 0
    assert output(again, job) == counter_reference(tmp_path, LINES)


def test_a_stall_shorter_than_death_costs_the_job_nothing(make_cluster, tmp_path):
    """Paused past its switch but not long enough to be declared dead: the job's switch freezes
    it, and on waking the agent asks the leader, which lets it go on where it is: same node,
    same generation, same pid, not a line lost."""
    cluster = make_cluster(2)
    job = submit(cluster)  # no checkpoint: nothing but a thaw could save its work
    running = wait_for(cluster, job, lambda j: output(cluster, job).count(b"\n") > 30, 30, "a start")
    init = psutil.Process(running["pid"])
    agent = cluster.pids()["node-1"]
    os.kill(agent, signal.SIGSTOP)
    try:
        # Frozen by its switch (1.3 s after the last reset) before the node could be declared dead
        # (2.5 s after its last heartbeat); woken at once, the agent finds its lease lapsed past its
        # own fence (1.2 s), so the leader's word is what thaws the job.
        assert wait_until(lambda: frozen_or_gone(init), timeout=2.2), "the switch did not freeze the job"
    finally:
        os.kill(agent, signal.SIGCONT)
    done = wait_for(cluster, job, lambda j: j["state"] in ("completed", "failed"), 60, "the end")
    # Generation 1 on node-1 to the end: the copy that was frozen is the one that finished.
    assert (done["state"], done["node"], done["generation"]) == ("completed", "node-1", 1), done
    kinds = [e["kind"] for e in job_events(cluster, job)]
    assert "evicted" not in kinds and "restoring" not in kinds, kinds
    assert output(cluster, job) == counter_reference(tmp_path, LINES)


def test_job_without_checkpoint_is_requeued_or_failed(make_cluster, tmp_path):
    cluster = make_cluster(2)
    requeued = submit(cluster, "--requeue", count=60)
    lost = submit(cluster, count=60)
    for job in (requeued, lost):
        wait_for(cluster, job, lambda j: output(cluster, j["id"]).count(b"\n") > 5, 20, "output")
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    again = wait_for(cluster, requeued, lambda j: j["state"] == "running" and j["node"] == "node-2", 20, "requeue")
    assert again["generation"] == 2 and again["epochs"] == []
    failed = wait_for(cluster, lost, lambda j: j["state"] == "failed", 20, "failure")
    assert "no checkpoint" in failed["reason"] and "--requeue" in failed["reason"]
    assert "requeued" in [e["kind"] for e in job_events(cluster, requeued)]
    wait_for(cluster, requeued, lambda j: j["state"] == "completed", 60, "completion")
    # Requeued from the start: the output is one clean run, not a run and a half.
    assert output(cluster, requeued) == counter_reference(tmp_path, 60)


def test_standby_coordinator_finishes_a_failover_when_the_leader_dies(make_cluster, tmp_path, monkeypatch):
    # A long lease margin holds the failover open long enough to kill the leader in the middle of it.
    monkeypatch.setenv("REVENANT_COORDINATOR_LEASE_MARGIN_S", "3")
    cluster = make_cluster(2)
    url = json.loads((cluster.dir / "cluster.json").read_text())["nats_url"]
    log = open(cluster.dir / "logs" / "standby.log", "wb")
    standby = subprocess.Popen([str(VENV_BIN / "revenant"), "coordinator", "--nats", url, "--name", "standby",
                                "--http-port", "0", "--creds", str(cluster.dir / "keys" / "coordinator.nk")],
                               stdout=log, stderr=log)
    try:
        job = submit(cluster, "--checkpoint", "0:01")
        wait_for(cluster, job, lambda j: j["epochs"] and output(cluster, job).count(b"\n") > 30, 30, "a checkpoint")
        os.kill(cluster.pids()["node-1"], signal.SIGKILL)
        assert wait_until(lambda: any(e["kind"] == "restoring" for e in job_events(cluster, job)), timeout=10,
                          interval=0.1)
        os.kill(cluster.pids()["coordinator"], signal.SIGKILL)
        # The standby takes the leader lease, reloads the job table from KV and finishes the job's
        # failover: on node-2, or on node-1 if revenant up's supervisor has brought that agent back
        # by then (a new agent, which never ran the job).
        moved = wait_for(cluster, job, lambda j: j["generation"] >= 2 and j["state"] in ("running", "completed"),
                         40, "failover by the standby")
        # 2, or 3 when the standby redid a restore the dead leader had already sent.
        assert moved["generation"] >= 2
        wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
        assert output(cluster, job) == counter_reference(tmp_path, LINES)
    finally:
        standby.terminate()
        try:
            assert standby.wait(timeout=15) == 0, "the standby failed to stop cleanly"
        except subprocess.TimeoutExpired:
            standby.kill()
            standby.wait()
            raise AssertionError("the standby did not stop within 15 s of SIGTERM:\n" +
                                 (cluster.dir / "logs" / "standby.log").read_text()[-3000:]) from None
        finally:
            log.close()


def test_an_operator_holds_failover_then_resumes_it(make_cluster, tmp_path):
    cluster = make_cluster(2)
    assert cluster.json("failover")["paused"] is False
    held = cluster.json("failover", "pause")
    assert held["paused"] and held["held"] and held["reason"] == "held by an operator"
    assert "failover paused" in cluster.cli("failover").stdout
    assert coordinator_metric(cluster, "revenant_failover_paused") == 1.0
    job = submit(cluster, "--checkpoint", "0:01")
    first = wait_for(cluster, job, lambda j: j["epochs"] and output(cluster, job).count(b"\n") > 30, 30,
                     "a checkpoint")
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    assert wait_until(lambda: any(e.get("kind") == "dead" and e.get("node") == "node-1" for e in cluster.events()),
                      timeout=15)
    time.sleep(3)  # past the lease: only the hold keeps the job from being restored
    assert show(cluster, job)["generation"] == first["generation"]
    resumed = cluster.json("failover", "resume")
    assert not resumed["paused"] and not resumed["held"]
    moved = wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 20, "failover")
    assert moved["generation"] == first["generation"] + 1
    assert coordinator_metric(cluster, "revenant_failover_paused") == 0.0
    kinds = [e["kind"] for e in cluster.events() if e.get("type") == "cluster_event.v1"
             and e["kind"].startswith("failover_")]  # (the leader's election is one too)
    assert kinds == ["failover_paused", "failover_resumed"]
    wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
    assert output(cluster, job) == counter_reference(tmp_path, LINES)
