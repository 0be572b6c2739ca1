"""Heartbeat scale: N simulated nodes heartbeating at 1 Hz into one real coordinator.

For each N (default 1,000, 10,000 and 20,000) it starts a private nats-server
and a real coordinator, exactly as production runs it
(``revenant coordinator --nats URL --http-port 0``), then one or more load
generator processes that simulate the N nodes:

* each node publishes ``heartbeat.v1`` on ``revenant.hb.<node>`` once per
  interval with the agent's own jitter rule (deadline-based, +/- 10 %), phases
  spread evenly over the second, with an agent-like payload (capabilities with a
  criu block and ``criu check --feature`` results, a health summary);
* each generator subscribes to ``revenant.node.*.probe`` and answers
  ``probe_reply.v1`` for its live nodes, as an agent would.  (A silenced node's
  probe times out after ``probe_timeout_s`` instead of failing at once with "no
  responders" as it would for a dead agent; either way the probe fails before
  ``node_timeout_s``, so the verdict time is the same.)

With ``--leases`` every node also renews its lease as the agent's LeaseKeeper
does: a put to the KV bucket ``revenant_leases`` (created first, as an agent
creates it: the agents' ``lease_ttl_s``, history 1, ``nats_replicas`` replicas)
that waits for the stream's ack, with a timeout of twice the renewal period,
then the renewal period of sleep.  Over the steady window it reports the
renewals acked per second against ``N / lease_renew_s``, the latency from
publish to ack (p50/p99/max, in buckets 20 % apart, interpolated), timeouts and
errors, and the longest time a node went between two acked renewals; a gap past
the agents' ``fence_timeout_s`` would have been a self-fence.
``--nats-servers 3`` runs on a 3-server JetStream cluster started by
common/messaging/natsserver.py, as ``revenant up --nats-servers 3`` starts it; the bucket
and the coordinator's streams then get 3 replicas (``nats_replicas`` auto, or
``--replicas``), and the generators (at least one per server) each connect to a
server of their own.

Each run measures the idle coordinator, warms up (all N alive per its
``/health``, the join events published, then ``--warmup`` seconds), scrapes
``/metrics`` (for the heartbeats it received), measures the coordinator's CPU
time (psutil, as a share of one core) and resident memory over a
``--duration`` second steady-state window, scrapes again, then silences
``--silence`` random nodes at once and measures, for each, the time from its
last heartbeat to its ``node_event.v1`` "dead" (seen on core NATS at
``revenant.evt.node.>``, and cross-checked against the coordinator's log).
Last it asks for the node table (``nodes_request.v1``, what `revenant nodes`
does).  Any dead verdict for a node that was never silenced is a false verdict;
they are counted over the whole run, and so are false suspicions.  The
generators' achieved publish rate and send lateness, the CPU of every process
involved and the machine's total CPU are reported too: on a 2-core machine the
generators and nats-server compete with the coordinator, and the numbers say
by how much.  One generator process sends 20,000 heartbeats/s on about a
sixth of a core.

    .venv/bin/python bench/heartbeats.py                    # 1k, 10k, 20k nodes (about 5 minutes)
    .venv/bin/python bench/heartbeats.py --quick            # 1,000 nodes, short phases
    .venv/bin/python bench/heartbeats.py --sizes 5000 --duration 30
    .venv/bin/python bench/heartbeats.py --profile          # + py-spy profiles of the coordinator
    .venv/bin/python bench/heartbeats.py --leases 0.35      # + every node's lease renewal, as agents do
    .venv/bin/python bench/heartbeats.py --leases --nats-servers 1,3 --sizes 500,2000,5000   # R1 and R3 leases
    .venv/bin/python bench/heartbeats.py --coordinator-ref HEAD~3   # an older coordinator
    .venv/bin/python bench/heartbeats.py --coordinator-src DIR      # a modified copy (DIR/revenant/...)

Goal: 20,000 nodes on less than one core, with no false verdicts.  Prints a
table (with ``--leases`` a second one, of the renewals) and writes
bench/results/heartbeats.json (with ``--leases`` heartbeats-leases.json;
``--out``); the coordinator's,
nats-server's and the generators' logs are kept next to it in
``<out stem>-logs-<N>[-<S>servers]/``, py-spy's collapsed stacks in
``<out stem>-<N>-profile-<phase>.txt``.  A benchmark, not a test.  Everything
it starts is stopped, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import heapq
import json
import math
import os
import platform
import random
import re
import secrets
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import msgspec
import nats
import nats.errors
import psutil

from revenant.agent.node.liveness import FULL_FIRST
from revenant.cli.client import request_nodes
from revenant.common.errors import RevenantError
from revenant.common.messaging import bus
from revenant.common.messaging.kv import open_bucket
from revenant.common.messaging.natsserver import NatsServer, start_nats_cluster, start_nats_server, wait_jetstream
from revenant.common.settings.config import AgentConfig
from revenant.messages import (
    Capabilities,
    CriuInfo,
    HealthSummary,
    Heartbeat,
    LeaseValue,
    MessageError,
    NodeEvent,
    Probe,
    ProbeReply,
    decode,
    decode_as,
    encode,
    subjects,
)

REPO = Path(__file__).resolve().parent.parent
GOAL_CORE_PERCENT = 100.0
GOAL_NODES = 100_000
GOAL_DETECT_P99_S = 3.0
NODE_METRICS_OFF_FROM = 50_000
CTL = "bench.hbgen"
# The generators wake every BATCH_S and send every heartbeat that is due (jitter is +/- 100 ms).
BATCH_S = 0.005
LATENESS_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
# Lease renewal latency (publish to the stream's ack): buckets 20 % apart, 0.1 ms to about 5 s.
LEASE_BUCKETS_MS = tuple(round(0.1 * 1.2**i, 4) for i in range(60))
try:  # the agent's own list, so the payload has the agent's shape
    from revenant.agent.pipeline.criu import FEATURES as CRIU_FEATURES
except Exception:  # pragma: no cover - keep the bench usable if the agent package changes
    CRIU_FEATURES = ("mem_dirty_track", "uffd-noncoop", "pidfd_store", "clone3_set_tid", "timens")


def node_name(i: int) -> str:
    return f"sim-{i:05d}"


# =============================================================================== load generator


class RawPublisher:
    """Core NATS publishes written straight to a socket in batches: the heartbeat load without a
    client library's per-message work (nats-py costs several microseconds a message, which at
    100,000 nodes is more than the machine's share for the load).  It speaks the client protocol's
    minimum: CONNECT (not verbose), PUB frames, PONG to the server's PING; an -ERR is counted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0
        self.last_error = ""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None

    async def connect(self, url: str) -> None:
        u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        self._reader, self._writer = await asyncio.open_connection(u.hostname, u.port or 4222)
        info = await self._reader.readline()
        if not info.startswith(b"INFO"):
            raise SystemExit(f"{url}: not a NATS server ({info[:60]!r})")
        connect = {"verbose": False, "pedantic": False, "lang": "python", "version": "bench", "protocol": 1,
                   "name": self.name, "headers": False, "no_responders": False}
        self._writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        await self._writer.drain()
        line = await asyncio.wait_for(self._reader.readline(), 10)
        if not line.startswith(b"PONG"):
            raise SystemExit(f"{url}: refused the benchmark's connection: {line.decode(errors='replace').strip()}")
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._reader is not None and self._writer is not None
        while line := await self._reader.readline():
            if line.startswith(b"PING"):
                self._writer.write(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                self.errors += 1
                self.last_error = line.decode(errors="replace").strip()
        self.errors += 1
        self.last_error = self.last_error or "connection closed by the server"

    def send(self, frames: list[bytes]) -> int:
        """Write (and clear) a batch of frames; how many were written."""
        if not frames:
            return 0
        n = len(frames)
        assert self._writer is not None
        closing = self._writer.is_closing()
        if closing:
            self.errors += n
        else:
            self._writer.write(b"".join(frames))
        frames.clear()
        return 0 if closing else n

    async def drain(self) -> None:
        assert self._writer is not None
        if self._writer.transport.get_write_buffer_size() > 8 * 2**20:
            await self._writer.drain()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()


class Generator:
    """Simulates nodes ``first .. last-1`` of ``total``; runs in its own process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.index = args.index
        rng = random.Random(args.seed * 1000 + args.index)
        self.rng = rng
        self.ids = list(range(args.first, args.last))
        self.names = [node_name(i) for i in self.ids]
        self.by_name = {n: k for k, n in enumerate(self.names)}
        self.subjects = [subjects.heartbeat(n) for n in self.names]
        self.incarnations = [secrets.token_hex(8) for _ in self.ids]
        self.pids = [rng.randrange(1000, 4_000_000) for _ in self.ids]
        self.seq = [0] * len(self.ids)
        self.last_sent = [0.0] * len(self.ids)
        self.silenced = [False] * len(self.ids)
        features = {f: f != "mem_dirty_track" for f in CRIU_FEATURES}  # as on this kernel
        criu = CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True, features=features)
        self.caps = [
            Capabilities(hostname=f"{n}.cluster.example", kernel="6.18.0-1-amd64", cpus=64,
                         memory_total_bytes=512 * 2**30, revenant_version="0.1.0", criu=criu,
                         metrics_url=f"http://10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:9750",
                         gpu="none")
            for n, i in zip(self.names, self.ids)
        ]
        # A few health summaries shared between nodes: GREEN with a realistic spread of readings.
        self.healths = [
            HealthSummary(state="GREEN", loop_lag_s=round(rng.uniform(0.0005, 0.004), 4), loop_stalls=rng.randrange(3),
                          memory_percent=round(rng.uniform(20, 70), 1),
                          storage_free_bytes=rng.randrange(200, 900) * 2**30, criu_ok=True, nats_connected=True)
            for _ in range(32)
        ]
        self.published = 0
        self.publish_errors = 0
        # Leases (--lease-renew): as the agent's LeaseKeeper, a KV put that waits for the stream's ack
        # (or --lease-timeout), then lease_renew_s of sleep before the next.
        self.leases_published = 0
        self.leases_acked = 0
        self.lease_errors = 0  # an error ack (or no stream: "no responders"), or a failed publish
        self.lease_timeouts = 0  # no ack within --lease-timeout (the agent's renew_s * 2)
        self.lease_late_acks = 0  # acks that came after their timeout
        self.lease_hist = [0] * (len(LEASE_BUCKETS_MS) + 1)
        self.lease_lat_sum = 0.0
        self.lease_lat_max = 0.0
        # The longest time a node went between two acked renewals, and how often that passed the
        # agent's fence_timeout_s (each would have been a self-fence: its jobs frozen).
        self.lease_gap_max = 0.0
        self.lease_gaps_over_fence = 0
        self.lease_last_ok: list[float | None] = [None] * len(self.ids)
        self.lease_pending: dict[int, tuple[int, float]] = {}  # token -> (node index, sent at)
        self.lease_order: collections.deque[tuple[float, int]] = collections.deque()  # (sent at, token)
        self.lease_token = 0
        self.lheap: list[tuple[float, int]] = []
        self.probes_answered = 0
        self.probes_ignored = 0
        self.lateness_hist = [0] * (len(LATENESS_BUCKETS_MS) + 1)
        self.lateness_max = 0.0
        self.stopping = asyncio.Event()
        self.server_name = ""

    def _late(self, late_s: float, count: int = 1) -> None:
        if not count:
            return
        ms = late_s * 1000
        if late_s > self.lateness_max:
            self.lateness_max = late_s
        for b, bound in enumerate(LATENESS_BUCKETS_MS):
            if ms <= bound:
                self.lateness_hist[b] += count
                return
        self.lateness_hist[-1] += count

    def stats(self, reset_max: bool = False) -> dict:
        cpu = psutil.Process().cpu_times()
        raw = getattr(self, "raw", None)
        out = {"index": self.index, "nodes": len(self.ids), "published": self.published,
               "publish_errors": self.publish_errors + (raw.errors if raw is not None else 0), "probes_answered": self.probes_answered,
               "probes_ignored": self.probes_ignored, "lateness_hist": self.lateness_hist,
               "lateness_max_s": self.lateness_max, "wall": time.time(), "cpu_s": cpu.user + cpu.system,
               "server": self.server_name,
               "leases_published": self.leases_published, "leases_acked": self.leases_acked,
               "lease_errors": self.lease_errors, "lease_timeouts": self.lease_timeouts,
               "lease_late_acks": self.lease_late_acks, "lease_hist": list(self.lease_hist),
               "lease_lat_sum_s": self.lease_lat_sum, "lease_lat_max_s": self.lease_lat_max,
               "lease_gap_max_s": self.lease_gap_max, "lease_gaps_over_fence": self.lease_gaps_over_fence,
               "lease_in_flight": len(self.lease_pending)}
        if reset_max:  # the lease maxima from here on: the steady window's own
            self.lease_lat_max = self.lease_gap_max = 0.0
        return out

    def _lease_sent(self, k: int, now: float) -> None:
        """The renewal of node ``k`` is done (acked, failed or timed out): the next in renew_s."""
        heapq.heappush(self.lheap, (now + self.args.lease_renew, k))

    async def _on_lease_ack(self, msg) -> None:
        now = time.monotonic()
        entry = self.lease_pending.pop(int(msg.subject.rpartition(".")[2]), None)
        if entry is None:
            self.lease_late_acks += 1  # its timeout already counted it
            return
        k, sent = entry
        if not msg.data or b'"error"' in msg.data:
            self.lease_errors += 1
            self._lease_sent(k, now)
            return
        self.leases_acked += 1
        late = now - sent
        self.lease_lat_sum += late
        self.lease_lat_max = max(self.lease_lat_max, late)
        ms = late * 1000
        b = 0
        while b < len(LEASE_BUCKETS_MS) and ms > LEASE_BUCKETS_MS[b]:
            b += 1
        self.lease_hist[b] += 1
        last = self.lease_last_ok[k]
        if last is not None:
            gap = now - last
            self.lease_gap_max = max(self.lease_gap_max, gap)
            if gap > self.args.lease_fence:
                self.lease_gaps_over_fence += 1
        self.lease_last_ok[k] = now
        self._lease_sent(k, now)

    def _lease_timeouts(self, now: float) -> None:
        order, limit = self.lease_order, now - self.args.lease_timeout
        while order and order[0][0] <= limit:
            sent, token = order.popleft()
            entry = self.lease_pending.pop(token, None)
            if entry is not None:
                self.lease_timeouts += 1
                self._lease_sent(entry[0], sent + self.args.lease_timeout)

    async def run(self) -> None:
        a = self.args
        # The first URL first (the orchestrator rotates the list): generators spread over a cluster's servers.
        nc = await nats.connect(a.nats.split(","), name=f"bench-hbgen-{self.index}", connect_timeout=5,
                                pending_size=64 * 2**20, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                dont_randomize=True)
        self.server_name = (getattr(nc, "_server_info", None) or {}).get("server_name", "")
        await nc.subscribe("revenant.node.*.probe", cb=self._on_probe)
        await nc.subscribe(f"{CTL}.{self.index}", cb=self._on_ctl)
        # The stream's acks for the lease puts: one wildcard inbox, the token names the put.
        inbox = f"_INBOX.bench-lease-{self.index}-{secrets.token_hex(4)}"
        if a.lease_renew > 0:
            await nc.subscribe(f"{inbox}.*", cb=self._on_lease_ack, pending_msgs_limit=4_000_000)
        await nc.flush()
        # Everyone starts at the same wall time, so phases are even across generators.
        start = time.monotonic() + max(0.0, a.start_at - time.time())
        interval, jitter = a.interval, a.jitter
        # Heartbeats are scheduled in slots of BATCH_S on a ring two intervals long: a node's next
        # heartbeat goes one interval +/- jitter later (rounded to a slot), or one interval from the
        # current slot if the generator fell behind (the agent's rule, agent/node/liveness.py).  A heap
        # per heartbeat cost more than the rest of the heartbeat at 100,000 nodes.
        per = max(1, round(interval / BATCH_S))
        ring_len = 2 * per + 1
        ring: list[list[int]] = [[] for _ in range(ring_len)]
        for k, i in enumerate(self.ids):
            ring[int(per * i / a.total) % ring_len].append(k)
        span = int(per * jitter)
        offsets = [per + self.rng.randint(-span, span) for _ in range(4099)]
        slot = 0  # the next slot to send, counted from start
        # Optional: the agent's lease, a KV put; the next lease_renew_s after its ack (or its timeout).
        renew = a.lease_renew
        self.lheap = lheap = [(start + renew * i / a.total, k) for k, i in enumerate(self.ids)] if renew > 0 else []
        heapq.heapify(lheap)
        lease_subjects = [f"$KV.{subjects.LEASES_BUCKET}.{n}" for n in self.names]
        lease_seq = [0] * len(self.ids)
        pending, order = self.lease_pending, self.lease_order
        # Heartbeats go out on a socket of their own, as pre-encoded frames patched in place.
        raw = RawPublisher(f"bench-hbraw-{self.index}")
        await raw.connect(a.nats.split(",")[0])
        self.raw = raw
        frames = [self.frame(k, interval) for k in range(len(self.ids))]
        slims = [self.frame(k, interval, full=False) for k in range(len(self.ids))]
        full_every = max(1, a.full_every)
        batch: list[bytes] = []
        pack_into = struct.pack_into
        pop = heapq.heappop
        seqs, last_sent, silenced = self.seq, self.last_sent, self.silenced
        draw = 0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                burst = 0
                current = int((now - start) / BATCH_S)
                while slot <= current:
                    nodes = ring[slot % ring_len]
                    ring[slot % ring_len] = []
                    late = now - (start + slot * BATCH_S)
                    wall = time.time()
                    base = slot if current - slot < per else current  # fell an interval behind: from now
                    for k in nodes:
                        if silenced[k]:
                            continue  # silenced for good: its schedule ends here
                        seq = seqs[k] = seqs[k] + 1
                        # As the agent: full in its first heartbeats and every full_every-th (the
                        # simulated verdicts never change), slim in between (agent/node/liveness.py FullBeats).
                        frame, seq_at, sent_at = frames[k] if seq <= FULL_FIRST or seq % full_every == 0 else slims[k]
                        pack_into(">I", frame, seq_at, seq)
                        pack_into(">d", frame, sent_at, wall)
                        batch.append(bytes(frame))
                        last_sent[k] = wall
                        draw = (draw + 1) % len(offsets)
                        ring[(base + offsets[draw]) % ring_len].append(k)
                    self._late(late, len(nodes))
                    slot += 1
                    if len(batch) >= 2000:
                        self.published += raw.send(batch)
                        await asyncio.sleep(0)  # let probes in
                self.published += raw.send(batch)
                await raw.drain()
                self._lease_timeouts(now)
                while lheap and lheap[0][0] <= now:
                    due, k = pop(lheap)
                    if self.silenced[k]:
                        continue
                    lease_seq[k] += 1
                    value = msgspec.msgpack.encode(LeaseValue(node=self.names[k], incarnation=self.incarnations[k],
                                                              seq=lease_seq[k], at=time.time()))
                    self.lease_token += 1
                    token = self.lease_token
                    sent = time.monotonic()
                    pending[token] = (k, sent)  # before the publish: its ack may come while it flushes
                    order.append((sent, token))
                    try:
                        await nc.publish(lease_subjects[k], value, reply=f"{inbox}.{token}")
                        self.leases_published += 1
                    except nats.errors.Error:
                        if pending.pop(token, None) is not None:
                            self.lease_errors += 1
                            self._lease_sent(k, sent)
                    burst += 1
                    if burst % 200 == 0:
                        await asyncio.sleep(0)
                # Send in batches every few ms: a timer per heartbeat would cost more than the heartbeat.
                next_slot = start + slot * BATCH_S
                delay = min(next_slot, lheap[0][0] if lheap else next_slot) - time.monotonic()
                await asyncio.sleep(min(max(delay, 0.001), 0.02))
        finally:
            await raw.close()
            try:
                await asyncio.wait_for(nc.drain(), 3)
            except (asyncio.TimeoutError, nats.errors.Error):
                await nc.close()

    def frame(self, k: int, interval: float, full: bool = True) -> tuple[bytearray, int, int]:
        """Node ``k``'s heartbeat as a whole NATS ``PUB`` frame, and where its seq and sent_at are.

        The seq is written as a msgpack uint32 and sent_at as a float64 whatever their values (valid
        msgpack: the decoder takes a wider form than needed), so each heartbeat patches 12 bytes of
        its frame instead of encoding a message: what a compiled sender would do."""
        hb = Heartbeat(node=self.names[k], seq=0xFFFFFFFF, sent_at=0.5, incarnation=self.incarnations[k],
                       pid=self.pids[k], interval_s=interval, capabilities=self.caps[k] if full else None,
                       health=self.healths[k % len(self.healths)] if full else None)
        payload = encode(hb)
        head = f"PUB {self.subjects[k]} {len(payload)}\r\n".encode()
        seq_at = len(head) + payload.index(b"\xa3seq\xce") + 5
        sent_at = len(head) + payload.index(b"\xa7sent_at\xcb") + 9
        return bytearray(head + payload + b"\r\n"), seq_at, sent_at

    async def _on_probe(self, msg) -> None:
        node = msg.subject.split(".")[2]
        k = self.by_name.get(node)
        if k is None:
            return  # another generator's node
        if self.silenced[k]:
            self.probes_ignored += 1
            return
        try:
            decode_as(msg.data, Probe)
            reply = encode(ProbeReply(node=node, incarnation=self.incarnations[k], seq=self.seq[k],
                                      sent_at=time.time(), health=self.healths[k % len(self.healths)]))
        except MessageError as exc:
            reply = bus.error_reply(exc)
        if msg.reply:
            try:
                await msg.respond(reply)
                self.probes_answered += 1
            except nats.errors.Error:
                pass

    async def _on_ctl(self, msg) -> None:
        req = json.loads(msg.data)
        op = req.get("op")
        if op == "silence":
            out = {}
            for name in req["nodes"]:
                k = self.by_name.get(name)
                if k is not None:
                    self.silenced[k] = True
                    out[name] = self.last_sent[k]
            reply = {"last_sent": out, "silenced_at": time.time()}
        elif op == "stats":
            reply = self.stats(reset_max=bool(req.get("reset_max")))
        elif op == "stop":
            reply = self.stats()
            self.stopping.set()
        else:
            reply = {"error": f"unknown op {op!r}"}
        await msg.respond(json.dumps(reply).encode())


def generator_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="heartbeats.py generate")
    p.add_argument("--nats", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--jitter", type=float, default=0.1)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lease-renew", type=float, default=0.0)
    p.add_argument("--lease-timeout", type=float, default=0.7)
    p.add_argument("--lease-fence", type=float, default=1.2)
    p.add_argument("--full-every", type=int, default=AgentConfig().heartbeat_full_every)
    args = p.parse_args(argv)
    import uvloop

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Below the coordinator under test: on a small machine the load shares its cores, and a
    # fair share among several busy generators would starve the process being measured.
    os.nice(10)
    uvloop.run(Generator(args).run())
    return 0


# =============================================================================== orchestration


def cpu_s(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return math.nan


def rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_get(url: str, timeout_s: float = 30.0) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - t0


def metric(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def top_functions(path: Path, limit: int = 20) -> dict:
    """Where the coordinator's CPU went, from py-spy's collapsed stacks (GIL-holding samples only).

    ``inclusive``: share of busy samples with the function anywhere on the stack
    (frames common to nearly every sample, like the event loop's run, are left
    out); ``self``: share with the function on top.
    """
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r" \(.*?([^/]+\.py):\d+\)$", r" (\1)", f) for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    if not total:
        return {"samples": 0, "inclusive": [], "self": []}
    share = lambda n: round(100 * n / total, 1)  # noqa: E731
    return {
        "samples": total,
        "inclusive": [{"function": f, "percent": share(n)}
                      for f, n in sorted(inclusive.items(), key=lambda kv: -kv[1]) if n < 0.97 * total][:limit],
        "self": [{"function": f, "percent": share(n)} for f, n in sorted(own.items(), key=lambda kv: -kv[1])][:limit],
    }


def lateness_quantile(hist: list[int], q: float) -> str:
    total = sum(hist)
    if not total:
        return "-"
    acc = 0
    for b, n in enumerate(hist):
        acc += n
        if acc >= q * total:
            return f"<={LATENESS_BUCKETS_MS[b]} ms" if b < len(LATENESS_BUCKETS_MS) else f">{LATENESS_BUCKETS_MS[-1]} ms"
    return "-"


def hist_quantile_ms(hist: list[int], q: float) -> float | None:
    """The ``q`` quantile of a LEASE_BUCKETS_MS histogram, interpolated within its bucket."""
    total = sum(hist)
    if not total:
        return None
    acc = 0
    for b, count in enumerate(hist):
        if count and acc + count >= q * total:
            lo = LEASE_BUCKETS_MS[b - 1] if b > 0 else 0.0
            hi = LEASE_BUCKETS_MS[b] if b < len(LEASE_BUCKETS_MS) else LEASE_BUCKETS_MS[-1] * 2
            return round(lo + (hi - lo) * (q * total - acc) / count, 3)
        acc += count
    return None


def lease_window(g0: list[dict], g1: list[dict], wall: float, n: int, renew: float) -> dict:
    """The lease renewals over the steady window, from the generators' counters before and after."""
    diff = lambda key: sum(s[key] for s in g1) - sum(s[key] for s in g0)  # noqa: E731
    hist = [sum(s["lease_hist"][b] for s in g1) - sum(s["lease_hist"][b] for s in g0)
            for b in range(len(LEASE_BUCKETS_MS) + 1)]
    acked = diff("leases_acked")
    return {
        "renew_s": renew,
        "target_per_s": round(n / renew, 1),
        "published_per_s": round(diff("leases_published") / wall, 1),
        "acked_per_s": round(acked / wall, 1),
        "errors": diff("lease_errors"),
        "timeouts": diff("lease_timeouts"),
        "late_acks": diff("lease_late_acks"),
        "latency_ms": {"p50": hist_quantile_ms(hist, 0.5), "p90": hist_quantile_ms(hist, 0.9),
                       "p99": hist_quantile_ms(hist, 0.99), "p999": hist_quantile_ms(hist, 0.999),
                       "mean": round(diff("lease_lat_sum_s") / acked * 1000, 3) if acked else None,
                       "max": round(max(s["lease_lat_max_s"] for s in g1) * 1000, 1)},
        "gap_max_s": round(max(s["lease_gap_max_s"] for s in g1), 3),
        "gaps_over_fence": diff("lease_gaps_over_fence"),
        "in_flight_at_end": sum(s["lease_in_flight"] for s in g1),
    }


class Run:
    """One size: its own nats-server (or cluster of ``servers``), coordinator and generators."""

    def __init__(self, args: argparse.Namespace, n: int, tmp: Path, servers: int = 1) -> None:
        self.args = args
        self.n = n
        self.tmp = tmp
        self.servers = servers
        self.procs: list[subprocess.Popen] = []
        self.events: list[tuple[float, str, NodeEvent]] = []  # (received wall, subject, event)
        self.result: dict = {"nodes": n, "nats_servers": servers}
        self.notes: list[str] = []

    def log(self, text: str) -> None:
        where = f", {self.servers} servers" if self.servers > 1 else ""
        print(f"  [{self.n:>6} nodes{where}] {text}", flush=True)

    async def start_nats(self) -> list[NatsServer]:
        """One nats-server, or a JetStream cluster of ``servers`` started as `revenant up --nats-servers`
        starts it (common/messaging/natsserver.py), ready once its metadata leader is elected."""
        if self.servers == 1:
            return [start_nats_server(self.tmp / "nats", log_file=self.tmp / "nats.log")]
        servers = start_nats_cluster(self.tmp / "nats", self.servers, log_dir=self.tmp)
        try:
            await wait_jetstream(",".join(s.url for s in servers), self.servers, 30.0)
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers

    async def open_leases(self, url: str) -> None:
        """The lease bucket, created as an agent creates it (its TTL, history 1, the replicas that
        ``nats_replicas`` gives on this bus); its stream's leader and replicas go into the result."""
        r = self.result
        nc = await bus.connect(url, "bench-hb-leases", endless_reconnect=False)
        try:
            replicas = bus.replicas_for(nc, self.args.replicas)
            js = nc.jetstream()
            # A cluster just formed may refuse a replicated stream for a moment (its peers are not
            # all current yet): try again, as an agent's lease keeper does at each renewal.
            deadline = time.monotonic() + 20
            while True:
                try:
                    await open_bucket(js, subjects.LEASES_BUCKET, AgentConfig().lease_ttl_s, replicas=replicas)
                    break
                except RevenantError as exc:
                    if time.monotonic() > deadline:
                        raise
                    self.log(f"lease bucket not created yet ({exc}); trying again")
                    await asyncio.sleep(0.5)
            info = await js.stream_info(f"KV_{subjects.LEASES_BUCKET}")
            r["lease_replicas"] = info.config.num_replicas or 1
            r["lease_stream_leader"] = info.cluster.leader if info.cluster else ""
        finally:
            await nc.close()

    # ------------------------------------------------------------------ processes

    def start_coordinator(self, url: str) -> subprocess.Popen:
        self.coord_log = self.tmp / "coordinator.log"
        args = ["coordinator", "--nats", url, "--http-port", "0", "--name", "bench-coordinator"]
        env = {**os.environ, **dict(kv.split("=", 1) for kv in self.args.coordinator_env)}
        # Per-node health series cost a scrape seconds at 100,000 nodes (the loop stops while it
        # renders): from NODE_METRICS_OFF_FROM nodes the coordinator runs as docs/deploy.md says
        # a large cluster should, with node_metrics = false (--coordinator-env overrides).
        env.setdefault("REVENANT_COORDINATOR_NODE_METRICS", "false" if self.n >= NODE_METRICS_OFF_FROM else "true")
        self.result["node_metrics"] = env["REVENANT_COORDINATOR_NODE_METRICS"]
        if self.args.source is None:  # the installed command: the working tree, as production runs it
            cmd = [str(Path(sys.executable).parent / "revenant"), *args]
        else:  # the same command from an exported commit (see --coordinator-ref)
            cmd = [sys.executable, "-m", "revenant.cli", *args]
            env["PYTHONPATH"] = str(self.args.source)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.coord_log, "wb"),
                                stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def start_profiler(self, pid: int, phase: str) -> subprocess.Popen | None:
        """py-spy (installed in the venv by hand; not a project dependency) on the coordinator."""
        if not self.args.profile:
            return None
        spy = Path(sys.executable).parent / "py-spy"
        out = self.args.out.parent / f"{self.args.out.stem}-{self.n}-profile-{phase}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)  # never report an older run's profile
        # --gil: only samples that hold the GIL, i.e. Python running, not the loop waiting in epoll.
        cmd = [str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking", "--gil",
               "--output", str(out)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(self.tmp / f"py-spy-{phase}.log", "wb"))
        self.procs.append(proc)
        self.profiles = getattr(self, "profiles", {})
        self.profiles[phase] = (proc, out)
        return proc

    def stop_profiler(self, phase: str) -> None:
        entry = getattr(self, "profiles", {}).get(phase)
        if entry is None:
            return
        proc, out = entry
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if out.exists():
            self.result.setdefault("profiles", {})[phase] = {"file": str(out), "top": top_functions(out)}

    def start_generators(self, url: str, count: int, start_at: float) -> list[subprocess.Popen]:
        gens = []
        bounds = [round(self.n * g / count) for g in range(count + 1)]
        urls = url.split(",")
        for g in range(count):
            # Generator g on server g (mod their number) first, as agents spread over a cluster.
            mine = ",".join(urls[g % len(urls):] + urls[:g % len(urls)])
            cmd = [sys.executable, str(Path(__file__).resolve()), "generate", "--nats", mine, "--index", str(g),
                   "--first", str(bounds[g]), "--last", str(bounds[g + 1]), "--total", str(self.n),
                   "--interval", str(self.args.interval), "--jitter", str(self.args.jitter),
                   "--start-at", repr(start_at), "--seed", str(self.args.seed),
                   "--lease-renew", str(self.args.leases), "--lease-timeout", str(self.args.leases * 2),
                   "--lease-fence", str(AgentConfig().fence_timeout_s), "--full-every", str(self.args.full_every)]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.tmp / f"gen-{g}.log", "wb"),
                                    stderr=subprocess.STDOUT)
            self.procs.append(proc)
            gens.append(proc)
        return gens

    async def wait_http_url(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"coordinator exited with {proc.returncode}:\n{self.coord_log.read_text()[-3000:]}")
            m = re.search(r"HTTP endpoints on (http://\S+)", self.coord_log.read_text(errors="replace"))
            if m:
                base = m.group(1).rstrip("/")
                status, _, _ = await asyncio.to_thread(http_get, base + "/ready", 5)
                if status == 200:
                    return base
            await asyncio.sleep(0.2)
        raise SystemExit("coordinator not ready within 30 s")

    async def gen_ctl(self, nc, g: int, op: dict, timeout_s: float = 10.0) -> dict:
        resp = await nc.request(f"{CTL}.{g}", json.dumps(op).encode(), timeout=timeout_s)
        return json.loads(resp.data)

    async def gen_stats(self, nc, count: int, reset_max: bool = False) -> list[dict]:
        return await asyncio.gather(*(self.gen_ctl(nc, g, {"op": "stats", "reset_max": reset_max})
                                      for g in range(count)))

    # ------------------------------------------------------------------ the run

    async def execute(self) -> dict:
        r = self.result
        r["coordinator_code_sha256"] = code_fingerprint(self.args.source or REPO)
        servers = await self.start_nats()
        url = ",".join(s.url for s in servers)
        try:
            if self.args.leases > 0:
                await self.open_leases(url)
            coord = self.start_coordinator(url)
            base = await self.wait_http_url(coord)
            r["coordinator_http"] = base
            nc = await nats.connect(url.split(","), name="bench-hb-observer", connect_timeout=5)
            try:
                await nc.subscribe(f"{subjects.EVENTS_PREFIX}.node.>", cb=self._on_event)
                await nc.flush()
                try:
                    await self._execute(nc, servers, coord, base)
                except Exception as exc:
                    if coord.poll() is None:
                        raise
                    raise SystemExit(f"the coordinator exited with status {coord.returncode} "
                                     f"({type(exc).__name__} in the bench): {self.coordinator_last_words()}") from exc
            finally:
                await nc.close()
        finally:
            for phase in list(getattr(self, "profiles", {})):
                self.stop_profiler(phase)
            # The coordinator first: it must not judge nodes whose generator is going away.
            for proc in self.procs:
                stop_process(proc)
            for server in servers:
                server.stop()
            self._read_logs()
        return r

    async def _on_event(self, msg) -> None:
        try:
            ev = decode(msg.data)
        except MessageError:
            return
        if isinstance(ev, NodeEvent):
            self.events.append((time.time(), msg.subject, ev))

    def _kinds(self, kind: str, since: float = 0.0) -> list[NodeEvent]:
        return [ev for t, _, ev in self.events if ev.kind == kind and t >= since]

    async def _execute(self, nc, servers: list[NatsServer], coord: subprocess.Popen, base: str) -> None:
        a, r, n = self.args, self.result, self.n
        # At least one generator per server of the largest cluster measured (the same count on each bus).
        count = a.generators or max(1, math.ceil(n / a.nodes_per_generator), max(a.nats_servers))
        r["generators"] = count
        r["interval_s"] = a.interval
        url = ",".join(s.url for s in servers)
        pc, ps = psutil.Process(coord.pid), [psutil.Process(s.pid) for s in servers]
        # The coordinator's own floor: no nodes yet, only its timers.
        i0, n0, iw0 = cpu_s(pc), sum(cpu_s(p) for p in ps), time.monotonic()
        await asyncio.sleep(a.idle)
        r["coordinator_idle_cpu_percent"] = round((cpu_s(pc) - i0) / (time.monotonic() - iw0) * 100, 2)
        # The bus's own floor too: a cluster keeps its RAFT groups (the coordinator's streams) alive.
        r["nats_server_idle_cpu_percent"] = round((sum(cpu_s(p) for p in ps) - n0) / (time.monotonic() - iw0) * 100, 2)
        t_start = time.time()
        self.start_profiler(coord.pid, "join")
        gens = self.start_generators(url, count, start_at=t_start + 2.0)
        pg = [psutil.Process(p.pid) for p in gens]
        me = psutil.Process()

        # -------------------------------------------------------------- warm-up: everyone joined
        deadline = time.monotonic() + a.join_timeout
        alive = 0
        while True:
            if coord.poll() is not None:
                raise SystemExit(f"the coordinator exited with status {coord.returncode} while {alive} of {n} "
                                 f"nodes were alive: {self.coordinator_last_words()}")
            for p in gens:
                if p.poll() is not None:
                    raise SystemExit(f"a load generator exited with status {p.returncode}; see gen-*.log")
            try:
                status, body, _ = await asyncio.to_thread(http_get, base + "/health", 10)
                counts = json.loads(body).get("nodes", {}) if status == 200 else {}
            except OSError as exc:  # a coordinator too busy to answer is not done joining
                counts = {}
                self.log(f"/health: {exc}")
            alive = counts.get("alive", 0)
            if alive >= n:
                break
            if time.monotonic() > deadline:
                self.stop_profiler("join")
                raise SystemExit(f"only {alive} of {n} nodes alive after {a.join_timeout:g} s")
            await asyncio.sleep(0.5)
        r["all_joined_after_s"] = round(time.time() - (t_start + 2.0), 2)
        # The join events go out one JetStream publish at a time: wait until they stop coming.
        last, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 2.0 and time.monotonic() < deadline + 60:
            seen = len(self._kinds("joined"))
            if seen != last:
                last, stable_since = seen, time.monotonic()
            if seen >= n:
                break
            await asyncio.sleep(0.25)
        r["join_events_seen"] = len(self._kinds("joined"))
        r["join_events_published_after_s"] = round(time.time() - (t_start + 2.0), 2)
        self.log(f"{alive} alive after {r['all_joined_after_s']} s; {r['join_events_seen']} join events seen; "
                 f"warming up {a.warmup:g} s")
        self.stop_profiler("join")
        await asyncio.sleep(a.warmup)

        # -------------------------------------------------------------- steady state
        ts0 = time.monotonic()
        _, m0_text, scrape0 = await asyncio.to_thread(http_get, base + "/metrics", 60)
        g0 = await self.gen_stats(nc, count, reset_max=True)
        mach0 = psutil.cpu_times()
        w0 = time.monotonic()
        self.start_profiler(coord.pid, "steady")
        s0 = [cpu_s(p) for p in ps]
        c0 = {"coordinator": cpu_s(pc), "nats-server": sum(s0), "generators": sum(cpu_s(p) for p in pg),
              "observer": cpu_s(me)}
        rss_samples: list[int] = []
        while time.monotonic() - w0 < a.duration:
            rss_samples.append(rss(pc))
            await asyncio.sleep(min(1.0, max(0.0, a.duration - (time.monotonic() - w0))))
        s1 = [cpu_s(p) for p in ps]
        c1 = {"coordinator": cpu_s(pc), "nats-server": sum(s1), "generators": sum(cpu_s(p) for p in pg),
              "observer": cpu_s(me)}
        w1 = time.monotonic()
        mach1 = psutil.cpu_times()
        rss_samples.append(rss(pc))
        self.stop_profiler("steady")
        g1 = await self.gen_stats(nc, count)
        ts1 = time.monotonic()
        _, m1_text, scrape1 = await asyncio.to_thread(http_get, base + "/metrics", 60)
        wall = w1 - w0
        cpu = {k: (c1[k] - c0[k]) / wall * 100 for k in c0}
        busy = lambda t: t.user + t.nice + t.system + t.irq + t.softirq + t.steal  # noqa: E731
        machine_pct = (busy(mach1) - busy(mach0)) / wall * 100
        published = sum(s["published"] for s in g1) - sum(s["published"] for s in g0)
        leases = sum(s["leases_published"] for s in g1) - sum(s["leases_published"] for s in g0)
        gen_wall = statistics.mean(s["wall"] for s in g1) - statistics.mean(s["wall"] for s in g0)
        m0_text, m1_text = m0_text.decode(), m1_text.decode()
        rcv0 = metric(m0_text, "revenant_heartbeats_received_total", '{result="ok"}') or 0
        rcv1 = metric(m1_text, "revenant_heartbeats_received_total", '{result="ok"}') or 0
        # The counter is read somewhere inside each scrape: take the scrapes' midpoints.
        received_rate = (rcv1 - rcv0) / ((ts1 + scrape1 / 2) - (ts0 + scrape0 / 2))
        r.update({
            "window_s": round(wall, 2),
            "coordinator_cpu_percent": round(cpu["coordinator"], 1),
            "coordinator_rss_mib": round(rss_samples[-1] / 2**20, 1),
            "coordinator_rss_max_mib": round(max(rss_samples) / 2**20, 1),
            "nats_server_cpu_percent": round(cpu["nats-server"], 1),
            "nats_server_cpu_percent_each": [round((b - a0) / wall * 100, 1) for a0, b in zip(s0, s1)],
            "nats_server_rss_mib_each": [round(rss(p) / 2**20, 1) for p in ps],
            "generators_cpu_percent": round(cpu["generators"], 1),
            "observer_cpu_percent": round(cpu["observer"], 1),
            "machine_cpu_percent": round(machine_pct, 1),
            "machine_cpu_capacity_percent": 100 * (os.cpu_count() or 1),
            "other_cpu_percent": round(machine_pct - sum(cpu.values()), 1),
            "target_hb_per_s": round(n / a.interval, 1),
            "published_hb_per_s": round(published / gen_wall, 1),
            "lease_renew_s": a.leases,
            "published_leases_per_s": round(leases / gen_wall, 1),
            "generator_servers": sorted({s["server"] for s in g1}),
            "received_hb_per_s": round(received_rate, 1),
            "coordinator_cpu_us_per_heartbeat": round((c1["coordinator"] - c0["coordinator"]) * 1e6
                                                      / max(1.0, received_rate * wall), 1),
            "publish_errors": sum(s["publish_errors"] for s in g1),
            "coordinator_loop_lag_s": metric(m1_text, "revenant_event_loop_lag_seconds"),
            "metrics_scrape_first_s": round(scrape0, 3),
            "metrics_scrape_s": round(scrape1, 3),
            "metrics_scrape_bytes": len(m1_text),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        })
        hist = [sum(s["lateness_hist"][b] for s in g1) for b in range(len(LATENESS_BUCKETS_MS) + 1)]
        r["generator_lateness"] = {"p50": lateness_quantile(hist, 0.5), "p99": lateness_quantile(hist, 0.99),
                                   "max_s": round(max(s["lateness_max_s"] for s in g1), 3),
                                   "hist_ms": dict(zip([*map(str, LATENESS_BUCKETS_MS), "more"], hist))}
        if a.leases > 0:
            r["leases"] = lease_window(g0, g1, gen_wall, n, a.leases)
        self._check_rate("steady", r["published_hb_per_s"], r["target_hb_per_s"])
        self.log(f"steady: coordinator {r['coordinator_cpu_percent']}% of a core, {r['coordinator_rss_mib']} MiB; "
                 f"published {r['published_hb_per_s']:.0f}/s, received {r['received_hb_per_s']:.0f}/s; "
                 f"machine {machine_pct:.0f}% of {r['machine_cpu_capacity_percent']}%")

        # -------------------------------------------------------------- silence a sample
        k = min(a.silence, n // 2)
        victims = sorted(random.Random(a.seed).sample(range(n), k))
        names = [node_name(i) for i in victims]
        bounds = [round(n * g / count) for g in range(count + 1)]
        per_gen = [[node_name(i) for i in victims if bounds[g] <= i < bounds[g + 1]] for g in range(count)]
        d0 = {"coordinator": cpu_s(pc), "wall": time.monotonic()}
        replies = await asyncio.gather(*(self.gen_ctl(nc, g, {"op": "silence", "nodes": per_gen[g]})
                                         for g in range(count)))
        last_sent: dict[str, float] = {}
        for rep in replies:
            last_sent.update(rep["last_sent"])
        silenced_at = min(rep["silenced_at"] for rep in replies)
        silenced = set(names)
        deadline = time.monotonic() + a.detect_timeout
        while time.monotonic() < deadline:
            if silenced <= {ev.node for ev in self._kinds("dead")}:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(a.tail)
        d1 = {"coordinator": cpu_s(pc), "wall": time.monotonic()}
        r["coordinator_cpu_percent_detection_phase"] = round(
            (d1["coordinator"] - d0["coordinator"]) / (d1["wall"] - d0["wall"]) * 100, 1)
        g2 = await self.gen_stats(nc, count)
        detect_wall = statistics.mean(s["wall"] for s in g2) - statistics.mean(s["wall"] for s in g1)
        r["published_hb_per_s_detection_phase"] = round(
            (sum(s["published"] for s in g2) - sum(s["published"] for s in g1)) / detect_wall, 1)
        self._check_rate("detection", r["published_hb_per_s_detection_phase"], (n - k) / a.interval)
        r["probes_answered"] = sum(s["probes_answered"] for s in g2)
        r["probes_ignored"] = sum(s["probes_ignored"] for s in g2)
        self.silenced, self.last_sent = silenced, last_sent

        # -------------------------------------------------------------- the node table over NATS, last:
        # `revenant nodes` at this size (it stalls the coordinator while it builds the reply).
        t0 = time.monotonic()
        try:
            reply = await request_nodes(nc, 30)
            r["nodes_request"] = {"ok": True, "nodes": len(reply.nodes), "s": round(time.monotonic() - t0, 3)}
        except (RevenantError, MessageError) as exc:
            r["nodes_request"] = {"ok": False, "error": str(exc), "s": round(time.monotonic() - t0, 3)}
        await asyncio.sleep(3)  # a verdict caused by that stall would show up here
        self._score(silenced, last_sent, silenced_at)

    def _check_rate(self, phase: str, published: float, target: float) -> None:
        """A note when the generators did not send at their target rate in a phase: short of it, or
        more than it (behind, then catching up in bursts the coordinator did not have to take)."""
        if not 0.97 * target <= published <= 1.03 * target:
            self.notes.append(f"{phase} phase: the generators published {published:.0f} of {target:.0f} "
                              f"heartbeats/s ({published / target:.0%}): not the target rate")

    def _score(self, silenced: set[str], last_sent: dict[str, float], silenced_at: float) -> None:
        r = self.result
        first_dead: dict[str, tuple[float, NodeEvent]] = {}
        for t, _, ev in self.events:
            if ev.kind == "dead" and ev.node not in first_dead:
                first_dead[ev.node] = (t, ev)
        verdict, delivered, coord_silence = [], [], []
        for name in sorted(silenced):
            if name in first_dead:
                t, ev = first_dead[name]
                verdict.append(ev.at - last_sent[name])
                delivered.append(t - last_sent[name])
                coord_silence.append(ev.silence_s)
        r["silenced"] = len(silenced)
        r["silenced_at"] = silenced_at
        r["detected"] = len(verdict)
        r["detection_s"] = {
            "median": round(statistics.median(verdict), 3) if verdict else None,
            "p99": round(quantile(verdict, 0.99), 3) if verdict else None,
            "max": round(max(verdict), 3) if verdict else None,
            "min": round(min(verdict), 3) if verdict else None,
            "delivered_median": round(statistics.median(delivered), 3) if delivered else None,
            "delivered_max": round(max(delivered), 3) if delivered else None,
            "coordinator_silence_median": round(statistics.median(coord_silence), 3) if coord_silence else None,
        }
        false_dead = sorted({ev.node for _, _, ev in self.events if ev.kind == "dead" and ev.node not in silenced})
        false_suspect = sorted({ev.node for _, _, ev in self.events
                                if ev.kind == "suspect" and ev.node not in silenced})
        r["false_dead_events"] = false_dead
        r["false_dead"] = len(false_dead)
        r["false_suspect"] = len(false_suspect)
        r["recovered_events"] = len(self._kinds("recovered"))
        if len(verdict) < len(silenced):
            self.notes.append(f"{len(silenced) - len(verdict)} silenced nodes got no dead event on the bus")

    def coordinator_last_words(self) -> str:
        """The coordinator's own last error: its `revenant: ...` exit line, else its last ERROR line."""
        text = self.coord_log.read_text(errors="replace") if hasattr(self, "coord_log") else ""
        exits = re.findall(r"^revenant: (.*)$", text, re.M)
        errors = re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) \[[^]]*\] (.*)$", text, re.M)
        return (exits or errors or ["nothing in its log"])[-1][:200]

    def _read_logs(self) -> None:
        r = self.result
        text = self.coord_log.read_text(errors="replace") if hasattr(self, "coord_log") else ""
        dead_logged = set(re.findall(r"node (\S+) dead \(silent", text))
        silenced = getattr(self, "silenced", set())
        r["false_dead_in_log"] = len(dead_logged - silenced)
        r["dead_in_log"] = len(dead_logged)
        r["event_queue_full_drops"] = text.count("event queue full")
        r["events_lost"] = text.count("event lost")
        r["coordinator_stalls"] = text.count("coordinator stalled")
        r["leader_lease_lost"] = text.count("lost the leader lease")
        r["coordinator_errors"] = len(re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) ", text, re.M))
        r["coordinator_last_error"] = self.coordinator_last_words() if r["coordinator_errors"] else ""
        r["nats_client_warnings"] = len(re.findall(r"nats \(revenant-coordinator", text))
        nlogs = [f.read_text(errors="replace") for f in [self.tmp / "nats.log", *self.tmp.glob("nats-server-*.log")]
                 if f.exists()]
        r["nats_slow_consumers"] = sum(text.lower().count("slow consumer") for text in nlogs)
        if r["false_dead_in_log"] > r.get("false_dead", 0):
            r["false_dead"] = r["false_dead_in_log"]
        if r["event_queue_full_drops"]:
            self.notes.append(f"the coordinator's event queue overflowed: {r['event_queue_full_drops']} events "
                              f"dropped (join burst)")
        r["notes"] = self.notes


# =============================================================================== report


def table(runs: list[dict]) -> str:
    header = ["nodes", "gens", "hb/s target", "published", "received", "coord CPU", "coord RSS",
              "detect median", "detect max", "detected", "false dead", "false suspect",
              "nats CPU", "gen CPU", "machine CPU", "gen late p99/max"]
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([f"{r['nodes']:,}", str(r.get("generators", "-")), f"{r['nodes'] / args_interval(r):,.0f}",
                         *["-"] * 12, "FAILED (below)"])
            continue
        d = r["detection_s"]
        lat = r["generator_lateness"]
        rows.append([
            f"{r['nodes']:,}", str(r["generators"]), f"{r['target_hb_per_s']:,.0f}",
            f"{r['published_hb_per_s']:,.0f}", f"{r['received_hb_per_s']:,.0f}",
            f"{r['coordinator_cpu_percent']:.1f} %", f"{r['coordinator_rss_mib']:.0f} MiB",
            f"{d['median']:.2f} s" if d["median"] is not None else "-",
            f"{d['max']:.2f} s" if d["max"] is not None else "-",
            f"{r['detected']}/{r['silenced']}", str(r["false_dead"]), str(r["false_suspect"]),
            f"{r['nats_server_cpu_percent']:.0f} %", f"{r['generators_cpu_percent']:.0f} %",
            f"{r['machine_cpu_percent']:.0f}/{r['machine_cpu_capacity_percent']} %",
            f"{lat['p99']} / {lat['max_s'] * 1000:.0f} ms",
        ])
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join(lines)


def lease_table(runs: list[dict]) -> str:
    header = ["servers", "R", "nodes", "renewals/s target", "acked/s", "latency p50", "p99", "max",
              "timeouts", "max gap", "gaps > fence", "nats CPU (each)", "coord CPU", "gen CPU", "machine CPU",
              "hb late p99"]
    rows = []
    for r in runs:
        le = r.get("leases")
        if le is None:
            rows.append([str(r.get("nats_servers", 1)), str(r.get("lease_replicas", "-")), f"{r['nodes']:,}",
                         *["-"] * (len(header) - 4), "FAILED" if "error" in r else "-"])
            continue
        lat = le["latency_ms"]
        each = "+".join(f"{x:.0f}" for x in r["nats_server_cpu_percent_each"])
        rows.append([
            str(r["nats_servers"]), str(r["lease_replicas"]), f"{r['nodes']:,}", f"{le['target_per_s']:,.0f}",
            f"{le['acked_per_s']:,.0f} ({le['acked_per_s'] / le['target_per_s'] * 100:.0f} %)",
            f"{lat['p50']:.2f} ms" if lat["p50"] is not None else "-",
            f"{lat['p99']:.1f} ms" if lat["p99"] is not None else "-", f"{lat['max']:.0f} ms",
            str(le["timeouts"] + le["errors"]), f"{le['gap_max_s']:.2f} s", str(le["gaps_over_fence"]),
            f"{r['nats_server_cpu_percent']:.0f} %" + (f" ({each})" if r["nats_servers"] > 1 else ""),
            f"{r['coordinator_cpu_percent']:.1f} %", f"{r['generators_cpu_percent']:.0f} %",
            f"{r['machine_cpu_percent']:.0f}/{r['machine_cpu_capacity_percent']} %",
            r["generator_lateness"]["p99"],
        ])
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def args_interval(r: dict) -> float:
    return r.get("interval_s", 1.0)


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between the two nearest ranks."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def verdict(runs: list[dict], leases: bool = False) -> tuple[bool, list[str]]:
    """The heartbeat goal; with ``leases``, runs below GOAL_NODES are enough (they measure the leases)."""
    lines, ok = [], True
    for r in runs:
        if "error" in r:
            ok = False
            lines.append(f"{r['nodes']:,} nodes: run failed: {r['error']}")
            continue
        bits = []
        if r["false_dead"]:
            ok = False
            bits.append(f"{r['false_dead']} FALSE dead verdicts")
        if r["detected"] < r["silenced"]:
            ok = False
            bits.append(f"only {r['detected']}/{r['silenced']} silenced nodes declared dead")
        if r["nodes"] >= GOAL_NODES and r["coordinator_cpu_percent"] >= GOAL_CORE_PERCENT:
            ok = False
            bits.append(f"coordinator uses {r['coordinator_cpu_percent']:.0f}% of a core (goal < 100%)")
        p99 = (r.get("detection_s") or {}).get("p99")
        if r["nodes"] >= GOAL_NODES and p99 is not None and p99 > GOAL_DETECT_P99_S:
            ok = False
            bits.append(f"detection p99 {p99:.2f} s after the last heartbeat (goal <= {GOAL_DETECT_P99_S:g} s)")
        if r["received_hb_per_s"] < 0.97 * r["target_hb_per_s"]:
            ok = ok and r["nodes"] < GOAL_NODES  # a goal run must hear its nodes
            bits.append(f"coordinator received {r['received_hb_per_s']:.0f} of {r['target_hb_per_s']:.0f} hb/s")
        if any("not the target rate" in note for note in r.get("notes", [])):
            ok = ok and r["nodes"] < GOAL_NODES  # the load was not what it should be: nothing shown
        le = r.get("leases")
        if le is not None:
            bits.append(f"leases (R{r['lease_replicas']} on {r['nats_servers']} server(s), renewed every "
                        f"{le['renew_s']:g} s): {le['acked_per_s']:.0f} of {le['target_per_s']:.0f} renewals/s "
                        f"acked, p50 {le['latency_ms']['p50']} ms, p99 {le['latency_ms']['p99']} ms, "
                        f"{le['timeouts']} timed out, {le['errors']} failed, {le['gaps_over_fence']} gaps past "
                        f"the fence timeout")
        bits += r.get("notes", [])
        if not r["nodes_request"]["ok"]:
            bits.append(f"nodes request failed: {r['nodes_request']['error']}")
        where = f" on {r['nats_servers']} servers" if r.get("nats_servers", 1) > 1 else ""
        lines.append(f"{r['nodes']:,} nodes{where}: " + ("; ".join(bits) if bits else "ok"))
    if not leases and not any(r["nodes"] >= GOAL_NODES and "error" not in r for r in runs):
        ok = False
        lines.append(f"(no completed run at {GOAL_NODES:,} nodes: the goal was not shown)")
    return ok, lines


# =============================================================================== main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="comma-separated node counts (default 20000,50000,100000)")
    p.add_argument("--duration", type=float, default=None, help="steady-state window in seconds (default 20)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds after every node joined (and the join events went out) before measuring (default 10)")
    p.add_argument("--silence", type=int, default=20, help="nodes silenced to measure detection (default 20)")
    p.add_argument("--detect-timeout", type=float, default=20.0, help="wait this long for their dead verdicts")
    p.add_argument("--tail", type=float, default=None,
                   help="seconds to keep watching for false verdicts after detection (default 5)")
    p.add_argument("--leases", type=float, nargs="?", default=0.0, const=AgentConfig().lease_renew_s,
                   metavar="SECONDS",
                   help="also renew each node's lease in KV revenant_leases as agents do: a put that waits "
                        "for the stream's ack (timeout 2 x SECONDS), then SECONDS of sleep (default "
                        f"{AgentConfig().lease_renew_s:g}, the agents' lease_renew_s); without it: off")
    p.add_argument("--nats-servers", default="1", metavar="COUNTS",
                   help="comma-separated: run every size on one nats-server (1) and/or on a JetStream cluster "
                        "of that many servers, started as `revenant up --nats-servers` does (e.g. 1,3)")
    p.add_argument("--replicas", type=int, default=0,
                   help="nats_replicas for the lease bucket and the coordinator (default 0: auto, as revenant: "
                        "3 on a cluster of 3 servers or more, else 1)")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval in seconds (default 1)")
    p.add_argument("--full-every", type=int, default=AgentConfig().heartbeat_full_every,
                   help="every this many heartbeats one is full, as the agent's heartbeat_full_every "
                        "(default %(default)s; 1: every heartbeat full, as heartbeat.v1 agents)")
    p.add_argument("--jitter", type=float, default=0.1, help="heartbeat jitter as a fraction (default 0.1, as the agent)")
    p.add_argument("--generators", type=int, default=0,
                   help="load generator processes (default: one per --nodes-per-generator nodes, and at least "
                        "the largest --nats-servers count, each connected to its own server)")
    p.add_argument("--nodes-per-generator", type=int, default=50_000,
                   help="nodes per load generator process (default 50,000)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds the idle coordinator is measured first (default 3)")
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--coordinator-ref", metavar="REF",
                   help="run the coordinator from this git commit (exported to a temporary directory) "
                        "instead of the working tree, e.g. HEAD while coordinator/ has uncommitted work")
    p.add_argument("--coordinator-src", type=Path, metavar="DIR",
                   help="run the coordinator from DIR/revenant/{agent,common,coordinator,messages,cli} (for "
                        "trying a change without touching the tree; --coordinator-ref lays a commit out so)")
    p.add_argument("--coordinator-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the coordinator (repeat it), e.g. REVENANT_COORDINATOR_TICK_INTERVAL_S=1")
    p.add_argument("--profile", action="store_true",
                   help="sample the coordinator with py-spy (`.venv/bin/pip install py-spy`; not a project "
                        "dependency) during the join and the steady window; inflates its CPU a little")
    p.add_argument("--quick", action="store_true", help="1,000 nodes, 5 s phases: for debugging the bench")
    p.add_argument("--out", type=Path, default=None,
                   help="default bench/results/heartbeats.json, with --leases heartbeats-leases.json")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("heartbeats-leases.json" if args.leases > 0 else "heartbeats.json")
    try:
        args.nats_servers = [int(c) for c in args.nats_servers.split(",")]
    except ValueError:
        p.error("--nats-servers takes comma-separated counts, e.g. 1,3")
    if any(c < 1 for c in args.nats_servers) or not 0 <= args.replicas <= 5 or args.leases < 0:
        p.error("--nats-servers counts must be >= 1, --replicas from 0 to 5, --leases >= 0")
    if args.replicas and args.replicas > min(args.nats_servers):
        p.error(f"--replicas {args.replicas} needs at least that many servers (--nats-servers)")
    if args.replicas:
        args.coordinator_env.append(f"REVENANT_COORDINATOR_NATS_REPLICAS={args.replicas}")
    quick = args.quick
    args.sizes = [int(s.replace("_", "")) for s in (args.sizes or ("1000" if quick else "20000,50000,100000")).split(",")]
    args.duration = args.duration if args.duration is not None else (5.0 if quick else 20.0)
    args.warmup = args.warmup if args.warmup is not None else (3.0 if quick else 10.0)
    args.tail = args.tail if args.tail is not None else (2.0 if quick else 5.0)
    if any("=" not in kv for kv in args.coordinator_env):
        p.error("--coordinator-env takes KEY=VALUE")
    if any(s < 2 for s in args.sizes) or args.duration <= 0 or args.interval <= 0 or args.silence < 1:
        p.error("sizes must be >= 2, --duration and --interval positive, --silence >= 1")
    return args


PACKAGES = ("agent", "common", "coordinator", "messages", "cli")


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True).stdout.strip()


def code_fingerprint(root: Path) -> str:
    """A hash of the Python sources the coordinator runs (the tree may change between sizes)."""
    h = hashlib.sha256()
    base = root / "revenant" if (root / "revenant").is_dir() else root
    for pkg in PACKAGES:
        for f in sorted((base / pkg).rglob("*.py")):
            h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def export_ref(ref: str, dest: Path) -> Path:
    """``ref``'s packages laid out as the ``revenant`` package under ``dest`` (for PYTHONPATH)."""
    pkg = dest / "revenant"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, *PACKAGES], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive.stdout, check=True)
    return dest


def code_under_test(args: argparse.Namespace) -> dict:
    try:
        head = git("rev-parse", "--short", "HEAD")
        if args.coordinator_src:
            return {"source": "directory", "path": str(args.source), "base_commit": head,
                    "describe": f"sources from {args.source} (a modified copy; HEAD is {head})"}
        if args.coordinator_ref:
            commit = git("rev-parse", "--short", args.coordinator_ref)
            return {"source": "git", "ref": args.coordinator_ref, "commit": commit, "dirty": [],
                    "describe": f"commit {commit} ({args.coordinator_ref}), exported"}
        dirty = [line[3:] for line in git("status", "--porcelain", "--", *PACKAGES).splitlines()]
        return {"source": "working tree", "commit": head, "dirty": dirty,
                "describe": f"working tree at {head}" + (f" with {len(dirty)} uncommitted change(s) in "
                                                        f"{', '.join(PACKAGES)}" if dirty else ", clean")}
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"source": "unknown", "describe": f"unknown ({exc})"}


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": psutil.virtual_memory().total,
            "kernel": platform.release(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["generate"]:
        return generator_main(argv[1:])
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    import uvloop

    src_tmp = None
    args.source = None
    if args.coordinator_ref:
        src_tmp = tempfile.TemporaryDirectory(prefix="revenant-bench-src-")
        args.source = export_ref(args.coordinator_ref, Path(src_tmp.name))
    elif args.coordinator_src:
        args.source = args.coordinator_src.resolve()
        if not (args.source / "revenant" / "coordinator").is_dir():
            raise SystemExit(f"--coordinator-src {args.source}: no revenant/coordinator/ in it")
    code = code_under_test(args)
    print(f"coordinator code: {code['describe']}", flush=True)
    runs: list[dict] = []
    print(f"heartbeat scale: sizes {args.sizes}, window {args.duration:g} s, silence {args.silence}, "
          f"nats-servers {args.nats_servers}, leases {args.leases or 'off'}, {os.cpu_count()} CPUs", flush=True)
    for count, n in [(c, n) for c in args.nats_servers for n in args.sizes]:
        with tempfile.TemporaryDirectory(prefix=f"revenant-bench-hb-{n}-") as tmp:
            run = Run(args, n, Path(tmp), servers=count)
            try:
                runs.append(uvloop.run(run.execute()))
            except (SystemExit, Exception) as exc:  # one size failing must not lose the others
                res = run.result
                res["error"] = str(exc) or type(exc).__name__
                runs.append(res)
                print(f"  [{n:>6} nodes] FAILED: {res['error']}", flush=True)
                log = Path(tmp) / "coordinator.log"
                if log.exists():
                    sys.stderr.write(log.read_text(errors="replace")[-2000:])
            finally:
                # The logs (coordinator, nats-server, generators) outlive the run, next to the JSON.
                keep = args.out.parent / (f"{args.out.stem}-logs-{n}" + (f"-{count}servers" if count > 1 else ""))
                shutil.rmtree(keep, ignore_errors=True)
                keep.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy(log, keep / log.name)
    if src_tmp is not None:
        src_tmp.cleanup()
    ok, lines = verdict(runs, leases=args.leases > 0)
    if len({r.get("coordinator_code_sha256") for r in runs}) > 1:
        lines.append("NOTE: the coordinator's code changed between sizes (someone edited the tree during the run)")
    print()
    print(table(runs))
    if args.leases > 0:
        print()
        print(lease_table(runs))
    print()
    print("\n".join(lines))
    if args.leases > 0:
        kept = all("leases" in r and r["leases"]["acked_per_s"] >= 0.95 * r["leases"]["target_per_s"]
                   and not r["leases"]["gaps_over_fence"] for r in runs)
        print(f"lease renewals kept up (>= 95 % of N / lease_renew_s acked, no gap past fence_timeout_s) "
              f"in every run: {'yes' if kept else 'NO'}")
    shown = any(r["nodes"] >= GOAL_NODES and "error" not in r for r in runs)
    status = "NOT met" if not ok else "MET" if shown else f"not shown (no run at {GOAL_NODES:,} nodes)"
    print(f"goal ({GOAL_NODES:,} nodes on < 1 core, no false verdicts, detection p99 <= {GOAL_DETECT_P99_S:g} s): "
          f"{status}")
    doc = {"goal": {"nodes": GOAL_NODES, "core_percent_below": GOAL_CORE_PERCENT, "false_dead": 0}, "met": ok,
           "verdict": lines, "machine": machine(), "coordinator_code": code, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()},
           "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
