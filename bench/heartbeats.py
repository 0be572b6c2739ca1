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

Authenticated against open (``--auth secure,insecure``; the default is ``insecure``, an open bus,
as the runs before it).  The secure side runs on the bus as ``revenant up`` (without
``--insecure``) makes it, built by the production functions (common/settings/security.py,
common/messaging/natsserver.py): a keyring of the cluster's identities (``cluster_identities``:
coordinator, admin and ``agent-<node>`` for each of the N simulated nodes, an NKey seed file each,
``Keyring.ensure_all``), the server's configuration with the ``authorization`` block of all N + 2
users and their permissions (``render_authorization``, ``write_server_config``,
``start_nats_server(config_file=...)``), and the coordinator started with its own credential
(``--creds DIR/keys/coordinator.nk``).  Before the coordinator starts, the run checks that the server
enforces it: a connection with no key is refused, and ``agent-sim-00000`` may publish its own
heartbeat but not node 1's.  What the secure side includes and what it does not depends on
``--conns``:

* ``--conns per-node`` (the honest comparison): each simulated node has a connection of its own,
  as each agent has, on both sides; on the secure side it authenticates as ``agent-<node>`` (the
  server's nonce signed with that node's seed), so the server checks every heartbeat against that
  node's own publish permissions (its ``revenant.hb.<node>`` and nothing else), and the node
  subscribes where its permissions let an agent subscribe (its probe, its commands, the
  full-heartbeat requests) and answers its probes on its reply subject (``allow_responses``).
  Included: N + 2 users in the server, N NKey handshakes (nonce signature verified), the
  per-message permission check on every heartbeat, probe reply and coordinator publish, and the
  coordinator's own authenticated connections.  Not included: the agents' other traffic (leases,
  job events, the inbox subscription an agent's nats-py client makes), TLS (revenant does not
  use it on the bus), and the agents' own CPU (a real agent signs one nonce per connect; the
  generator signs N at the start, outside the measured window).  At 10,000 nodes a run measures
  whether this machine takes it (the connections' set-up time, nats-server's RSS).
* ``--conns shared`` (the default, as before): a generator sends all its nodes' heartbeats on one
  socket.  One connection cannot be thousands of identities, and an agent identity may publish only
  its own heartbeat; so on the secure side the generators connect as the ``coordinator`` identity,
  the one whose permissions (``revenant.>``) cover every node's subjects.  Included: the N + 2
  users in the server and the permission check on every message; but against the coordinator's
  permissions, not an agent's, and over a few connections that each publish thousands of
  subjects (nats-server caches its permission verdicts per connection and subject, a cache that
  thousands of subjects overflow), and without the N handshakes.  Not a model of production's
  connection count on either side.

On both sides the benchmark's own connections (the observer, each generator's control connection)
are the coordinator identity's on the secure side (the control subject is ``revenant.bench.hbgen.<g>``
so that identity may use it).  The sides run interleaved for each size (and with ``--repeat R``,
R times each, A B then B A), and a second table gives, per metric, each side's values, the medians
and secure / insecure: the coordinator's CPU share and RSS, nats-server's CPU and RSS, detection
p50/p99/max, the heartbeats heard, false verdicts; the first five judged against 5 %.

    .venv/bin/python bench/heartbeats.py                    # 1k, 10k, 20k nodes (about 5 minutes)
    .venv/bin/python bench/heartbeats.py --quick            # 1,000 nodes, short phases
    .venv/bin/python bench/heartbeats.py --sizes 5000 --duration 30
    .venv/bin/python bench/heartbeats.py --profile          # + py-spy profiles of the coordinator
    .venv/bin/python bench/heartbeats.py --leases 0.35      # + every node's lease renewal, as agents do
    .venv/bin/python bench/heartbeats.py --leases --nats-servers 1,3 --sizes 500,2000,5000   # R1 and R3 leases
    .venv/bin/python bench/heartbeats.py --coordinator-ref HEAD~3   # an older coordinator
    .venv/bin/python bench/heartbeats.py --coordinator-src DIR      # a modified copy (DIR/revenant/...)
    .venv/bin/python bench/heartbeats.py --sizes 10000 --auth secure,insecure --conns per-node --repeat 3
                                                            # authenticated against open (about 7 minutes)

Goal: 20,000 nodes on less than one core, with no false verdicts.  Prints a
table (with ``--leases`` a second one, of the renewals; with both --auth sides one of the ratios) and
writes bench/results/heartbeats.json (with ``--leases`` heartbeats-leases.json, with --auth secure
``-auth`` added to the name; ``--out``); the coordinator's,
nats-server's and the generators' logs are kept next to it in
``<out stem>-logs-<N>[-<S>servers][-<side>][-<repetition>]/``, py-spy's collapsed stacks in
``<out stem>-<N>-profile-<phase>.txt``.  A benchmark, not a test.  Everything
it starts is stopped, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from revenant.common.settings.config import AgentConfig

# bench/ is not a package: these are this script's own directory's.
from harness import PACKAGES, REPO, export_ref, git, machine, write_json
from heartbeat_load import generator_main
from heartbeat_run import Run

GOAL_CORE_PERCENT = 100.0
GOAL_NODES = 100_000
GOAL_DETECT_P99_S = 3.0


# =============================================================================== report


def table(runs: list[dict]) -> str:
    header = ["nodes", "auth", "gens", "hb/s target", "published", "received", "coord CPU", "coord RSS",
              "detect median", "p99", "max", "detected", "false dead", "false suspect",
              "nats CPU", "nats RSS", "gen CPU", "machine CPU", "gen late p99/max"]
    rows = []
    for r in runs:
        side = f"{r.get('auth', 'insecure')}" + (" per-node" if r.get("conns") == "per-node" else "")
        if "error" in r:
            rows.append([f"{r['nodes']:,}", side, str(r.get("generators", "-")),
                         f"{r['nodes'] / args_interval(r):,.0f}", *["-"] * 14, "FAILED (below)"])
            continue
        d = r["detection_s"]
        lat = r["generator_lateness"]
        rows.append([
            f"{r['nodes']:,}", side, str(r["generators"]), f"{r['target_hb_per_s']:,.0f}",
            f"{r['published_hb_per_s']:,.0f}", f"{r['received_hb_per_s']:,.0f}",
            f"{r['coordinator_cpu_percent']:.1f} %", f"{r['coordinator_rss_mib']:.0f} MiB",
            f"{d['median']:.2f} s" if d["median"] is not None else "-",
            f"{d['p99']:.2f} s" if d["p99"] is not None else "-",
            f"{d['max']:.2f} s" if d["max"] is not None else "-",
            f"{r['detected']}/{r['silenced']}", str(r["false_dead"]), str(r["false_suspect"]),
            f"{r['nats_server_cpu_percent']:.1f} %", f"{sum(r['nats_server_rss_mib_each']):.0f} MiB",
            f"{r['generators_cpu_percent']:.0f} %",
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


# secure / insecure, per size (and server count): the medians over the repetitions of each side.
AUTH_WITHIN = 0.05
AUTH_METRICS = [  # label, how to read it from a run, judged against AUTH_WITHIN
    ("coordinator CPU (% of a core)", lambda r: r["coordinator_cpu_percent"], True),
    ("coordinator RSS (MiB)", lambda r: r["coordinator_rss_mib"], True),
    ("nats-server CPU (% of a core)", lambda r: r["nats_server_cpu_percent"], True),
    ("nats-server RSS (MiB)", lambda r: sum(r["nats_server_rss_mib_each"]), False),
    ("detection p50 (s)", lambda r: r["detection_s"]["median"], True),
    ("detection p99 (s)", lambda r: r["detection_s"]["p99"], True),
    ("detection max (s)", lambda r: r["detection_s"]["max"], False),
    ("heartbeats received/s", lambda r: r["received_hb_per_s"], False),
    ("generators CPU (% of a core)", lambda r: r["generators_cpu_percent"], False),
    ("machine CPU (% of 200)", lambda r: r["machine_cpu_percent"], False),
    ("false dead verdicts", lambda r: r["false_dead"], False),
    ("false suspicions", lambda r: r["false_suspect"], False),
]


def auth_ratios(runs: list[dict]) -> list[dict]:
    """Per size and server count, per metric: each side's values, their medians, secure / insecure, and
    whether that is within AUTH_WITHIN (for the metrics the issue names; None for the others)."""
    out = []
    keys = sorted({(r["nodes"], r.get("nats_servers", 1)) for r in runs})
    for n, servers in keys:
        sides = {a: [r for r in runs if r["nodes"] == n and r.get("nats_servers", 1) == servers
                     and r.get("auth") == a and "error" not in r] for a in ("secure", "insecure")}
        if not sides["secure"] or not sides["insecure"]:
            continue
        for label, get, judged in AUTH_METRICS:
            vals = {a: [v for v in (get(r) for r in rs) if v is not None] for a, rs in sides.items()}
            med = {a: statistics.median(v) if v else None for a, v in vals.items()}
            ratio = (med["secure"] / med["insecure"] if med["secure"] is not None and med["insecure"]
                     else None)
            out.append({"nodes": n, "nats_servers": servers, "metric": label, "secure": vals["secure"],
                        "insecure": vals["insecure"], "secure_median": med["secure"],
                        "insecure_median": med["insecure"], "ratio": None if ratio is None else round(ratio, 3),
                        "within": (abs(ratio - 1) <= AUTH_WITHIN if ratio is not None else None) if judged else None})
    return out


def auth_table(ratios: list[dict]) -> str:
    header = ["nodes", "metric", "secure (runs)", "insecure (runs)", "secure / insecure", f"within {AUTH_WITHIN:.0%}"]
    fmt = lambda xs: ", ".join(f"{x:g}" for x in xs) or "-"  # noqa: E731
    rows = [[f"{x['nodes']:,}", x["metric"], fmt(x["secure"]), fmt(x["insecure"]),
             "-" if x["ratio"] is None else f"{x['ratio']:.3f}",
             "" if x["within"] is None else ("yes" if x["within"] else "NO")] for x in ratios]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in [header, *rows])


def args_interval(r: dict) -> float:
    return r.get("interval_s", 1.0)


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
    p.add_argument("--auth", default="insecure", metavar="SIDES",
                   help="comma-separated: insecure (an open bus, the default) and/or secure (the bus as "
                        "`revenant up` authenticates it: the authorization block of the N nodes' identities, "
                        "the coordinator with its credential); with both, the sides alternate for each size "
                        "and repetition (A B, then B A)")
    p.add_argument("--conns", choices=("shared", "per-node"), default="shared",
                   help="shared: each generator sends its nodes' heartbeats on one socket (the default); "
                        "per-node: a connection per simulated node, as each agent has (secure: each its own "
                        "agent-<node> identity), subscribed as an agent and answering its own probes")
    p.add_argument("--connect-concurrency", type=int, default=200,
                   help="per-node: connections being set up at once per generator (default 200)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each size and side (default 1); the sides' order alternates")
    p.add_argument("--quick", action="store_true", help="1,000 nodes, 5 s phases: for debugging the bench")
    p.add_argument("--out", type=Path, default=None,
                   help="default bench/results/heartbeats.json, with --leases heartbeats-leases.json")
    args = p.parse_args(argv)
    args.auth = list(dict.fromkeys(x.strip() for x in args.auth.split(",") if x.strip()))
    if not args.auth or set(args.auth) - {"secure", "insecure"}:
        p.error("--auth takes secure and/or insecure, comma-separated")
    if args.repeat < 1 or args.connect_concurrency < 1:
        p.error("--repeat and --connect-concurrency must be >= 1")
    if args.conns == "per-node" and args.leases > 0:
        p.error("--conns per-node sends heartbeats only: no --leases")
    if args.out is None:
        name = ("heartbeats-leases" if args.leases > 0 else "heartbeats") + ("-auth" if "secure" in args.auth else "")
        args.out = REPO / "bench" / "results" / f"{name}.json"
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
    # With --auth secure,insecure the sides take turns, A B then B A, so a drift of the machine's load
    # touches both alike.
    plan = [(c, n, rep, auth) for c in args.nats_servers for n in args.sizes for rep in range(args.repeat)
            for auth in (args.auth if rep % 2 == 0 else args.auth[::-1])]
    for count, n, rep, auth in plan:
        with tempfile.TemporaryDirectory(prefix=f"revenant-bench-hb-{n}-") as tmp:
            run = Run(args, n, Path(tmp), servers=count, auth=auth, rep=rep)
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
                keep = args.out.parent / (f"{args.out.stem}-logs-{n}" + (f"-{count}servers" if count > 1 else "")
                                          + (f"-{auth}" if len(args.auth) > 1 or auth != "insecure" else "")
                                          + (f"-{rep + 1}" if args.repeat > 1 else ""))
                shutil.rmtree(keep, ignore_errors=True)
                keep.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy(log, keep / log.name)
    if src_tmp is not None:
        src_tmp.cleanup()
    compare = "secure" in args.auth
    ok, lines = verdict(runs, leases=args.leases > 0 or compare)
    if len({r.get("coordinator_code_sha256") for r in runs}) > 1:
        lines.append("NOTE: the coordinator's code changed between sizes (someone edited the tree during the run)")
    print()
    print(table(runs))
    if args.leases > 0:
        print()
        print(lease_table(runs))
    ratios = auth_ratios(runs) if len(args.auth) > 1 else []
    if ratios:
        print()
        print(auth_table(ratios))
    print()
    print("\n".join(lines))
    if args.leases > 0:
        kept = all("leases" in r and r["leases"]["acked_per_s"] >= 0.95 * r["leases"]["target_per_s"]
                   and not r["leases"]["gaps_over_fence"] for r in runs)
        print(f"lease renewals kept up (>= 95 % of N / lease_renew_s acked, no gap past fence_timeout_s) "
              f"in every run: {'yes' if kept else 'NO'}")
    shown = any(r["nodes"] >= GOAL_NODES and "error" not in r for r in runs)
    status = "NOT met" if not ok else "MET" if shown else f"not shown (no run at {GOAL_NODES:,} nodes)"
    if ratios:
        within = all(x["within"] for x in ratios if x["within"] is not None)
        print(f"secure within {AUTH_WITHIN:.0%} of insecure (medians of coordinator CPU and RSS, nats-server CPU, "
              f"detection p50/p99): {'yes' if within else 'NO'} (see the ratios above)")
    print(f"goal ({GOAL_NODES:,} nodes on < 1 core, no false verdicts, detection p99 <= {GOAL_DETECT_P99_S:g} s): "
          f"{status}")
    doc = {"goal": {"nodes": GOAL_NODES, "core_percent_below": GOAL_CORE_PERCENT, "false_dead": 0}, "met": ok,
           "verdict": lines, "machine": machine(), "coordinator_code": code, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()},
           "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": runs, "auth_ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, doc)
    print(f"written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
