"""How a job looks to a user: the documented JSON shape (docs/cli.md) and ``show job``'s text,
with the byte and time formats the other client commands share."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import msgspec

from revenant.common.gpufit import describe
from revenant.common.settings.intervals import format_interval
from revenant.common.settings.resources import describe as describe_ask, limits_line, size_text
from revenant.messages import CheckpointPolicy, EpochInfo, JobRecord, JobResource


def _fmt_bytes(n: int) -> str:
    return size_text(n, tenths=True)


def _fmt_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def job_view(rec: JobRecord) -> dict:
    """The documented JSON shape of a job (docs/cli.md)."""
    return {
        "id": rec.spec.id,
        "name": rec.spec.name,
        "user": rec.spec.user,
        "state": rec.state,
        "node": rec.node,
        "address": rec.address,
        "pid": rec.pid,
        "program_pid": rec.program_pid,
        "generation": rec.generation,
        "restored_from": rec.restored_from,
        "epochs": [{"n": e.n, "bytes": e.bytes, "output_bytes": e.output_bytes, "created_at": e.created_at,
                    "node": e.node,
                    "freeze_s": e.freeze_s, "duration_s": e.duration_s,
                    "files": [{"path": f.path, "size": f.size, "copied": f.copied, "not_copied": f.not_copied}
                              for f in e.files],
                    "files_total": e.files_total, "files_copied": e.files_copied,
                    "workdir_note": e.workdir_note, "workdir_files": e.workdir_files,
                    "workdir_copied": e.workdir_copied, "workdir_linked": e.workdir_linked,
                    "own_bytes": e.own_bytes, "incremental": e.incremental,
                    "gpus": msgspec.to_builtins(e.gpus), "gpu_driver": e.gpu_driver,
                    "listening": e.listening, "connections": e.connections}
                   for e in rec.epochs],
        "gpus": msgspec.to_builtins(rec.gpus),
        "gpu_driver": rec.gpu_driver,
        "storage_bytes": rec.storage_bytes,
        "last_checkpoint_error": rec.last_checkpoint_error,
        "blocking": rec.blocking,
        "output": rec.output,
        "exit_code": rec.exit_code,
        "reason": rec.reason,
        "argv": rec.spec.argv,
        "workdir": rec.spec.workdir,
        "checkpoint_interval_s": rec.spec.checkpoint_interval_s,
        "max_epochs": rec.spec.max_epochs,
        "policy": msgspec.to_builtins(rec.spec.policy),
        "on_sick": rec.spec.on_sick,
        "requeue": rec.spec.requeue,
        "resources": msgspec.to_builtins(rec.spec.resources),
        "assigned_gpus": rec.assigned_gpus,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    }


def _print_job(rec: JobRecord, as_json: bool) -> None:
    if as_json:
        print(json.dumps(job_view(rec), indent=2))
        return
    v = job_view(rec)
    every = (f"every {format_interval(rec.spec.checkpoint_interval_s)}" if rec.spec.checkpoint_interval_s
             else "manual")
    epochs = ", ".join(_epoch_cell(e) for e in rec.epochs) or "none"
    rows = [
        ("job", f"{v['id']} ({v['name']})"),
        ("user", v["user"] or "-"),
        ("state", v["state"] + (f" ({v['reason']})" if v["reason"] else "")),
        ("node", (v["node"] or "-") + (f" ({v['address']})" if v["node"] and v["address"] else "")),
        ("pid", str(rec.program_pid or "-") + (f" (init {rec.pid})" if rec.pid else "")),
        ("generation", str(v["generation"])),
        ("checkpoints", f"{every}, keep {rec.spec.max_epochs}"),
        ("policy", policy_line(rec.spec.policy)),
        ("on sick", rec.spec.on_sick or "the cluster's default"),
        ("asks", describe_ask(rec.spec.resources) + (f" (GPUs {', '.join(rec.assigned_gpus)})"
                                                     if rec.assigned_gpus and rec.node else "")),
        *([("limits", limits)] if (limits := limits_line(rec.spec.resources)) else []),
        *([("gpus", describe(rec.gpus, rec.gpu_driver) + ": a restore needs the same")] if rec.gpus else []),
        ("storage", _storage_cell(rec)),
        *([("last failure", rec.last_checkpoint_error)] if rec.last_checkpoint_error else []),
        *([("blocking", rec.blocking + " (revenant check lists what it holds)")] if rec.blocking else []),
        ("epochs", epochs),
        *_epoch_files(rec),
        *_network(rec),
        ("output", v["output"] or "-"),
        ("exit_code", "-" if v["exit_code"] is None else str(v["exit_code"])),
        ("command", " ".join(rec.spec.argv)),
    ]
    print("\n".join(f"{k:<12} {val}" for k, val in rows))


def policy_line(p: CheckpointPolicy) -> str:
    """A job's checkpoint policy on one line (``show job``)."""
    packs = f", packs {p.pack_compression}" if p.pack_compression != "none" else ""
    parts = [f"incremental, full every {p.full_every}{packs}" if p.incremental else "full epochs",
             f"pre-dump {p.pre_dump_delay_s:g} s before" if p.pre_dump else "no pre-dump",
             (f"load-aware (cpu {p.load_threshold_cpu:g}, io {p.load_threshold_io:g}, "
              f"memory {p.load_threshold_memory:g})") if p.load_aware else "not load-aware",
             f"connections {p.connections}"]
    return ", ".join(parts)


def _epoch_cell(e: EpochInfo) -> str:
    """``#3 1.0 GiB at T``; with its own bytes when reported (a delta's are a fraction of its size)."""
    own = ""
    if e.own_bytes or e.incremental:
        own = f" ({_fmt_bytes(e.own_bytes)} own{', incremental' if e.incremental else ''})"
    return f"#{e.n} {_fmt_bytes(e.bytes)}{own} at {_fmt_time(e.created_at)}"


def storage_rows(rec: JobRecord) -> tuple[list[str], list[list[str]]]:
    """``revenant job storage``: per kept epoch, its image's size, the bytes only it holds, and
    where its pages are: its own plain images, the job's packs, a newer epoch's plain images."""
    header = ["EPOCH", "NODE", "CREATED", "IMAGES", "OWN", "PLAIN", "IN PACKS", "IN NEWER EPOCHS", "STORED AS"]
    rows = []
    for e in rec.epochs:
        placed = e.plain_bytes or e.packed_bytes or e.newer_bytes
        cell = (lambda n: _fmt_bytes(n) if placed else "-")
        rows.append([str(e.n), e.node, _fmt_time(e.created_at), _fmt_bytes(e.bytes),
                     _fmt_bytes(e.own_bytes) if e.own_bytes else "-", cell(e.plain_bytes), cell(e.packed_bytes),
                     cell(e.newer_bytes), "delta" if e.incremental else "plain"])
    return header, rows


def _storage_cell(rec: JobRecord) -> str:
    if rec.storage_bytes:
        return f"{_fmt_bytes(rec.storage_bytes)} on disk (data shared between epochs counted once)"
    return "none" if not rec.epochs else "not reported"


def _network(rec: JobRecord) -> list[tuple[str, str]]:
    """What the job listened on at its newest epoch (where a restore listens again, on its node),
    and the connections a restore of it closes."""
    if not rec.epochs or not (rec.epochs[-1].listening or rec.epochs[-1].connections):
        return []
    e = rec.epochs[-1]
    rows = [("listening", ", ".join(e.listening) + f" (epoch #{e.n})")] if e.listening else []
    if e.connections:
        kept = " (but one on the node that has just vacated it)" if rec.spec.policy.connections == "keep" else ""
        rows.append(("connections", f"{len(e.connections)} at epoch #{e.n}, closed by a restore of it{kept}: "
                                    + ", ".join(e.connections)))
    return rows


def _epoch_files(rec: JobRecord) -> list[tuple[str, str]]:
    """The newest epoch's own files: how many, how each comes back, and those it could not copy."""
    if not rec.epochs:
        return []
    e = rec.epochs[-1]
    rows = [("files", f"epoch #{e.n} covers {e.files_total} open for writing: {e.files_copied} copied, "
                      f"{e.files_total - e.files_copied} cut back on restore"
                      + (f" ({e.files_total - len(e.files)} more not listed)" if e.files_total > len(e.files) else ""))]
    rows += [("", f"{f.path} ({_fmt_bytes(f.size)}): not copied, {f.not_copied}") for f in e.files
             if not f.copied and not f.not_copied.startswith("append-only")]
    if e.workdir_note:
        rows.append(("", f"workdir not tracked: {e.workdir_note}"))
    elif e.workdir_files:
        rows.append(("", f"workdir: {e.workdir_files} files as at the dump, {_fmt_bytes(e.workdir_copied)} stored, "
                         f"{_fmt_bytes(e.workdir_linked)} shared with the epoch before"))
    return rows


def print_resources(rec: JobRecord, resources: list[JobResource], as_json: bool) -> int:
    """``revenant check``: one line per resource, blocking ones first; exit status 1 if any blocks."""
    blocking = [r for r in resources if r.verdict == "blocking"]
    if as_json:
        print(json.dumps({"job": rec.spec.id, "node": rec.node, "address": rec.address, "checkpointable": not blocking,
                          "resources": msgspec.to_builtins(resources)}, indent=2))
        return 1 if blocking else 0
    where = f"{rec.node} ({rec.address})" if rec.address else rec.node
    print(f"job {rec.spec.id} on {where}: " + (f"{len(blocking)} resource(s) block a checkpoint" if blocking else
                                                  "checkpointable"))
    words = {"blocking": "BLOCKS", "closed_on_move": "closed on move", "carried": "carried"}
    for r in resources:
        print(f"  {words[r.verdict]:<15} {r.kind:<11} {r.what}: {r.reason}")
    return 1 if blocking else 0
