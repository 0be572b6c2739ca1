"""Finding a cluster: ``--nats URL``, ``--dir DIR`` (its cluster.json) or ``$REVENANT_NATS``;
and the credential to reach it with: ``--creds FILE``, ``$REVENANT_CREDS`` or cluster.json's.

``cluster.json`` is written by ``revenant up`` and is part of the CLI contract
(docs/cli.md): the NATS URL (with ``--nats-servers 3`` every server's, comma-separated, as
``--nats``, ``$REVENANT_NATS`` and ``nats_url`` take them too), every process that ``up``
started (with the argv that restarts it on the same ports) and the supervisor that restarts
them.  It names the admin credential, so it is written mode 0600.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from revenant.common.errors import ClusterNotFound

CLUSTER_FILE = "cluster.json"


class ProcessInfo(msgspec.Struct, kw_only=True):
    role: str  # "nats-server", "coordinator" or "agent"
    name: str
    pid: int
    # psutil's create_time, so a recycled pid is never mistaken for ours.
    create_time: float
    log: str = ""
    argv: list[str] = []
    # Where the process serves /metrics, /health, /ready and /live ("" for nats-server).
    metrics_url: str = ""
    # How often the supervisor restarted it, and whether it stopped doing so (a crash loop).
    restarts: int = 0
    given_up: bool = False


class NetMember(msgspec.Struct, kw_only=True):
    netns: str  # its network namespace, /run/netns/<netns>
    address: str  # its address on the cluster's subnet


class NetLayout(msgspec.Struct, kw_only=True):
    """``revenant up --netns``: every process in a network namespace of its own, joined by a
    bridge in the host's namespace, which holds ``host_address`` (the CLI reaches the cluster
    through it).  The storage stays a shared directory, as NFS would be."""

    bridge: str
    prefix: str  # the subnet's first three octets: <prefix>.0/24
    host_address: str
    members: dict[str, NetMember] = {}  # by process name: nats-server-1, coordinator, node-1, ...


class ClusterFile(msgspec.Struct, kw_only=True):
    version: int = 1
    nats_url: str  # one URL, or several comma-separated (one per server of a NATS cluster)
    dir: str
    storage: str
    created_at: float
    processes: list[ProcessInfo] = []
    # The process that restarts them when they die (``revenant up`` itself, or with
    # --detach its ``revenant supervise``); ``revenant down`` stops it first.
    supervisor: ProcessInfo | None = None
    # The client (admin) credential: an NKey seed file under DIR/keys (docs/security.md); ""
    # with ``insecure``: the bus asks no one for a credential and lets everyone do anything.
    creds: str = ""
    insecure: bool = False
    netns: NetLayout | None = None


def cluster_file(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / CLUSTER_FILE


def read_cluster(directory: str | os.PathLike[str]) -> ClusterFile:
    path = cluster_file(directory)
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterFile)
    except FileNotFoundError:
        raise ClusterNotFound(f"no cluster in {directory}: {path} not found (start one with 'revenant up')") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise ClusterNotFound(f"cannot read {path}: {exc}") from None


def write_cluster(directory: str | os.PathLike[str], cluster: ClusterFile) -> Path:
    path = cluster_file(directory)
    tmp = path.with_suffix(".json.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(msgspec.to_builtins(cluster), indent=2).encode() + b"\n")
    os.replace(tmp, path)
    return path


def resolve_nats_url(directory: str | None, nats_url: str | None, environ: dict[str, Any] | None = None) -> str:
    if nats_url:
        return nats_url
    if directory:
        return read_cluster(directory).nats_url
    env = os.environ if environ is None else environ
    if env.get("REVENANT_NATS"):
        return env["REVENANT_NATS"]
    raise ClusterNotFound("no cluster given: pass --dir DIR or --nats URL, or set REVENANT_NATS")


def resolve_creds(directory: str | None, creds: str | None, environ: dict[str, Any] | None = None) -> str:
    """The credential file a client connects with, in the order of :func:`resolve_nats_url`:
    ``--creds FILE``, else the ``--dir`` cluster's (none for an insecure one), else
    ``$REVENANT_CREDS``; "" for none."""
    if creds:
        return creds
    if directory:
        return read_cluster(directory).creds
    env = os.environ if environ is None else environ
    return str(env.get("REVENANT_CREDS") or "")
