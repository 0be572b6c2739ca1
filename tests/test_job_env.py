"""A job's environment is the one its submit carried plus the documented variables: nothing of
its agent's own environment reaches it (no credential's path, no REVENANT_* but its job id, no
loader variable), read from the running program's /proc/PID/environ on a real cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

# What docs/cli.md (submit) says a job gets besides what its submit exported; and what its own
# shell (revenant-cd, `sh`) adds as it runs: PWD, and dash's none else.
DOCUMENTED = {"PATH", "USER", "LOGNAME", "HOME", "SHELL", "LANG", "TZ", "REVENANT_JOB_ID", "CUDA_VISIBLE_DEVICES"}
SHELL_OWN = {"PWD", "SHLVL", "_", "OLDPWD"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_nothing_of_the_agents_environment_leaks_into_a_job(make_cluster, tmp_path):
    secret = {"AGENT_ONLY_SECRET": "s3cret", "LD_LIBRARY_PATH": "/opt/agent-only/lib",
              "REVENANT_AGENT_HEARTBEAT_JITTER": "0.1", "PYTHONPATH": "/opt/agent-only/py"}
    cluster = make_cluster(2, env=secret)
    wait_until(lambda: (n := cluster.json("nodes", "--json")) and len(n) == 2 and n, timeout=30)
    workdir = tmp_path / "wd"
    workdir.mkdir()
    job = cluster.cli("submit", "--export", "NONE", "--env", "MINE=1", "--workdir", str(workdir), "--",
                      "sleep", "600").stdout.strip()
    info = wait_until(lambda: (j := cluster.job(job)) and j["state"] == "running" and j["program_pid"] and j,
                      timeout=30)
    assert info, cluster.job(job)
    agent_env = _environ(cluster.pids()["node-1" if info["node"] == "node-1" else "node-2"])
    assert agent_env.get("AGENT_ONLY_SECRET") == "s3cret"  # the agent has it ...
    env = _environ(info["program_pid"])
    assert env["MINE"] == "1" and env["REVENANT_JOB_ID"] == job
    extra = set(env) - DOCUMENTED - SHELL_OWN - {"MINE"}
    assert not extra, f"the job got variables no one gave it: {sorted(extra)}"  # ... the job does not
    assert not [k for k in env if k.startswith("REVENANT_") and k != "REVENANT_JOB_ID"]
    assert not [v for v in env.values() if "agent-only" in v or ".nk" in v or ".creds" in v]
    cluster.cli("cancel", job)
