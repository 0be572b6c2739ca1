"""Databases whose files are closed between writes, on a 2-node `revenant up` with real criu,
checked with their own clients (docs/cli.md, "A job's own files"):

- PostgreSQL as the job, driven by psql from outside: after every restore (a vacate and restart
  on the other node, a failover, ``checkpoint restart --epoch N``) the table holds exactly the
  rows committed before that epoch, a count by index and one by sequential scan agree, and the
  server takes writes again.  Its relation files are written by its checkpointer and closed: only
  the working directory's snapshot brings them back as the epoch had them.

PostgreSQL runs as root here through tests/jobs/notroot.c (a preload that answers getuid/geteuid
with the data directory's owner), on TCP; and as its own user, `postgres`, with its socket in its
data directory, which the restore makes again as that user (agent/files/asuser/sockets.py), psql
reaching it there.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import psutil
import pytest

from pgserver import Postgres
from revenant.agent.storage.epochs import USER_SOCKETS
from test_network_jobs import kill_node, running_on, show, submit

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads]


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


def moved(cluster, pg: Postgres, job: str) -> list[int]:
    """1000 rows written and checkpointed by the server; epoch 1 (create), epoch 2 (vacate), the
    job restarted on node-2 with exactly those rows; the rows."""
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
    return first


def failed_over(cluster, pg: Postgres, job: str, first: list[int]) -> None:
    """More rows and epoch 3, a row after it, node-2 killed: the job on node-1 with epoch 3's rows."""
    pg.insert(2001, 3000)
    pg.sql("checkpoint")  # the relation's file written and closed: after the epoch it is not open
    at_epoch = first + list(range(2001, 3001))
    cluster.cli("checkpoint", "create", job)  # epoch 3
    pg.insert(3001, 3001)
    pg.sql("checkpoint")  # written after the epoch: the epoch's file must come back
    kill_node(cluster, "node-2", show(cluster, job)["pid"])
    running_on(cluster, job, "node-1", timeout=90)
    check_restored(pg, at_epoch, 9002)


def test_postgres_holds_exactly_each_epochs_rows_after_a_move_a_failover_and_a_restart_of_an_older_epoch(
        make_cluster, tmp_path):
    pg = Postgres(tmp_path)
    cluster = make_cluster(2)
    job = submit(cluster, *pg.argv(), extra=("--workdir", str(pg.workdir), "--max-epochs", "5"))
    first = moved(cluster, pg, job)
    failed_over(cluster, pg, job, first)
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


def test_postgres_as_its_own_user_with_its_socket_in_its_data_directory_survives_a_move_and_a_failover(
        make_cluster):
    """Issue 44's last refusal: the server as ``postgres``, listening on ``.s.PGSQL.<port>`` in its
    data directory (the user's), through a create, a move and a failover, checked with psql over
    that socket: the socket made again by the user each time, never by root."""
    postgres = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="revenant-pg-", dir="/var/tmp"))  # the user searches its way
    base.chmod(0o755)
    try:
        pg = Postgres(base, user="postgres")
        sock = pg.data / f".s.PGSQL.{pg.port}"
        cluster = make_cluster(2)
        job = submit(cluster, *pg.argv(), extra=("--user", "postgres", "--workdir", str(pg.workdir),
                                                 "--max-epochs", "5"))
        first = moved(cluster, pg, job)  # its epoch 1 was refused before, for the socket
        server = psutil.Process(show(cluster, job)["pid"]).children(recursive=True)
        assert server and all(p.uids().effective == postgres.pw_uid for p in server), server
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == postgres.pw_uid, st

        failed_over(cluster, pg, job, first)
        assert os.lstat(sock).st_uid == postgres.pw_uid
        kinds = [(e.get("kind"), e.get("node")) for e in cluster.events() if e.get("job") == job]
        assert ("restored", "node-2") in kinds and ("restored", "node-1") in kinds, kinds
        made = sorted(p.parent.name for p in cluster.dir.rglob(f"jobs/{job}/epochs/*/{USER_SOCKETS}"))
        assert made == ["1", "2", "3"], made  # each epoch's socket made by the user at its restore
    finally:
        shutil.rmtree(base, ignore_errors=True)
