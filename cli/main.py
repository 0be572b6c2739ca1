"""``revenant``: the command line.  See docs/cli.md for the contract."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from revenant.cli import jobcontrol
from revenant.cli.parsing import _add_cluster_args, _fail, _one_line, _OnlyCommand, _Parser, _Version
from revenant.common.errors import RevenantError
from revenant.common.settings.limits import MAX_EPOCHS, MAX_GRACE_S, check_range
from revenant.messages import MessageError

# Numeric flags, checked after parsing and before anything runs: flag, lowest, highest.
NUMBER_RANGES = {
    "timeout": ("--timeout", 0.001, 7 * 86400.0),
    "interval": ("--interval", 0.01, 86400.0),
    "nodes": ("--nodes", 1, 1000),
    "max_epochs": ("--max-epochs", 1, MAX_EPOCHS),
    "epoch": ("--epoch", 1, 2**63 - 1),
    "ready_fd": ("--ready-fd", 0, 1 << 20),
    "grace": ("--grace", 0.0, MAX_GRACE_S),
    "tail": ("--tail", 0, 1 << 40),
}
# A service's flags go into its config, which checks their ranges; here, only that they are finite.
FINITE_NUMBERS = {"heartbeat_interval_s": "--heartbeat-interval", "node_timeout_s": "--node-timeout",
                  "suspect_timeout_s": "--suspect-timeout"}
def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only`` (the command given), that command's parser alone, or
    the whole one if ``only`` is no command."""
    parser = _Parser(prog="revenant", description="Checkpoint/restore and failover for cluster jobs.")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adding = _OnlyCommand(sub, only) if only and not only.startswith("-") else sub
    _cluster_commands(adding)
    _submit_command(adding)
    _job_commands(adding)
    jobcontrol.add_commands(adding, _add_cluster_args)
    jobcontrol.add_logs_command(adding, _add_cluster_args)
    if isinstance(adding, _OnlyCommand) and not adding.found:
        return build_parser()
    return parser


def _cluster_commands(sub: Any) -> None:
    """The services and a local cluster: agent, coordinator, up, supervise, keys, down, nodes."""
    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument("--node", help="node name (a NATS subject token)")
    p.add_argument("--nats", help="NATS URL(s), comma-separated")
    p.add_argument("--storage", help="storage directory shared by the nodes")
    p.add_argument("--config", help="TOML file with an [agent] table")
    p.add_argument("--creds", help="NATS credential of this node's identity, agent-<node> (an NKey seed file)")
    p.add_argument("--criu", help="criu binary (default: $REVENANT_CRIU, then PATH)")
    p.add_argument("--image-keys", help="the cluster's image keys, which sign every epoch (`revenant keys` writes them)")
    p.add_argument("--heartbeat-interval", type=float, dest="heartbeat_interval_s", help="seconds between heartbeats")
    p.add_argument("--http-host", help="address for /metrics, /health, /ready, /live (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="port for them (default 9750; 0 any free port, -1 off)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("coordinator", help="run the coordinator")
    p.add_argument("--nats", help="NATS URL(s), comma-separated")
    p.add_argument("--config", help="TOML file with a [coordinator] table")
    p.add_argument("--creds", help="NATS credential of the coordinator identity (an NKey seed file)")
    p.add_argument("--name", help="coordinator name (default: host-pid)")
    p.add_argument("--node-timeout", type=float, dest="node_timeout_s", help="seconds of silence before a node is dead")
    p.add_argument("--suspect-timeout", type=float, dest="suspect_timeout_s", help="seconds of silence before a node is suspect")
    p.add_argument("--http-host", help="address for /metrics, /health, /ready, /live (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="port for them (default 9751; 0 any free port, -1 off)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_cmd_coordinator)

    p = sub.add_parser("up", help="start a local cluster: nats-server, a coordinator and N agents")
    p.add_argument("--nodes", type=int, default=3, help="number of agents (default 3)")
    p.add_argument("--dir", required=True, help="directory for state, logs, storage and cluster.json")
    p.add_argument("--detach", action="store_true", help="return once every node is alive")
    p.add_argument("--nats", help="use this external NATS server instead of starting one")
    p.add_argument("--nats-servers", type=int, default=1, metavar="N",
                   help="start N nats-servers as one JetStream cluster, every stream and bucket on 3 of "
                        "them (1, or 3 or more; default 1)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the nodes (default 30)")
    p.add_argument("--insecure", action="store_true",
                   help="no authentication: anyone who reaches NATS may do anything (experiments only)")
    p.add_argument("--coordinators", type=int, default=1, metavar="N",
                   help="start N coordinators: one leads, the others stand by (default 1)")
    p.add_argument("--netns", action="store_true",
                   help="run every process (and so every job) in a network namespace of its own, on a "
                        "bridge: a node's jobs answer at its address, and links can be cut (needs root)")
    p.set_defaults(func=_cmd_up)

    # Hidden (no help): what 'revenant up --detach' leaves running to restart what dies.
    p = sub.add_parser("supervise")
    p.add_argument("dir")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--nats")
    p.add_argument("--nats-servers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--ready-fd", type=int, help="a pipe to write the start's outcome to (JSON), then close")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--coordinators", type=int, default=1)
    p.add_argument("--netns", action="store_true")
    p.set_defaults(func=_cmd_supervise)

    p = sub.add_parser("keys", help="NATS identities (NKey seeds) and the server's authorization block")
    p.add_argument("--out", help="directory for the seeds and authorization.conf (an existing NATS deployment)")
    p.add_argument("--dir", help="a 'revenant up' cluster: add to its keys and reload its nats-server")
    p.add_argument("--node", action="append", help="an agent identity for this node (repeat, or comma-separate)")
    p.add_argument("--user", action="append", help="a user identity for this Unix user (repeat, or comma-separate)")
    p.add_argument("--rotate", action="store_true",
                   help="add a new image key, which signs every epoch from now on (older epochs stay readable)")
    p.set_defaults(func=_cmd_keys)

    p = sub.add_parser("down", help="stop everything 'revenant up' started")
    p.add_argument("--dir", required=True)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait before SIGKILL, long enough for the agents' drains (default 30)")
    p.set_defaults(func=_cmd_down)

    p = sub.add_parser("nodes", help="show the nodes, their state and health")
    _add_cluster_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--watch", "-w", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=_cmd_nodes, one_shot=True)


def _submit_command(sub: Any) -> None:
    """submit, with the job's checkpoint policy."""
    p = sub.add_parser("submit", help="run a job; prints its id")
    _add_cluster_args(p)
    p.add_argument("--name", help="a name for the job (default: the command)")
    p.add_argument("--node", help="run on this node (default: the healthiest with the fewest jobs)")
    p.add_argument("--checkpoint", metavar="INTERVAL",
                   help="checkpoint periodically: minutes, m:s, h:m:s, d-h, d-h:m or d-h:m:s")
    p.add_argument("--max-epochs", type=int, help="checkpoints to keep (default: the cluster's [checkpoint] "
                   "max_epochs, 1 unless set)")
    # The job's checkpoint policy; each left out takes the cluster's [checkpoint] default.
    p.add_argument("--incremental", action=argparse.BooleanOptionalAction,
                   help="store older epochs as deltas against the job's other epochs (default: the cluster's)")
    p.add_argument("--full-every", type=int, metavar="N",
                   help="with --incremental, every N-th epoch starts a new chain (1-1000; default: the cluster's)")
    p.add_argument("--pre-dump", action=argparse.BooleanOptionalAction,
                   help="pre-dump memory before the final dump, for a shorter freeze (default: the cluster's)")
    p.add_argument("--pre-dump-delay", type=float, metavar="S", dest="pre_dump_delay_s",
                   help="seconds between the pre-dump and the final dump (0-3600; default: the cluster's)")
    p.add_argument("--load-aware", action=argparse.BooleanOptionalAction,
                   help="skip a periodic checkpoint while the node is over a load threshold (default: the cluster's)")
    p.add_argument("--on-sick", choices=("checkpoint", "migrate", "none"),
                   help="when the job's node turns sick: take a fresh checkpoint, move the job to a healthy "
                   "node, or nothing (default: the cluster's on_sick for a job with --checkpoint, else none)")
    p.add_argument("--connections", choices=("keep", "close"),
                   help="the job's TCP connections on a move: keep (a restore on the node that vacated it "
                   "brings them back intact; elsewhere closed) or close (always closed; a vacate resets them at "
                   "once) (default: the cluster's, keep)")
    p.add_argument("--pack-compression", choices=("none", "zstd", "lz4"),
                   help="with --incremental, compress the packs older epochs' pages go into (never the newest "
                   "epoch's images, which failover restores) (default: the cluster's, none)")
    p.add_argument("--requeue", action="store_true", help="rerun from the start if the node dies before a checkpoint")
    p.add_argument("--cpus", type=float, metavar="N", help="CPUs the job needs on its node: reserved, and its limit "
                   "(its cgroup's cpu quota) (default: the cluster's [resources] cpus, 0: none)")
    p.add_argument("--mem", metavar="SIZE", help="memory the job needs (64G, 512M): reserved, and its limit "
                   "(default: the cluster's [resources] memory, none)")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs the job needs: its own, named by UUID in "
                   "CUDA_VISIBLE_DEVICES (default: the cluster's [resources] gpus, 0)")
    p.add_argument("--workdir", help="working directory (default: the current one)")
    p.add_argument("--export", metavar="ALL|NONE|[ALL,]NAME[=VALUE],...",
                   help="which of this shell's environment variables the job gets, as sbatch --export: ALL "
                   "(the default: all of them but REVENANT_* and those no job may get, which are named on "
                   "stderr), NONE, or the NAMEs listed (NAME=VALUE sets one), after ALL, if given")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set one variable in the job's environment (repeatable); applied after --export")
    p.add_argument("--user", help="admin (root) only: submit for this user, who owns the job and whom it runs as "
                   "(default: the caller; root for admin)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    p.set_defaults(func=_cmd_submit, one_shot=True)


def _job_commands(sub: Any) -> None:
    """What is done to jobs once submitted, and the event stream."""
    p = sub.add_parser("checkpoint", help="checkpoint create / vacate / restart")
    cps = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, verb, text in (("create", "checkpoint", "checkpoint a running job; it keeps running"),
                               ("vacate", "vacate", "checkpoint a job, then stop it"),
                               ("restart", "restart", "restore a vacated job from its newest good checkpoint")):
        q = cps.add_parser(action, help=text)
        _add_cluster_args(q, timeout=3600.0)
        q.add_argument("job")
        q.add_argument("--json", action="store_true")
        q.add_argument("--stats", action="store_true",
                       help="also print criu's own statistics (freeze, memory dump, pages written)")
        if action == "restart":
            q.add_argument("--node", help="restore on this node (default: the coordinator chooses)")
            q.add_argument("--epoch", type=int, metavar="N",
                           help="restore exactly this kept epoch (default: the newest that can be restored)")
        q.set_defaults(func=_cmd_job_action, verb=verb, one_shot=True)


    p = sub.add_parser("show", help="show an object")
    shs = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    q = shs.add_parser("job", help="show a job")
    _add_cluster_args(q)
    q.add_argument("job")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_cmd_show_job, one_shot=True)

    p = sub.add_parser("check", help="what in a running job a checkpoint or a move carries, closes or cannot carry")
    _add_cluster_args(p)
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=jobcontrol.check, one_shot=True)

    p = sub.add_parser("jobs", help="list every job")
    _add_cluster_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_jobs, one_shot=True)

    p = sub.add_parser("job", help="job maintenance")
    jbs = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = jbs.add_parser("purge", help="remove a finished job's checkpoints")
    _add_cluster_args(q, timeout=600.0)
    q.add_argument("job")
    q.set_defaults(func=_cmd_job_action, verb="purge", one_shot=True)
    q = jbs.add_parser("storage", help="where each kept epoch's pages are, and the job's storage")
    _add_cluster_args(q)
    q.add_argument("job")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_cmd_job_storage, one_shot=True)

    p = sub.add_parser("failover", help="automatic failover: status, or pause/resume it")
    _add_cluster_args(p)
    p.add_argument("action", nargs="?", choices=("status", "pause", "resume"), default="status",
                   help="status (default); pause: hold it (say, for maintenance); resume: lift a hold, "
                        "and let a storm the guard paused for through")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_failover, one_shot=True)

    p = sub.add_parser("events", help="print the event stream")
    _add_cluster_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.set_defaults(func=_cmd_events)


def _cmd_agent(args: argparse.Namespace) -> int:
    from revenant.agent.node.agent import Agent
    from revenant.cli.cluster.service import run_service, setup_logging
    from revenant.common.settings.config import AgentConfig, load_config

    cfg = load_config(AgentConfig, "agent", args.config, {
        "node": args.node, "nats_url": args.nats, "nats_creds": args.creds, "storage": args.storage,
        "criu_path": args.criu, "heartbeat_interval_s": args.heartbeat_interval_s, "image_keys": args.image_keys,
        "http_host": args.http_host, "http_port": args.http_port,
    })
    if not cfg.node:
        raise RevenantError("agent needs a node name: --node NAME")
    setup_logging("agent", cfg.node, args.log_level)
    from revenant.agent.processes import procs
    procs.raise_nofile()  # a margin over what it holds, bounded; its jobs keep the limit it had
    return run_service(Agent(cfg))


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from revenant.cli.cluster.service import run_service, setup_logging
    from revenant.common.settings.config import CoordinatorConfig, load_config
    from revenant.coordinator.coordinator import Coordinator

    cfg = load_config(CoordinatorConfig, "coordinator", args.config, {
        "nats_url": args.nats, "nats_creds": args.creds, "name": args.name,
        "node_timeout_s": args.node_timeout_s, "suspect_timeout_s": args.suspect_timeout_s,
        "http_host": args.http_host, "http_port": args.http_port,
    })
    setup_logging("coordinator", cfg.name, args.log_level)
    return run_service(Coordinator(cfg))


def _cmd_up(args: argparse.Namespace) -> int:
    from revenant.cli.cluster.local import up

    return up(args.dir, _shape(args), detach=args.detach, timeout_s=args.timeout)


def _shape(args: argparse.Namespace):
    from revenant.cli.cluster.processes import Shape

    return Shape(nodes=args.nodes, nats_servers=args.nats_servers, coordinators=args.coordinators, netns=args.netns,
                 external_nats=args.nats, insecure=args.insecure)


def _cmd_supervise(args: argparse.Namespace) -> int:
    from revenant.cli.cluster.supervise import supervise

    return supervise(args.dir, _shape(args), timeout_s=args.timeout, ready_fd=args.ready_fd)


def _cmd_keys(args: argparse.Namespace) -> int:
    from revenant.cli.keys import keys

    return keys(args.out, args.dir, args.node, args.user, args.rotate)


def _cmd_down(args: argparse.Namespace) -> int:
    from revenant.cli.cluster.local import down

    return down(args.dir, timeout_s=args.timeout)


def _cmd_nodes(args: argparse.Namespace) -> int:
    from revenant.cli.client import nodes

    return nodes(args)


def _cmd_submit(args: argparse.Namespace) -> int:
    from revenant.cli.client import submit

    return submit(args)


def _cmd_job_action(args: argparse.Namespace) -> int:
    from revenant.cli.client import job_action

    return job_action(args, args.verb)


def _cmd_job_storage(args: argparse.Namespace) -> int:
    from revenant.cli.client import job_storage

    return job_storage(args)


def _cmd_show_job(args: argparse.Namespace) -> int:
    from revenant.cli.client import show_job

    return show_job(args)


def _cmd_jobs(args: argparse.Namespace) -> int:
    from revenant.cli.client import list_jobs

    return list_jobs(args)


def _cmd_failover(args: argparse.Namespace) -> int:
    from revenant.cli.client import failover

    return failover(args)


def _cmd_events(args: argparse.Namespace) -> int:
    from revenant.cli.events import events

    return events(args)


def check_args(args: argparse.Namespace) -> None:
    """Range-check numbers, and build (and so check) what a submit would send: a mistake is found
    here, before anything connects or starts."""
    for dest, (flag, lowest, highest) in NUMBER_RANGES.items():
        value = getattr(args, dest, None)
        if isinstance(value, (int, float)):
            check_range(flag, value, lowest, highest)
    for dest, flag in FINITE_NUMBERS.items():
        value = getattr(args, dest, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise RevenantError(f"{flag} must be a finite number, got {value}")
    if getattr(args, "func", None) in (jobcontrol.cancel, jobcontrol.signal_job):
        from revenant.common.settings.limits import parse_signal

        parse_signal(args.signal)
    if getattr(args, "func", None) is _cmd_submit:
        from revenant.cli.client import submit_request

        submit_request(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed and checked command line; any mistake exits 2 with one line on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        check_args(args)
    except (RevenantError, MessageError) as exc:
        _fail(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Client commands speak through their one-line errors; services reconfigure logging.  A
    # one-shot request imports nothing that logs (and not logging itself: a twentieth of its
    # start); where it goes through the NATS client library after all, cli/client.py's run() sets this.
    if not getattr(args, "one_shot", False):
        from revenant.cli.client import quiet_logging

        quiet_logging()
    try:
        return args.func(args)
    except (RevenantError, MessageError) as exc:
        print(f"revenant: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
