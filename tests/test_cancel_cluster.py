"""Cancel, signal and a vacate that waits, through the CLI on a real cluster with real criu: a
training-like job saves its state on USR1 and ends cleanly on a cancel's TERM; a cancelled job
keeps its epochs and restarts from them; a cancel that cuts a checkpoint short leaves no copy and
no half-written epoch; a vacate asked during a periodic checkpoint waits for it and then vacates;
``logs -f`` follows the output across a vacate and a restart from an older epoch, marking what
the restore undid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER, VENV_BIN, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

SIGNALLED = Path(__file__).resolve().parent / "jobs" / "signalled.py"


def output(cluster, job: str) -> str:
    try:
        return (cluster.storage / "jobs" / job / "output.log").read_text()
    except FileNotFoundError:
        return ""


def submit(cluster, *argv: str, extra: tuple[str, ...] = ()) -> str:
    job = cluster.cli("submit", "--node", "node-1", *extra, "--", *argv).stdout.strip()
    assert job.isdigit(), job
    return job


def in_background(cluster, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    doc = json.loads((cluster.dir / "cluster.json").read_text())
    env = {**os.environ, "REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}
    return subprocess.Popen([str(VENV_BIN / "revenant"), *args], env=env, cwd=cluster.dir, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.DEVNULL)


def state_is(cluster, job: str, state: str, timeout: float = 60) -> dict:
    info = wait_until(lambda: (j := cluster.job(job))["state"] == state and j, timeout=timeout, interval=0.05)
    assert info, f"job {job} never reached {state}: {cluster.job(job)}"
    return info


def test_a_signalled_job_saves_and_a_cancelled_one_ends_cleanly_and_restarts_from_its_epochs(make_cluster):
    cluster = make_cluster(2)
    job = submit(cluster, sys.executable, str(SIGNALLED), extra=("--max-epochs", "2"))
    assert wait_until(lambda: "program: started" in output(cluster, job), timeout=30)
    info = cluster.job(job)
    program = psutil.Process(info["program_pid"])
    assert str(SIGNALLED) in program.cmdline() and program.ppid() == info["pid"]
    said = cluster.cli("signal", job, "usr1").stdout
    assert said == f"job {job}: SIGUSR1 sent to its program, pid {info['program_pid']} on node-1\n"
    assert wait_until(lambda: "program: saved at step" in output(cluster, job), timeout=10)
    assert "worker: USR1" not in output(cluster, job)
    cluster.cli("signal", job, "SIGUSR1", "--all")
    assert wait_until(lambda: "worker: USR1" in output(cluster, job), timeout=10)
    cluster.cli("checkpoint", "create", job)

    done = cluster.cli("cancel", job)
    assert done.stdout == f"job {job}: cancelled\n"
    after = cluster.job(job)
    assert (after["state"], after["reason"], after["pid"], len(after["epochs"])) == (
        "cancelled", "cancelled by admin", 0, 1)
    assert output(cluster, job).rstrip().endswith("program: bye") and not program.is_running()
    again = cluster.cli("cancel", job, check=False)
    assert (again.returncode, again.stderr) == (1, f"revenant: job {job} is already cancelled; nothing to cancel\n")
    refused = cluster.cli("signal", job, "USR1", check=False)
    assert refused.stderr == f"revenant: job {job} is cancelled; only a running job can be signalled\n"
    kinds = [e["kind"] for e in cluster.events() if e.get("job") == job]
    assert "signalled" in kinds and kinds.count("cancelled") == 1 and "restoring" not in kinds

    # Its epoch takes it back, elsewhere; a cancel with KILL ends it at once.
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    back = cluster.job(job)
    assert (back["state"], back["node"]) == ("running", "node-2") and psutil.pid_exists(back["program_pid"])
    cluster.cli("cancel", job, "--signal", "KILL", "--grace", "0")
    assert not psutil.pid_exists(back["program_pid"]) and cluster.job(job)["state"] == "cancelled"


def test_a_cancel_during_a_checkpoint_leaves_no_copy_and_no_half_written_epoch(make_cluster):
    cluster = make_cluster(2)
    job = submit(cluster, sys.executable, str(COUNTER), "100000", "0.01", "400", extra=("--max-epochs", "3"))
    assert wait_until(lambda: output(cluster, job).count("\n") >= 20, timeout=60)
    cluster.cli("checkpoint", "create", job)
    first = cluster.job(job)
    dumping = in_background(cluster, "checkpoint", "create", job)
    state_is(cluster, job, "checkpointing", timeout=30)
    cluster.cli("cancel", job, "--signal", "KILL")
    dumping.wait(timeout=120)
    after = cluster.job(job)
    assert after["state"] == "cancelled"
    if len(after["epochs"]) == 1:  # the kill cut the dump short (else it had committed whole first)
        assert after["last_checkpoint_error"].startswith("criu dump failed"), after["last_checkpoint_error"]
    assert not psutil.pid_exists(first["pid"]) and not psutil.pid_exists(first["program_pid"])
    epochs = cluster.storage / "jobs" / job / "epochs"
    leftovers = [p.name for p in epochs.iterdir() if not p.name.isdigit() and p.name != ".lock"]
    assert not leftovers, leftovers  # nothing half-written (.tmp-*) is left beside the committed epochs
    assert {e["n"] for e in after["epochs"]} == {int(p.name) for p in epochs.iterdir() if p.name.isdigit()}
    # Every epoch it lists restores (the cut-short one either committed whole or never was).
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    restored = cluster.job(job)
    assert restored["state"] == "running" and restored["node"] == "node-2"
    n = output(cluster, job).count("\n")
    assert wait_until(lambda: output(cluster, job).count("\n") > n + 10, timeout=30)
    cluster.cli("cancel", job, "--signal", "KILL")


def test_a_vacate_asked_during_a_periodic_checkpoint_waits_for_it_then_vacates(make_cluster):
    cluster = make_cluster(2)
    job = submit(cluster, sys.executable, str(COUNTER), "100000", "0.01", "300", extra=("--checkpoint", "0:01"))
    state_is(cluster, job, "checkpointing", timeout=60)  # a periodic one, under way
    began = time.monotonic()
    vacated = cluster.cli("checkpoint", "vacate", job)
    assert "job vacated" in vacated.stdout, vacated.stdout
    assert cluster.job(job)["state"] == "vacated"
    assert time.monotonic() - began < 120


def test_logs_follow_the_output_across_restores_and_mark_a_rollback(make_cluster):
    cluster = make_cluster(2)
    job = submit(cluster, sys.executable, str(COUNTER), "300", "0.03", extra=("--max-epochs", "3"))
    assert wait_until(lambda: output(cluster, job).count("\n") >= 10, timeout=60)
    tail = cluster.cli("logs", job, "--tail", "3").stdout
    assert len(tail.splitlines()) == 3 and tail in output(cluster, job)
    following = in_background(cluster, "logs", job, "-f", stdout=subprocess.PIPE)
    cluster.cli("checkpoint", "create", job)
    first = cluster.job(job)["epochs"][-1]
    assert first["output_bytes"] > 0
    assert wait_until(lambda: len(output(cluster, job)) > first["output_bytes"] + 200, timeout=60)
    cluster.cli("checkpoint", "vacate", job)
    cluster.cli("checkpoint", "restart", job, "--epoch", str(first["n"]), "--node", "node-2")
    assert cluster.job(job)["restored_from"] == first["n"]
    state_is(cluster, job, "completed", timeout=120)
    text, _ = following.communicate(timeout=60)
    assert following.returncode == 0
    before, marker, after = text.partition(b"--- revenant: job %s's output rolled back to epoch %d, at byte %d "
                                           % (job.encode(), first["n"], first["output_bytes"]))
    assert marker, text[-2000:]
    after = after.split(b" ---\n", 1)[1]
    # What it printed, less what the marker says was undone, is the job's output exactly.
    assert before[:first["output_bytes"]] + after == (cluster.storage / "jobs" / job / "output.log").read_bytes()
