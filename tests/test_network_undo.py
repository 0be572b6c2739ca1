"""A vacate that fails after criu has dumped the job (here: its dump is spoiled before the commit)
resumes the job, and its established connections go on.  A vacate whose node holds them
(agent/network/netlock.py) has criu leave them in repair mode and locked: the undo takes them out of
repair mode before the job resumes (agent/pipeline/blockers.py repair_off), and the hold lets go of
criu's lock.  Without the first, every recv and send of the job's would fail with EPERM; without
the second, not a packet of them would pass."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from helpers import until

from revenant.agent.network import netlock
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

ECHO_CLIENT = """import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
f = s.makefile("rb")
n = 0
while True:
    n += 1
    s.sendall(b"%d\\n" % n)
    assert int(f.readline()) == n
    time.sleep(0.02)
"""


async def test_a_vacate_spoiled_after_the_dump_leaves_the_jobs_connection_working(supervisors, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    lines: list[int] = []

    def serve() -> None:  # echoes each line back: the job reads it before it sends the next
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            for raw in f:
                lines.append(int(raw))
                conn.sendall(raw)
    threading.Thread(target=serve, daemon=True).start()
    try:
        sup = supervisors("n1", allow_root_jobs=True)
        hold = netlock.NetLockStep(netlock.locate() or "nft", "n1", tmp_path)
        sup.engine.steps.append(hold)
        spec = JobSpec(id="1", argv=[sys.executable, "-c", ECHO_CLIENT, str(server.getsockname()[1])],
                       workdir=str(tmp_path))
        await sup.start(spec, 1)
        await until(lambda: len(lines) > 10)
        with pytest.raises(RevenantError, match="spoiled on purpose"):
            await sup.engine.checkpoint("1", 1, sup.jobs["1"].pid, stop=True, workdir=str(tmp_path),
                                        spoiled=lambda: "spoiled on purpose")
        assert hold.holds == {} and (tmp_path / "netlock-held-n1").read_text() == ""
        at = len(lines)
        await until(lambda: len(lines) > at + 20)  # the same connection carries on
        assert lines == list(range(1, len(lines) + 1))
        out = JobFiles(sup.storage, "1").output.read_text()
        assert "Error" not in out, out
    finally:
        server.close()


async def test_an_eviction_holds_no_connection_its_peer_sees_it_close(supervisors, tmp_path):
    """A job the node stops to be restored elsewhere (a drain, a proactive move) gets its
    connections back closed there: the node holds none, and the peer sees the connection end
    when the job is killed rather than after connection_hold_s of silence."""
    server = socket.create_server(("127.0.0.1", 0))
    ended = threading.Event()
    lines: list[int] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            for raw in f:
                lines.append(int(raw))
                conn.sendall(raw)
        ended.set()
    threading.Thread(target=serve, daemon=True).start()
    try:
        sup = supervisors("n1", allow_root_jobs=True)
        hold = netlock.NetLockStep(netlock.locate() or "nft", "n1", tmp_path, hold_s=300)
        sup.engine.steps.append(hold)
        spec = JobSpec(id="1", argv=[sys.executable, "-c", ECHO_CLIENT, str(server.getsockname()[1])],
                       workdir=str(tmp_path))
        await sup.start(spec, 1)
        await until(lambda: len(lines) > 10)
        await sup.checkpoint("1", 1, stop=True, evict_reason="node n1 is draining")
        assert hold.holds == {}
        await until(ended.is_set, timeout=10)  # not 300 s of silence
    finally:
        server.close()
