"""Helpers for the proactive-move cluster tests (tests/test_proactive_cluster.py): a node of its
own, made sick for real (memory, storage, a GPU), and the checks on the counter job it runs.

`revenant up` gives every agent the same environment, and its agents share the machine's memory
and disks, so one sick node is an agent started here with an environment of its own (thresholds
just above what the machine has now, the fake GPU's libraries): :class:`ExtraAgent`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil

from conftest import COUNTER, REPO, wait_until

MEMHOG = REPO / "tests" / "jobs" / "memhog.py"
MIB = 1024**2
INTERVAL = 0.05  # the counter's: 20 lines a second


# ------------------------------------------------------------------ the counter job

class Counter:
    """A counter job, told apart from every other process on the machine by its line count (a
    number drawn for it: the output never gets near it, so any prefix of the chain is checked)."""

    def __init__(self, cluster, node: str, *options: str) -> None:
        self.cluster = cluster
        self.count = str(10**8 + secrets.randbelow(10**8))
        self.id = cluster.cli("submit", "--node", node, *options, "--", sys.executable, str(COUNTER), self.count,
                              str(INTERVAL)).stdout.strip()
        assert self.id.isdigit(), self.id

    def output(self) -> bytes:
        try:
            return (self.cluster.storage / "jobs" / self.id / "output.log").read_bytes()
        except FileNotFoundError:
            return b""

    def lines(self) -> int:
        return self.output().count(b"\n")

    def copies(self) -> list[psutil.Process]:
        """The live processes running this job (the counter itself, not its namespace's init)."""
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            cmd = proc.info["cmdline"] or []
            if len(cmd) >= 3 and cmd[1] == str(COUNTER) and cmd[2] == self.count \
                    and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        return found

    def show(self) -> dict:
        """The job, or {} while no coordinator answers."""
        out = self.cluster.cli("show", "job", self.id, "--json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def wait(self, predicate, what: str, timeout: float = 60) -> dict:
        info = wait_until(lambda: (j := self.show()) and predicate(j) and j, timeout=timeout, interval=0.2)
        assert info, f"job {self.id}: {what} did not happen: {self.show()}"
        return info

    def wait_lines(self, n: int, timeout: float = 60) -> None:
        assert wait_until(lambda: self.lines() >= n, timeout=timeout), \
            f"job {self.id}: {self.lines()} lines, not {n}: {self.show()}"

    def assert_one_copy_continuous(self, past: int) -> None:
        """Exactly one copy runs, and the output grows past ``past`` lines as one unbroken chain:
        byte for byte a prefix of an uninterrupted run's (no line lost, doubled or from a second copy)."""
        self.wait_lines(past + 20)
        copies = self.copies()
        assert len(copies) == 1, f"job {self.id} runs {len(copies)} times: {[p.pid for p in copies]}"
        data = self.output()
        want = counter_output(data.count(b"\n") + 1)
        assert want.startswith(data), f"job {self.id}'s output breaks its chain: ...{data[-300:]!r}"


def counter_output(lines: int) -> bytes:
    """The first ``lines`` lines of tests/jobs/counter.py's output."""
    h = hashlib.sha256()
    out = []
    for i in range(lines):
        h.update(str(i).encode())
        out.append(f"line {i} {h.hexdigest()[:16]}\n")
    return "".join(out).encode()


# ------------------------------------------------------------------ events

def events(cluster, type_: str, **match) -> list[dict]:
    """Events of ``type_`` (job_event.v1, epoch_event.v1, cluster_event.v1) whose fields match."""
    return [e for e in cluster.events()
            if e.get("type") == type_ and all(e.get(k) == v for k, v in match.items())]


def wait_event(cluster, type_: str, what: str, timeout: float = 60, **match) -> list[dict]:
    found = wait_until(lambda: events(cluster, type_, **match), timeout=timeout, interval=0.3)
    assert found, f"no {what} ({type_} {match}) within {timeout:g} s"
    return found


def health_epochs(cluster, job: str) -> list[dict]:
    """The job's epochs taken because its node looked sick."""
    return events(cluster, "epoch_event.v1", job=job, kind="created", cause="health")


# ------------------------------------------------------------------ nodes

class ExtraAgent:
    """An agent started here, on the cluster's bus and storage, with an environment of its own;
    its log goes with the cluster's (shown when a test fails).  :meth:`kill` ends it and every
    job it runs."""

    def __init__(self, cluster, name: str, env: dict[str, str]) -> None:
        doc = json.loads((cluster.dir / "cluster.json").read_text())
        assert doc.get("insecure"), "an extra agent needs an --insecure cluster (it has no identity of its own)"
        self.name = name
        self.log = cluster.dir / "logs" / f"{name}.log"
        argv = [sys.executable, "-m", "revenant.cli", "agent", "--node", name, "--nats", doc["nats_url"],
                "--http-port", "0", "--storage", doc["storage"], "--image-keys", str(cluster.dir / "keys" / "image.keys")]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env}, start_new_session=True)

    def kill(self) -> None:
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for proc in [psutil.Process(self.proc.pid), *tree] if self.proc.poll() is None else tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.proc.wait(timeout=30)


def node(cluster, name: str) -> dict:
    return next((n for n in cluster.json("nodes") if n["name"] == name), {})


def wait_node(cluster, name: str, predicate, what: str, timeout: float = 60) -> dict:
    found = wait_until(lambda: (n := node(cluster, name)) and predicate(n) and n, timeout=timeout, interval=0.3)
    assert found, f"node {name}: {what} did not happen: {node(cluster, name)}"
    return found


def agent_health(node_status: dict) -> dict:
    """The agent's own /health (what its next heartbeat reports)."""
    url = node_status["capabilities"]["metrics_url"]
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        return json.loads(resp.read())


# ------------------------------------------------------------------ real trouble

@contextlib.contextmanager
def memhog(mib: int):
    """``mib`` MiB allocated and resident until the block ends; yields the process (SIGUSR1:
    it gives half back)."""
    proc = subprocess.Popen([sys.executable, str(MEMHOG), str(mib)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "memhog did not start"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def release_half(hog: subprocess.Popen) -> None:
    hog.send_signal(signal.SIGUSR1)
    assert hog.stdout is not None and hog.stdout.readline().strip() == "released"


@contextlib.contextmanager
def busy_loops(n: int, nice: int = 0):
    """``n`` processes spinning on a core each until the block ends; ``nice`` below 0 (tests run as
    root) gives them more CPU weight than the agent, so its wake-ups wait their turn rather than
    preempting them at once, as they often can against equals."""
    procs = [subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small filesystem of its own at ``path`` (tests run as root), unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=30)
    try:
        yield path
    finally:
        # Lazily, should something still hold it: it goes once the last holder does.
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill_to(directory: Path, free_bytes: int) -> int:
    """Grow (or shrink) ``directory``/fill so that the filesystem has about ``free_bytes`` free; its size."""
    fill = directory / "fill"
    have = fill.stat().st_size if fill.exists() else 0
    size = max(0, have + shutil.disk_usage(directory).free - free_bytes)
    with open(fill, "ab") as f:
        if size > have:
            os.posix_fallocate(f.fileno(), 0, size)
        else:
            f.truncate(size)
    return size
