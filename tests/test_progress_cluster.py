"""A large job's checkpoint through a real cluster: criu's statistics in the reply (``--stats``,
``--json``), progress published while the dump and the restore run, a progress line on a
terminal and none when piped."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import subprocess
import sys

import nats
import pytest

from conftest import REPO, VENV_BIN, wait_until
from revenant.common.settings import security
from revenant.messages import Progress, decode_as, subjects

pytestmark = pytest.mark.criu

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
# A dump of this much takes about a second here: a few reports, one every half second.
JOB_MIB = 1000
MEMHOG = REPO / "tests" / "jobs" / "memhog.py"


async def listen(cluster) -> tuple[object, list[Progress]]:
    """Every job's progress, heard as admin (as `revenant checkpoint` on a terminal hears it)."""
    doc = json.loads((cluster.dir / "cluster.json").read_text())
    heard: list[Progress] = []

    async def on_report(msg) -> None:
        heard.append(decode_as(msg.data, Progress))

    nc = await nats.connect(doc["nats_url"], nkeys_seed=doc["creds"], inbox_prefix=security.inbox_prefix("admin"),
                            allow_reconnect=False, connect_timeout=10)
    await nc.subscribe(subjects.PROGRESS_ALL, cb=on_report)
    await nc.flush()
    return nc, heard


def on_a_terminal(cluster, *args: str) -> tuple[int, str, str]:
    """The CLI with its stderr on a pseudo-terminal: (status, stdout, what the terminal got)."""
    doc = json.loads((cluster.dir / "cluster.json").read_text())
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "REVENANT_NATS": doc["nats_url"],
           "REVENANT_CREDS": doc["creds"], "COLUMNS": "100"}
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([str(VENV_BIN / "revenant"), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=slave, env=env, cwd=cluster.dir, text=True)
        os.close(slave)
        terminal = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer has closed it
                break
            if not chunk:
                break
            terminal += chunk
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out, terminal.decode(errors="replace")
    finally:
        os.close(master)


async def test_a_large_checkpoint_reports_progress_and_criu_statistics(make_cluster):
    cluster = make_cluster(1, env={"REVENANT_AGENT_RESTORE_MODE": "eager"})  # a restore that reads every page
    out = cluster.cli("submit", "--node", "node-1", "--", sys.executable, str(MEMHOG), str(JOB_MIB))
    job = out.stdout.strip()
    log = cluster.storage / "jobs" / job / "output.log"
    assert wait_until(lambda: log.exists() and b"ready" in log.read_bytes(), timeout=60), "the job never got ready"
    nc, heard = await listen(cluster)
    try:
        # Piped (as scripts run it): the result and criu's table on stdout, no progress line anywhere.
        done = await asyncio.to_thread(cluster.cli, "checkpoint", "create", job, "--stats")
        assert "\r" not in done.stdout + done.stderr and "dumping" not in done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"job {job}: epoch 1 committed") and lines[1] == "criu statistics:"
        written = re.search(r"^  pages written +([0-9,]+)$", done.stdout, re.M)
        frozen = re.search(r"^  frozen time +([0-9.]+) ms$", done.stdout, re.M)
        assert written and frozen, done.stdout
        assert int(written[1].replace(",", "")) * PAGE >= 0.9 * JOB_MIB * MiB and float(frozen[1]) > 0

        # While it dumped, the agent said how far it was: the epoch's bytes against the job's RSS.
        dumps = [m for m in heard if m.job == job and m.op in ("dump", "commit")]
        assert dumps, f"no progress heard during a dump of {JOB_MIB} MiB"
        # How far a sample got depends on where the half-second ticks fall in a dump of about
        # a second: a timing, not asserted; that the bytes only grow is (below).
        assert all(m.node == "node-1" for m in dumps)
        assert all(0.9 * JOB_MIB * MiB <= m.total_bytes <= 4 * JOB_MIB * MiB for m in dumps), dumps
        assert [m.elapsed_s for m in dumps] == sorted(m.elapsed_s for m in dumps)
        assert [m.bytes for m in dumps if m.op == "dump"] == sorted(m.bytes for m in dumps if m.op == "dump")

        # --json: the job as always, and criu's statistics beside it, whatever --stats says.
        view = json.loads((await asyncio.to_thread(cluster.cli, "checkpoint", "create", job, "--json")).stdout)
        stats, epoch = view["stats"], view["epochs"][-1]
        assert stats["frozen_time_s"] == pytest.approx(epoch["freeze_s"], abs=1e-6)
        assert stats["memory_pages_written"] * PAGE <= epoch["bytes"]
        assert stats["memory_pages_written"] * PAGE >= 0.9 * JOB_MIB * MiB
        assert 0 < stats["memory_dump_time_s"] and 0 <= stats["freezing_time_s"] < stats["frozen_time_s"]
        assert stats["memory_pages_scanned"] >= stats["memory_pages_written"]

        # On a terminal: the line is drawn in place, then cleared before anything else is printed
        # (notes, such as a load warning, come after it on stderr).
        status, stdout, terminal = await asyncio.to_thread(on_a_terminal, cluster, "checkpoint", "vacate", job)
        assert status == 0, terminal
        assert f"job {job}: epoch 3 committed" in stdout and stdout.endswith("job vacated\n")
        assert f"\rdumping job {job}: " in terminal, repr(terminal)
        drawn, cleared, after = terminal.rpartition("\r\x1b[K")
        assert drawn and cleared and all(line.startswith("revenant: ") for line in after.splitlines()), repr(terminal)

        heard.clear()
        view = json.loads((await asyncio.to_thread(cluster.cli, "checkpoint", "restart", job, "--json")).stdout)
        assert view["state"] == "running"
        assert view["stats"]["restore_time_s"] > 0
        assert view["stats"]["pages_restored"] * PAGE >= 0.9 * JOB_MIB * MiB
        restores = [m for m in heard if m.job == job and m.op == "restore"]
        assert restores, f"no progress heard during a restore of {JOB_MIB} MiB"
        assert [m.bytes for m in restores] == sorted(m.bytes for m in restores), restores
        assert [m.elapsed_s for m in restores] == sorted(m.elapsed_s for m in restores), restores
        assert all(m.total_bytes == view["epochs"][-1]["bytes"] for m in restores)
        assert max(m.bytes for m in restores) <= 2 * view["epochs"][-1]["bytes"]
    finally:
        await nc.close()
