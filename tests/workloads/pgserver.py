"""A PostgreSQL server for a job: its data directory made by initdb, and psql to it.

Run as its own user (``postgres``), its socket in its data directory; or as root through
tests/jobs/notroot.c, a preload that answers getuid/geteuid with the data directory's owner
(PostgreSQL refuses to run as root), on TCP only.  Used by tests/workloads/test_databases.py
and bench/pg_failover.py.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin() -> Path:
    """The newest PostgreSQL server's programs (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (Debian package postgresql; make setup installs it)")
    return Path(found[-1]).parent


class Postgres:
    """A data directory made by initdb in ``workdir``, and psql to the server the job runs.

    ``user`` empty: the server runs as root through the preload, on TCP only.  ``user`` named
    (``postgres``): it runs as that user, its socket in its data directory (``tmp`` must be a
    directory the user can search), and psql reaches it there."""

    def __init__(self, tmp: Path, user: str = "") -> None:
        self.bin = pg_bin()
        self.user = user
        self.workdir = tmp / "pg"
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, mode=0o700)
        self.port = free_port()
        if user:
            for d in (self.workdir, self.data):
                shutil.chown(d, user, user)
            subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", str(self.bin / "initdb"),
                            "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                           check=True, capture_output=True, timeout=120, cwd=self.workdir)
            self.host = str(self.data)
            return
        os.chown(self.data, NOBODY, NOBODY)  # the server checks its owner against geteuid()
        self.preload = tmp / "notroot.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(self.preload), str(REPO / "tests/jobs/notroot.c")],
                       check=True, timeout=60)
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], env={**os.environ, "LD_PRELOAD": str(self.preload)}, check=True,
                       capture_output=True, timeout=120)
        self.host = "127.0.0.1"

    def argv(self) -> list[str]:
        if self.user:  # listening on its socket in its data directory only
            return [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-c", "listen_addresses=",
                    "-c", f"unix_socket_directories={self.data}", "-c", "fsync=off"]
        return ["env", f"LD_PRELOAD={self.preload}", f"NOTROOT_UID={NOBODY}", str(self.bin / "postgres"),
                "-D", str(self.data), "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                "-c", "unix_socket_directories=", "-c", "fsync=off"]

    def sql(self, query: str, timeout: float = 60) -> str:
        """``query`` through psql, once the server accepts connections (it may be restoring)."""
        end = time.monotonic() + timeout
        while True:
            r = subprocess.run(["psql", "-h", self.host, "-p", str(self.port), "-U", "postgres", "-d", "postgres",
                                "-Atq", "-v", "ON_ERROR_STOP=1", "-c", query],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "PGCONNECT_TIMEOUT": "5"})
            if r.returncode == 0:
                return r.stdout.strip()
            refused = "could not connect" in r.stderr or "Connection refused" in r.stderr \
                or "the database system is" in r.stderr or "No such file or directory" in r.stderr
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
