"""The heartbeat benchmark's load (bench/heartbeats.py): generator processes that simulate nodes,
each publishing heartbeats (and, with --leases, renewing its lease) as an agent would and
answering the coordinator's probes for its live nodes; and the readings of their counters.
Run as ``python bench/heartbeats.py generate ...`` by the benchmark itself.

Two ways to carry the heartbeats (``--conns``): ``shared``, every node of a generator on one
socket (RawPublisher), the cheap way to make 100,000 nodes; ``per-node``, each node on a
connection of its own (NodeConn), as each agent has, subscribed where an agent subscribes and
answering its own probes.  On an authenticated bus (``--keys DIR``: the keyring ``revenant up``
would write) a per-node connection signs the server's nonce as ``agent-<node>``, the identity
whose permissions let it publish only its own ``revenant.hb.<node>``; a shared one (and every
generator's control connection) can only be the ``coordinator`` identity, the one allowed to
publish every node's heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import heapq
import json
import os
import random
import secrets
import signal
import struct
import sys
import time
import urllib.parse
import urllib.request

import msgspec
import nats
import nats.errors
import psutil

from revenant.agent.node.liveness import FULL_FIRST
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig
from revenant.messages import (Capabilities, CriuInfo, HealthSummary, Heartbeat, LeaseValue, MessageError, Probe,
                               ProbeReply, decode_as, encode, subjects)

# Under revenant.>: on an authenticated bus the benchmark's control connections are the coordinator
# identity's, which may publish and subscribe there and nowhere else (no coordinator subscribes here).
CTL = "revenant.bench.hbgen"
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


def nkey_fields(seed: bytes, nonce: str) -> dict[str, str]:
    """The CONNECT fields that authenticate as the NKey ``seed``: its public key and its signature of
    the server's ``nonce`` (as nats-py sends them)."""
    import nkeys

    kp = nkeys.from_seed(bytearray(seed.strip()))
    try:
        return {"nkey": kp.public_key.decode(), "sig": base64.b64encode(kp.sign(nonce.encode())).decode()}
    finally:
        kp.wipe()


def connect_options(name: str, info: dict, seed: bytes | None) -> bytes:
    """A minimal CONNECT (not verbose, no headers); signed with ``seed`` if the server sent a nonce."""
    connect: dict = {"verbose": False, "pedantic": False, "lang": "python", "version": "bench", "protocol": 1,
                     "name": name, "headers": False, "no_responders": False}
    if seed is not None:
        if "nonce" not in info:
            raise SystemExit("the server asks for no credential, but the benchmark was given keys (--keys)")
        connect.update(nkey_fields(seed, info["nonce"]))
    return b"CONNECT " + json.dumps(connect).encode() + b"\r\n"


# =============================================================================== load generator


class RawPublisher:
    """Core NATS publishes written straight to a socket in batches: the heartbeat load without a
    client library's per-message work (nats-py costs several microseconds a message, which at
    100,000 nodes is more than the machine's share for the load).  It speaks the client protocol's
    minimum: CONNECT (not verbose), PUB frames, PONG to the server's PING; an -ERR is counted."""

    def __init__(self, name: str, seed: bytes | None = None) -> None:
        self.name = name
        self.seed = seed  # an NKey seed: authenticate with it (the coordinator identity's, see --keys)
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
        self._writer.write(connect_options(self.name, json.loads(info[5:]), self.seed) + b"PING\r\n")
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


class NodeConn(asyncio.Protocol):
    """One simulated node's own connection (``--conns per-node``), as an agent has one: authenticated
    as ``agent-<node>`` when given its seed, subscribed to what the agent subscribes to (its probe
    subject, its commands, the coordinator's full-heartbeat requests), answering its probes on
    the same connection (the identity's ``allow_responses``), and carrying its heartbeats.  A
    protocol object rather than a stream and a task: 10,000 of them in one process."""

    def __init__(self, gen: Generator, k: int, seed: bytes | None) -> None:
        self.gen = gen
        self.k = k
        self.seed = seed
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = -1  # the size of the MSG payload awaited, or -1: a protocol line
        self.subject = b""
        self.reply = b""
        self.connected = False
        self.closed = False
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(self.gen.last_error or "closed by the server"))
        elif not self.gen.stopping.is_set():
            self.gen.conns_lost += 1

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            if self.need >= 0:  # a message's payload, then CRLF
                if len(buf) < self.need + 2:
                    return
                payload = bytes(buf[:self.need])
                del buf[:self.need + 2]
                self.need = -1
                self.gen.on_node_msg(self, self.subject, self.reply, payload)
                continue
            i = buf.find(b"\r\n")
            if i < 0:
                return
            line = bytes(buf[:i])
            del buf[:i + 2]
            if line.startswith(b"MSG "):  # MSG <subject> <sid> [reply] <size>
                parts = line.split(b" ")
                self.subject = parts[1]
                self.reply = parts[3] if len(parts) == 5 else b""
                self.need = int(parts[-1])
            elif line == b"PING":
                self.write(b"PONG\r\n")
            elif line == b"PONG":
                if not self.ready.done():
                    self.ready.set_result(None)
            elif line.startswith(b"INFO ") and not self.connected:
                self.connected = True
                name = self.gen.names[self.k]
                try:
                    hello = connect_options(f"bench-agent-{name}", json.loads(line[5:]), self.seed)
                except SystemExit as exc:
                    self.ready.set_exception(exc)
                    return
                subs = (subjects.probe(name), subjects.node_commands(name), subjects.HEARTBEAT_REQUESTS)
                self.write(hello + b"".join(f"SUB {s} {i + 1}\r\n".encode() for i, s in enumerate(subs))
                           + b"PING\r\n")
            elif line.startswith(b"-ERR"):
                self.gen.conn_errors += 1
                self.gen.last_error = line.decode(errors="replace").strip()

    def write(self, data: bytes) -> bool:
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True


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
        # --conns per-node: a connection per node (NodeConn), its set-up time and its failures.
        self.conns: list[NodeConn] = []
        self.connect_s = 0.0
        self.conns_lost = 0
        self.conn_errors = 0
        self.last_error = ""
        self.keys = args.keys  # the keyring of an authenticated bus (revenant up's DIR/keys), or ""

    def seed(self, identity: str) -> bytes | None:
        """``identity``'s NKey seed from the keyring, or None on an open bus."""
        if not self.keys:
            return None
        return security.Keyring(self.keys).seed_path(identity).read_bytes().strip()

    async def connect_nodes(self, url: str) -> None:
        """A connection per node, ``--connect-concurrency`` at a time, each ready (its CONNECT and
        SUBs answered by a PONG, so the server accepted its key) before the heartbeats start."""
        u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(self.args.connect_concurrency)
        t0 = time.monotonic()

        async def one(k: int) -> NodeConn:
            seed = self.seed(security.agent_identity(self.names[k]))
            async with gate:
                _, conn = await loop.create_connection(lambda: NodeConn(self, k, seed), u.hostname, u.port or 4222)
                try:
                    await asyncio.wait_for(conn.ready, 30)
                except (asyncio.TimeoutError, ConnectionError) as exc:
                    raise SystemExit(f"node {self.names[k]}: not connected: {exc or 'no PONG in 30 s'}"
                                     f" ({self.last_error})") from None
                return conn

        self.conns = list(await asyncio.gather(*(one(k) for k in range(len(self.ids)))))
        self.connect_s = time.monotonic() - t0
        print(f"{len(self.conns)} node connections in {self.connect_s:.1f} s"
              + (" (each its own identity)" if self.keys else ""), flush=True)

    def on_node_msg(self, conn: NodeConn, subject: bytes, reply: bytes, payload: bytes) -> None:
        """A message on a node's own connection: a probe is answered as the agent answers it (a
        silenced node's is not); a command or a full-heartbeat request is ignored, as the shared
        generators ignore them (none comes in a run: no jobs; see the coordinator's log)."""
        if not reply or not subject.endswith(b".probe"):
            return
        k = conn.k
        if self.silenced[k]:
            self.probes_ignored += 1
            return
        node = self.names[k]
        try:
            decode_as(payload, Probe)
            answer = encode(ProbeReply(node=node, incarnation=self.incarnations[k], seq=self.seq[k],
                                       sent_at=time.time(), health=self.healths[k % len(self.healths)]))
        except MessageError as exc:
            answer = bus.error_reply(exc)
        if conn.write(b"PUB " + reply + b" %d\r\n" % len(answer) + answer + b"\r\n"):
            self.probes_answered += 1

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
               "lease_in_flight": len(self.lease_pending),
               "conns": self.args.conns, "connections": len(self.conns), "connect_s": round(self.connect_s, 3),
               "conns_lost": self.conns_lost, "conn_errors": self.conn_errors, "last_error": self.last_error}
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
        # The control connection (and, shared, the probes' and the leases'): on an authenticated bus
        # the coordinator identity's, the one whose permissions cover every node's subjects.
        creds = {} if not self.keys else {
            "nkeys_seed": str(security.Keyring(self.keys).seed_path(security.COORDINATOR)),
            "inbox_prefix": security.inbox_prefix(security.COORDINATOR)}
        nc = await nats.connect(a.nats.split(","), name=f"bench-hbgen-{self.index}", connect_timeout=5,
                                pending_size=64 * 2**20, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                dont_randomize=True, **creds)
        self.server_name = (getattr(nc, "_server_info", None) or {}).get("server_name", "")
        per_node = a.conns == "per-node"
        if not per_node:
            await nc.subscribe("revenant.node.*.probe", cb=self._on_probe)
        await nc.subscribe(f"{CTL}.{self.index}", cb=self._on_ctl)
        # The stream's acks for the lease puts: one wildcard inbox, the token names the put.
        inbox = f"_INBOX.bench-lease-{self.index}-{secrets.token_hex(4)}"
        if a.lease_renew > 0:
            await nc.subscribe(f"{inbox}.*", cb=self._on_lease_ack, pending_msgs_limit=4_000_000)
        await nc.flush()
        if per_node:
            await self.connect_nodes(a.nats.split(",")[0])
        # Everyone starts at the same wall time, so phases are even across generators (unless the
        # node connections took longer than the orchestrator allowed: then from now, not in a burst).
        start = time.monotonic() + max(0.1, a.start_at - time.time())
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
        # Heartbeats go out on a socket of their own (per-node: each on its node's), as pre-encoded
        # frames patched in place.
        raw = RawPublisher(f"bench-hbraw-{self.index}", self.seed(security.COORDINATOR))
        if not per_node:
            await raw.connect(a.nats.split(",")[0])
        self.raw = raw
        conns = self.conns
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
                        if per_node:
                            if conns[k].write(bytes(frame)):
                                self.published += 1
                            else:
                                self.publish_errors += 1
                        else:
                            batch.append(bytes(frame))
                        last_sent[k] = wall
                        draw = (draw + 1) % len(offsets)
                        ring[(base + offsets[draw]) % ring_len].append(k)
                    self._late(late, len(nodes))
                    slot += 1
                    if len(batch) >= 2000:
                        self.published += raw.send(batch)
                        await asyncio.sleep(0)  # let probes in
                if not per_node:
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
            for conn in self.conns:
                if conn.transport is not None:
                    conn.transport.close()
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
    p.add_argument("--conns", choices=("shared", "per-node"), default="shared")
    p.add_argument("--connect-concurrency", type=int, default=200)
    p.add_argument("--keys", default="", help="the keyring of an authenticated bus (DIR/keys); none: an open bus")
    args = p.parse_args(argv)
    import uvloop

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Below the coordinator under test: on a small machine the load shares its cores, and a
    # fair share among several busy generators would starve the process being measured.
    os.nice(10)
    uvloop.run(Generator(args).run())
    return 0


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
