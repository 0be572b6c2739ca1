"""NATS identities and their server-enforced permissions (NKeys).

Every process on the bus authenticates with an NKey of its own and the server lets each
identity publish and subscribe only where its role needs (docs/security.md):

* ``coordinator``: every coordinator process (leader and standbys); commands agents, writes
  the job table, the leader bucket and the archive, owns the event stream.
* ``agent-<node>``: one per node; its own heartbeat, lease key and node events, job and epoch
  events, the progress of its dumps and restores, ``reconcile``, replies; it hears only its own
  commands and probes.
* ``user-<name>``: a Unix user: its own ``revenant.user.<name>.>`` requests, the event stream
  read-only, the progress of its own jobs.
* ``admin``: root and operators: ``revenant.coord.>`` requests, the event stream read-only, every
  job's progress.

Each identity gets its replies on ``_INBOX_<identity>.>`` (see :func:`inbox_prefix`), so no one
can listen to another's replies.  A seed file holds one seed (``SU...``) and nothing else; it is
what nats-py's ``nkeys_seed`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from revenant.common.errors import ConfigError
from revenant.messages import subjects
from revenant.messages.subjects import InvalidName, check_name

COORDINATOR = "coordinator"
ADMIN = "admin"
AGENT_PREFIX = "agent-"
USER_PREFIX = "user-"
# The coordinator's durable consumer on the event stream (coordinator/table/job_events.py): no one
# else may create, change, read or delete it.
COORDINATOR_CONSUMER = "revenant-coordinator-jobs"
COORDINATOR_EPOCHS_CONSUMER = "revenant-coordinator-epochs-3"
# The ones before (their filters predate node-stamped, then user-scoped epoch events): left unused by an upgrade.
_OLD_EPOCHS_CONSUMERS = ("revenant-coordinator-epochs", "revenant-coordinator-epochs-2")
ARCHIVE_BUCKET = "revenant_jobs_archive"
SEED_SUFFIX = ".nk"

_JS = "$JS.API"
_EVENTS = subjects.EVENTS_STREAM


def agent_identity(node: str) -> str:
    return AGENT_PREFIX + check_name(node)


def user_identity(user: str) -> str:
    return USER_PREFIX + check_name(user, "user name")


def inbox_prefix(identity: str) -> str:
    """The reply-inbox prefix of ``identity``: its replies come on ``_INBOX_<identity>.>``."""
    return f"_INBOX_{check_identity(identity)}"


def check_identity(identity: str) -> str:
    """``identity`` if it is one of the four kinds, else ValueError."""
    if identity in (COORDINATOR, ADMIN):
        return identity
    for prefix, what in ((AGENT_PREFIX, "node name"), (USER_PREFIX, "user name")):
        if identity.startswith(prefix):
            try:
                check_name(identity[len(prefix):], what)
            except InvalidName as exc:
                raise ValueError(f"identity {identity!r}: {exc}") from None
            return identity
    raise ValueError(f"unknown identity {identity!r}: use coordinator, admin, agent-<node> or user-<name>")


def credentials(identity: str, creds_file: str) -> dict[str, str | None]:
    """:func:`revenant.common.messaging.bus.connect`'s keyword arguments for ``identity``: the credential
    file it authenticates with (none if empty: an open bus) and its own reply inbox."""
    return {"nkey_seed": creds_file or None, "inbox_prefix": inbox_prefix(identity)}


def identity_of(creds_file: str) -> str:
    """The identity a credential file is for, from its name: ``<identity>.nk`` (or ``.creds``),
    as ``revenant up`` and ``revenant keys`` name them."""
    identity = os.path.basename(creds_file).split(".", 1)[0]
    try:
        return check_identity(identity)
    except ValueError:
        raise ConfigError(f"cannot tell whose credential {creds_file} is: name it <identity>.nk "
                         "(coordinator, admin, agent-<node> or user-<name>)") from None


def client_credentials(creds_file: str) -> dict[str, str | None]:
    """:func:`credentials` for a client holding ``creds_file`` ("" for none: an open bus)."""
    if not creds_file:
        return {}
    return credentials(identity_of(creds_file), creds_file)


# How long an identity that answers requests may still answer one (nats-server's allow_responses
# expires, 2 minutes by default): past the longest operation an agent or the coordinator answers
# (a checkpoint or restore of a large job on slow storage: hours, not minutes).
RESPONSE_EXPIRES = "24h"


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    # May answer a request it received (once, on the request's reply subject).
    allow_responses: bool = False


def _event_reader(user: str | None = None) -> tuple[str, ...]:
    """Read the event stream with consumers of one's own, nothing more: as ``user``, only consumers
    whose one filter (named in the API subject, where the server checks it against the
    consumer's) is among subjects.user_events(user); as admin (None), any consumer."""
    if user is None:
        creates: tuple[str, ...] = (f"{_JS}.CONSUMER.CREATE.{_EVENTS}", f"{_JS}.CONSUMER.CREATE.{_EVENTS}.>")
    else:
        # (a filter of one of the user's jobs, ``...job.<user>.<job>.>``, lies under these)
        creates = tuple(f"{_JS}.CONSUMER.CREATE.{_EVENTS}.*.{f}" for f in subjects.user_events(user))
    return (
        f"{_JS}.STREAM.NAMES",
        f"{_JS}.STREAM.INFO.{_EVENTS}",
        *creates,
        f"{_JS}.CONSUMER.INFO.{_EVENTS}.*",
        f"$JS.FC.{_EVENTS}.>",
    )


# Nobody but the coordinator touches its durable consumer (acks included).
_COORDINATOR_CONSUMER_DENY = tuple(deny for name in (COORDINATOR_CONSUMER, COORDINATOR_EPOCHS_CONSUMER,
                                                     *_OLD_EPOCHS_CONSUMERS) for deny in (
    f"{_JS}.CONSUMER.*.{_EVENTS}.{name}",
    f"{_JS}.CONSUMER.*.{_EVENTS}.{name}.>",
    f"{_JS}.CONSUMER.MSG.NEXT.{_EVENTS}.{name}",
    f"$JS.ACK.{_EVENTS}.{name}.>",
))


def permissions_for(identity: str) -> Permissions:
    """The least privilege ``identity`` needs (see the module docstring)."""
    check_identity(identity)
    inbox = f"{inbox_prefix(identity)}.>"
    root = subjects.ROOT
    if identity == COORDINATOR:
        return Permissions(
            publish_allow=(f"{root}.>", f"{_JS}.>", "$KV.>", "$JS.ACK.>", "$JS.FC.>"),
            subscribe_allow=(f"{root}.>", inbox),
            allow_responses=True,
        )
    if identity.startswith(AGENT_PREFIX):
        node = identity[len(AGENT_PREFIX):]
        leases = f"KV_{subjects.LEASES_BUCKET}"
        return Permissions(
            publish_allow=(
                subjects.heartbeat(node),
                f"{subjects.EVENTS_PREFIX}.node.{node}.>",
                # Its own jobs' and epochs' events, by the node the subject ends with: never as another node.
                f"{subjects.EVENTS_PREFIX}.job.*.*.*.{node}",
                f"{subjects.EVENTS_PREFIX}.epoch.*.*.*.{node}",
                subjects.PROGRESS_ALL,  # any job's (a subject carries the job's user, not the node)
                subjects.coordinator("reconcile"),
                f"$KV.{subjects.LEASES_BUCKET}.{node}",
                # Create the bucket and the stream if missing (a create never changes one
                # that exists), and look them up; never update, purge or delete them.
                f"{_JS}.STREAM.INFO.{leases}",
                f"{_JS}.STREAM.CREATE.{leases}",
                f"{_JS}.STREAM.INFO.{_EVENTS}",
                f"{_JS}.STREAM.CREATE.{_EVENTS}",
            ),
            subscribe_allow=(subjects.node_commands(node), subjects.probe(node), subjects.HEARTBEAT_REQUESTS, inbox),
            allow_responses=True,
        )
    if identity == ADMIN:
        return Permissions(
            publish_allow=(f"{subjects.COORDINATOR_PREFIX}.>", f"{_JS}.STREAM.CREATE.{_EVENTS}",
                           *_event_reader()),
            publish_deny=(subjects.coordinator("reconcile"), *_COORDINATOR_CONSUMER_DENY),
            subscribe_allow=(inbox, subjects.PROGRESS_ALL),
        )
    user = identity[len(USER_PREFIX):]
    return Permissions(
        publish_allow=(f"{root}.user.{user}.>", *_event_reader(user)),
        publish_deny=_COORDINATOR_CONSUMER_DENY,
        subscribe_allow=(inbox, f"{subjects.PROGRESS_PREFIX}.{user}.>"),
    )


# ---------------------------------------------------------------------------- keys


def new_seed() -> str:
    """A fresh user NKey seed (``SU...``)."""
    import nkeys  # a key is made or read rarely: not at every client command's start

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key(seed: str) -> str:
    """The public key (``U...``) of a user seed."""
    import nkeys

    kp = nkeys.from_seed(bytearray(seed.strip().encode()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


def write_private(path: Path, data: str) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the start (never readable by others)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass
class Keyring:
    """Seed files, one per identity, in a directory of mode 0700 (``DIR/keys`` for ``revenant up``)."""

    directory: Path
    public: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)

    def seed_path(self, identity: str) -> Path:
        return self.directory / f"{check_identity(identity)}{SEED_SUFFIX}"

    def ensure(self, identity: str) -> Path:
        """The seed file of ``identity``, created if missing (an existing one is kept)."""
        path = self.seed_path(identity)
        if path.exists():
            os.chmod(path, 0o600)
            seed = path.read_text()
        else:
            seed = new_seed()
            write_private(path, seed + "\n")
        self.public[identity] = public_key(seed)
        return path

    def ensure_all(self, identities: Iterable[str]) -> dict[str, Path]:
        """Seeds for ``identities`` and for every identity already in the directory (kept: one
        added by ``revenant keys`` stays admitted)."""
        return {identity: self.ensure(identity) for identity in sorted(set(identities) | set(self.existing()))}

    def existing(self) -> list[str]:
        """The identities whose seeds are in the directory."""
        found = []
        for path in sorted(self.directory.glob(f"*{SEED_SUFFIX}")):
            try:
                found.append(check_identity(path.name[: -len(SEED_SUFFIX)]))
            except ValueError:
                continue
        return found


def cluster_identities(nodes: Iterable[str], users: Iterable[str] = ()) -> list[str]:
    """coordinator, admin, an agent per node and a user identity per user."""
    return [COORDINATOR, ADMIN, *(agent_identity(n) for n in nodes), *(user_identity(u) for u in users)]


# ---------------------------------------------------------------------------- server config


def _quoted(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def _permission_map(allow: tuple[str, ...], deny: tuple[str, ...]) -> str:
    parts = [f"allow: {_quoted(allow)}"]
    if deny:
        parts.append(f"deny: {_quoted(deny)}")
    return "{ " + ", ".join(parts) + " }"


def render_user(identity: str, public: str) -> str:
    p = permissions_for(identity)
    lines = [
        f"    # {identity}",
        "    {",
        f'      nkey: "{public}"',
        "      permissions: {",
        f"        publish: {_permission_map(p.publish_allow, p.publish_deny)}",
        f"        subscribe: {_permission_map(p.subscribe_allow, p.subscribe_deny)}",
    ]
    if p.allow_responses:
        # nats-server lets a response through for 2 minutes unless told otherwise: a checkpoint,
        # restore or drain that takes longer would commit and never be answered.
        lines.append(f'        allow_responses: {{max: 1, expires: "{RESPONSE_EXPIRES}"}}')
    lines += ["      }", "    }"]
    return "\n".join(lines)


def render_authorization(public: dict[str, str]) -> str:
    """The nats-server ``authorization { users = [...] }`` block for these identities
    (identity -> public key): without a listed key no connection is accepted."""
    users = "\n".join(render_user(identity, key) for identity, key in sorted(public.items()))
    return "authorization {\n  users = [\n" + users + "\n  ]\n}\n"
