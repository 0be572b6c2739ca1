"""Recording a partition test's history, as Jepsen does: what the jobs did, what ran where,
and what the job table said, each with the time it was seen (tests/netcluster/checker.py reads it).

- ``Collector``: a UDP socket on the bridge's host address; every step of every stepper job
  (tests/jobs/stepper.py) arrives here as ``"<job> <step> <address> <pid> <time>"`` (the
  stepper's clock is this host's).
- ``Sampler``: every 0.1 s, every copy of every stepper job on this host (its pid, its node by
  its network namespace, frozen or not: stopped, held by criu, or dying).
- ``TableWatch``: every revision of every job's record in the job table (a KV watch through
  each NATS server, on a thread of its own), timed by the leader's save (``updated_at``), and
  every node's lease renewals (when the bus took writes again after a heal).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil

from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import JobRecord, LeaseValue, subjects

STEPPER = str(Path(__file__).resolve().parent.parent / "jobs" / "stepper.py")
FROZEN = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc/<pid>/status's signal masks


def dying(pid: int) -> bool:
    """Whether ``pid`` can no longer run a line of its own: SIGKILL is pending or it is exiting.
    A stopped copy that its agent kills leaves the stopped state for the kernel's exit path,
    where /proc shows it running for a moment (never back in user space)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            flags = int(f.read().rsplit(b")", 1)[1].split()[6])
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return True  # gone meanwhile
    return bool(flags & PF_EXITING) or any(m & SIGKILL_BIT for m in masks)


@dataclass
class Step:
    t: float
    job: str
    step: int
    node: str  # by its address ("?" for an address no node has)


@dataclass
class Copy:
    job: str
    pid: int
    node: str
    frozen: bool


@dataclass
class Placement:
    t: float
    job: str
    node: str
    generation: int
    state: str
    epochs: list[int]
    reason: str = ""
    revision: int = 0  # the record's revision in the job table


@dataclass
class History:
    steps: list[Step] = field(default_factory=list)
    samples: list[tuple[float, list[Copy]]] = field(default_factory=list)
    table: list[Placement] = field(default_factory=list)
    heals: list[float] = field(default_factory=list)
    # Each node's lease renewals as the leases bucket took them (the agent's clock, this machine's):
    # when the bus took writes again after a split, node by node.
    leases: dict[str, list[float]] = field(default_factory=dict)


class Collector:
    """Receives the steppers' step records (``history.steps``) on ``address``:<port>."""

    def __init__(self, address: str, nodes_by_address: dict[str, str], history: History) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.sock.settimeout(0.2)
        self.where = f"{address}:{self.sock.getsockname()[1]}"
        self.nodes = nodes_by_address
        self.history = history
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                data = self.sock.recv(512)
            except socket.timeout:
                continue
            except OSError:
                return
            parts = data.decode(errors="replace").split()
            if len(parts) >= 3 and parts[1].isdigit():
                # The stepper's own time of the step (this host's clock), else the arrival's.
                at = float(parts[4]) if len(parts) > 4 else time.time()
                self.history.steps.append(Step(at, parts[0], int(parts[1]), self.nodes.get(parts[2], "?")))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self.sock.close()


def copies(namespaces: dict[int, str]) -> list[Copy]:
    """Every stepper process on this host: its job (from its environment), its node (from its
    network namespace's inode) and whether it is frozen (stopped, held by criu, or dying)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if len(cmd) < 2 or cmd[1] != STEPPER or proc.info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue
        try:
            job = proc.environ().get("REVENANT_JOB_ID", "?")
            node = namespaces.get(os.stat(f"/proc/{proc.pid}/ns/net").st_ino, "host")
        except (psutil.Error, OSError):
            continue
        found.append(Copy(job, proc.pid, node, proc.info["status"] in FROZEN or dying(proc.pid)))
    return found


class Sampler:
    def __init__(self, namespaces: dict[int, str], history: History, interval_s: float = 0.1) -> None:
        self.namespaces, self.history, self.interval_s = namespaces, history, interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.history.samples.append((time.time(), copies(self.namespaces)))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


class TableWatch:
    """Every revision of the job table, as the coordinator's identity reads it (``history.table``),
    through one watch per NATS server: a watch whose server is cut off from the others stalls
    (its client is not cut off, so it never moves), and the others see what it misses.  Each
    revision is recorded once."""

    def __init__(self, url: str, seed: str, history: History) -> None:
        self.urls, self.seed, self.history = url.split(","), seed, history
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._seen: set[tuple[str, str, int]] = set()
        self.error = ""
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),),
                                        name="table-watch", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the job table watch did not start: {self.error or 'no answer'}")

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        watches = []
        try:
            for url in self.urls:
                nc = await bus.connect(url, "history", **security.credentials(security.COORDINATOR, self.seed))
                js = nc.jetstream(timeout=5)
                watches.append((nc, await (await js.key_value(subjects.JOBS_BUCKET)).watch(">")))
                watches.append((nc, await (await js.key_value(subjects.LEASES_BUCKET)).watch(">")))
        except Exception as exc:  # noqa: BLE001 - reported by the constructor
            self.error = str(exc)
            self._ready.set()
            for nc, _ in watches:
                await nc.close()
            return
        self._ready.set()
        await asyncio.gather(*(self._follow(w, leases=i % 2 == 1) for i, (_, w) in enumerate(watches)))
        for nc, watcher in watches:
            await watcher.stop()
        for nc in {id(nc): nc for nc, _ in watches}.values():
            await nc.close()

    async def _follow(self, watcher, leases: bool) -> None:
        decoder = msgspec.msgpack.Decoder(JobRecord)
        assert self._stop is not None
        while not self._stop.is_set():
            try:
                entry = await watcher.updates(timeout=0.5)
            except Exception:  # noqa: BLE001 - a timeout, or the connection moving to another server
                continue
            if entry is None or not entry.value or (entry.bucket, entry.key, entry.revision) in self._seen:
                continue
            self._seen.add((entry.bucket, entry.key, entry.revision))
            if leases:
                try:
                    lease = msgspec.msgpack.decode(entry.value, type=LeaseValue)
                except msgspec.DecodeError:
                    continue
                self.history.leases.setdefault(lease.node, []).append(lease.at)
                continue
            if not entry.key.isdigit():
                continue
            try:
                rec = decoder.decode(entry.value)
            except msgspec.DecodeError:
                continue
            # Timed by the leader's save (this machine's clock): a watch whose server is cut off
            # sees the record late, and a late time would make an honest step look superseded.
            self.history.table.append(Placement(rec.updated_at or time.time(), entry.key, rec.node, rec.generation,
                                                rec.state, [e.n for e in rec.epochs], rec.reason, entry.revision))

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
