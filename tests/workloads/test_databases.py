"""Databases whose files are closed between writes, on a 2-node `revenant up` with real criu,
checked with their own clients (docs/cli.md, "A job's own files"):

- PostgreSQL as the job, driven by psql from outside: after every restore (a vacate and restart
  on the other node, a failover, ``checkpoint restart --epoch N``) the table holds exactly the
  rows committed before that epoch, a count by index and one by sequential scan agree, and the
  server takes writes again.  Its relation files are written by its checkpointer and closed: only
  the working directory's snapshot brings them back as the epoch had them.

PostgreSQL refuses to run as root, and criu cannot dump another user's job on hosts whose root
lacks CAP_SYS_RESOURCE (these test machines: docs/security.md), so the server runs as root
through tests/jobs/notroot.c, a preload that answers getuid/geteuid with the data directory's
owner.  Once non-root jobs are checkpointable here, this runs as the `postgres` user instead.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_until
from test_network_jobs import free_port, kill_node, running_on, show, submit

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads]

NOBODY = 65534


def pg_bin() -> Path:
    """The newest PostgreSQL server's programs (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        pytest.fail("PostgreSQL is not installed (Debian package postgresql; make setup installs it)")
    return Path(found[-1]).parent


class Postgres:
    """A data directory made by initdb in ``workdir``, and psql to the server the job runs."""

    def __init__(self, tmp: Path) -> None:
        self.bin = pg_bin()
        self.workdir = tmp / "pg"
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, mode=0o700)
        os.chown(self.data, NOBODY, NOBODY)  # the server checks its owner against geteuid()
        self.preload = tmp / "notroot.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(self.preload), str(REPO / "tests/jobs/notroot.c")],
                       check=True, timeout=60)
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], env={**os.environ, "LD_PRELOAD": str(self.preload)}, check=True,
                       capture_output=True, timeout=120)
        self.port = free_port()

    def argv(self) -> list[str]:
        return ["env", f"LD_PRELOAD={self.preload}", f"NOTROOT_UID={NOBODY}", str(self.bin / "postgres"),
                "-D", str(self.data), "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                "-c", "unix_socket_directories=", "-c", "fsync=off"]

    def sql(self, query: str, timeout: float = 60) -> str:
        """``query`` through psql, once the server accepts connections (it may be restoring)."""
        end = time.monotonic() + timeout
        while True:
            r = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "postgres",
                                "-Atq", "-v", "ON_ERROR_STOP=1", "-c", query],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "PGCONNECT_TIMEOUT": "5"})
            if r.returncode == 0:
                return r.stdout.strip()
            refused = "could not connect" in r.stderr or "Connection refused" in r.stderr \
                or "the database system is" in r.stderr
            if not refused or time.monotonic() > end:
                raise AssertionError(f"psql {query!r}: {r.stderr.strip()}")
            time.sleep(0.2)

    def insert(self, first: int, last: int) -> None:
        self.sql(f"insert into t select i, md5(i::text) from generate_series({first}, {last}) i")

    def rows(self) -> list[int]:
        """Every id in t, read by index and again by sequential scan: the two must agree."""
        by_index = self.sql("set enable_seqscan = off; set enable_bitmapscan = off; "
                            "select string_agg(id::text, ',' order by id) from t where id > 0")
        by_scan = self.sql("set enable_indexscan = off; set enable_bitmapscan = off; "
                           "set enable_indexonlyscan = off; select string_agg(id::text, ',' order by id) from t")
        assert by_index == by_scan, "the index and the table disagree"
        return [int(i) for i in by_scan.split(",")] if by_scan else []


def check_restored(pg: Postgres, want: list[int], probe: int) -> None:
    """Exactly ``want`` (nothing lost, nothing resurrected), and the server writes again."""
    got = pg.rows()
    assert got == want, (f"{len(got)} rows, want {len(want)}: lost {sorted(set(want) - set(got))[:10]}, "
                         f"resurrected {sorted(set(got) - set(want))[:10]}")
    pg.insert(probe, probe)
    pg.sql("checkpoint")
    assert pg.rows() == want + [probe]
    pg.sql(f"delete from t where id = {probe}")
    pg.sql("checkpoint")


def test_postgres_holds_exactly_each_epochs_rows_after_a_move_a_failover_and_a_restart_of_an_older_epoch(
        make_cluster, tmp_path):
    pg = Postgres(tmp_path)
    cluster = make_cluster(2)
    job = submit(cluster, *pg.argv(), extra=("--workdir", str(pg.workdir), "--max-epochs", "5"))
    running_on(cluster, job, "node-1")
    pg.sql("create table t (id int primary key, v text)")
    pg.insert(1, 1000)
    pg.sql("checkpoint")
    first = list(range(1, 1001))
    cluster.cli("checkpoint", "create", job)  # epoch 1
    cluster.cli("checkpoint", "vacate", job)  # epoch 2
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    running_on(cluster, job, "node-2")
    check_restored(pg, first, 9001)

    pg.insert(2001, 3000)
    pg.sql("checkpoint")  # the relation's file written and closed: after the epoch it is not open
    at_epoch = first + list(range(2001, 3001))
    cluster.cli("checkpoint", "create", job)  # epoch 3
    pg.insert(3001, 3001)
    pg.sql("checkpoint")  # written after the epoch: the epoch's file must come back
    kill_node(cluster, "node-2", show(cluster, job)["pid"])
    running_on(cluster, job, "node-1", timeout=90)
    check_restored(pg, at_epoch, 9002)
    restored = [e for e in cluster.events() if e.get("kind") == "restored"][-1]
    assert not any("revenant-after-epoch" in n and "base/" in n for n in restored.get("notes", [])), restored

    cluster.cli("checkpoint", "vacate", job)
    cluster.cli("checkpoint", "restart", job, "--epoch", "1", "--node", "node-1")  # node-2 is still dead
    running_on(cluster, job, "node-1")
    check_restored(pg, first, 9003)
    # Nothing that existed at an epoch was ever moved aside: only what appeared after one.
    for aside in pg.workdir.glob("revenant-after-epoch-*"):
        for path in aside.rglob("*"):
            assert not (path.is_file() and path.relative_to(aside).parts[:2] == ("data", "base")), path
