"""``revenant keys``: NATS identities and the server's authorization block, for an existing
NATS deployment (or to add users to a ``revenant up`` cluster).

It writes one NKey seed file per identity (``<identity>.nk``, mode 0600, in a directory of
mode 0700; a seed that exists is kept, so running it again only adds) and
``authorization.conf``, the nats-server ``authorization { users = [...] }`` block that admits
every identity in that directory, each with its permissions (docs/security.md).  Include it
in the server's configuration (``include ./authorization.conf``) and reload the server.

With ``--dir`` (a ``revenant up`` cluster) the keys are the cluster's (DIR/keys), and its
nats-server is given the new block at once (DIR/nats.conf, then a reload).

It also writes the cluster's image keys (``image.keys``, mode 0600, kept if it exists), with
which every agent signs and checks its epochs (agent/storage/imagekeys.py; the agents'
``image_keys``).  ``--rotate`` adds a new one: every agent signs with it once it restarts with the
new file, and epochs signed with an older one stay readable while the file holds it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from revenant.agent.storage import imagekeys
from revenant.common.errors import ConfigError, RevenantError
from revenant.common.messaging.natsserver import write_server_config
from revenant.common.settings import security
from revenant.common.settings.cluster import read_cluster
from revenant.messages import MessageError

FRAGMENT = "authorization.conf"
IMAGE_KEYS = "image.keys"


def _names(values: list[str] | None) -> list[str]:
    """Names given as repeated options and/or comma-separated lists."""
    return [n.strip() for v in values or [] for n in v.split(",") if n.strip()]


def make_keys(directory: Path, nodes: list[str], users: list[str]) -> security.Keyring:
    """Seeds for coordinator, admin, ``nodes``' agents and ``users`` (besides those already in
    ``directory``), and the authorization block for all of them in ``directory/authorization.conf``."""
    try:
        wanted = security.cluster_identities(nodes, users)
    except MessageError as exc:
        raise ConfigError(str(exc)) from None
    keyring = security.Keyring(directory)
    keyring.ensure_all(wanted)
    security.write_private(keyring.directory / FRAGMENT, security.render_authorization(keyring.public))
    return keyring


def _reload_embedded(root: Path, keyring: security.Keyring) -> str:
    """Give a running ``revenant up`` nats-server the new block: rewrite DIR/nats.conf, SIGHUP it."""
    write_server_config(root / "nats.conf", security.render_authorization(keyring.public))
    cluster = read_cluster(root)
    if cluster.insecure:
        return f"{root} runs --insecure: its NATS asks for no credential and ignores these keys"
    servers = [info for info in cluster.processes if info.role == "nats-server"]
    for info in servers:  # each includes DIR/nats.conf
        try:
            os.kill(info.pid, signal.SIGHUP)  # nats-server reloads its configuration
        except OSError as exc:
            return f"could not reload its nats-server (pid {info.pid}): {exc.strerror or exc}"
    if not servers:
        return "it uses an external NATS: give that server the authorization block"
    pids = ", ".join(str(info.pid) for info in servers)
    return f"its nats-server{'s' if len(servers) > 1 else ''} (pid {pids}) reloaded {root / 'nats.conf'}"


def image_keys(directory: Path, rotate: bool = False) -> str:
    """The cluster's image keys in ``directory`` (made if missing, a new one added with ``rotate``): a line saying so."""
    path = directory / IMAGE_KEYS
    held, changed = imagekeys.write(path, rotate)
    if not changed:
        return f"image keys: {path} (kept; signing with key {held.current})"
    more = f"; epochs signed with {', '.join(k for k in held.keys if k != held.current)} stay readable" if len(
        held.keys) > 1 else ""
    return (f"image keys: {path}, signing with key {held.current}{more}: give every agent this file "
            "(image_keys) and restart it")


def keys(out: str | None, cluster_dir: str | None, nodes: list[str] | None, users: list[str] | None,
         rotate: bool = False) -> int:
    if bool(out) == bool(cluster_dir):
        raise RevenantError("revenant keys needs one of --out DIR (an existing NATS) or --dir DIR (revenant up's)")
    directory = Path(cluster_dir) / "keys" if cluster_dir else Path(out or ".")
    keyring = make_keys(directory, _names(nodes), _names(users))
    print(f"revenant: {image_keys(directory, rotate)}", file=sys.stderr)
    for identity in sorted(keyring.public):
        print(f"{identity:<24} {keyring.public[identity]}  {keyring.seed_path(identity)}")
    print(f"revenant: authorization block for the server: {keyring.directory / FRAGMENT}", file=sys.stderr)
    if cluster_dir:
        print(f"revenant: {_reload_embedded(Path(cluster_dir), keyring)}", file=sys.stderr)
    else:
        print("revenant: add 'include ./authorization.conf' (its path relative to the server's config) to "
              "nats-server's configuration and reload it; give each process its own seed file "
              "(agent: --creds / nats_creds, clients: --creds / $REVENANT_CREDS)", file=sys.stderr)
    return 0
