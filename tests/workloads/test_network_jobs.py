"""Jobs that use the network, on a 2-node `revenant up` with real criu, each checked through its
own client (docs/cli.md, "Jobs that use the network"):

- each through `checkpoint create`, a vacate and restart on the other node, and a failover
  (the node's agent and the job SIGKILLed: restored on the other from its newest epoch);
- the seed's UDP counter: the count goes on from the epoch;
- an HTTP/1.1 server: a keep-alive connection held across `checkpoint create` goes on unharmed;
  after a move it is closed (the client sees it at its next use) and a new one finds the
  server's state as the epoch had it;
- a TCP client job: its connection to a server outside the cluster stays across a create, with
  not a byte lost or duplicated; after a move it reconnects and goes on from the epoch;
- redis over TCP: keys written before, read after, through a connection held across a create.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time

import pytest

from conftest import REPO, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads]

JOBS = REPO / "tests" / "jobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(cluster, *argv: str, node: str = "node-1", extra: tuple[str, ...] = ()) -> str:
    return cluster.cli("submit", "--node", node, *extra, "--", *argv).stdout.strip()


def show(cluster, job: str) -> dict:
    out = cluster.cli("show", "job", job, "--json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def running_on(cluster, job: str, node: str, timeout: float = 60) -> dict:
    info = wait_until(lambda: (j := show(cluster, job)) and j["state"] == "running" and j["node"] == node and j,
                      timeout=timeout, interval=0.2)
    assert info, f"job {job} is not running on {node}: {show(cluster, job)}"
    return info


def output(cluster, job: str) -> str:
    return (cluster.storage / "jobs" / job / "output.log").read_text()


def udp_bound(port: int) -> bool:
    """Whether a UDP socket is bound to ``port`` here (/proc/net/udp: a restored job's is, once criu
    has made it again)."""
    with open("/proc/net/udp") as f:
        return any(line.split()[1].endswith(f":{port:04X}") for line in f.read().splitlines()[1:])


def udp(port: int, timeout: float = 30) -> int:
    """One packet to the counter, its answer.  Sent once the port is bound, and again only after a
    long silence: a packet sent again too soon to a counter slow to answer (a restored job still
    fetching its pages) would count twice."""
    assert wait_until(lambda: udp_bound(port), timeout=timeout), f"nothing listens on udp port {port}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        end = time.monotonic() + timeout
        while True:
            s.sendto(b"hello", ("127.0.0.1", port))
            try:
                return int(s.recv(16))
            except socket.timeout:
                if time.monotonic() > end:
                    raise


def kill_node(cluster, node: str, job_pid: int) -> None:
    assert job_pid > 0, "the job is not running"  # os.kill(0) would hit the test's own group
    os.kill(cluster.pids()[node], signal.SIGKILL)
    os.kill(job_pid, signal.SIGKILL)


def test_the_seeds_udp_counter_counts_on_from_each_epoch(make_cluster):
    cluster = make_cluster(2)
    port = free_port()
    job = submit(cluster, sys.executable, str(JOBS / "udp_counter.py"), str(port))
    running_on(cluster, job, "node-1")
    assert [udp(port), udp(port)] == [101, 102]
    cluster.cli("checkpoint", "create", job)
    assert udp(port) == 103  # the socket went on working through the dump
    cluster.cli("checkpoint", "vacate", job)  # epoch 2, at 103
    assert cluster.job(job)["epochs"][-1]["listening"] == [f"udp 127.0.0.1:{port}"]
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    running_on(cluster, job, "node-2")
    assert udp(port) == 104
    cluster.cli("checkpoint", "create", job)  # epoch 3, at 104
    first = show(cluster, job)
    kill_node(cluster, "node-2", first["pid"])
    running_on(cluster, job, "node-1")
    assert udp(port) == 105  # from epoch 3
    # Its output as an uninterrupted run's: each value once (printed after its answer went).
    want = ["101", "102", "103", "104", "105"]
    assert wait_until(lambda: output(cluster, job).split() == want, timeout=10), output(cluster, job)


def get(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/")
    return int(conn.getresponse().read())


def test_an_http_server_keeps_a_client_connection_across_a_create_and_closes_it_on_a_move(make_cluster):
    cluster = make_cluster(2)
    port = free_port()
    job = submit(cluster, sys.executable, str(JOBS / "http_counter.py"), str(port))
    running_on(cluster, job, "node-1")
    assert wait_until(lambda: "listening" in output(cluster, job), timeout=30)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert [get(conn), get(conn)] == [1, 2]
    local = conn.sock.getsockname()
    cluster.cli("checkpoint", "create", job)
    assert get(conn) == 3 and conn.sock.getsockname() == local  # the same connection, unharmed
    cluster.cli("checkpoint", "vacate", job)  # at 3
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    running_on(cluster, job, "node-2")
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected, BrokenPipeError)):
        get(conn)  # closed by the move: seen at its next use
    restored = [e for e in cluster.events() if e.get("kind") == "restored"][-1]
    assert restored["listening"] == [f"tcp 127.0.0.1:{port}"]
    # Where its clients find it: the node's address (here, on a loopback bus, 127.0.0.1).
    assert restored["address"] == "127.0.0.1" and show(cluster, job)["address"] == "127.0.0.1"
    assert restored["closed"] == [f"127.0.0.1:{port} -> 127.0.0.1:{local[1]}"]  # named, with its peer
    conn.close()
    again = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        assert get(again) == 4  # the server's state as the epoch had it
        cluster.cli("checkpoint", "create", job)  # at 4, with this connection open
        assert get(again) == 5
        kill_node(cluster, "node-2", show(cluster, job)["pid"])
        running_on(cluster, job, "node-1")
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected, BrokenPipeError)):
            get(again)  # the failover closed it too
    finally:
        again.close()
    third = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        assert get(third) == 5  # from the epoch at 4: the GET the epoch never saw is counted again
    finally:
        third.close()
    restored = [e for e in cluster.events() if e.get("kind") == "restored"]
    assert [e["node"] for e in restored] == ["node-2", "node-1"]  # the move, then the failover


class LineServer:
    """A TCP server outside the cluster: what each connection sent, line by line."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[list[int]] = []
        self.peer_ports: list[int] = []  # each connection's client port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            lines: list[int] = []
            self.peer_ports.append(peer[1])
            self.connections.append(lines)
            threading.Thread(target=self._read, args=(conn, lines), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, lines: list[int]) -> None:
        with conn, conn.makefile("rb") as f:
            try:
                for raw in f:
                    lines.append(int(raw))
            except ConnectionResetError:
                pass  # a failover's end of a connection: the killed job's socket may close with a reset

    def close(self) -> None:
        self.sock.close()


def test_a_tcp_client_job_keeps_its_connection_across_a_create_and_reconnects_after_a_move(make_cluster):
    server = LineServer()
    try:
        cluster = make_cluster(2)
        job = submit(cluster, sys.executable, str(JOBS / "tcp_sender.py"), str(server.port))
        running_on(cluster, job, "node-1")
        assert wait_until(lambda: server.connections and len(server.connections[0]) > 20, timeout=30)
        cluster.cli("checkpoint", "create", job)
        seen = len(server.connections[0])
        assert wait_until(lambda: len(server.connections[0]) > seen + 20, timeout=30)
        # Through the dump, on the one connection: not a line lost or repeated.
        first = server.connections[0]
        assert len(server.connections) == 1 and first == list(range(1, len(first) + 1))
        cluster.cli("checkpoint", "vacate", job)
        at_epoch = len(server.connections[0])
        cluster.cli("checkpoint", "restart", job, "--node", "node-2")
        running_on(cluster, job, "node-2")
        assert wait_until(lambda: len(server.connections) == 2 and len(server.connections[1]) > 10, timeout=30)
        # The vacate stopped it at its epoch: the new connection goes on exactly from there.
        assert server.connections[1][:5] == list(range(at_epoch + 1, at_epoch + 6))
        assert "reconnecting after" in output(cluster, job)
        restored = [e for e in cluster.events() if e.get("kind") == "restored"][-1]
        assert len(restored["closed"]) == 1 and restored["closed"][0].endswith(f" -> 127.0.0.1:{server.port}")
        # A failover, from a create: the job goes on from that epoch on a new connection (what it
        # sent after the epoch, its peer has seen once already: a restore replays from the epoch).
        cluster.cli("checkpoint", "create", job)
        epoch_at = len(server.connections[1])
        kill_node(cluster, "node-2", show(cluster, job)["pid"])
        running_on(cluster, job, "node-1")
        assert wait_until(lambda: len(server.connections) == 3 and len(server.connections[2]) > 10, timeout=30)
        resumed = server.connections[2][0]
        assert at_epoch < resumed <= at_epoch + epoch_at + 1, (at_epoch, epoch_at, resumed)
        assert server.connections[2][:5] == list(range(resumed, resumed + 5))
    finally:
        server.close()


def redis(sock: socket.socket, *words: str) -> bytes:
    sock.sendall(b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words))
    return sock.recv(4096)


def test_redis_keeps_its_keys_and_a_client_connection_across_a_create_and_its_keys_across_a_move(make_cluster):
    cluster = make_cluster(2)
    port = free_port()
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: make setup installs it (Debian package redis-server)"
    job = submit(cluster, server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no")
    running_on(cluster, job, "node-1")
    client = None
    deadline = time.monotonic() + 30
    while client is None:
        try:
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            assert time.monotonic() < deadline, output(cluster, job)
            time.sleep(0.1)
    assert redis(client, "SET", "before", "1") == b"+OK\r\n"
    cluster.cli("checkpoint", "create", job)
    assert redis(client, "GET", "before") == b"$1\r\n1\r\n"  # the same connection
    assert redis(client, "SET", "after", "2") == b"+OK\r\n"
    cluster.cli("checkpoint", "vacate", job)
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    running_on(cluster, job, "node-2")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as again:
        assert redis(again, "GET", "before") == b"$1\r\n1\r\n"
        assert redis(again, "GET", "after") == b"$1\r\n2\r\n"
        assert redis(again, "SET", "moved", "3") == b"+OK\r\n"
    client.close()
    cluster.cli("checkpoint", "create", job)
    kill_node(cluster, "node-2", show(cluster, job)["pid"])
    running_on(cluster, job, "node-1")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
        assert redis(third, "GET", "moved") == b"$1\r\n3\r\n"  # every key, as the last epoch had them


def test_a_job_connected_to_an_outside_unix_stream_socket_is_refused_before_it_is_frozen(make_cluster, tmp_path):
    """criu carries no unix stream connection to the outside: the dump is refused before criu
    freezes the job, in one line naming the peer, and the job runs on."""
    path = tmp_path / "daemon.sock"
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(path))
    daemon.listen(1)
    try:
        cluster = make_cluster(1)
        script = ("import socket,sys,time\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
                  "i=0\nwhile True:\n    print(i, flush=True); i+=1; time.sleep(0.05)\n")
        job = submit(cluster, sys.executable, "-c", script, str(path))
        conn, _ = daemon.accept()
        assert wait_until(lambda: len(output(cluster, job).split()) > 5, timeout=30)
        # Seen before it matters: revenant check names it as blocking, and exits 1.
        checked = cluster.cli("check", job, "--json", check=False)
        assert checked.returncode == 1, checked.stderr
        found = json.loads(checked.stdout)
        assert not found["checkpointable"] and found["resources"][0]["verdict"] == "blocking", found
        assert str(path) in found["resources"][0]["what"], found
        out = cluster.cli("checkpoint", "create", job, check=False)
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert (f"checkpoint of {job} refused: the job holds a unix stream connection to the socket {path} "
                "outside the job") in out.stderr, out.stderr
        frozen = [e for e in cluster.events() if e.get("type") == "epoch_event.v1" and e["kind"] == "failed"]
        assert frozen and str(path) in frozen[-1]["error"]
        # Told once as its own event, and shown by show job until a checkpoint commits.
        told = [e for e in cluster.events() if e.get("kind") == "not_checkpointable"]
        assert len(told) == 1 and str(path) in told[0]["reason"], told
        assert str(path) in show(cluster, job)["blocking"]
        seen = len(output(cluster, job).split())
        assert wait_until(lambda: len(output(cluster, job).split()) > seen + 5, timeout=30)  # runs on
        conn.close()
    finally:
        daemon.close()


def test_a_server_holding_a_connection_it_has_not_accepted_yet_is_checkpointed(make_cluster):
    """A busy server's backlog (criu's --skip-in-flight): a checkpoint leaves the connection it has
    not accepted yet out of the epoch instead of failing; a move closes it, and the server listens
    again for the next."""
    cluster = make_cluster(2)
    port = free_port()
    script = ("import socket,sys,time\nl=socket.create_server(('127.0.0.1', int(sys.argv[1])))\n"
              "print('listening', flush=True)\nwhile True:\n    time.sleep(0.05)\n")
    job = submit(cluster, sys.executable, "-c", script, str(port))
    assert wait_until(lambda: "listening" in output(cluster, job), timeout=30)
    pending = socket.create_connection(("127.0.0.1", port), timeout=10)  # in its backlog, never accepted
    try:
        cluster.cli("checkpoint", "create", job)
        cluster.cli("checkpoint", "vacate", job)
        cluster.cli("checkpoint", "restart", job, "--node", "node-2")
        running_on(cluster, job, "node-2")
        try:
            assert pending.recv(1) == b""  # closed by the move
        except ConnectionResetError:
            pass  # closed by the move (reset rather than ended)
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # listening again
    finally:
        pending.close()
    assert [e["epoch"] for e in cluster.events() if e.get("kind") == "restored"] == [2]


def test_revenant_check_lists_what_a_move_carries_and_what_it_closes(make_cluster):
    """A server with a client connected: its listening socket is carried, its connection is kept
    by a create and closed by a move; nothing blocks."""
    cluster = make_cluster(1)
    port = free_port()
    script = ("import socket,sys,time\nl=socket.create_server(('127.0.0.1', int(sys.argv[1])))\n"
              "print('listening', flush=True)\nc, _ = l.accept()\nwhile True:\n    time.sleep(0.05)\n")
    job = submit(cluster, sys.executable, "-c", script, str(port))
    assert wait_until(lambda: "listening" in output(cluster, job), timeout=30)
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        local = client.getsockname()[1]
        want = {("socket", f"listening tcp 127.0.0.1:{port}", "carried"),
                ("connection", f"127.0.0.1:{port} -> 127.0.0.1:{local}", "closed_on_move")}
        found: dict = {}

        def checked() -> bool:
            out = cluster.cli("check", job, "--json", check=False)
            found.update(json.loads(out.stdout) if out.stdout else {})
            return out.returncode == 0 and want <= {(r["kind"], r["what"], r["verdict"]) for r in found["resources"]}
        assert wait_until(checked, timeout=30), found  # once the job has accepted it
        assert found["checkpointable"] and found["node"] == "node-1" and found["address"] == "127.0.0.1"
        text = cluster.cli("check", job).stdout
        assert text.startswith(f"job {job} on node-1 (127.0.0.1): checkpointable"), text
        assert "closed on move" in text and f"listening tcp 127.0.0.1:{port}" in text, text
    finally:
        client.close()
    missing = cluster.cli("check", "999", check=False)
    assert missing.returncode != 0 and "999" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_a_restart_on_the_node_that_vacated_it_brings_its_connection_back_intact(make_cluster):
    """--connections keep (the default): the vacate's node holds the connection, silent, and a
    restart there brings it back as it was: the server sees one connection, not a line lost or
    repeated, and the job never reconnects.  --connections close: the same restart closes it."""
    server = LineServer()
    try:
        cluster = make_cluster(2)
        job = submit(cluster, sys.executable, str(JOBS / "tcp_sender.py"), str(server.port))
        closing = submit(cluster, sys.executable, str(JOBS / "tcp_sender.py"), str(server.port),
                         extra=("--connections", "close"))
        assert show(cluster, closing)["policy"]["connections"] == "close"
        running_on(cluster, job, "node-1")
        running_on(cluster, closing, "node-1")
        assert wait_until(lambda: len(server.connections) == 2 and all(len(c) > 20 for c in server.connections),
                          timeout=30)
        cluster.cli("checkpoint", "vacate", job)
        cluster.cli("checkpoint", "restart", job, "--node", "node-1")
        running_on(cluster, job, "node-1")
        restored = [e for e in cluster.events() if e.get("kind") == "restored" and e.get("job") == job][-1]
        assert len(restored["kept"]) == 1 and restored["closed"] == []
        assert restored["kept"][0].endswith(f" -> 127.0.0.1:{server.port}")
        port = int(restored["kept"][0].split(" -> ")[0].rsplit(":", 1)[1])
        assert "reconnecting" not in output(cluster, job)
        cluster.cli("checkpoint", "vacate", closing)
        cluster.cli("checkpoint", "restart", closing, "--node", "node-1")
        running_on(cluster, closing, "node-1")
        assert wait_until(lambda: len(server.connections) == 3 and len(server.connections[2]) > 10, timeout=30)
        assert "reconnecting after" in output(cluster, closing)
        restored = [e for e in cluster.events() if e.get("kind") == "restored" and e.get("job") == closing][-1]
        assert restored["kept"] == [] and len(restored["closed"]) == 1
        # The kept one: still its first connection, every line once, in order, going on.
        lines = server.connections[server.peer_ports.index(port)]
        seen = len(lines)
        assert wait_until(lambda: len(lines) > seen + 20, timeout=30)
        assert lines == list(range(1, len(lines) + 1))
    finally:
        server.close()
