"""Helpers shared by the in-process agent and coordinator tests (a real nats-server, no cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig, CoordinatorConfig


@contextlib.asynccontextmanager
async def running(service):
    task = asyncio.create_task(service.run())
    ready = asyncio.create_task(service.ready.wait())
    await asyncio.wait([task, ready], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await task  # raises what made it stop
    assert service.ready.is_set(), "service did not become ready"
    try:
        yield service
    finally:
        service.stop()
        await _stopped(service, task)


async def _stopped(service, task: asyncio.Task, bound_s: float = 45.0) -> None:
    """Wait for ``task`` (the service's run) to end; past the generous ``bound_s`` (a loaded
    2-core machine drains slowly) fail naming where it was stuck."""
    done, _ = await asyncio.wait([task], timeout=bound_s)
    if not done:
        where = "".join(f"\n  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                        for frame in _awaiting(task.get_coro()))
        task.cancel()
        raise AssertionError(f"{type(service).__name__} did not stop within {bound_s:g} s; stuck at:{where}")
    await task


def _awaiting(coro):
    """The frames of a suspended coroutine and of what it awaits, outermost first."""
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        yield coro.cr_frame
        coro = coro.cr_await


class HeldLease:
    """A leader lease that is always fresh and held (a JobService driven in-process)."""

    def fresh(self) -> bool:
        return True

    async def holds(self) -> bool:
        return True

    def step_down(self, why: str) -> None:
        raise AssertionError(why)


def image_keys(tmp_path):
    """The image keys of a test's cluster (agent/storage/imagekeys.py), made once per test."""
    from revenant.agent.storage import imagekeys

    path = tmp_path / "image.keys"
    path.parent.mkdir(parents=True, exist_ok=True)
    imagekeys.write(path)
    return path


def agent_config(nats_url, tmp_path, node="node-1", **kw):
    kw.setdefault("image_keys", str(image_keys(tmp_path)))  # one test's agents: one cluster, one key
    kw.setdefault("allow_root_jobs", True)  # the suite's jobs run as root (tests/test_job_user.py: as a user)
    kw.setdefault("nats_creds", creds(nats_url, security.agent_identity(node)))
    return AgentConfig(node=node, nats_url=nats_url, storage=str(tmp_path / "storage"),
                       heartbeat_interval_s=0.2, http_port=0, **kw)


def coordinator_config(nats_url, **kw) -> CoordinatorConfig:
    """A coordinator's configuration on the test's bus, as the coordinator identity."""
    kw.setdefault("nats_creds", creds(nats_url, security.COORDINATOR))
    return CoordinatorConfig(nats_url=nats_url, **kw)


# ---------------------------------------------------------------------- the test's bus


# The node and user names the suite's tests use on the test bus: admitted from the start.  An
# identity admitted later costs a reload, and a reload makes nats-server forget the replies it
# owes (allow_responses): a request in flight then goes unanswered.
TEST_NODES = ("node-1", "node-2", "node-3", "node-a", "node-b", "node-x", "n1", "junk")
TEST_USERS = ("alice", "bob", "daemon", "nobody", "root")


class AuthBus:
    """The test's nats-server as ``revenant up`` runs it: the same keys directory, ``nats.conf``
    and authorization block (cli/cluster/processes.py generate_identities), so that only the identities
    it admits connect, each with its production permissions; nothing passes because the bus is
    open.  Admitted: coordinator, admin, the agents of TEST_NODES and the users of TEST_USERS;
    another identity a test names is admitted on demand, as ``revenant keys --dir`` does it: its
    seed, the block written again, a SIGHUP."""

    def __init__(self, directory: Path, log_file: Path) -> None:
        from revenant.cli.cluster.processes import generate_identities
        from revenant.common.messaging.natsserver import start_nats_server

        self.dir, self.log_file = Path(directory), Path(log_file)
        users = security.Keyring(self.dir / "keys")
        for user in TEST_USERS:
            users.ensure(security.user_identity(user))
        self.keyring = generate_identities(self.dir, list(TEST_NODES))  # keeps the users' seeds
        self.server = start_nats_server(self.dir / "store", log_file=self.log_file,
                                        config_file=self.dir / "nats.conf")
        self.url = self.server.url
        _BUSES[self.url] = self

    def creds(self, identity: str) -> str:
        """The seed file of ``identity`` (admitted first if it is not yet)."""
        if identity not in self.keyring.public:
            self._admit(identity)
        return str(self.keyring.seed_path(identity))

    def _admit(self, identity: str) -> None:
        from revenant.cli.cluster.processes import generate_identities

        reloads = self._reloads()
        self.keyring.ensure(identity)
        self.keyring = generate_identities(self.dir, [])  # the block for every seed in keys/
        os.kill(self.server.pid, signal.SIGHUP)  # as `revenant keys --dir` reloads the server
        deadline = time.monotonic() + 10
        while self._reloads() == reloads:  # the server says when it has the new block
            assert time.monotonic() < deadline, f"nats-server did not reload its configuration for {identity}"
            time.sleep(0.005)

    def _reloads(self) -> int:
        return self.log_file.read_text(errors="replace").count("Reloaded server configuration")

    def violations(self) -> list[str]:
        """The server's permission violations so far, each naming the identity (not its key)."""
        names = {key: identity for identity, key in self.keyring.public.items()}
        lines = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if "Violation" in ln]
        for key, identity in names.items():
            lines = [ln.replace(key, identity) for ln in lines]
        return lines

    def kill(self) -> None:
        """An outage: the server stops (:meth:`restart` brings it back)."""
        self.server.stop()

    def restart(self) -> None:
        """The server again, on its port, with its store and the same identities."""
        from revenant.common.messaging.natsserver import start_nats_server

        self.server = start_nats_server(self.dir / "store", port=self.server.port, log_file=self.log_file,
                                        config_file=self.dir / "nats.conf")

    def stop(self) -> None:
        _BUSES.pop(self.url, None)
        self.server.stop()


_BUSES: dict[str, AuthBus] = {}  # url -> the running test bus (the nats_server fixture's)


def creds(nats_url: str, identity: str) -> str:
    """The seed file ``identity`` connects to the test's bus at ``nats_url`` with; "" (none) for
    a server that is not the nats_server fixture's (a test's own, or the open one)."""
    test_bus = _BUSES.get(nats_url)
    return test_bus.creds(identity) if test_bus else ""


def credentials(nats_url: str, identity: str) -> dict[str, str | None]:
    """``bus.connect``'s keyword arguments to connect as ``identity``: its seed and its inbox."""
    return security.credentials(identity, creds(nats_url, identity))


async def connect_as(nats_url: str, identity: str = security.ADMIN, name: str = "test", **kw):
    """A connection to the test's bus as ``identity``, with that identity's rights alone: admin
    for what an operator may do, the coordinator where a test stands in for it (writes the job
    table, hears heartbeats, commands agents), ``agent-<node>`` where it plays that agent."""
    from revenant.common.messaging import bus

    kw.setdefault("endless_reconnect", False)
    return await bus.connect(nats_url, name, **credentials(nats_url, identity), **kw)


def cli_env(nats_url: str, identity: str = security.ADMIN) -> dict[str, str]:
    """The environment that points the CLI at the test's bus with ``identity``'s credential."""
    return {"REVENANT_NATS": nats_url, "REVENANT_CREDS": creds(nats_url, identity)}


def external_nats(cluster_dir: Path, nodes: list[str], store: Path, **kw):
    """An operator's own nats-server for ``revenant up --dir cluster_dir --nats URL``, set up as
    docs/security.md asks: the cluster's identities made first (DIR/keys, which ``up`` keeps) and
    the server given their authorization block (DIR/nats.conf), so it admits them alone.
    ``kw``: start_nats_server's (port, log_file)."""
    from revenant.cli.cluster.processes import generate_identities
    from revenant.common.messaging.natsserver import start_nats_server

    generate_identities(Path(cluster_dir), nodes)
    return start_nats_server(store, config_file=Path(cluster_dir) / "nats.conf", **kw)


async def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


async def until(predicate, timeout: float = 60.0) -> None:
    """Wait for a plain (not awaitable) ``predicate``; fails the test past ``timeout`` (generous:
    a bound on a protocol, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _states(nodes, want):
    table = await nodes()
    if table and {n.name: n.state for n in table} == want:
        return table
    return None


# The property tests' example counts, scaled: `make test` runs each at full strength; `make
# test-fast` (REVENANT_TEST_EXAMPLES=0.2) a fifth of them, at least 20, so that the unit tier
# stays quick enough to run before every commit.
EXAMPLES_SCALE = float(os.environ.get("REVENANT_TEST_EXAMPLES", "1"))


def examples(n: int) -> int:
    """``max_examples`` for a property test that runs ``n`` at full strength."""
    return n if EXAMPLES_SCALE >= 1 else max(20, min(n, round(n * EXAMPLES_SCALE)))
