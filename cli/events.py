"""``revenant events``: the event stream, replayed and followed, one line (or JSON object) each."""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec

from revenant.cli.client import bus_url, cli_creds
from revenant.cli.jobview import _fmt_bytes, _fmt_time
from revenant.client import Client
from revenant.messages import AnomalyEvent, EpochEvent, JobEvent, Message, NodeEvent


def format_event(subject: str, seq: int, event: Message | None, error: str = "") -> tuple[str, dict]:
    """(human line, JSON object) for one event from the stream (``event`` None: undecodable)."""
    if event is None:
        obj = {"seq": seq, "subject": subject, "error": error}
        return f"#{seq} {subject}: undecodable event ({error})", obj
    obj = {"seq": seq, "subject": subject, **msgspec.to_builtins(event)}
    if isinstance(event, NodeEvent):
        extra = f" after {event.silence_s:.2f}s silence" if event.kind in ("suspect", "dead") else ""
        why = f" ({event.reason})" if event.reason else ""
        line = f"{_fmt_time(event.at)} node {event.node} {event.kind}{extra}{why}"
    elif isinstance(event, JobEvent):
        bits = [f"on {event.node}" if event.node else "", f"gen {event.generation}" if event.generation else "",
                f"pid {event.pid}" if event.pid else "",
                f"exit {event.exit_code}" if event.exit_code is not None else "",
                f"epoch {event.epoch}" if event.epoch is not None else "",
                f"from {event.from_node}" if event.from_node else "",
                f"{event.since_last_heartbeat_s:.2f}s after its last heartbeat"
                if event.since_last_heartbeat_s is not None else "",
                f"({event.reason})" if event.reason else ""]
        line = f"{_fmt_time(event.at)} job {event.job} {event.kind} " + " ".join(b for b in bits if b)
    elif isinstance(event, AnomalyEvent):
        line = (f"{_fmt_time(event.at)} node {event.node} anomaly {event.metric}={event.value:g} "
                f"(mean {event.mean:g}, std {event.std:g})")
    elif isinstance(event, EpochEvent):
        if event.kind == "created":
            detail = (f"epoch {event.n} on {event.node}: {_fmt_bytes(event.bytes)}, frozen "
                      f"{event.freeze_s * 1000:.0f} ms, {event.duration_s:.2f} s in all")
        elif event.kind == "failed":
            detail = f"on {event.node}: {event.error}"
        elif event.kind in ("skipped", "degraded", "forced"):
            detail = f"on {event.node}: {event.reason}"
        elif event.kind == "converted":
            detail = f"epoch {event.n} on {event.node}: now a delta of {_fmt_bytes(event.bytes)}"
        else:
            detail = f"epoch {event.n}"
        line = f"{_fmt_time(event.at)} job {event.job} checkpoint {event.kind} {detail}"
    else:
        fields = {k: v for k, v in obj.items() if k not in ("seq", "subject", "type", "at")}
        at = getattr(event, "at", None)
        line = f"{_fmt_time(at) if at else '-'} {obj['type']} {json.dumps(fields, default=str)}"
    return line, obj


async def _stream_events(url: str, follow: bool, as_json: bool, timeout_s: float) -> None:
    async with Client.connect(nats=url, creds=cli_creds(), timeout=timeout_s, name="revenant-cli",
                              reconnect=follow) as rv:
        async for ev in rv.events(follow=follow):
            line, obj = format_event(ev.subject, ev.seq, ev.message, ev.error)
            print(json.dumps(obj) if as_json else line, flush=True)


def events(args: argparse.Namespace) -> int:
    asyncio.run(_stream_events(bus_url(args), args.follow, args.json, args.timeout))
    return 0
