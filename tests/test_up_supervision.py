"""`revenant up` supervises what it started, as real processes: a nats-server, coordinator or agent
that is killed comes back (nats-server on its port with its store, the others on their HTTP
ports), a crash loop is given up and reported, a clean stop is left alone, and `revenant down`
stops the supervisor first, then everything, for good."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from urllib.parse import urlsplit

import psutil
import pytest

from conftest import VENV_BIN, revenant_cli, wait_until

pytestmark = pytest.mark.cluster


def doc(directory) -> dict:
    return json.loads((directory / "cluster.json").read_text())


def info(directory, name: str) -> dict:
    return next(p for p in doc(directory)["processes"] if p["name"] == name)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def restarted(directory, name: str, old_pid: int, timeout: float) -> dict | None:
    """The process's record once the supervisor has started a new one in its place."""
    return wait_until(lambda: (p := info(directory, name))["pid"] != old_pid and running(p["pid"]) and p,
                      timeout=timeout, interval=0.05)


def accepts(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=0.5):
            return True
    except OSError:
        return False


def nodes(directory) -> dict[str, dict]:
    """The coordinator's node table, or {} while none answers."""
    out = revenant_cli("nodes", "--dir", str(directory), "--json", "--timeout", "2", timeout=30)
    return {n["name"]: n for n in json.loads(out.stdout)} if out.returncode == 0 else {}


def live(metrics_url: str) -> bool:
    try:
        with urllib.request.urlopen(metrics_url + "/live", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def supervisor_log(directory) -> str:
    try:
        return (directory / "logs" / "supervisor.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def leftovers(directory) -> list[str]:
    """Processes still running with the cluster directory on their command line."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(directory) in " ".join(p.info["cmdline"] or []):
            found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])}")
    return found


def test_a_killed_nats_server_comes_back_on_its_port_with_its_store(make_cluster):
    cluster = make_cluster(2)
    url = doc(cluster.dir)["nats_url"]
    nats = info(cluster.dir, "nats-server")
    assert str(urlsplit(url).port) in nats["argv"], "cluster.json must record the real port, not --port -1"
    agents = {name: info(cluster.dir, name)["pid"] for name in ("node-1", "node-2")}
    joined = [e for e in cluster.events() if e.get("kind") == "joined"]

    os.kill(nats["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    back = wait_until(lambda: (p := restarted(cluster.dir, "nats-server", nats["pid"], 0.05)) and accepts(url) and p,
                      timeout=10, interval=0.05)
    assert back, f"nats-server was not restarted on {url}:\n{supervisor_log(cluster.dir)}"
    assert time.monotonic() - killed_at < 5
    assert doc(cluster.dir)["nats_url"] == url and back["argv"] == nats["argv"] and back["restarts"] == 1

    # The agents reconnect to it (the same processes: they were never restarted), and its
    # JetStream store is the one from before (the events published before the kill are there).
    table = wait_until(lambda: (t := nodes(cluster.dir)) and all(t[n]["state"] == "alive" for n in agents) and t,
                       timeout=20, interval=0.3)
    assert table, f"nodes not alive again after the restart: {nodes(cluster.dir)}"
    assert {n: table[n]["pid"] for n in agents} == agents
    assert [e for e in cluster.events() if e.get("kind") == "joined"][:len(joined)] == joined
    log = supervisor_log(cluster.dir)
    assert f"nats-server (pid {nats['pid']}) died (killed by SIGKILL); restart 1" in log
    assert f"nats-server restarted: pid {back['pid']} (restart 1)" in log


def test_a_killed_coordinator_is_restarted_and_answers_again(make_cluster):
    cluster = make_cluster(1)
    coord = info(cluster.dir, "coordinator")
    assert f"--http-port {urlsplit(coord['metrics_url']).port}" in " ".join(coord["argv"])
    os.kill(coord["pid"], signal.SIGKILL)
    back = restarted(cluster.dir, "coordinator", coord["pid"], timeout=5)
    assert back, f"the coordinator was not restarted:\n{supervisor_log(cluster.dir)}"
    # It leads again once the dead one's leader lease ran out, and answers on the same port.
    assert wait_until(lambda: nodes(cluster.dir).get("node-1", {}).get("state") == "alive", timeout=20, interval=0.3)
    assert back["metrics_url"] == coord["metrics_url"] and live(back["metrics_url"])
    assert f"coordinator (pid {coord['pid']}) died (killed by SIGKILL)" in supervisor_log(cluster.dir)


def test_a_killed_agent_is_restarted_once_its_node_is_declared_dead(make_cluster):
    cluster = make_cluster(2)
    agent = info(cluster.dir, "node-2")
    os.kill(agent["pid"], signal.SIGKILL)
    back = restarted(cluster.dir, "node-2", agent["pid"], timeout=20)
    assert back, f"node-2's agent was not restarted:\n{supervisor_log(cluster.dir)}"
    table = wait_until(lambda: (t := nodes(cluster.dir)).get("node-2", {}).get("pid") == back["pid"]
                       and t["node-2"]["state"] == "alive" and t, timeout=20, interval=0.3)
    assert table, f"the restarted agent never joined: {nodes(cluster.dir)}"
    # Its node died first, as seen by everyone (so its jobs were failed over), then joined again.
    kinds = [e["kind"] for e in cluster.events() if e.get("node") == "node-2" and e.get("type") == "node_event.v1"]
    assert "dead" in kinds and kinds.index("dead") < len(kinds) - 1 - kinds[::-1].index("joined"), kinds
    assert back["metrics_url"] == agent["metrics_url"] and live(back["metrics_url"])
    assert "agent node-2: restart held until the coordinator has declared the node dead" in supervisor_log(cluster.dir)


def test_down_after_restarts_stops_everything_for_good(make_cluster):
    cluster = make_cluster(2)
    before = {p["name"]: p["pid"] for p in doc(cluster.dir)["processes"]}
    supervisor = (doc(cluster.dir).get("supervisor") or {}).get("pid")
    for name in ("nats-server", "coordinator", "node-1"):
        os.kill(before[name], signal.SIGKILL)
    for name in ("nats-server", "coordinator", "node-1"):
        assert restarted(cluster.dir, name, before[name], timeout=40), \
            f"{name} was not restarted:\n{supervisor_log(cluster.dir)}"
    assert wait_until(lambda: (t := nodes(cluster.dir)) and all(n["state"] == "alive" for n in t.values()) and
                      len(t) == 2, timeout=20, interval=0.3)
    after = {p["name"]: p["pid"] for p in doc(cluster.dir)["processes"]}

    revenant_cli("down", "--dir", str(cluster.dir), check=True)
    assert not (cluster.dir / "cluster.json").exists()
    time.sleep(3)  # a supervisor left behind would have restarted something by now
    assert supervisor is not None and not running(supervisor)
    assert not [pid for pid in (*before.values(), *after.values()) if running(pid)]
    assert leftovers(cluster.dir) == []
    assert "'revenant down' is stopping the cluster; supervisor exiting" in supervisor_log(cluster.dir)


def test_a_crash_loop_is_reported_not_spun(make_cluster):
    cluster = make_cluster(1)
    pid = info(cluster.dir, "coordinator")["pid"]
    kills = 0
    deadline = time.monotonic() + 50
    while kills < 6 and time.monotonic() < deadline:
        os.kill(pid, signal.SIGKILL)
        kills += 1
        if kills < 6:
            back = restarted(cluster.dir, "coordinator", pid, timeout=15)
            assert back, f"restart {kills} did not happen:\n{supervisor_log(cluster.dir)}"
            pid = back["pid"]
    assert kills == 6
    assert wait_until(lambda: info(cluster.dir, "coordinator")["given_up"], timeout=5), supervisor_log(cluster.dir)
    assert "crash loop, 6 failures within 60 s; not restarting it" in supervisor_log(cluster.dir)
    time.sleep(2)
    coord = info(cluster.dir, "coordinator")
    assert coord["pid"] == pid and coord["restarts"] == 5 and not running(pid)
    # The rest of the cluster is still supervised, and down still stops it.
    assert running(info(cluster.dir, "node-1")["pid"])
    revenant_cli("down", "--dir", str(cluster.dir), check=True)
    assert leftovers(cluster.dir) == []


def test_a_process_stopped_cleanly_is_not_restarted(make_cluster):
    cluster = make_cluster(2)
    agent = info(cluster.dir, "node-2")
    psutil.Process(agent["pid"]).terminate()  # a drain: it leaves and exits 0
    assert wait_until(lambda: "stopped (exit status 0)" in supervisor_log(cluster.dir), timeout=20)
    time.sleep(3)
    assert info(cluster.dir, "node-2")["pid"] == agent["pid"] and not running(agent["pid"])
    assert nodes(cluster.dir)["node-2"]["state"] == "left"


def _clean_up_after(proc: subprocess.Popen, directory) -> None:
    """Whatever a failed test left running: the foreground up, then its cluster."""
    proc.kill()
    proc.communicate()
    if (directory / "cluster.json").exists():
        pids = [p["pid"] for p in doc(directory)["processes"]]
        revenant_cli("down", "--dir", str(directory), timeout=60)
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def _foreground_up(directory, nodes_n: int = 1) -> subprocess.Popen:
    proc = subprocess.Popen([str(VENV_BIN / "revenant"), "up", "--nodes", str(nodes_n), "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "cluster up" in line:
            return proc
    proc.wait(timeout=10)
    raise AssertionError(f"foreground up never came up: {''.join(seen)}")


def test_foreground_up_restarts_what_dies_and_stops_it_on_ctrl_c(tmp_path):
    d = tmp_path / "fg"
    proc = _foreground_up(d)
    pids = []
    try:
        coord = info(d, "coordinator")
        pids = [p["pid"] for p in doc(d)["processes"]]
        os.kill(coord["pid"], signal.SIGKILL)
        back = restarted(d, "coordinator", coord["pid"], timeout=5)
        assert back, "the foreground up did not restart its coordinator"
        pids.append(back["pid"])
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
        assert f"coordinator (pid {coord['pid']}) died (killed by SIGKILL)" in err
        assert "stopping the cluster" in err
    finally:
        _clean_up_after(proc, d)
    assert not [pid for pid in pids if running(pid)]
    assert leftovers(d) == []


def test_down_stops_a_foreground_up_and_its_cluster(tmp_path):
    d = tmp_path / "fg"
    proc = _foreground_up(d)
    try:
        pids = [p["pid"] for p in doc(d)["processes"]]
        supervisor = doc(d).get("supervisor")
        revenant_cli("down", "--dir", str(d), check=True)
        _, err = proc.communicate(timeout=15)  # down ends the foreground up too
        assert proc.returncode == 0, err
        assert supervisor and supervisor["pid"] == proc.pid
    finally:
        _clean_up_after(proc, d)
    assert not [pid for pid in pids if running(pid)]
    assert leftovers(d) == []
