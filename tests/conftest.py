"""Shared fixtures: a real nats-server on a free port, started per test (authenticated as
``revenant up``'s: tests/helpers.py AuthBus)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import AuthBus

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# The suite submits as root, and its jobs run as root: the agents `revenant up` starts (and
# restarts) inherit this.  tests/test_job_user.py runs jobs as an unprivileged user, and the refusal.
os.environ.setdefault("REVENANT_AGENT_ALLOW_ROOT_JOBS", "true")


@pytest.fixture
def nats_server(tmp_path):
    """A nats-server that admits only the identities `revenant up` would, each with its own
    permissions (an AuthBus): every in-process agent, coordinator and client connects with its
    identity's credential (tests/helpers.py agent_config, coordinator_config, connect_as, cli_env)."""
    server = AuthBus(tmp_path / "nats", log_file=tmp_path / "nats.log")
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


def revenant_cli(*args: str, timeout: float = 60, check: bool = False, env: dict | None = None,
                 cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run the installed CLI as a subprocess, the way users and scripts do (from ``cwd``: a job
    submitted without --workdir works there)."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run([str(VENV_BIN / "revenant"), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=subprocess.DEVNULL, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"revenant {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


COUNTER = REPO / "tests" / "jobs" / "counter.py"


def counter_reference(tmp_path, count: int, interval: float = 0.0) -> bytes:
    """The output of an uninterrupted run of the counter job."""
    out = subprocess.run([sys.executable, str(COUNTER), str(count), str(interval)], capture_output=True, check=True,
                         timeout=120)
    return out.stdout


class Cluster:
    """A `revenant up --detach` cluster, driven through the CLI like a user would."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def env(self) -> dict[str, str]:
        """Where a CLI finds the cluster: $REVENANT_NATS (so "-- CMD ARGS" can stay last), and its
        admin credential, $REVENANT_CREDS ("" for an --insecure cluster: none)."""
        import json

        doc = json.loads((self.dir / "cluster.json").read_text())
        return {"REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        # From the cluster's own directory: a job submitted without --workdir works there, never in
        # the repository (a restore tracks its workdir's changes).
        return revenant_cli(*args, check=check, timeout=timeout, env=self.env(), cwd=self.dir)

    def json(self, *args: str):
        import json

        return json.loads(self.cli(*args, "--json").stdout)

    def job(self, job_id: str) -> dict:
        return self.json("show", "job", job_id)

    def pids(self) -> dict[str, int]:
        import json

        doc = json.loads((self.dir / "cluster.json").read_text())
        return {p["name"]: p["pid"] for p in doc["processes"]}

    def supervisor_pid(self) -> int | None:
        import json

        sup = json.loads((self.dir / "cluster.json").read_text()).get("supervisor")
        return sup["pid"] if sup else None

    def events(self) -> list[dict]:
        import json

        return [json.loads(line) for line in self.cli("events", "--json").stdout.splitlines()]

    @property
    def storage(self) -> Path:
        return self.dir / "storage"


@functools.lru_cache(maxsize=None)
def _reads_other_users(criu_path: str) -> bool:
    """Whether this criu dumps another user's job without CAP_SYS_RESOURCE (its patch, in its version)."""
    from revenant.agent.pipeline.criu import RLIMITS_PATCH
    out = subprocess.run([criu_path, "--version"], capture_output=True, text=True, timeout=60)
    return RLIMITS_PATCH in out.stdout


@pytest.fixture
async def supervisors(tmp_path):
    """The agent's job supervisor and checkpoint engine in-process, with real criu: ``make(node,
    storage=None, events=None, **kw)`` gives one; several share one storage, as nodes would.
    ``kw``: the Supervisor's (scratch, allow_root_jobs), the job-files step's (max_bytes,
    max_entries, timeout_s, workdir_max_bytes) or the Engine's (staging, ...).  No agent renews a lease: a long switch timeout keeps the dead
    man's switch quiet.  Every job they started is killed at the end."""
    from revenant.agent.processes import procs
    from revenant.agent.pipeline.criu import locate_criu
    from revenant.agent.checkpointing.engine import Engine
    from revenant.agent.files.filestep import JobFilesStep
    from revenant.agent.running.jobs import Supervisor

    procs.become_subreaper()
    made = []

    def make(node: str = "n1", storage: Path | None = None, events: list | None = None, **kw):
        storage = storage or tmp_path / "storage"
        sink = events if events is not None else []
        sup_kw = {k: kw.pop(k) for k in ("scratch", "allow_root_jobs") if k in kw}
        files_kw = {k: kw.pop(k) for k in ("max_bytes", "max_entries", "timeout_s", "workdir_max_bytes") if k in kw}
        criu_path = kw.pop("criu_path", "") or locate_criu()
        kw.setdefault("other_users", _reads_other_users(criu_path))  # as the agent learns it from its criu
        engine = Engine(criu_path=criu_path, criu_version="4.1.1", node=node, storage=storage,
                        work_roots=[storage.parent / f"work-{node}"], job_files=JobFilesStep(storage, **files_kw), **kw)
        sup = Supervisor(node, storage, engine, lambda subject, msg: sink.append(msg), switch_timeout_s=3600,
                         **sup_kw)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        await sup.shutdown()


@pytest.fixture
def make_cluster(tmp_path):
    import psutil

    made: list[Cluster] = []

    def make(nodes: int = 2, name: str = "cluster", insecure: bool = False, env: dict | None = None) -> Cluster:
        """``env``: more environment for `revenant up`, which its agents and coordinator inherit."""
        d = tmp_path / name
        revenant_cli("up", "--nodes", str(nodes), "--dir", str(d), "--detach", *(["--insecure"] if insecure else []),
                     check=True, env=env)
        c = Cluster(d)
        made.append(c)
        return c

    make.clusters = made  # for the failure report (pytest_runtest_makereport)
    yield make
    for c in made:
        pids = c.pids() if (c.dir / "cluster.json").exists() else {}
        supervisor = c.supervisor_pid() if (c.dir / "cluster.json").exists() else None
        if (c.dir / "cluster.json").exists():
            revenant_cli("down", "--dir", str(c.dir))
        # Should down have failed, the supervisor goes first: it would restart what is killed next.
        for pid in ([supervisor] if supervisor else []) + list(pids.values()):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def wait_until(predicate, timeout: float, interval: float = 0.1):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def gone(proc) -> bool:
    """Whether a ``psutil.Process`` has exited (a zombie counts): it may exit between any two looks."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def running(root, marker: str) -> list:
    """The processes below ``root`` (a pid or a ``psutil.Process``) whose command line holds
    ``marker``, each with its status then: the init's passing children (``sleep``, ``stat``)
    exit between any two looks, and are left out when they do."""
    import psutil

    found = []
    try:
        below = (root if isinstance(root, psutil.Process) else psutil.Process(root)).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in below:
        try:
            if marker in " ".join(proc.cmdline()):
                found.append((proc, proc.status()))
        except psutil.NoSuchProcess:
            continue
    return found


LOG_TAIL_LINES = {"coordinator.log": 40, "violations": 20}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on a local cluster shows the tail of each process's log."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    server = item.funcargs.get("nats_server") if hasattr(item, "funcargs") else None
    if isinstance(server, AuthBus):
        # What the bus refused: a test that lacks a right fails on a timeout, far from the cause.
        refused = server.violations()[-LOG_TAIL_LINES["violations"]:]
        if refused:
            report.sections.append((f"nats-server permission violations (last {len(refused)})", "\n".join(refused)))
    make = item.funcargs.get("make_cluster") if hasattr(item, "funcargs") else None
    for c in getattr(make, "clusters", []):
        for log_file in sorted((c.dir / "logs").glob("*.log")):
            if log_file.name == "nats-server.log":
                continue
            try:
                lines = log_file.read_text(errors="replace").splitlines()
            except OSError:
                continue
            tail = lines[-LOG_TAIL_LINES.get(log_file.name, 20):]
            report.sections.append((f"{c.dir.name}/{log_file.name} (last {len(tail)} lines)", "\n".join(tail)))


# ------------------------------------------------------------------ tiers
# Every test carries at least one tier marker (registered in pyproject.toml):
#   unit     pure logic in-process: no subprocess, no nats-server, no criu, no real waiting beyond a blink
#   nats     needs a real nats-server
#   criu     runs real criu on real processes
#   cluster  a multi-process revenant cluster (agents + coordinator)
# `make test-fast` runs `-m unit` alone; `make test` runs every tier.

TIERS = ("unit", "nats", "criu", "cluster")

# Fixtures that start a nats-server or a cluster. item.fixturenames is the closure of what a test
# requests, so a fixture built on one of these (nats_url, test_job_table's table, ...) counts too.
SERVICE_FIXTURES = frozenset({"nats_server", "nats_url", "make_cluster", "cluster"})

TIER_ERROR = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `make test-fast` checks every test's tier too
def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) carry no tier marker ({', '.join(TIERS)}); mark the module "
            "(pytestmark = pytest.mark.unit, ...) or the test:\n  " + "\n  ".join(untiered))
    for item in items:
        if item.get_closest_marker("unit"):
            services = sorted(SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())))
            if services:
                item.stash[TIER_ERROR] = (
                    f"{item.nodeid} is marked unit but requests {', '.join(services)}, which starts a "
                    "nats-server or a cluster: mark it nats or cluster instead")


_MISSING: dict[str, str | None] = {}  # tool -> why it is missing (None: found), once per session


def _missing(tool: str) -> str | None:
    """Why ``tool`` (nats-server or criu) cannot be found, or None when it can."""
    cache = _MISSING
    if tool not in cache:
        try:
            if tool == "nats-server":
                from revenant.common.messaging.natsserver import find_nats_server

                find_nats_server()
            else:
                from revenant.agent.pipeline.criu import locate_criu

                locate_criu()
            cache[tool] = None
        except Exception as e:  # reported as the test's failure
            cache[tool] = f"{type(e).__name__}: {e}"
    return cache[tool]


NEEDS = {"nats": ("nats-server",), "criu": ("criu",), "cluster": ("nats-server", "criu")}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A unit test that starts services fails; a test whose tier needs nats-server or criu fails
    (never skips) when that is missing, saying so, instead of failing later on a timeout."""
    if TIER_ERROR in item.stash:
        pytest.fail(item.stash[TIER_ERROR], pytrace=False)
    for tier, tools in NEEDS.items():
        if item.get_closest_marker(tier):
            for tool in tools:
                reason = _missing(tool)
                if reason:
                    pytest.fail(f"{item.nodeid} ({tier} tier) needs {tool}, which is missing: {reason}. "
                                "Run `make setup`.", pytrace=False)


# criu's nftables lock tables (``inet CRIU-<run id>``) that the run leaves behind are named at its
# end: one left behind black-holes the connections it lists (agent/network/netlock.py removes every one
# it knows of; an agent SIGKILLed while it holds one leaves it).
_CRIU_TABLES: set[str] = set()


def _criu_tables() -> set[str]:
    import shutil
    import subprocess
    nft = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")
    if nft is None or os.geteuid() != 0:
        return set()
    out = subprocess.run([nft, "list", "tables", "inet"], capture_output=True, text=True).stdout
    return {ln.split()[-1] for ln in out.splitlines() if ln.startswith("table inet CRIU-")}


def pytest_sessionstart(session):
    _CRIU_TABLES.update(_criu_tables())


def pytest_terminal_summary(terminalreporter):
    left = _criu_tables() - _CRIU_TABLES
    if left:
        terminalreporter.write_line(f"criu lock tables left behind by this run: {len(left)} "
                                    f"(nft list tables; e.g. {sorted(left)[0]})")
