"""A job that writes its own files survives its node, through the whole cluster: real NATS, the
coordinator's failover, real criu.  Its files come out exactly as an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys

import pytest

from test_failover import job_events, output, wait_for
from test_job_files import WRITER, exact_steps

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

STEPS = 220


def test_a_failover_leaves_every_file_of_the_job_exact(make_cluster, tmp_path):
    cluster = make_cluster(2)
    wd = tmp_path / "wd"
    wd.mkdir()
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(wd), "--", sys.executable, str(WRITER),
                      str(STEPS), "0.03", "10").stdout.strip()
    wait_for(cluster, job, lambda j: output(cluster, job).count(b"\n") > 40, 30, "40 steps")
    cluster.cli("checkpoint", "create", job)
    first = wait_for(cluster, job, lambda j: j["epochs"], 10, "the epoch")
    at_dump = output(cluster, job).count(b"\n")
    assert wait_for(cluster, job, lambda j: output(cluster, job).count(b"\n") > at_dump + 30, 30, "more steps")
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 30, "failover")
    done = wait_for(cluster, job, lambda j: j["state"] in ("completed", "failed"), 60, "the end")
    assert done["state"] == "completed" and done["exit_code"] == 0, output(cluster, job)[-300:]
    # Every file holds each step once, as a run without the failover would have left it.
    assert exact_steps(cluster.storage / "jobs" / job / "output.log") == STEPS
    assert exact_steps(wd / "train.log") == STEPS
    assert exact_steps(wd / "metrics.csv", csv=True) == STEPS
    with sqlite3.connect(wd / "steps.db") as db:
        assert [n for (n,) in db.execute("SELECT n FROM steps ORDER BY n")] == list(range(STEPS))
    db.close()
    assert (wd / "state.bin").read_bytes()[:8] == b"%08d" % (STEPS - 1)
    restored = [e for e in job_events(cluster, job) if e["kind"] == "restored"]
    assert f"cut {wd / 'train.log'} back" in restored[0]["reason"], restored
    assert f"restored {wd / 'steps.db'} from epoch {first['epochs'][0]['n']}'s copy" in restored[0]["reason"]
    # Its checkpoint, closed at the dump and renamed over after it, was put back, not moved aside.
    assert "ckpt.json" in restored[0]["reason"] and "as they were at epoch" in restored[0]["reason"], restored
    assert not (wd / f"revenant-after-epoch-{first['epochs'][0]['n']}" / "ckpt.json").exists()
