"""Faults of the bus, with real servers: a 3-server JetStream cluster (`revenant up --nats-servers
3`) under counter jobs checkpointed every second loses, by SIGKILL, the server that leads
JetStream's meta group, then the one that leads the job table's stream; a server is killed in the
middle of a failover, and so is the leader coordinator (a standby finishes that failover).  No
node is declared dead by a bus fault, no job is lost or runs twice (one `restored` event, one live
copy), every job's output is its uninterrupted run's, byte for byte, and the events go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import COUNTER, VENV_BIN, counter_reference, wait_until
from nats_cluster_helpers import (
    INTERVAL, JOBS_STREAM, LEASES_STREAM, caught_up, connected_to, copies, copies_watched, dead_nodes, doc, isolate,
    kill_server, kinds, lines, meta_leader, meta_leaders, newest_epoch, on_state, restarted, servers, show, since,
    streams_now, submit, supervisor_held, up, wait_log, wait_state,
)

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

LINES = 600  # 30 s of output at the counter's 20 lines a second: it outlasts the faults
SHORT = 202  # a job submitted during a fault: 10 s
MOVED = ("restoring", "restored", "requeued", "failed", "evicted", "killed")


def timed(call, *args, **kw):
    """``call``'s result, and how long it took (s)."""
    t0 = time.monotonic()
    return call(*args, **kw), time.monotonic() - t0


def start_jobs(cluster) -> dict[str, int]:
    """A counter job on each node, job id -> its line count; once each has a checkpoint."""
    jobs = {submit(cluster, "node-1", LINES): LINES, submit(cluster, "node-2", LINES + 1): LINES + 1}
    assert wait_until(lambda: all(newest_epoch(cluster, j, waiting=True) >= 1 and lines(cluster, j) > 20
                                  for j in jobs), timeout=30), "no checkpoint of the jobs"
    return jobs


def same_copies(cluster, jobs: dict[str, int], before: dict[str, dict]) -> None:
    """Each job runs where it ran, the same process, one copy of it."""
    for job, count in jobs.items():
        now = wait_state(cluster, job, lambda j: j["state"] in ("running", "checkpointing"), 60, "an answer")
        assert (now["node"], now["pid"], now["generation"]) == \
            (before[job]["node"], before[job]["pid"], before[job]["generation"]), now
        assert len(copies(count)) == 1, copies(count)


def untouched(cluster, tmp_path, jobs: dict[str, int], before: dict[str, dict], killed_at: float,
              dead: tuple[str, ...] = ()) -> None:
    """Every job ran to its end where it started, as one copy, never moved, checkpointed after
    ``killed_at``, its output the uninterrupted run's; no node but ``dead`` was declared dead (or
    left), and each of those once."""
    for job in jobs:
        wait_state(cluster, job, lambda j: j["state"] == "completed", 120, "completion")
    events = cluster.events()
    assert [(e["node"], e["kind"]) for e in dead_nodes(events)] == [(node, "dead") for node in dead], \
        dead_nodes(events)
    for job, count in jobs.items():
        done = cluster.job(job)
        assert (done["node"], done["generation"]) == (before[job]["node"], before[job]["generation"]), done
        assert not set(kinds(events, job)) & set(MOVED), kinds(events, job)
        assert kinds(events, job).count("started") == kinds(events, job).count("exited") == 1, kinds(events, job)
        assert since(events, killed_at, "epoch_event.v1", "created", job), f"job {job}: no checkpoint after the kill"
        assert (cluster.storage / "jobs" / job / "output.log").read_bytes() == counter_reference(tmp_path, count), \
            f"job {job}: the output is not the uninterrupted run's"


@pytest.mark.timeout(300)
def test_the_jetstream_meta_leader_killed_under_running_jobs(make_cluster, tmp_path):
    cluster = up(make_cluster, tmp_path / "cluster")
    jobs = start_jobs(cluster)
    before = {job: cluster.job(job) for job in jobs}
    victim_name = meta_leader(cluster)
    isolate(cluster, victim_name)  # it leads no stream: this is the meta group's election alone
    with supervisor_held(cluster), copies_watched(list(jobs.values())) as most:
        killed_at = time.time()
        victim = kill_server(cluster, victim_name)
        at_kill = {job: (lines(cluster, job), newest_epoch(cluster, job)) for job in jobs}
        # The two servers left elect a meta leader of their own ...
        assert wait_until(lambda: (said := {s for n, s in meta_leaders(cluster).items() if n != victim_name})
                          and len(said) == 1 and said != {victim_name} and said != {""}, timeout=30), \
            meta_leaders(cluster)
        # ... and the jobs go on, one copy each, checkpointed on their schedule.
        assert wait_until(lambda: all(lines(cluster, j) > at_kill[j][0] + 40 for j in jobs), timeout=60), \
            {j: show(cluster, j) for j in jobs}
        same_copies(cluster, jobs, before)
        assert wait_until(lambda: all(newest_epoch(cluster, j, waiting=True) > at_kill[j][1] for j in jobs),
                          timeout=60), {j: show(cluster, j) for j in jobs}
        assert {n["name"]: n["state"] for n in cluster.json("nodes")} == {"node-1": "alive", "node-2": "alive"}
    assert set(most.values()) == {1}, f"live copies at once, most seen per line count: {most}"
    assert wait_until(lambda: restarted(cluster, victim), timeout=30)
    untouched(cluster, tmp_path, jobs, before, killed_at)
    assert wait_until(lambda: caught_up(cluster), timeout=60)


@pytest.mark.timeout(300)
def test_the_job_tables_leader_killed_under_running_jobs(make_cluster, tmp_path):
    cluster = up(make_cluster, tmp_path / "cluster")
    jobs = start_jobs(cluster)
    first = next(iter(jobs))
    manual = submit(cluster, "node-2", LINES + 2, every="")  # checkpointed only when asked
    jobs[manual] = LINES + 2
    before = {job: wait_state(cluster, job, lambda j: j["state"] == "running", 30, "a start") for job in jobs}
    # A server that leads the job table's stream and nothing else, not JetStream's meta group,
    # and not the server the coordinator is connected to: this is the job table's election alone.
    avoid = {meta_leader(cluster), connected_to(cluster, cluster.pids()["coordinator"])}
    victim_name = next(name for name in servers(cluster) if name not in avoid)
    isolate(cluster, victim_name, (JOBS_STREAM,))
    with supervisor_held(cluster), copies_watched(list(jobs.values())) as most:
        killed_at = time.time()
        # In the middle of a checkpoint: its reply comes back during the election.
        victim = on_state(cluster, first, "checkpointing", lambda: kill_server(cluster, victim_name))
        at_kill = {job: (lines(cluster, job), newest_epoch(cluster, job)) for job in jobs}
        # Right away, while the job table's stream elects a leader: a submit and a checkpoint.
        with ThreadPoolExecutor(2) as pool:
            submitting = pool.submit(timed, cluster.cli, "submit", "--node", "node-2", "--checkpoint", "0:1", "--",
                                     sys.executable, str(COUNTER), str(SHORT), str(INTERVAL), check=False)
            asking = pool.submit(timed, cluster.cli, "checkpoint", "create", manual, check=False)
            (submitted, submit_s), (asked, ask_s) = submitting.result(), asking.result()
        right_away = (f"during the election, submit exited {submitted.returncode} after {submit_s:.1f} s "
                      f"({(submitted.stdout + submitted.stderr).strip()}), checkpoint create exited "
                      f"{asked.returncode} after {ask_s:.1f} s ({(asked.stdout + asked.stderr).strip()})")
        print(right_away)
        if submitted.returncode == 0:
            jobs[submitted.stdout.strip()] = SHORT
        # The jobs go on, the same copies, and those on a schedule are checkpointed again.
        assert wait_until(lambda: all(lines(cluster, j) > at_kill[j][0] + 40 for j in at_kill), timeout=60), \
            {j: show(cluster, j) for j in jobs}
        same_copies(cluster, {j: jobs[j] for j in at_kill}, before)
        assert wait_until(lambda: all(newest_epoch(cluster, j, waiting=True) > at_kill[j][1]
                                      for j in at_kill if j != manual), timeout=60), {j: show(cluster, j) for j in jobs}
        assert {n["name"]: n["state"] for n in cluster.json("nodes")} == {"node-1": "alive", "node-2": "alive"}
        led = wait_until(lambda: (state := streams_now(cluster)) and state[JOBS_STREAM]["leader"], timeout=30)
        assert led and led != victim_name, led
        # Led again, on the two servers left: both work.
        cluster.cli("checkpoint", "create", manual)
        jobs[submit(cluster, "node-1", SHORT + 1)] = SHORT + 1
    assert set(most.values()) == {1}, f"live copies at once, most seen per line count: {most}"
    assert wait_until(lambda: restarted(cluster, victim), timeout=30)
    before.update({job: cluster.job(job) for job in jobs if job not in before})
    untouched(cluster, tmp_path, jobs, before, killed_at)
    assert wait_until(lambda: caught_up(cluster), timeout=60)
    # Last, so as not to hide the checks above: asked during the election, the checkpoint waited
    # for the job table and was taken; the submit, asked again with its request id while no reply
    # came (the CLI's 5 s bound each time), ran once (one job: `jobs` holds it, and untouched()
    # checked its output), or failed with one line (after the one saying it asked again), and
    # then no job of it appeared later.
    assert asked.returncode == 0, right_away
    if submitted.returncode != 0:
        said = submitted.stderr.strip().splitlines()
        assert 1 <= len(said) <= 2 and "Traceback" not in submitted.stderr, right_away
    listed = {j["id"] for j in cluster.json("jobs")}
    assert listed == set(jobs), (listed, set(jobs), right_away)  # never a second job of one submit


def restored_once(cluster, tmp_path, job: str, count: int, first: dict) -> dict:
    """``job`` failed over once: one `restored` event, on the node left, one live copy, its
    output the uninterrupted run's once it ends."""
    moved = wait_state(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 60, "failover")
    restored = [e for e in cluster.events() if e.get("type") == "job_event.v1" and e.get("job") == job
                and e["kind"] == "restored"]
    assert len(restored) == 1 and restored[0]["node"] == "node-2", restored
    assert len(copies(count)) == 1, copies(count)
    done = wait_state(cluster, job, lambda j: j["state"] == "completed", 120, "completion")
    assert done["node"] == "node-2" and done["generation"] == moved["generation"] > first["generation"], done
    assert (cluster.storage / "jobs" / job / "output.log").read_bytes() == counter_reference(tmp_path, count), \
        f"job {job}: the output is not the uninterrupted run's"
    return moved


@pytest.mark.timeout(300)
def test_a_nats_server_killed_in_the_middle_of_a_failover(make_cluster, tmp_path):
    cluster = up(make_cluster, tmp_path / "cluster")
    jobs = start_jobs(cluster)
    lost, kept = jobs  # on node-1, on node-2
    before = {job: cluster.job(job) for job in jobs}
    coordinator = cluster.pids()["coordinator"]
    # The server the coordinator is connected to leads the lease bucket and the job table: the
    # restore's reply is lost with the connection, the failover records what became of it during
    # the job table's election, and the node left fences itself meanwhile (no lease to renew).
    victim_name = connected_to(cluster, coordinator)
    isolate(cluster, victim_name, (LEASES_STREAM, JOBS_STREAM))
    # Nothing comes back meanwhile: not node-1's agent, not the server.
    with supervisor_held(cluster), copies_watched(list(jobs.values())) as most:
        os.kill(cluster.pids()["node-1"], signal.SIGKILL)
        os.kill(before[lost]["pid"], signal.SIGKILL)  # the job's namespace, with it
        # Once the restore is on its way to node-2: its reply comes back during the elections.
        killed_at = time.time()
        victim = on_state(cluster, lost, "restoring", lambda: kill_server(cluster, victim_name))
        restored_once(cluster, tmp_path, lost, jobs[lost], before[lost])
        assert {n["name"]: n["state"] for n in cluster.json("nodes")} == {"node-1": "dead", "node-2": "alive"}
    assert max(most.values()) == 1, f"live copies at once, most seen per line count: {most}"
    assert wait_until(lambda: restarted(cluster, victim), timeout=30)
    untouched(cluster, tmp_path, {kept: jobs[kept]}, before, killed_at, dead=("node-1",))
    assert wait_until(lambda: caught_up(cluster), timeout=60)


@pytest.mark.timeout(300)
def test_the_leader_coordinator_killed_in_the_middle_of_a_failover(make_cluster, tmp_path):
    cluster = up(make_cluster, tmp_path / "cluster")
    log = open(cluster.dir / "logs" / "standby.log", "wb")
    standby = subprocess.Popen([str(VENV_BIN / "revenant"), "coordinator", "--nats", doc(cluster)["nats_url"],
                                "--name", "standby", "--http-port", "0",
                                "--creds", str(cluster.dir / "keys" / "coordinator.nk")], stdout=log, stderr=log)
    try:
        assert wait_log(cluster.dir / "logs" / "standby.log", "waiting to lead"), "the standby did not start"
        jobs = start_jobs(cluster)
        lost, kept = jobs
        before = {job: cluster.job(job) for job in jobs}
        # Nothing comes back meanwhile: not node-1's agent, not the coordinator.
        with supervisor_held(cluster), copies_watched(list(jobs.values())) as most:
            os.kill(cluster.pids()["node-1"], signal.SIGKILL)
            os.kill(before[lost]["pid"], signal.SIGKILL)
            # Once the restore is on its way to node-2: the leader never hears its reply.
            killed_at = time.time()
            on_state(cluster, lost, "restoring", lambda: os.kill(cluster.pids()["coordinator"], signal.SIGKILL))
            # The standby takes the leader lease, reloads the job table, and finishes the failover.
            restored_once(cluster, tmp_path, lost, jobs[lost], before[lost])
            assert wait_log(cluster.dir / "logs" / "standby.log", "leads (term"), "the standby did not lead"
        assert max(most.values()) == 1, f"live copies at once, most seen per line count: {most}"
        untouched(cluster, tmp_path, {kept: jobs[kept]}, before, killed_at, dead=("node-1",))
        assert kinds(cluster.events(), lost).count("restored") == 1, kinds(cluster.events(), lost)
    finally:
        standby.terminate()
        standby.wait(timeout=30)
        log.close()
