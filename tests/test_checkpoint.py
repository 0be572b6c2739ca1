"""Checkpoint create / vacate / restart through the CLI, with real CRIU on real processes."""

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

from conftest import COUNTER, counter_reference, wait_until
from revenant.agent.storage.epochs import JobFiles

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

LINES = 160
CYCLE_LINES = 400
FALLBACK_LINES = 200  # 10 s: its vacate never races its end on a busy machine
INTERVAL = 0.05


def submit_counter(cluster, *extra: str, count: int = LINES, interval: float = INTERVAL, ballast_mib: int = 0) -> str:
    out = cluster.cli("submit", "--node", "node-1", *extra, "--", sys.executable, str(COUNTER), str(count),
                      str(interval), str(ballast_mib))
    job = out.stdout.strip()
    assert job.isdigit(), out.stdout
    return job


def output_lines(cluster, job: str) -> int:
    try:
        return (cluster.storage / "jobs" / job / "output.log").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_lines(cluster, job: str, at_least: int) -> None:
    assert wait_until(lambda: output_lines(cluster, job) >= at_least, timeout=30), "job output stalled"


def wait_state(cluster, job: str, state: str, timeout: float = 60) -> dict:
    info = wait_until(lambda: (j := cluster.job(job))["state"] == state and j, timeout=timeout)
    assert info, f"job {job} never reached {state}: {cluster.job(job)}"
    return info


def test_create_vacate_restart_cycles_keep_output_byte_exact(make_cluster, tmp_path):
    cluster = make_cluster(2)
    # Long enough that its last restore never races its end (the CLI calls take their time).
    job = submit_counter(cluster, "--max-epochs", "2", count=CYCLE_LINES)
    info = cluster.job(job)
    assert info["state"] == "running" and info["node"] == "node-1" and info["generation"] == 1
    assert psutil.pid_exists(info["pid"])
    nodes = ["node-2", "node-1", "node-2"]
    for cycle, target in enumerate(nodes):
        wait_lines(cluster, job, 15 + cycle * 40)
        cluster.cli("checkpoint", "create", job)
        assert cluster.job(job)["state"] == "running"
        wait_lines(cluster, job, 25 + cycle * 40)
        cluster.cli("checkpoint", "vacate", job)
        vacated = cluster.job(job)
        assert vacated["state"] == "vacated" and vacated["pid"] == 0
        time.sleep(0.3)  # the job is really stopped: its output does not grow
        frozen_at = output_lines(cluster, job)
        time.sleep(0.3)
        assert output_lines(cluster, job) == frozen_at
        cluster.cli("checkpoint", "restart", job, "--node", target)
        restored = cluster.job(job)
        assert restored["state"] == "running" and restored["node"] == target
        assert restored["generation"] == cycle + 2
        # The restored job's pid is a live process, a child of the new node's agent.
        proc = psutil.Process(restored["pid"])
        assert proc.is_running() and proc.ppid() == cluster.pids()[target]
        assert [e["n"] for e in restored["epochs"]] == [2 * cycle + 1, 2 * cycle + 2][-2:]

    done = wait_state(cluster, job, "completed", timeout=60)
    assert done["exit_code"] == 0
    expected = counter_reference(tmp_path, CYCLE_LINES)
    assert (cluster.storage / "jobs" / job / "output.log").read_bytes() == expected

    kinds = [(e["type"], e["kind"]) for e in cluster.events() if e.get("job") == job]
    assert kinds.count(("job_event.v1", "vacated")) == 3
    assert kinds.count(("job_event.v1", "restored")) == 3
    assert kinds.count(("epoch_event.v1", "created")) == 6
    assert ("epoch_event.v1", "pruned") in kinds
    assert kinds[-1] == ("job_event.v1", "exited")
    created = [e for e in cluster.events() if e.get("type") == "epoch_event.v1" and e["kind"] == "created"]
    assert all(e["bytes"] > 0 and e["freeze_s"] > 0 and e["duration_s"] >= e["freeze_s"] for e in created)
    # Checkpoints outlive the job until purged.
    files = JobFiles(cluster.storage, job)
    assert files.committed() == [5, 6]
    purged = cluster.cli("job", "purge", job)
    assert "freed" in purged.stderr
    assert files.committed() == []
    # And the record goes with them (issue 9).
    assert f"unknown job {job}" in cluster.cli("show", "job", job, check=False).stderr


@pytest.mark.parametrize("mode,integrity", [("eager", "mac"), ("lazy", "mac"), ("lazy", "crc32")])
def test_corrupted_newest_epoch_falls_back_to_the_previous(make_cluster, tmp_path, mode, integrity):
    """Eager: the corrupt epoch is refused before criu runs.  Lazy with image keys: the pages are
    checked by extent as they are made ready or served; here the changed extent holds a page criu
    restore reads itself, so it fails before criu runs and the restore falls back at once.  Lazy
    with CRC-32s: the job runs before its page data is read, so the corruption is found as the
    pages are checked alongside; the restored copy is killed at once (evicted), the epoch set
    aside, and the coordinator restores epoch 1."""
    cluster = make_cluster(2, env={"REVENANT_AGENT_RESTORE_MODE": mode, "REVENANT_AGENT_IMAGE_INTEGRITY": integrity})
    job = submit_counter(cluster, "--max-epochs", "2", count=FALLBACK_LINES)
    wait_lines(cluster, job, 10)
    cluster.cli("checkpoint", "create", job)
    wait_lines(cluster, job, 25)
    cluster.cli("checkpoint", "vacate", job)
    files = JobFiles(cluster.storage, job)
    assert files.committed() == [1, 2]
    assert files.read_manifest(2).checksum == ("blake3-keyed" if integrity == "mac" else "crc32")
    pages = max((files.epoch_dir(2)).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(100)
        f.write(b"\xde\xad\xbe\xef")
    out = cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    if mode == "eager":
        assert f"epoch 2: {pages.name} fails its checksum" in out.stderr, out.stderr
    elif integrity == "mac":
        assert f"epoch 2: {pages.name}: bytes 0..65536 (page 0 on) fail their MAC" in out.stderr, out.stderr
    else:
        evicted = wait_until(lambda: [e for e in cluster.events() if e.get("kind") == "evicted"], timeout=60)
        assert "lazy restore of epoch 2 failed" in evicted[0]["reason"] and "checksum" in evicted[0]["reason"]
        wait_until(lambda: [e for e in cluster.events() if e.get("kind") == "restored"][-1]["epoch"] == 1, 60)
    restored = [e for e in cluster.events() if e.get("kind") == "restored"]
    assert restored[-1]["epoch"] == 1
    wait_state(cluster, job, "completed")
    assert (cluster.storage / "jobs" / job / "output.log").read_bytes() == counter_reference(tmp_path, FALLBACK_LINES)


def test_failed_vacate_keeps_the_job_running(make_cluster, tmp_path):
    cluster = make_cluster(1)
    # A job holding a device criu cannot dump (/dev/fuse): criu fails, once it has frozen the job.
    script = ("import os,time,sys\nfd=os.open(sys.argv[1], os.O_RDWR)\n"
              "i=0\nwhile True:\n    print(i, flush=True); i+=1; time.sleep(0.05)\n")
    job = cluster.cli("submit", "--", sys.executable, "-c", script, "/dev/fuse").stdout.strip()
    wait_lines(cluster, job, 5)
    before = cluster.job(job)
    out = cluster.cli("checkpoint", "vacate", job, check=False)
    assert out.returncode != 0
    assert out.stderr.startswith("revenant: criu dump failed: ") and "Error" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    after = cluster.job(job)
    assert after["state"] == "running" and after["pid"] == before["pid"] and after["epochs"] == []
    grown = output_lines(cluster, job)
    wait_lines(cluster, job, grown + 5)  # still writing
    assert JobFiles(cluster.storage, job).committed() == []
    failed = [e for e in cluster.events() if e.get("type") == "epoch_event.v1" and e["kind"] == "failed"]
    assert failed and "Can't dump file" in failed[-1]["error"] and "chr 10:229" in failed[-1]["error"]


def test_agent_killed_mid_dump_leaves_no_listed_epoch(make_cluster):
    cluster = make_cluster(2)
    job = submit_counter(cluster, count=100000, interval=0.05, ballast_mib=600)
    wait_lines(cluster, job, 3)
    files = JobFiles(cluster.storage, job)
    job_pid = cluster.job(job)["pid"]
    ck = subprocess.Popen([sys.executable, "-m", "revenant.cli", "checkpoint", "create", job, "--dir", str(cluster.dir)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Wait until images are being copied into shared storage, then kill the agent.
        assert wait_until(lambda: any(p.name.startswith(".tmp-") for p in files.epochs_dir.glob(".tmp-*")),
                          timeout=60, interval=0.01), "the dump never reached shared storage"
        # A big checkpoint in progress does not hold up the node's heartbeats.
        node = {n["name"]: n for n in cluster.json("nodes")}["node-1"]
        assert node["state"] == "alive" and node["last_heartbeat_age_s"] < 1.5
        killed = cluster.pids()["node-1"]
        os.kill(killed, signal.SIGKILL)
    finally:
        ck.wait(timeout=120)
    assert files.committed() == []
    assert not [p for p in files.epochs_dir.iterdir() if not p.name.startswith(".")]
    # The agent's death took the job with it.
    assert wait_until(lambda: not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == "zombie",
                      timeout=10)
    # The next agent of node-1 clears both what the dead one left: the half-written
    # epoch on shared storage and its node-local staging.
    stale_staging = [p for p in Path("/dev/shm/revenant-node-1").glob("*") if f"-{killed}-" in p.name]
    revenant = str(Path(sys.executable).parent / "revenant")
    url = json.loads((cluster.dir / "cluster.json").read_text())["nats_url"]
    agent = subprocess.Popen([revenant, "agent", "--node", "node-1", "--nats", url, "--storage", str(cluster.storage),
                              "--http-port", "0", "--creds", str(cluster.dir / "keys" / "agent-node-1.nk"),
                              "--image-keys", str(cluster.dir / "keys" / "image.keys")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: not list(files.epochs_dir.glob(".tmp-*")) and
                          not any(p.exists() for p in stale_staging), timeout=30)
    finally:
        agent.terminate()
        agent.wait(timeout=15)


@pytest.mark.parametrize(
    "args, message",
    [
        (["checkpoint", "create", "999"], "unknown job 999"),
        (["checkpoint", "vacate", "999"], "unknown job 999"),
        (["checkpoint", "restart", "999"], "unknown job 999"),
        (["show", "job", "999"], "unknown job 999"),
        (["job", "purge", "999"], "unknown job 999"),
        (["checkpoint", "create", "bad.id"], "invalid job id"),
        (["submit", "--checkpoint", "soon", "--", "true"], "bad checkpoint interval 'soon'"),
        (["submit", "--max-epochs", "0", "--", "true"], "--max-epochs must be at least 1"),
        (["submit", "--node", "node-9", "--", "true"], "unknown node node-9"),
        (["submit", "--", "no-such-command-xyz"], "command not found"),
        (["submit"], "nothing to run"),
    ],
)
def test_job_errors_are_one_line(make_cluster, args, message):
    cluster = make_cluster(1, name="errors")
    out = cluster.cli(*args, check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_not_running_and_finished_job_errors(make_cluster):
    cluster = make_cluster(1)
    job = cluster.cli("submit", "--", "true").stdout.strip()
    wait_state(cluster, job, "completed")
    for args in (["checkpoint", "create", job], ["checkpoint", "vacate", job]):
        out = cluster.cli(*args, check=False)
        assert out.returncode != 0 and f"job {job} is completed, not running" in out.stderr
    out = cluster.cli("checkpoint", "restart", job, check=False)
    assert out.returncode != 0 and "only a vacated, failed or cancelled job can be restarted" in out.stderr
    failing = cluster.cli("submit", "--", "sh", "-c", "exit 3").stdout.strip()
    info = wait_state(cluster, failing, "failed")
    assert info["exit_code"] == 3
    assert [j["id"] for j in cluster.json("jobs")] == [job, failing]
