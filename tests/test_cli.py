"""The CLI contract, exercised as a subprocess on a real local cluster."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from conftest import VENV_BIN, revenant_cli, wait_until
from helpers import external_nats

pytestmark = pytest.mark.cluster


def node_table(cluster_dir) -> dict[str, dict]:
    out = revenant_cli("nodes", "--dir", str(cluster_dir), "--json", check=True)
    return {n["name"]: n for n in json.loads(out.stdout)}


def events(cluster_dir) -> list[dict]:
    out = revenant_cli("events", "--dir", str(cluster_dir), "--json", check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def cluster_pids(cluster_dir) -> dict[str, int]:
    doc = json.loads((cluster_dir / "cluster.json").read_text())
    return {p["name"]: p["pid"] for p in doc["processes"]}


@pytest.fixture
def cluster(tmp_path):
    d = tmp_path / "cluster"
    revenant_cli("up", "--nodes", "3", "--dir", str(d), "--detach", check=True)
    pids = cluster_pids(d)
    yield d
    if (d / "cluster.json").exists():
        revenant_cli("down", "--dir", str(d))
    for pid in pids.values():
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_up_nodes_events_down(cluster):
    doc = json.loads((cluster / "cluster.json").read_text())
    assert doc["nats_url"].startswith("nats://")
    assert {p["role"] for p in doc["processes"]} == {"nats-server", "coordinator", "agent"}
    table = node_table(cluster)
    assert sorted(table) == ["node-1", "node-2", "node-3"]
    pids = cluster_pids(cluster)
    for name, node in table.items():
        assert node["state"] == "alive"
        assert node["health"] in ("GREEN", "YELLOW", "RED")
        assert node["pid"] == pids[name]
        assert node["last_heartbeat_age_s"] < 3
        assert node["capabilities"]["criu"]["ok"] is True
        assert node["capabilities"]["gpu"] == "none"

    human = revenant_cli("nodes", "--dir", str(cluster), check=True).stdout
    assert human.splitlines()[0].split()[:3] == ["NAME", "STATE", "HEALTH"]
    joined = {e["node"] for e in events(cluster) if e.get("kind") == "joined"}
    assert joined == {"node-1", "node-2", "node-3"}

    # The same cluster is reachable by URL and by environment variable, with its admin credential
    # (cluster.json names it, and is private); without one the server refuses the connection.
    url, creds = doc["nats_url"], doc["creds"]
    assert doc["insecure"] is False and creds == str(cluster / "keys" / "admin.nk")
    assert stat.S_IMODE((cluster / "cluster.json").stat().st_mode) == 0o600
    assert json.loads(revenant_cli("nodes", "--nats", url, "--creds", creds, "--json", check=True).stdout)
    assert json.loads(revenant_cli("nodes", "--json", env={"REVENANT_NATS": url, "REVENANT_CREDS": creds},
                                   check=True).stdout)
    refused = revenant_cli("nodes", "--nats", url, env={"REVENANT_CREDS": ""})
    assert refused.returncode == 1 and "refused the connection" in refused.stderr

    started = time.monotonic()
    revenant_cli("down", "--dir", str(cluster), check=True)
    assert time.monotonic() - started < 20
    assert not (cluster / "cluster.json").exists()
    assert not [p for p in pids.values() if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_sigkilled_agent_is_reported_dead_within_the_timeout(cluster):
    victim = cluster_pids(cluster)["node-2"]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    table = wait_until(lambda: (t := node_table(cluster))["node-2"]["state"] == "dead" and t, timeout=10)
    assert table, "node-2 never declared dead"
    dead = [e for e in events(cluster) if e.get("kind") == "dead"]
    assert [e["node"] for e in dead] == ["node-2"]
    # Declared within node_timeout (2.5 s) + a probe, measured from its last heartbeat.
    assert dead[0]["silence_s"] <= 3.0
    assert dead[0]["at"] - killed_at <= 3.5
    assert table["node-1"]["state"] == table["node-3"]["state"] == "alive"


def test_busy_node_is_not_declared_dead(cluster):
    # Saturate both cores (twice over) for 12 s with plain CPU burners.
    burners = [subprocess.Popen([sys.executable, "-c", "import time\nend=time.time()+12\nwhile time.time()<end: pass"])
               for _ in range(2 * (os.cpu_count() or 2))]
    try:
        for b in burners:
            b.wait(timeout=30)
    finally:
        for b in burners:
            b.kill()
    bad = [e for e in events(cluster) if e.get("kind") == "dead"]
    assert bad == []
    assert all(n["state"] == "alive" for n in node_table(cluster).values())


def test_agent_sigterm_drains_and_leaves(cluster):
    pid = cluster_pids(cluster)["node-3"]
    proc = psutil.Process(pid)
    started = time.monotonic()
    proc.terminate()
    proc.wait(timeout=10)
    assert time.monotonic() - started < 5
    table = wait_until(lambda: (t := node_table(cluster))["node-3"]["state"] == "left" and t, timeout=5)
    assert table
    kinds = [e["kind"] for e in events(cluster) if e.get("node") == "node-3"]
    assert kinds == ["joined", "left"]


def test_up_refuses_a_running_cluster(cluster):
    out = revenant_cli("up", "--nodes", "1", "--dir", str(cluster), "--detach")
    assert out.returncode != 0
    assert "already running" in out.stderr and "Traceback" not in out.stderr


def test_up_with_external_nats(tmp_path):
    d = tmp_path / "c"
    server = external_nats(d, ["node-1"], tmp_path / "ext")
    try:
        revenant_cli("up", "--nodes", "1", "--dir", str(d), "--nats", server.url, "--detach", check=True)
        assert node_table(d)["node-1"]["state"] == "alive"
        revenant_cli("down", "--dir", str(d), check=True)
        assert server.process.poll() is None, "down must not stop a NATS server it did not start"
    finally:
        if (d / "cluster.json").exists():
            revenant_cli("down", "--dir", str(d))
        server.stop()


def test_foreground_up_stops_everything_on_ctrl_c(tmp_path):
    d = tmp_path / "fg"
    proc = subprocess.Popen([str(VENV_BIN / "revenant"), "up", "--nodes", "2", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # wait for "cluster up", then press Ctrl-C
            seen.append(line)
            if "cluster up" in line:
                break
        assert node_table(d)["node-2"]["state"] == "alive", seen
        pids = cluster_pids(d)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopping the cluster" in err
    finally:
        proc.kill()
        proc.communicate()
    assert not [p for p in pids.values() if psutil.pid_exists(p)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["nodes"], "no cluster given"),
        (["nodes", "--dir", "/nonexistent"], "cluster.json not found"),
        (["nodes", "--nats", "nats://127.0.0.1:1", "--timeout", "1"], "cannot connect to NATS"),
        (["events", "--nats", "nats://127.0.0.1:1", "--timeout", "1"], "cannot connect to NATS"),
        (["down", "--dir", "/nonexistent"], "cluster.json not found"),
        (["up", "--nodes", "0", "--dir", "/tmp/revenant-never"], "--nodes must be at least 1"),
        (["agent", "--nats", "nats://127.0.0.1:1"], "needs a node name"),
        (["agent", "--node", "bad.name", "--nats", "nats://127.0.0.1:1"], "invalid node name"),
        (["coordinator", "--node-timeout", "-1"], "node_timeout_s must be positive"),
    ],
)
def test_user_errors_are_one_line(args, message):
    out = revenant_cli(*args, env={"REVENANT_NATS": ""}, timeout=30)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_nodes_watch_refreshes_in_place(cluster):
    doc = json.loads((cluster / "cluster.json").read_text())
    with subprocess.Popen([str(VENV_BIN / "revenant"), "nodes", "--watch", "--interval", "0.3",
                           "--nats", doc["nats_url"], "--creds", doc["creds"]],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        # Three frames drawn (a busy machine takes its time to start the CLI), then Ctrl-C.
        seen = ""
        while seen.count("\x1b[H\x1b[2J") < 4:
            line = proc.stdout.readline()
            assert line, f"the watch ended: {proc.stderr.read()}"
            seen += line
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out = seen + out
    frames = out.split("\x1b[H\x1b[2J")[1:-1]  # the last one Ctrl-C may have cut
    assert len(frames) >= 3, out
    assert all("node-1" in f and "NAME" in f for f in frames), frames
    assert "Traceback" not in err


def test_cluster_json_lists_every_metrics_url(cluster):
    import urllib.request

    doc = json.loads((cluster / "cluster.json").read_text())
    for p in doc["processes"]:
        if p["role"] == "nats-server":
            continue
        assert p["metrics_url"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(p["metrics_url"] + "/metrics", timeout=5) as resp:
            assert b"revenant_" in resp.read()
        with urllib.request.urlopen(p["metrics_url"] + "/ready", timeout=5) as resp:
            assert resp.status == 200
