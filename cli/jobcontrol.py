"""``revenant cancel`` and ``revenant signal``: a job ended without a checkpoint, or sent a signal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable


def add_commands(sub: Any, cluster_args: Callable[..., None]) -> None:
    p = sub.add_parser("cancel", help="end a job without a checkpoint (its epochs stay for a restart until purged)")
    cluster_args(p, timeout=30.0)
    p.add_argument("job")
    p.add_argument("--signal", "-s", default="TERM", metavar="SIG",
                   help="sent to every process of the job first (default TERM; KILL: at once)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds the job has to end after --signal before SIGKILL (default 10; 0: SIGKILL at once)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cancel)

    p = sub.add_parser("signal", help="send a signal to a running job's program")
    cluster_args(p)
    p.add_argument("job")
    p.add_argument("signal", metavar="SIG", help="a name as kill -l lists them (USR1, SIGTERM) or a number")
    p.add_argument("--all", action="store_true", help="to every process of the job, not only its program")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=signal_job)


def _answer(reply, as_json: bool, line: str) -> int:
    from revenant.cli.jobview import job_view

    for note in reply.notes if not as_json else ():
        print(f"revenant: {note}", file=sys.stderr)
    print(json.dumps({**job_view(reply.job), "notes": reply.notes}, indent=2) if as_json else line)
    return 0


def cancel(args: argparse.Namespace) -> int:
    import asyncio

    from revenant.cli.client import bus_url, coord
    from revenant.messages import JobReply, JobRequest

    req = JobRequest(job=args.job, signal=args.signal, grace_s=args.grace)
    # Its node gives the job --grace seconds to end before SIGKILL: the reply waits for that too.
    reply = asyncio.run(coord(bus_url(args), "cancel", req, JobReply, args.timeout + args.grace))
    return _answer(reply, args.json, f"job {reply.job.spec.id}: cancelled")


def signal_job(args: argparse.Namespace) -> int:
    import asyncio

    from revenant.cli.client import bus_url, coord
    from revenant.messages import JobReply, JobRequest

    req = JobRequest(job=args.job, signal=args.signal, all=args.all)
    reply = asyncio.run(coord(bus_url(args), "signal", req, JobReply, args.timeout))
    return _answer(reply, args.json, f"job {reply.job.spec.id}: {'; '.join(reply.notes)}")
