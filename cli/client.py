"""Client commands that read the cluster over NATS: ``nodes`` and ``events``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime, timezone

import msgspec
import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from revenant.common import bus
from revenant.common.cluster import resolve_nats_url
from revenant.common.errors import BusError
from revenant.messages import MessageError, NodeEvent, NodesReply, NodesRequest, NodeStatus, decode, subjects


def _url(args: argparse.Namespace) -> str:
    return resolve_nats_url(args.dir, args.nats)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _node_row(n: NodeStatus) -> list[str]:
    criu = n.capabilities.criu
    age = "-" if n.last_heartbeat_age_s is None else f"{n.last_heartbeat_age_s:.1f}s"
    return [
        n.name, n.state, n.health if n.state in ("alive", "suspect") else "-", str(n.pid), age,
        criu.version if criu.ok else "unusable",
        n.capabilities.gpu if not n.capabilities.gpus else f"{len(n.capabilities.gpus)} gpu",
        "; ".join(n.reasons) or "-",
    ]


def render_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


async def fetch_nodes(url: str, timeout_s: float) -> NodesReply:
    nc = await bus.connect(url, "revenant-cli", endless_reconnect=False, connect_timeout_s=timeout_s)
    try:
        return await bus.request(nc, subjects.coordinator("nodes"), NodesRequest(), NodesReply, timeout_s)
    finally:
        await nc.close()


def nodes(args: argparse.Namespace) -> int:
    reply = asyncio.run(fetch_nodes(_url(args), args.timeout))
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply.nodes), indent=2))
        return 0
    if not reply.nodes:
        print("no nodes have sent a heartbeat yet")
        return 0
    header = ["NAME", "STATE", "HEALTH", "PID", "LAST-HB", "CRIU", "GPU", "REASONS"]
    print(render_table(header, [_node_row(n) for n in reply.nodes]))
    return 0


def _fmt_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def format_event(subject: str, seq: int, data: bytes) -> tuple[str, dict]:
    """(human line, JSON object) for one event from the stream."""
    try:
        event = decode(data)
    except MessageError as exc:
        obj = {"seq": seq, "subject": subject, "error": str(exc)}
        return f"#{seq} {subject}: undecodable event ({exc})", obj
    obj = {"seq": seq, "subject": subject, **msgspec.to_builtins(event)}
    if isinstance(event, NodeEvent):
        extra = f" after {event.silence_s:.2f}s silence" if event.kind in ("suspect", "dead") else ""
        why = f" ({event.reason})" if event.reason else ""
        line = f"{_fmt_time(event.at)} node {event.node} {event.kind}{extra}{why}"
    else:
        fields = {k: v for k, v in obj.items() if k not in ("seq", "subject", "type", "at")}
        at = getattr(event, "at", None)
        line = f"{_fmt_time(at) if at else '-'} {obj['type']} {json.dumps(fields, default=str)}"
    return line, obj


async def _stream_events(url: str, follow: bool, as_json: bool, timeout_s: float) -> None:
    nc = await bus.connect(url, "revenant-cli", endless_reconnect=follow, connect_timeout_s=timeout_s)
    js = nc.jetstream(timeout=timeout_s)
    try:
        try:
            info = await js.stream_info(subjects.EVENTS_STREAM)
        except nats.js.errors.NotFoundError:
            if not follow:
                return
            await bus.ensure_event_stream(js)
            info = await js.stream_info(subjects.EVENTS_STREAM)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise BusError(f"cannot read the event stream: {exc or type(exc).__name__}") from None
        last = info.state.last_seq
        if not follow and info.state.messages == 0:
            return
        sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True,
                                 config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        while True:
            try:
                msg = await sub.next_msg(timeout=None if follow else timeout_s)
            except nats.errors.TimeoutError:
                raise BusError(f"event stream stalled: no message within {timeout_s:g} s") from None
            seq = msg.metadata.sequence.stream
            line, obj = format_event(msg.subject, seq, msg.data)
            print(json.dumps(obj) if as_json else line, flush=True)
            if not follow and seq >= last:
                return
    finally:
        await nc.close()


def events(args: argparse.Namespace) -> int:
    asyncio.run(_stream_events(_url(args), args.follow, args.json, args.timeout))
    return 0
