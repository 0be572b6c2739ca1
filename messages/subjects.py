"""The subject hierarchy: every NATS subject revenant uses is built here.

Layout (``<node>`` is always a single token, so per-node permissions can be
granted with ``revenant.*.<node>.>``-style rules):

=====================================  ==========================  =======================
subject                                transport                   payload
=====================================  ==========================  =======================
revenant.hb.<node>                     core NATS, fire and forget  Heartbeat
revenant.node.<node>.probe             core request/reply          Probe -> ProbeReply
revenant.node.<node>.cmd.<verb>        core request/reply          command -> reply
revenant.coord.<verb>                  core request/reply          command -> reply (admin)
revenant.user.<user>.<verb>            core request/reply          command -> reply (user)
revenant.evt.node.<node>.<kind>        JetStream stream EVENTS     NodeEvent
revenant.evt.job.<user>.<job>.<kind>[.<node>]    stream EVENTS   JobEvent
revenant.evt.epoch.<user>.<job>.<kind>.<node>    stream EVENTS   EpochEvent
revenant.evt.cluster.<kind>            JetStream stream EVENTS     cluster-wide alerts
revenant.progress.<user>.<job>         core NATS, fire and forget  Progress
=====================================  ==========================  =======================

A job or epoch event carries the job's user (``root`` for a job recorded before jobs had
users), so that a server can let ``user-<user>`` read its own jobs' events only, and an agent's
ends with its node, which is the only node its credential may publish as; the leader's own job
events have no node token.

``revenant.coord.<verb>`` is how admin (root, operators) asks the coordinator, and how
agents ask for ``reconcile``; ``revenant.user.<user>.<verb>`` is how the Unix user ``<user>``
asks (see :func:`user_request`): the coordinator takes the subject's ``<user>`` token as
who asks, and shows and acts on that user's jobs only.  A job's progress carries its user
too, so that a server can let ``user-<user>`` hear its own jobs' progress only.
"""

from __future__ import annotations

import re

from revenant.messages.errors import MessageError

ROOT = "revenant"

HEARTBEAT_PREFIX = f"{ROOT}.hb"
# A coordinator that starts, or whose heartbeat connection came back, asks every agent for a
# full heartbeat here (heartbeat_request.v1): it may have missed the last change of a verdict.
HEARTBEAT_REQUESTS = f"{ROOT}.nodes.full_heartbeat"
HEARTBEATS_ALL = f"{HEARTBEAT_PREFIX}.*"

EVENTS_PREFIX = f"{ROOT}.evt"
EVENTS_ALL = f"{EVENTS_PREFIX}.>"
EVENTS_STREAM = "REVENANT_EVENTS"

COORDINATOR_PREFIX = f"{ROOT}.coord"
USER_PREFIX = f"{ROOT}.user"
PROGRESS_PREFIX = f"{ROOT}.progress"
PROGRESS_ALL = f"{PROGRESS_PREFIX}.>"
# The progress token of a job recorded before jobs had users: such a job runs as root.
_NO_USER = "root"

# Names become subject tokens and directory names: keep them boring.
# \Z, not $: "$" would let a trailing newline through.  No ".", "/", NUL or empty name passes.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")


class InvalidName(MessageError):
    code = "invalid_name"


def check_name(name: str, what: str = "node name") -> str:
    """Return ``name`` if it is usable as a subject token, else raise :class:`InvalidName`."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidName(
            f"invalid {what} {name!r}: use 1-63 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return name


def heartbeat(node: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{check_name(node)}"


def node_from_heartbeat(subject: str) -> str | None:
    """The node token of a heartbeat subject, or None if it is not one."""
    prefix = HEARTBEAT_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    node = subject[len(prefix):]
    return node if _NAME_RE.match(node) else None


def probe(node: str) -> str:
    return f"{ROOT}.node.{check_name(node)}.probe"


def node_command(node: str, verb: str) -> str:
    return f"{ROOT}.node.{check_name(node)}.cmd.{check_name(verb, 'verb')}"


def node_commands(node: str) -> str:
    """Wildcard for every command to ``node``."""
    return f"{ROOT}.node.{check_name(node)}.cmd.*"


def coordinator(verb: str) -> str:
    return f"{COORDINATOR_PREFIX}.{check_name(verb, 'verb')}"


def user_request(user: str, verb: str) -> str:
    """The subject on which the Unix user ``user`` asks the coordinator for ``verb``: one token
    per user, so that a server can let identity ``user-<user>`` publish on its own only."""
    return f"{USER_PREFIX}.{check_name(user, 'user name')}.{check_name(verb, 'verb')}"


def user_requests(verb: str) -> str:
    """Wildcard for every user's ``verb`` requests (the coordinator's subscription)."""
    return f"{USER_PREFIX}.*.{check_name(verb, 'verb')}"


def user_from_request(subject: str) -> str | None:
    """The user token of a ``revenant.user.<user>.<verb>`` subject, or None if it is not one."""
    prefix = USER_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    user, dot, verb = subject[len(prefix):].partition(".")
    if not dot or not _NAME_RE.match(user) or not _NAME_RE.match(verb):
        return None
    return user


def progress(user: str, job: str) -> str:
    """Where the agent running a dump or restore of ``job``, whose user is ``user``, says how far it is."""
    return f"{PROGRESS_PREFIX}.{check_name(user or _NO_USER, 'user name')}.{check_name(job, 'job id')}"


def job_progress(job: str, user: str | None = None) -> str:
    """What a client hears ``job``'s progress on: as ``user``, or (None) as admin, whoever's it is."""
    return progress(user, job) if user is not None else f"{PROGRESS_PREFIX}.*.{check_name(job, 'job id')}"


def node_event(node: str, kind: str) -> str:
    return f"{EVENTS_PREFIX}.node.{check_name(node)}.{check_name(kind, 'event kind')}"


def job_event(job: str, kind: str, node: str = "", *, user: str) -> str:
    """Where an event of ``job`` (whose user is ``user``) goes: an agent's ends with its ``node``
    (the only node its credential may publish as: docs/security.md); the leader's has no node."""
    return f"{EVENTS_PREFIX}.job.{_owner(user)}.{check_name(job, 'job id')}.{check_name(kind, 'event kind')}{_by(node)}"


def epoch_event(job: str, kind: str, node: str = "", *, user: str) -> str:
    return f"{EVENTS_PREFIX}.epoch.{_owner(user)}.{check_name(job, 'job id')}.{check_name(kind, 'event kind')}{_by(node)}"


def _owner(user: str) -> str:
    return check_name(user or _NO_USER, "user name")


def _by(node: str) -> str:
    return f".{check_name(node)}" if node else ""


def event_node(subject: str) -> str | None:
    """The node a job or epoch event's subject names as its publisher; None: the leader's."""
    parts = subject.split(".")
    return parts[6] if len(parts) == 7 and parts[2] in ("job", "epoch") else None


def user_events(user: str | None, job: str | None = None) -> list[str]:
    """The event filters a reader hears: as ``user``, that user's jobs' and epochs' events and
    every node's and the cluster's (what the server lets ``user-<user>`` read); as admin (None),
    everything.  With ``job``: that job's events only."""
    owner = "*" if user is None else _owner(user)
    if job is not None:
        job = check_name(job, "job id")
        return [f"{EVENTS_PREFIX}.{kind}.{owner}.{job}.>" for kind in ("job", "epoch")]
    if user is None:
        return [EVENTS_ALL]
    return [f"{EVENTS_PREFIX}.{kind}.{owner}.>" for kind in ("job", "epoch")] + [
        f"{EVENTS_PREFIX}.{kind}.>" for kind in ("node", "cluster")]


JOB_EVENTS_ALL = f"{EVENTS_PREFIX}.job.>"
# Every node's anomaly events (the leader's proactive moves read them).
ANOMALIES_ALL = f"{EVENTS_PREFIX}.node.*.anomaly"
# Older epochs an agent turned into deltas (the coordinator's listing follows them).
EPOCHS_CONVERTED = f"{EVENTS_PREFIX}.epoch.*.*.converted.*"
JOBS_BUCKET = "revenant_jobs"
LEASES_BUCKET = "revenant_leases"
LEADER_BUCKET = "revenant_leader"


def cluster_event(kind: str) -> str:
    return f"{EVENTS_PREFIX}.cluster.{check_name(kind, 'event kind')}"


# The header a leader's commands to agents carry: its term, the leader bucket's revision at its
# election, which grows with every election cluster-wide.  An agent refuses a command (or a
# reconcile answer) from a term older than the newest it has heard from: a deposed leader's.
TERM_HEADER = "Revenant-Term"
