"""Client commands that speak to the cluster over NATS: nodes and jobs (events: cli/events.py).

Every list is read page by page (``nodes_request.v1``, ``jobs_request.v1``); the events come
one message at a time from the stream, so no single reply grows with the cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from typing import Mapping, TypeVar

import msgspec

# Neither the NATS client library nor asyncio at start: a one-shot command asks through
# revenant.client.ask_once, over a plain socket (the commands that follow or list import them).
from revenant.client import asking as who
from revenant.client.asking import SUBMIT_RETRY_S
from revenant.cli.jobview import _fmt_bytes, _print_job, job_view, storage_rows
from revenant.cli.progress import ProgressLine, stats_table
from revenant.common.errors import RevenantError
from revenant.common.settings import security
from revenant.common.settings.cluster import read_cluster, resolve_creds, resolve_nats_url
from revenant.common.settings.intervals import parse_interval
from revenant.common.settings.resources import parse_size, size_text
from revenant.common.settings.limits import ROOT_USERS, BadRequest, check_submit, env_problem
from revenant.messages import (
    FailoverReply,
    FailoverRequest,
    JobReply,
    JobRequest,
    Message,
    NodesReply,
    NodeStatus,
    SubmitRequest,
    subjects,
)

M = TypeVar("M", bound=Message)


# The credential this command connects with (--creds, --dir's, $REVENANT_CREDS), set by bus_url.
_creds = ""


def bus_url(args: argparse.Namespace) -> str:
    global _creds
    _creds = resolve_creds(args.dir, getattr(args, "creds", None))
    return resolve_nats_url(args.dir, args.nats)


def cli_creds() -> str:
    """The credential this command resolved (--creds, --dir's, $REVENANT_CREDS; "": none)."""
    return _creds


def auth() -> dict[str, str | None]:
    """bus.connect's credential and inbox for this command (none on an open bus)."""
    return security.client_credentials(_creds)


def _creds_in_use(creds: str | None) -> str:
    return (_creds or os.environ.get("REVENANT_CREDS", "")) if creds is None else creds


def asking_user(creds: str | None = None) -> str | None:
    """:func:`revenant.client.asking.asking_user` with the credential this command resolved from
    --creds, --dir or ``$REVENANT_CREDS`` (or ``creds``)."""
    return who.asking_user(_creds_in_use(creds))


def request_subject(verb: str, creds: str | None = None) -> str:
    return who.request_subject(verb, _creds_in_use(creds))


def _node_row(n: NodeStatus) -> list[str]:
    criu = n.capabilities.criu
    age = "-" if n.last_heartbeat_age_s is None else f"{n.last_heartbeat_age_s:.1f}s"
    live = n.state in ("alive", "suspect")
    if not n.capabilities.gpus:
        gpu = n.capabilities.gpu
    elif n.gpus and live:
        gpu = " ".join(f"{g.temperature_c:.0f}C" for g in n.gpus)
    else:
        gpu = f"{len(n.capabilities.gpus)} gpu"
    if n.capabilities.gpus:  # how its GPU jobs are checkpointed: driver_api, binary or none
        gpu += f" ({n.capabilities.gpu_checkpoint})"
    return [
        n.name, n.state, n.health if live else "-", str(n.pid), age,
        (criu.version + (" (no sockets)" if criu.network_error else "")) if criu.ok else "unusable", gpu,
        _allocated(n), ("; ".join(n.reasons) or "-") if live else "-",
    ]


def _allocated(n: NodeStatus) -> str:
    """What the node's jobs asked for, of what it has: "3 jobs, 2/8 cpu, 4 GiB/31.3 GiB, 1/2 gpu"."""
    a, caps = n.allocated, n.capabilities
    parts = [f"{n.jobs} job{'s' * (n.jobs != 1)}"]
    if a.cpus:
        parts.append(f"{a.cpus:g}/{caps.cpus} cpu")
    if a.memory_bytes:
        parts.append(f"{size_text(a.memory_bytes)}/{size_text(caps.memory_total_bytes)}")
    if a.gpus:
        parts.append(f"{a.gpus}/{len(caps.gpus)} gpu")
    return ", ".join(parts)


def render_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def connecting(url: str, timeout_s: float):
    """``Client.connect`` with this command's bus and credential (``async with``)."""
    from revenant.client import Client

    return Client.connect(nats=url, creds=_creds, timeout=timeout_s, name="revenant-cli")


async def request_nodes(nc, timeout_s: float, creds: str = "") -> NodesReply:
    """The whole node table, page by page, on a connection of the caller's (as ``creds`` asks)."""
    from revenant.client import Client

    return await Client(nc, creds, timeout_s).nodes_reply()


def asking(url: str, timeout_s: float):
    """The synchronous client (one plain request per call) with this command's bus and credential."""
    from revenant.client.sync import SyncClient

    return SyncClient(url, _creds, timeout_s)


def nodes_table(reply: NodesReply) -> str:
    if not reply.nodes:
        return "no nodes have sent a heartbeat yet"
    header = ["NAME", "STATE", "HEALTH", "PID", "LAST-HB", "CRIU", "GPU", "JOBS", "REASONS"]
    return render_table(header, [_node_row(n) for n in reply.nodes])


def nodes(args: argparse.Namespace) -> int:
    url = bus_url(args)
    if args.dir and read_cluster(args.dir).insecure:
        print("revenant: WARNING: INSECURE cluster (revenant up --insecure): its NATS asks no one for a "
              "credential, so anyone who reaches it can command every node", file=sys.stderr)
    if args.watch:
        return run(_watch_nodes(url, args))
    reply = asking(url, args.timeout).nodes_reply()
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply.nodes), indent=2))
    else:
        print(nodes_table(reply))
    return 0


async def _watch_nodes(url: str, args: argparse.Namespace) -> int:
    """Redraw the table in place (one connection for the whole watch)."""
    import asyncio
    import contextlib

    from revenant.common.messaging import bus

    nc = await bus.connect(url, "revenant-cli", **auth(), endless_reconnect=True, connect_timeout_s=args.timeout)
    try:
        while True:
            try:
                reply = await request_nodes(nc, args.timeout, _creds)
                body = (json.dumps(msgspec.to_builtins(reply.nodes)) if args.json else nodes_table(reply))
            except RevenantError as exc:
                body = f"revenant: {exc}"
            stamp = datetime.now().strftime("%H:%M:%S")
            sys.stdout.write(f"\x1b[H\x1b[2J{stamp}  every {args.interval:g}s, Ctrl-C to stop\n\n{body}\n")
            sys.stdout.flush()
            await asyncio.sleep(args.interval)
    finally:
        # Ctrl-C ends the watch at once, whatever the connection is doing (a reconnect, a busy host).
        with contextlib.suppress(Exception):  # leaving anyway (a timeout included)
            await asyncio.wait_for(nc.close(), 2.0)


# ---------------------------------------------------------------------- jobs

def quiet_logging() -> None:
    """A client command's logging: errors only, one line each, as its own errors are."""
    import logging

    logging.basicConfig(level=logging.ERROR, format="revenant: %(message)s")


def run(coro):
    """Run a command's coroutine (the NATS client library's path), its libraries' logs quiet."""
    import asyncio

    quiet_logging()
    return asyncio.run(coro)


def ask(url: str, verb: str, msg: Message, reply_type: type[M], timeout_s: float,
        watch: ProgressLine | None = None) -> M:
    """Ask the coordinator once (without the NATS client library where the bus allows); with
    ``watch``, draw the job's progress until the reply comes (that needs the library)."""
    from revenant.common.messaging.handshake import plain_urls

    if watch is None and plain_urls(url):
        return asking(url, timeout_s).ask(verb, msg, reply_type)
    return run(coord(url, verb, msg, reply_type, timeout_s, watch))


async def coord(url: str, verb: str, msg: Message, reply_type: type[M], timeout_s: float,
                watch: ProgressLine | None = None) -> M:
    """Ask the coordinator; with ``watch``, draw the job's progress until the reply comes."""
    try:
        async with connecting(url, min(timeout_s, 5.0)) as rv:
            return await rv.ask(verb, msg, reply_type, timeout_s, watch.show if watch else None,
                                watch.job if watch else "")
    finally:
        if watch is not None:
            watch.close()


# What a job's environment is made of at ``revenant submit``: ``--export`` and ``--env``, as sbatch
# has them (docs/cli.md).  Pure: the coordinator checks the result again (common/settings/limits.py).
def exported_env(export: str | None, pairs: list[str], environ: Mapping[str, str],
                 root: bool) -> tuple[dict[str, str], list[str]]:
    """The job's environment from ``--export`` (``ALL`` by default, as sbatch; ``NONE``; ``NAME``s
    and ``NAME=VALUE``s, after ``ALL`` if it is listed) and ``--env NAME=VALUE``s, over
    ``environ``; and the names ``ALL`` left out because no job may get them (:func:`env_problem`).
    REVENANT_* (this client's own settings, its credential) are never exported by ``ALL``."""
    items = [item for item in (export if export is not None else "ALL").split(",") if item]
    words = [item.upper() for item in items if "=" not in item]
    if "NONE" in words and len(items) > 1:
        raise BadRequest("--export NONE stands alone; to pass a few variables, list them: --export NAME,NAME=VALUE")
    env: dict[str, str] = {}
    dropped: list[str] = []
    if "ALL" in words:
        for name, value in environ.items():
            if name.startswith("REVENANT_"):
                continue
            if env_problem(name, value, root) is not None:
                dropped.append(name)
            else:
                env[name] = value
    for item in items:
        if item.upper() in ("ALL", "NONE"):
            continue
        name, eq, value = item.partition("=")
        if not eq:
            if name not in environ:
                raise BadRequest(f"--export {name}: it is not set in this environment (give {name}=VALUE)")
            value = environ[name]
        env[name] = value
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise BadRequest(f"--env takes NAME=VALUE, got {pair[:80]!r}")
        env[name] = value
    return env, dropped


def submit_request(args: argparse.Namespace, request_id: str = "") -> SubmitRequest:
    """The request ``revenant submit`` sends, checked against every limit the coordinator checks
    (:func:`revenant.common.settings.limits.check_submit`), before anything is sent."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise BadRequest("nothing to run: revenant submit [options] -- CMD [ARG...]")
    interval = parse_interval(args.checkpoint) if args.checkpoint else None
    if args.node:
        subjects.check_name(args.node)
    user = getattr(args, "user", None) or ""
    if user:
        subjects.check_name(user, "user name")
    try:
        workdir = os.path.realpath(args.workdir or os.getcwd())  # the node refuses a path through a link
    except OSError as exc:
        raise BadRequest(f"cannot read the current directory ({exc.strerror}): give --workdir") from None
    try:
        job_user = user or asking_user() or "root"  # admin's own job is root's
    except RevenantError:
        job_user = "root"  # the stricter rules; the credential's own error comes with the request
    root = job_user in ROOT_USERS
    env, dropped = exported_env(getattr(args, "export", None), getattr(args, "env", None) or [], os.environ, root)
    if dropped:
        print(f"revenant: not exported to the job (no job may get them{' as root' if root else ''}; set what it "
              f"needs with --env): {', '.join(sorted(dropped)[:20])}", file=sys.stderr)
    req = SubmitRequest(argv=command, name=args.name or "", node=args.node or "", workdir=workdir, env=env,
                        checkpoint_interval_s=interval, max_epochs=args.max_epochs, requeue=args.requeue,
                        user=user, incremental=args.incremental, full_every=args.full_every,
                        pre_dump=args.pre_dump, pre_dump_delay_s=args.pre_dump_delay_s, load_aware=args.load_aware,
                        pack_compression=getattr(args, "pack_compression", None),
                        connections=getattr(args, "connections", None),
                        on_sick=getattr(args, "on_sick", None) or "", request_id=request_id,
                        cpus=getattr(args, "cpus", None), gpus=getattr(args, "gpus", None),
                        memory_bytes=parse_size(args.mem) if getattr(args, "mem", None) is not None else None)
    check_submit(req, job_user)
    return req


def submit(args: argparse.Namespace) -> int:
    import secrets

    req = submit_request(args, request_id=secrets.token_hex(16))
    reply = submitted(bus_url(args), req, args.timeout)
    print(reply.job.spec.id)
    if reply.job.state == "pending" and not reply.job.node:
        print(f"revenant: job {reply.job.spec.id} is pending, {reply.job.reason}", file=sys.stderr)
    return 0


def submitted(url: str, req: SubmitRequest, timeout_s: float, retry_s: float = SUBMIT_RETRY_S,
              pause_s: float = 1.0) -> JobReply:
    """Submit ``req`` (with a request id), asking again while no leader could answer, for up to
    ``retry_s``: the coordinator answers a repeat with the job the first made."""
    def said(exc: RevenantError) -> None:
        print(f"revenant: {exc}; asking again for up to {retry_s:g} s (the same request: it makes one job at "
              f"most)", file=sys.stderr)

    return asking(url, timeout_s).submit_request(req, retry_s, pause_s, retrying=said)


def show_job(args: argparse.Namespace) -> int:
    reply = ask(bus_url(args), "job", JobRequest(job=args.job), JobReply, args.timeout)
    for note in reply.notes:
        print(f"revenant: {note}", file=sys.stderr)
    _print_job(reply.job, args.json)
    return 0


def job_storage(args: argparse.Namespace) -> int:
    """``revenant job storage JOB``: where each kept epoch's pages are, and the job's storage."""
    rec = ask(bus_url(args), "job", JobRequest(job=args.job), JobReply, args.timeout).job
    if args.json:
        print(json.dumps({"job": rec.spec.id, "storage_bytes": rec.storage_bytes,
                          "epochs": [{"n": e.n, "bytes": e.bytes, "own_bytes": e.own_bytes,
                                      "plain_bytes": e.plain_bytes, "packed_bytes": e.packed_bytes,
                                      "newer_bytes": e.newer_bytes, "incremental": e.incremental}
                                     for e in rec.epochs]}, indent=2))
        return 0
    if not rec.epochs:
        print(f"job {rec.spec.id} has no checkpoint")
        return 0
    print(render_table(*storage_rows(rec)))
    print(f"storage: {size_text(rec.storage_bytes, tenths=True) if rec.storage_bytes else 'not reported'} "
          "(data shared between epochs counted once)")
    return 0


def list_jobs(args: argparse.Namespace) -> int:
    jobs = asking(bus_url(args), args.timeout).jobs()
    if args.json:
        print(json.dumps([job_view(r) for r in jobs], indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    header = ["ID", "NAME", "STATE", "USER", "NODE", "PID", "GEN", "EPOCHS", "EXIT"]
    rows = [[r.spec.id, r.spec.name, r.state, r.spec.user or "-", r.node or "-", str(r.program_pid or r.pid or "-"),
             str(r.generation),
             str(len(r.epochs)), "-" if r.exit_code is None else str(r.exit_code)] for r in jobs]
    print(render_table(header, rows))
    return 0


def failover(args: argparse.Namespace) -> int:
    reply = ask(bus_url(args), "failover", FailoverRequest(action=args.action), FailoverReply, args.timeout)
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2))
        return 0
    state = "paused" if reply.paused else "active"
    detail = f" ({reply.reason})" if reply.reason else ""
    print(f"failover {state}{detail}; {reply.silent} of {reply.total} nodes silent, "
          f"{reply.recovering} job(s) being recovered")
    return 0


def job_action(args: argparse.Namespace, verb: str) -> int:
    """checkpoint create (verb 'checkpoint'), vacate, restart, purge."""
    # A checkpoint or vacate waits for one in progress for half its --timeout, then takes its own.
    wait_s = who.waiting(args.timeout, None) if verb in ("checkpoint", "vacate") else 0.0
    req = JobRequest(job=args.job, node=getattr(args, "node", None) or "", epoch=getattr(args, "epoch", None) or 0,
                     wait_s=wait_s)
    criu_op = verb in ("checkpoint", "vacate", "restart")
    as_json = getattr(args, "json", False)
    # A person watching (a terminal, no --json) sees how far the dump or restore is.
    watch = ProgressLine(args.job, sys.stderr) if criu_op and not as_json and sys.stderr.isatty() else None
    reply = ask(bus_url(args), verb, req, JobReply, args.timeout, watch)
    rec = reply.job
    for note in reply.notes:
        print(f"revenant: {note}", file=sys.stderr)
    if as_json:
        print(json.dumps({**job_view(rec), "stats": reply.stats} if criu_op else job_view(rec), indent=2))
    elif verb in ("checkpoint", "vacate") and rec.epochs:
        e = rec.epochs[-1]
        print(f"job {rec.spec.id}: epoch {e.n} committed ({_fmt_bytes(e.bytes)}, frozen {e.freeze_s * 1000:.0f} ms, "
              f"{e.duration_s:.2f} s in all){'; job vacated' if verb == 'vacate' else ''}")
    elif verb == "restart":
        print(f"job {rec.spec.id}: restored on {rec.node} as generation {rec.generation}, pid "
              f"{rec.program_pid or '-'} (init {rec.pid})")
    else:
        print(f"job {rec.spec.id}: {rec.state}")
    if criu_op and getattr(args, "stats", False) and not as_json:
        print(stats_table(reply.stats))
    return 0
