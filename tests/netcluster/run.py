"""A partition run: a ``revenant up --netns`` cluster with its nemesis and its history recorder,
stepper jobs on it, and the checker over what happened.  tests/test_partitions.py and
bench/nemesis.py drive it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys
import time

from netcluster.checker import Job, check, slow_heals
from netcluster.history import STEPPER, Collector, History, Sampler, TableWatch
from netcluster.nemesis import Nemesis
from revenant.cli.cluster import netns
from revenant.cli.cluster.processes import nodes
from revenant.common.errors import RevenantError
from revenant.common.settings.cluster import read_cluster

FIRST_PORT = 7100


def reference(steps: int) -> bytes:
    """The stepper's output for ``steps`` steps, uninterrupted, without its addresses."""
    h, out = hashlib.sha256(), []
    for n in range(steps):
        h.update(str(n).encode())
        out.append(f"{n} {h.hexdigest()[:16]}\n")
    return "".join(out).encode()


class Run:
    """``cluster``: a conftest.Cluster started with ``--netns``."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        doc = read_cluster(cluster.dir)
        assert doc.netns is not None, "not a --netns cluster"
        self.layout = doc.netns
        self.members = {name: msg for name, msg in json.loads((cluster.dir / "cluster.json").read_text())
                        ["netns"]["members"].items()}
        self.nodes = sorted(n for n in self.members if n.startswith("node-"))
        self.addresses = {self.members[n]["address"]: n for n in self.nodes}
        self.nemesis = Nemesis(self.members, log_path=cluster.dir / "nemesis.jsonl")
        self.history = History()
        self.collector = Collector(self.layout.host_address, self.addresses, self.history)
        self.sampler = Sampler(netns.namespace_inodes(self.layout), self.history)
        self.watch = TableWatch(doc.nats_url, str(cluster.dir / "keys" / "coordinator.nk"), self.history)
        self.jobs: dict[str, tuple[int, int, int]] = {}  # id -> (steps, port, max_epochs)
        self.stopped = False

    def submit(self, node: str, steps: int, *, interval: float = 0.1, every: str = "0:2", max_epochs: int = 3) -> str:
        port = FIRST_PORT + len(self.jobs)
        job = self.cluster.cli("submit", "--node", node, "--checkpoint", every, "--max-epochs", str(max_epochs),
                               "--", sys.executable, STEPPER, str(steps), str(interval), self.collector.where,
                               str(port)).stdout.strip()
        self.jobs[job] = (steps, port, max_epochs)
        return job

    def placement(self, job: str):
        rows = [p for p in self.history.table if p.job == job]
        return max(rows, key=lambda p: p.revision) if rows else None

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            time.sleep(interval)
        raise AssertionError(f"{what} did not happen within {timeout:g} s; nemesis: {self.nemesis.log[-3:]}")

    def epoch_of(self, job: str) -> int:
        p = self.placement(job)
        return max(p.epochs, default=0) if p else 0

    def leader(self) -> str:
        """The leading coordinator's name, as it answers a nodes request ("" while none answers)."""
        doc = read_cluster(self.cluster.dir)
        try:
            return asyncio.run(nodes(doc.nats_url, doc.creds, 2.0)).coordinator
        except RevenantError:
            return ""

    def events(self) -> list[dict]:
        """The event stream, or [] while it cannot be read (its stream electing a leader)."""
        out = self.cluster.cli("events", "--json", check=False, timeout=30)
        return [json.loads(line) for line in out.stdout.splitlines()] if out.returncode == 0 else []

    def heal(self) -> None:
        self.nemesis.heal()
        self.history.heals.append(time.time())

    def reach(self, job: str, timeout: float = 10.0) -> str:
        """The job's latest line, asked over TCP at its node's address as the table has it."""
        p = self.placement(job)
        address = self.members[p.node]["address"]
        with socket.create_connection((address, self.jobs[job][1]), timeout=timeout) as conn:
            return conn.makefile().readline().strip()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.nemesis.heal()
            self.sampler.stop()
            self.collector.stop()
            self.watch.stop()

    def violations(self) -> list[str]:
        self.stop()
        jobs = []
        for job, (steps, _, max_epochs) in self.jobs.items():
            root = self.cluster.storage / "jobs" / job
            try:
                out = (root / "output.log").read_bytes()
            except OSError:
                out = b""
            on_disk = {int(p.name) for p in (root / "epochs").glob("[0-9]*") if p.name.isdigit()}
            jobs.append(Job(job, reference(steps), out, on_disk, max_epochs))
        return check(self.history, jobs, set(self.addresses))

    def slow_heals(self, bound_s: float = 5.0, from_lease: bool = False) -> list[str]:
        """Copies frozen at a heal that took longer than ``bound_s`` to thaw or go (``from_lease``:
        counted from when their node's lease was back, checker.heal_times)."""
        return slow_heals(self.history, bound_s, from_lease)
